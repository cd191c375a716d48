"""Detection metrics: YOLOv5's own mAP protocol (the default) or torchmetrics' COCO mAP, and YOLOv5's fitness.

Two metrics with the same `update(dets, labels)` and the same `val/*` keys (`conf/module/metric/*.yaml`):
- "yolov5" (`DetectionMAP`, default): ultralytics/yolov5 v7.0's validation protocol (`val.py::process_batch`,
  `utils/metrics.py::ap_per_class`): detections matched to labels per IoU threshold, AP integrated over 101 recall
  points per class, precision and recall at the best smoothed mean-F1 confidence. Matching is vectorised over
  thresholds; the state is a few numbers per detection, so `compute()` is a sort and running sums per class, not a
  COCOeval run.
- "coco" (`COCOMap`): the COCO protocol (matching in score order, AP sampled at 101 recall thresholds);
  pycocotools scores yolov5s ~0.4 mAP points higher on COCO than YOLOv5's internal protocol.

COCO backend choices (see docs/design.md, "Training"):
- `MeanAveragePrecision(backend="faster_coco_eval", max_detection_thresholds=[1, 10, 300])`: COCO-style AP at
  IoU 0.50:0.05:0.95, averaged over classes present; detections per image capped at 300 like YOLOv5's validation
  (COCO's official number uses 100; pycocotools would return -1 for the non-default cap, faster_coco_eval does not).
- `compute_on_cpu=False`: torchmetrics gathers list states on their own device, so CPU states break NCCL gathers;
  300 detections x 6 numbers per image is ~36 MB for 5k images, small enough to keep on the GPU.
- precision / recall: YOLOv5's definition (mean over classes at the one confidence that maximises the box-filter-
  smoothed mean F1, IoU 0.5), evaluated on COCOeval's 101-point interpolated PR curves from the extended summary
  rather than on raw detection lists. The envelope makes precision a little optimistic versus YOLOv5's raw curve.
- fitness = 0.1 mAP50 + 0.9 mAP50-95 (YOLOv5 `utils/metrics.py::fitness`).

Both metrics also keep what ultralytics' val.py prints and plots per class (`per_class()` -> `PerClassResults`):
per-class AP, P and R, image and label counts, the P/R/F1-confidence and PR curves, and YOLOv5's confusion matrix
once told the class count (`set_num_classes`). All of it comes out of the same `compute()` pass.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric
from torchvision.ops import box_iou

from yolo5l.eval.per_class import PerClassResults, PerClassState, ap_per_class, confidence_curves, images_per_class

__all__ = [
    "DetectionMAP",
    "confusion_update",
    "fitness",
    "match_detections",
    "precision_recall_at_best_f1",
    "summarize_map",
]

# faster_coco_eval prints its 12-line COCO summary at INFO on every compute(); yolo5l logs the numbers itself.
logging.getLogger("faster_coco_eval").setLevel(logging.WARNING)


def fitness(map_50: Tensor, map_50_95: Tensor) -> Tensor:
    """YOLOv5's model-selection score, 0.1 mAP50 + 0.9 mAP50-95. Reference: yolov5 `utils/metrics.py::fitness`."""
    return 0.1 * map_50 + 0.9 * map_50_95


def precision_recall_at_best_f1(precision: Tensor, scores: Tensor, num_conf: int = 1000) -> tuple[Tensor, Tensor]:
    """Mean precision and recall over classes at the confidence with the best smoothed mean F1.

    Args:
        precision: (R, K) interpolated precision of K classes at R recall thresholds linspace(0, 1, R), -1 for
            classes without labels (COCOeval's `precision[iou, :, :, area_all, max_det]`).
        scores: (R, K) the detection confidence at which each recall threshold is reached (0 where it never is).
        num_conf: size of the confidence grid on [0, 1] (YOLOv5 uses 1000).

    Returns:
        (precision, recall) as 0-dim float tensors; zeros when no class has labels.

    Reference: yolov5 `utils/metrics.py::ap_per_class` (F1 box filter of width 0.1, mean over classes).
    """
    curves = confidence_curves(precision, scores, num_conf)
    if curves is None:
        zero = torch.zeros((), dtype=torch.float32)
        return zero, zero.clone()
    _, prec, recall, best = curves
    return prec[best].mean().float(), recall[best].mean().float()


