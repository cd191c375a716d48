"""Box post-processing: non-maximum suppression, mapping boxes and labels back to the original image (shared by
`YOLOv5Module` and the validation of exported models).

Validation and prediction only: NMS output sizes depend on the data, so these functions sync the host (boolean
masks, `nonzero`) and never run inside the training step.

The torch box-format conversion is `yolo5l_kernels.reference.xywh_to_xyxy` (the lowest layer, shared with the
fused kernels), re-exported here.

Reference: ultralytics/yolov5 v7.0 `utils/general.py` (`non_max_suppression`, `scale_boxes`, `clip_boxes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchvision.ops import nms
from yolo5l_kernels.reference import xywh_to_xyxy

__all__ = ["clip_boxes", "labels_to_original", "non_max_suppression", "scale_boxes", "to_original", "xywh_to_xyxy"]

# _nms_best_first: the best _NMS_FIRST_TAKE x max_det candidates of an image first, _NMS_GROWTH x as many a retry.
_NMS_FIRST_TAKE, _NMS_GROWTH = 2, 4


def clip_boxes(boxes: Tensor, shape: Sequence[int]) -> Tensor:
    """Clip (..., 4) xyxy boxes in place to an image of `shape` = (height, width); returns `boxes`."""
    h, w = shape[0], shape[1]
    boxes[..., 0::2] = boxes[..., 0::2].clamp(0, w)
    boxes[..., 1::2] = boxes[..., 1::2].clamp(0, h)
    return boxes


def scale_boxes(
    img1_shape: Sequence[int],
    boxes: Tensor,
    img0_shape: Sequence[int],
    ratio_pad: Sequence[Sequence[float]] | None = None,
) -> Tensor:
    """Map xyxy boxes from a letterboxed image back to the original image, in place, and clip them.

    Args:
        img1_shape: (height, width) of the letterboxed image the boxes live in.
        boxes: (n, 4+) boxes, xyxy pixels in the letterboxed image; only the first four columns change.
        img0_shape: (height, width) of the original image.
        ratio_pad: ((ratio_h, ratio_w), (pad_w, pad_h)) as recorded by the letterbox; None recomputes both from the
            shapes assuming a centred, aspect-preserving resize (YOLOv5's behaviour).

    Returns:
        `boxes`, now in original-image pixels, clipped to `img0_shape`.
    """
    if ratio_pad is None:
        gain = min(img1_shape[0] / img0_shape[0], img1_shape[1] / img0_shape[1])
        pad_w = (img1_shape[1] - img0_shape[1] * gain) / 2
        pad_h = (img1_shape[0] - img0_shape[0] * gain) / 2
    else:
        # YOLOv5 uses the first ratio for both axes: the letterbox keeps the aspect ratio.
        gain = ratio_pad[0][0]
        pad_w, pad_h = ratio_pad[1][0], ratio_pad[1][1]
    boxes[:, [0, 2]] -= pad_w
    boxes[:, [1, 3]] -= pad_h
    boxes[:, :4] /= gain
    clip_boxes(boxes[:, :4], img0_shape)
    return boxes


def to_original(dets: list[Tensor], img_hw: Sequence[int], shapes: Sequence[Any] | None) -> list[Tensor]:
    """Scale (n, 4+) xyxy boxes per image from the letterboxed batch back to each original image, in place
    (`scale_boxes`); `shapes[i]` is the batch's ((h0, w0), ratio_pad) or None (left as it is). Returns `dets`."""
    if shapes is None:
        return dets
    for det, shape in zip(dets, shapes, strict=True):
        if shape is not None:
            scale_boxes(img_hw, det, shape[0], shape[1])
    return dets


def labels_to_original(
    targets: Tensor, img_hw: Sequence[int], batch_size: int, shapes: Sequence[Any] | None
) -> list[Tensor]:
    """A batch's (N, 6) normalised targets [image, class, cx, cy, w, h] as per-image (m, 5) ground truth
    [x1, y1, x2, y2, class] in original-image pixels: what the mAP metrics compare detections with.

    Validation only: the split by image syncs the host.
    """
    h, w = img_hw[0], img_hw[1]
    t = targets[torch.argsort(targets[:, 0], stable=True)]
    xyxy = xywh_to_xyxy(t[:, 2:6] * torch.tensor([w, h, w, h], device=t.device, dtype=t.dtype))
    gt = torch.cat((xyxy, t[:, 1:2]), 1).split(torch.bincount(t[:, 0].long(), minlength=batch_size).tolist())
    return to_original([g.clone() for g in gt], (h, w), shapes)


def _rank_within_group(group: Tensor, num_groups: int) -> Tensor:
    """Position of each element inside its group, for a 1-D `group` already sorted (grouped) by group id."""
    counts = torch.bincount(group, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(group.numel(), device=group.device) - starts[group]


def _top_per_image(image: Tensor, scores: Tensor, num_images: int, k: int) -> Tensor:
    """Indices of the at most `k` best-scoring candidates of every image, grouped by image, best first."""
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[torch.sort(image[order], stable=True).indices]  # grouped by image, descending score inside
    keep = _rank_within_group(image[order], num_images) < k
    return order[keep]


def _nms_best_first(
    boxes: Tensor, scores: Tensor, cls: Tensor, counts: Sequence[int], iou_thres: float, max_det: int
) -> list[Tensor]:
    """Class-aware NMS image by image over candidates grouped by image and sorted best first; kept indices per image.

    One `torchvision.ops.nms` call per image, since NMS is quadratic in the boxes of a call and early in training a
    batch holds B x thousands of candidates; classes are kept apart by offsetting boxes by class x span, the trick
    of `torchvision.ops.batched_nms` (which itself loops over classes above a few thousand boxes on the CPU).
    Greedy NMS on the n best candidates keeps exactly what NMS over all of them keeps among those n (a box is only
    ever suppressed by a better-scoring one), so each image first gets its best `_NMS_FIRST_TAKE` x `max_det` and
    `_NMS_GROWTH` x as many only while fewer than `max_det` survive: with thousands of candidates per image at a low
    confidence threshold, most of them never enter NMS. Same result as NMS on everything up to exactly tied scores.
    """
    if boxes.numel() == 0:
        return [torch.empty(0, dtype=torch.int64, device=boxes.device) for _ in counts]
    span = boxes.max() - boxes.min() + 1  # 0-dim tensor: no host sync
    shifted = boxes + (cls.to(boxes.dtype) * span)[:, None]
    kept, start = [], 0
    for count in counts:
        n = min(count, _NMS_FIRST_TAKE * max_det)
        while True:
            keep = nms(shifted[start : start + n], scores[start : start + n], iou_thres)
            if keep.numel() >= max_det or n == count:
                break
            n = min(count, _NMS_GROWTH * n)
        kept.append(keep[:max_det] + start)
        start += count
    return kept


def non_max_suppression(
    prediction: Tensor,
    conf_thres: float = 0.25,
    iou_thres: float = 0.45,
    classes: Sequence[int] | None = None,
    agnostic: bool = False,
    multi_label: bool = False,
    max_det: int = 300,
    max_nms: int = 30000,
) -> list[Tensor]:
    """Class-aware NMS over a whole batch of decoded predictions.

    YOLOv5's semantics: candidates need objectness > `conf_thres`; score = objectness x class probability; with
    `multi_label` every class whose score > `conf_thres` becomes its own box, else only the best class is kept (and
    must pass the threshold); at most `max_nms` best candidates per image enter NMS; at most `max_det` survive.

    Unlike YOLOv5 (a Python loop over images doing everything, a time limit, class offsets of 7680 px) the
    candidate selection runs once for the whole batch and only the NMS calls go image by image, each on just
    enough of the best candidates (`_nms_best_first`). There is no time limit.

    Args:
        prediction: (B, N, 5 + C) decoded predictions [cx, cy, w, h, obj, cls...], xywh in pixels, sigmoid scores.
        conf_thres: score threshold.
        iou_thres: IoU above which the lower-scoring box of the same class is suppressed.
        classes: keep only these class ids (None: all).
        agnostic: suppress across classes.
        multi_label: one box per (anchor, class) above the threshold instead of one per anchor.
        max_det: detections kept per image.
        max_nms: candidates per image entering NMS.

    Returns:
        B tensors of shape (n_i, 6): [x1, y1, x2, y2, score, class], sorted by descending score.
    """
    if prediction.dim() != 3 or prediction.shape[-1] < 6:
        raise ValueError(f"non_max_suppression expects (B, N, 5 + C) predictions, got {tuple(prediction.shape)}")
    if not (0.0 <= conf_thres <= 1.0 and 0.0 <= iou_thres <= 1.0):
        raise ValueError(f"conf_thres and iou_thres must lie in [0, 1], got {conf_thres} and {iou_thres}")
    bsz, device = prediction.shape[0], prediction.device
    prediction = prediction.float()

    # Candidate anchors: objectness above the threshold (one host sync: the number of candidates).
    img, anc = (prediction[..., 4] > conf_thres).nonzero(as_tuple=True)
    cand = prediction[img, anc]  # (M, 5 + C)
    scores = cand[:, 5:] * cand[:, 4:5]  # (M, C) obj x cls
    boxes = xywh_to_xyxy(cand[:, :4])
    if multi_label:
        row, cls = (scores > conf_thres).nonzero(as_tuple=True)
        conf = scores[row, cls]
    else:
        conf, cls = scores.max(1)
        row = (conf > conf_thres).nonzero(as_tuple=True)[0]
        conf, cls = conf[row], cls[row]
    img, boxes = img[row], boxes[row]
    if classes is not None:
        keep = torch.isin(cls, torch.as_tensor(list(classes), device=device))
        img, boxes, conf, cls = img[keep], boxes[keep], conf[keep], cls[keep]

    # The `max_nms` best candidates per image, as YOLOv5 sorts and truncates before NMS; grouped by image.
    top = _top_per_image(img, conf, bsz, max_nms)
    img, boxes, conf, cls = img[top], boxes[top], conf[top], cls[top]
    counts = torch.bincount(img, minlength=bsz).tolist()  # host sync: candidates per image
    kept = _nms_best_first(boxes, conf, torch.zeros_like(cls) if agnostic else cls, counts, iou_thres, max_det)
    out = torch.cat((boxes, conf[:, None], cls[:, None].float()), dim=1)  # (M, 6)
    return [out[k] for k in kept]
