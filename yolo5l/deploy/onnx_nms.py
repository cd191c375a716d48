"""End-to-end ONNX (`format=onnx nms=true`): the detector, its decode and NMS in one graph, as deployment servers want.

Outputs, for a batch of B images and `max_det` rows per image:

- `boxes` (B, max_det, 4) float: x1, y1, x2, y2 in input pixels;
- `scores` (B, max_det) float: objectness x class score;
- `classes` (B, max_det) int64;
- `count` (B,) int64: how many rows of each image are detections (the rest are zeros).

NMS is ONNX's `NonMaxSuppression` per class (a box may be kept for several classes, as v7.0's validation NMS with
`multi_label` keeps it), with the score and IoU thresholds fixed at export (`conf_thres`, `iou_thres`); the kept
boxes of each image are sorted by score and the first `max_det` kept, as ultralytics/yolov5 v7.0
`utils/general.py::non_max_suppression` does. `topk_per_class` keeps at most that many boxes of each class before
(ONNX's `max_output_boxes_per_class`; v7.0 `export.py --topk-per-class`, its TF NMS's per-class cap). With
`agnostic=True` each box takes its best class, and boxes suppress each other whatever their classes (v7.0
`models/tf.py::AgnosticNMS`: the highest class score and its class).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from yolo5l.infer.boxes import xywh_to_xyxy

__all__ = ["OUTPUT_NAMES", "EndToEnd", "as_decoded"]

OUTPUT_NAMES = ("boxes", "scores", "classes", "count")


class _NonMaxSuppression(torch.autograd.Function):
    """ONNX `NonMaxSuppression` (selected (K, 3) [batch, class, box] indices); torchvision's NMS when run eagerly."""

    @staticmethod
    def forward(ctx, boxes: Tensor, scores: Tensor, max_per_class: int, iou: float, score: float) -> Tensor:
        from torchvision.ops import nms

        out = []
        for b in range(scores.shape[0]):
            for c in range(scores.shape[1]):
                s = scores[b, c]
                idx = torch.nonzero(s > score).flatten()
                keep = idx[nms(boxes[b, idx], s[idx], iou)][:max_per_class]
                out.append(torch.stack((torch.full_like(keep, b), torch.full_like(keep, c), keep), 1))
        return torch.cat(out) if out else boxes.new_zeros((0, 3), dtype=torch.long)

    @staticmethod
    def symbolic(g, boxes, scores, max_per_class: int, iou: float, score: float):  # type: ignore[override]
        const = lambda v, dtype: g.op("Constant", value_t=torch.tensor([v], dtype=dtype))  # noqa: E731
        return g.op(
            "NonMaxSuppression", boxes, scores, const(max_per_class, torch.long), const(iou, torch.float),
            const(score, torch.float),
        )  # fmt: skip


class EndToEnd(nn.Module):
    """Images -> (boxes, scores, classes, count): a decoded detector with NMS after it.

    Args:
        net: Images -> (B, N, 5 + nc) decoded boxes (`yolo5l.exporter.DecodedYOLOv5`).
        conf_thres: Score threshold.
        iou_thres: IoU threshold.
        max_det: Detections kept per image (the outputs' second dimension).
        topk_per_class: Boxes kept per class and image before the `max_det` cut; None: `max_det`.
        agnostic: One class-agnostic NMS over each box's best class score.
    """

    def __init__(
        self,
        net: nn.Module,
        conf_thres: float = 0.25,
        iou_thres: float = 0.45,
        max_det: int = 300,
        topk_per_class: int | None = None,
        agnostic: bool = False,
    ) -> None:
        super().__init__()
        self.net, self.conf_thres, self.iou_thres, self.max_det = net, conf_thres, iou_thres, max_det
        self.topk_per_class, self.agnostic = topk_per_class or max_det, agnostic

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        y = self.net(images)  # (B, N, 5 + nc)
        boxes = xywh_to_xyxy(y[..., :4])  # (B, N, 4)
        scores = y[..., 5:] * y[..., 4:5]  # (B, N, nc)
        if self.agnostic:
            scores, best = scores.max(-1, keepdim=True)  # (B, N, 1): one "class" holds every box
        scores = scores.transpose(1, 2).contiguous()  # (B, nc or 1, N)
        sel = _NonMaxSuppression.apply(boxes, scores, self.topk_per_class, self.iou_thres, self.conf_thres)  # (K, 3)
        b, c, i = sel[:, 0], sel[:, 1], sel[:, 2]
        score = scores[b, c, i]  # (K,)
        if self.agnostic:
            c = best[b, i, 0]
        # Grouped by image, best first: scores are in (0, 1], so the image index dominates the key (in float64,
        # which keeps scores that differ in float32's last bits apart).
        order = torch.argsort(b.double() * 2 - score.double())
        b, c, i, score = b[order], c[order], i[order], score[order]
        batch = images.shape[0]
        onehot = (b[None] == torch.arange(batch, device=b.device)[:, None]).long()  # (B, K)
        rank = onehot.cumsum(1).gather(0, b[None]).squeeze(0) - 1  # place of each detection within its image
        keep = rank < self.max_det
        slot = (b * self.max_det + rank)[keep]
        rows = batch * self.max_det
        out_boxes = boxes.new_zeros((rows, 4)).index_put((slot,), boxes[b, i][keep])
        out_scores = score.new_zeros(rows).index_put((slot,), score[keep])
        out_classes = c.new_zeros(rows).index_put((slot,), c[keep])
        count = onehot.sum(1).clamp(max=self.max_det)
        return (
            out_boxes.view(batch, self.max_det, 4), out_scores.view(batch, self.max_det),
            out_classes.view(batch, self.max_det), count,
        )  # fmt: skip


def as_decoded(boxes: Tensor, scores: Tensor, classes: Tensor, nc: int) -> Tensor:
    """End-to-end outputs as the (B, max_det, 5 + nc) decoded layout: cx, cy, w, h, objectness = score, a one-hot
    class score. Run through `yolo5l.infer.boxes.non_max_suppression` again it gives the same detections (kept boxes of
    a class overlap below the export's IoU threshold; the padding rows score 0), so val and predict take it as they
    take any exported model, with their thresholds applied on top of the file's."""
    xyxy = boxes.float()
    xywh = torch.cat(((xyxy[..., :2] + xyxy[..., 2:]) / 2, xyxy[..., 2:] - xyxy[..., :2]), -1)
    onehot = torch.nn.functional.one_hot(classes.long().clamp(0, max(nc - 1, 0)), max(nc, 1)).to(xywh.dtype)
    return torch.cat((xywh, scores.float()[..., None], onehot), -1)