def summarize_map(result: dict[str, Tensor]) -> dict[str, Tensor]:
    """Turn `MeanAveragePrecision.compute()` output into yolo5l's `val/*` metrics.

    Args:
        result: `MeanAveragePrecision.compute()` with the extended summary (as `COCOMap` makes it).

    Returns:
        {"map", "map_50", "precision", "recall", "fitness"} as 0-dim float tensors (mAP values of -1, i.e. no
        labels at all, are reported as 0).
    """
    map_50 = result["map_50"].float().clamp(min=0)
    map_all = result["map"].float().clamp(min=0)
    # precision: (T, R, K, A, M); IoU 0.5 first, area "all" first, the largest detection cap last.
    p, r = precision_recall_at_best_f1(result["precision"][0, :, :, 0, -1], result["scores"][0, :, :, 0, -1])
    return {"map": map_all, "map_50": map_50, "precision": p, "recall": r, "fitness": fitness(map_50, map_all)}


# ---- YOLOv5's protocol ---------------------------------------------------------------------------------------------
def match_detections(det: Tensor, gt: Tensor, iou_thresholds: Tensor, iou: Tensor | None = None) -> Tensor:
    """Which detections of one image are true positives at each IoU threshold (YOLOv5's matching rule).

    At threshold t a (label, detection) pair is eligible when the classes agree and IoU >= t. Every detection
    takes its highest-IoU eligible label; each label then keeps the first (best-scoring) detection that chose it.
    This is the outcome of yolov5 v7.0 `val.py::process_batch` (pairs sorted by IoU, unique detections, then unique
    labels in detection order), computed for all thresholds at once without a host sync.

    Args:
        det: (N, 6) [x1, y1, x2, y2, score, class], sorted by descending score (NMS order).
        gt: (M, 5) [x1, y1, x2, y2, class] in the same pixel space.
        iou_thresholds: (T,) thresholds.
        iou: (M, N) `box_iou(gt, det)` when the caller has it already.

    Returns:
        (N, T) bool.
    """
    n, m, t = det.shape[0], gt.shape[0], iou_thresholds.numel()
    if n == 0 or m == 0:
        return torch.zeros((n, t), dtype=torch.bool, device=det.device)
    if iou is None:
        iou = box_iou(gt[:, :4], det[:, :4])  # (M, N)
    eligible = (iou[None] >= iou_thresholds[:, None, None]) & (gt[:, 4:5] == det[:, 5])[None]  # (T, M, N)
    best = torch.where(eligible, iou[None], -1.0).argmax(1)  # (T, N) each detection's label
    has = eligible.any(1)  # (T, N)
    idx = torch.arange(n, device=det.device).expand(t, n)
    chosen = torch.where(has, best, m)  # detections without a label go to a dummy slot m
    first = torch.full((t, m + 1), n, device=det.device).scatter_reduce(1, chosen, idx, "amin")
    return (has & (first.gather(1, best) == idx)).T


def confusion_update(
    matrix: Tensor, det: Tensor, gt: Tensor, conf: float = 0.25, iou_thres: float = 0.45, iou: Tensor | None = None
) -> None:
    """Add one image to YOLOv5's detection confusion matrix, in place and on the device (no host sync).

    Detections scoring above `conf` are matched to labels of any class with IoU above `iou_thres`: every detection
    takes its highest-IoU label, every label then keeps the highest-IoU detection among those that took it. A matched
    pair counts at [detection class, label class]; a label left unmatched at [background, label class] (missed); a
    detection left unmatched at [detection class, background] (a false positive on background).

    Reference: yolov5 v7.0 `utils/metrics.py::ConfusionMatrix.process_batch` (the thresholds, both strict, the
    matching order, rows predicted and columns true, background last). Unlike v7.0, unmatched detections of images
    where nothing matched, or without labels at all, count as background false positives too (v7.0 skips them: its
    `if n:`, and val.py calls it for labelled images only).

    Args:
        matrix: (nc + 1, nc + 1) integer counts [predicted, true], updated in place.
        det: (N, 6) [x1, y1, x2, y2, score, class].
        gt: (M, 5) [x1, y1, x2, y2, class] in the same pixels.
        conf: detections scoring at most this are ignored.
        iou_thres: pairs need an IoU above this.
        iou: (M, N) `box_iou(gt, det)` when the caller has it already.
    """
    nc = matrix.shape[0] - 1
    n, m = det.shape[0], gt.shape[0]
    if n == 0 and m == 0:
        return
    stride = nc + 1
    # Class ids beyond nc (a dataset / weights mismatch the entry points refuse) must not index past the matrix.
    gcls = gt[:, 4].long().clamp(0, nc - 1)
    dcls = det[:, 5].long().clamp(0, nc - 1)
    keep = det[:, 4] > conf
    flat = matrix.view(-1)
    if m == 0:
        flat.index_put_((dcls * stride + nc,), keep.to(matrix.dtype), accumulate=True)
        return
    if n == 0:
        flat.index_put_((nc * stride + gcls,), torch.ones_like(gcls, dtype=matrix.dtype), accumulate=True)
        return
    if iou is None:
        iou = box_iou(gt[:, :4], det[:, :4])
    eligible = (iou > iou_thres) & keep[None]  # (M, N)
    has = eligible.any(0)
    det_iou, best = torch.where(eligible, iou, -1.0).max(0)  # (N,) each detection's label and its IoU
    label_iou = torch.full((m + 1,), -1.0, dtype=iou.dtype, device=iou.device)
    label_iou = label_iou.scatter_reduce(0, torch.where(has, best, m), det_iou, "amax")  # slot m: no label
    cand = has & (det_iou == label_iou[best])
    idx = torch.arange(n, device=det.device)
    first = torch.full((m + 1,), n, dtype=torch.long, device=det.device)
    first = first.scatter_reduce(0, torch.where(cand, best, m), idx, "amin")  # IoU ties: the first detection
    matched = cand & (first[best] == idx)
    index = torch.cat((dcls * stride + gcls[best], dcls * stride + nc, nc * stride + gcls))
    count = torch.cat((matched, keep & ~matched, first[:m] == n))
    flat.index_put_((index,), count.to(matrix.dtype), accumulate=True)


class DetectionMAP(PerClassState, Metric):
    """YOLOv5's validation metrics as a torchmetrics `Metric`: mAP@0.5, mAP@0.5:0.95, precision, recall, fitness.

    `update` matches each image's detections to its labels on the spot (`match_detections`) and keeps only
    (true-positive flags, score, class) per detection and (class, first of its class in its image) per label, the
    image count, and with `num_classes` the confusion matrix; DDP gathers those (list states "cat", counts "sum"),
    and `compute` runs `ap_per_class` on the CPU. `per_class()` gives the per-class breakdown of that computation.

    Args:
        iou_thresholds: matching thresholds; YOLOv5 uses linspace(0.5, 0.95, 10) (mAP@0.5 is the first).
        num_classes: class count for the confusion matrix (also settable later: `set_num_classes`); None keeps none.
        confusion_conf: score a detection needs to count in the confusion matrix (YOLOv5: 0.25).
        confusion_iou: IoU a detection needs to match a label in the confusion matrix (YOLOv5: 0.45).
    """

    full_state_update = False
    higher_is_better = True

    def __init__(
        self,
        iou_thresholds: Tensor | None = None,
        num_classes: int | None = None,
        confusion_conf: float = 0.25,
        confusion_iou: float = 0.45,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        thresholds = torch.linspace(0.5, 0.95, 10) if iou_thresholds is None else iou_thresholds
        self.register_buffer("iou_thresholds", thresholds.float(), persistent=False)
        for name in ("tp", "conf", "pred_cls", "target_cls", "target_first"):
            self.add_state(name, default=[], dist_reduce_fx="cat")
        self._init_per_class(num_classes, confusion_conf, confusion_iou)

    def update(self, preds: list[Tensor], targets: list[Tensor]) -> None:
        """Add a batch: per image (n, 6) detections [x1, y1, x2, y2, score, class] sorted by descending score, and
        (m, 5) labels [x1, y1, x2, y2, class], both in the same (original-image) pixels."""
        if len(preds) != len(targets):
            raise ValueError(f"DetectionMAP.update: {len(preds)} prediction lists for {len(targets)} target lists")
        iouv = self.iou_thresholds
        tp, first = [], []
        for d, g in zip(preds, targets, strict=True):
            iou = box_iou(g[:, :4], d[:, :4]) if d.shape[0] and g.shape[0] else None
            tp.append(match_detections(d, g, iouv, iou))
            if self.num_classes:
                confusion_update(self.confusion, d, g, self.confusion_conf, self.confusion_iou, iou)
            # A label is its image's first of its class unless an earlier label has the same class (images per class).
            first.append(~(g[:, 4:5] == g[None, :, 4]).triu(1).any(0))
        dets = torch.cat([d.reshape(-1, 6) for d in preds]) if preds else torch.zeros((0, 6), device=iouv.device)
        # Always append, even empty: every rank then has a tensor of the right shape to gather.
        self.tp.append(torch.cat(tp).to(torch.uint8) if tp else torch.zeros((0, iouv.numel()), dtype=torch.uint8))
        self.conf.append(dets[:, 4].float())
        self.pred_cls.append(dets[:, 5].float())
        self.target_cls.append(torch.cat([g[:, 4].float() for g in targets]) if targets else dets.new_zeros(0))
        self.target_first.append(torch.cat(first).to(torch.uint8) if first else torch.zeros(0, dtype=torch.uint8))
        self.num_images += len(preds)

    def compute(self) -> dict[str, Tensor]:
        """{"map", "map_50", "precision", "recall", "fitness"} as 0-dim float tensors (0 when there are no labels);
        the per-class breakdown is kept for `per_class()`."""

        def cat(state: list[Tensor] | Tensor, width: int | None = None) -> np.ndarray:
            parts = state if isinstance(state, list) else [state]
            parts = [p.reshape(-1, width) if width else p.reshape(-1) for p in parts]
            if not parts:
                return np.zeros((0, width) if width else (0,))
            return torch.cat(parts).cpu().double().numpy()

        t = self.iou_thresholds.numel()
        target_cls = cat(self.target_cls)
        stats = ap_per_class(cat(self.tp, t), cat(self.conf), cat(self.pred_cls), target_cls)
        ap = stats["ap"]
        self._per_class = PerClassResults(
            classes=stats["classes"].astype(np.int64),
            images=images_per_class(stats["classes"], target_cls, cat(self.target_first)),
            instances=stats["instances"].astype(np.int64),
            precision=stats["precision"],
            recall=stats["recall"],
            map_50=ap[:, 0] if ap.size else np.zeros(0),
            map=ap.mean(1) if ap.size else np.zeros(0),
            seen=int(self.num_images),
            confusion=self._confusion_numpy(),
            conf_grid=stats["conf_grid"],
            p_curve=stats["p_curve"],
            r_curve=stats["r_curve"],
            f1_curve=2 * stats["p_curve"] * stats["r_curve"] / (stats["p_curve"] + stats["r_curve"] + 1e-16),
            pr_recall=stats["conf_grid"],  # the same linspace(0, 1, 1000), as a recall grid
            pr_curve=stats["pr_curve"],
        )
        device = self.iou_thresholds.device

        def mean(x: np.ndarray) -> Tensor:
            return torch.tensor(float(x.mean()) if x.size else 0.0, dtype=torch.float32, device=device)

        map_50, map_all = mean(self._per_class.map_50), mean(self._per_class.map)
        return {
            "map": map_all,
            "map_50": map_50,
            "precision": mean(stats["precision"]),
            "recall": mean(stats["recall"]),
            "fitness": fitness(map_50, map_all),
        }
