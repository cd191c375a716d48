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
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.detection import MeanAveragePrecision
from torchvision.ops import box_iou

__all__ = [
    "COCOMap",
    "DetectionMAP",
    "ap_per_class",
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
    precision, scores = precision.double(), scores.double()
    present = (precision > -1).any(0)
    p, s = precision[:, present], scores[:, present]  # (R, K')
    if p.shape[1] == 0:
        zero = torch.zeros((), dtype=torch.float32)
        return zero, zero.clone()
    num_rec = p.shape[0]
    rec = torch.linspace(0, 1, num_rec, dtype=torch.float64)
    conf = torch.linspace(0, 1, num_conf, dtype=torch.float64)
    reached = (s[None] >= conf[:, None, None]) & (s[None] > 0)  # (G, R, K'): recall threshold met at conf
    r_idx = torch.where(reached, torch.arange(num_rec)[None, :, None], -1).amax(1)  # (G, K') last met
    hit = r_idx >= 0
    r_idx = r_idx.clamp(min=0)
    recall = torch.where(hit, rec[r_idx], 0.0)
    prec = torch.where(hit, p.gather(0, r_idx), 1.0)  # no detection above conf: precision 1, recall 0 (YOLOv5)
    f1 = (2 * prec * recall / (prec + recall + 1e-16)).mean(1)  # (G,)
    nf = round(num_conf * 0.1 * 2) // 2 + 1  # YOLOv5's smooth(f1, 0.1): box filter, edges replicated
    f1 = F.avg_pool1d(F.pad(f1[None, None], (nf // 2, nf // 2), mode="replicate"), nf, stride=1)[0, 0]
    best = int(f1.argmax())
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
def match_detections(det: Tensor, gt: Tensor, iou_thresholds: Tensor) -> Tensor:
    """Which detections of one image are true positives at each IoU threshold (YOLOv5's matching rule).

    At threshold t a (label, detection) pair is eligible when the classes agree and IoU >= t. Every detection
    takes its highest-IoU eligible label; each label then keeps the first (best-scoring) detection that chose it.
    This is the outcome of yolov5 v7.0 `val.py::process_batch` (pairs sorted by IoU, unique detections, then unique
    labels in detection order), computed for all thresholds at once without a host sync.

    Args:
        det: (N, 6) [x1, y1, x2, y2, score, class], sorted by descending score (NMS order).
        gt: (M, 5) [x1, y1, x2, y2, class] in the same pixel space.
        iou_thresholds: (T,) thresholds.

    Returns:
        (N, T) bool.
    """
    n, m, t = det.shape[0], gt.shape[0], iou_thresholds.numel()
    if n == 0 or m == 0:
        return torch.zeros((n, t), dtype=torch.bool, device=det.device)
    iou = box_iou(gt[:, :4], det[:, :4])  # (M, N)
    eligible = (iou[None] >= iou_thresholds[:, None, None]) & (gt[:, 4:5] == det[:, 5])[None]  # (T, M, N)
    best = torch.where(eligible, iou[None], -1.0).argmax(1)  # (T, N) each detection's label
    has = eligible.any(1)  # (T, N)
    idx = torch.arange(n, device=det.device).expand(t, n)
    chosen = torch.where(has, best, m)  # detections without a label go to a dummy slot m
    first = torch.full((t, m + 1), n, device=det.device).scatter_reduce(1, chosen, idx, "amin")
    return (has & (first.gather(1, best) == idx)).T


_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy 2 renamed trapz


def ap_per_class(
    tp: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, target_cls: np.ndarray, num_conf: int = 1000
) -> dict[str, np.ndarray]:
    """Per-class AP, and precision / recall at the best smoothed mean-F1 confidence (YOLOv5's definitions).

    Args:
        tp: (N, T) true-positive flags of all detections (`match_detections`).
        conf: (N,) scores. pred_cls: (N,) predicted classes. target_cls: (M,) classes of all labels.
        num_conf: size of the confidence grid on [0, 1] for the P/R/F1 curves (YOLOv5 uses 1000).

    Returns:
        {"ap": (K, T), "precision": (K,), "recall": (K,), "classes": (K,)} over the K classes that have labels;
        a class without detections has AP, precision and recall 0.

    Reference: yolov5 v7.0 `utils/metrics.py::ap_per_class` / `compute_ap` (envelope of the PR curve, trapezoidal
    integral at 101 recall points; precision curve 1 and recall curve 0 above the highest score; F1 box filter of
    width 0.1, mean over classes).
    """
    order = np.argsort(-conf, kind="stable")
    tp, conf, pred_cls = tp[order], conf[order], pred_cls[order]
    classes, counts = np.unique(target_cls, return_counts=True)
    k, t = classes.shape[0], tp.shape[1]
    grid = np.linspace(0, 1, num_conf)
    rec_pts = np.linspace(0, 1, 101)
    ap, p_curve, r_curve = np.zeros((k, t)), np.zeros((k, num_conf)), np.zeros((k, num_conf))
    for ci, (c, n_labels) in enumerate(zip(classes, counts, strict=True)):
        sel = pred_cls == c
        if not sel.any():
            continue
        tpc = tp[sel].cumsum(0)
        fpc = (1 - tp[sel]).cumsum(0)
        recall = tpc / (n_labels + 1e-16)
        precision = tpc / (tpc + fpc)
        r_curve[ci] = np.interp(-grid, -conf[sel], recall[:, 0], left=0)  # scores fall along the detections
        p_curve[ci] = np.interp(-grid, -conf[sel], precision[:, 0], left=1)
        for j in range(t):
            mrec = np.concatenate(([0.0], recall[:, j], [1.0]))
            mpre = np.flip(np.maximum.accumulate(np.flip(np.concatenate(([1.0], precision[:, j], [0.0])))))
            ap[ci, j] = _trapezoid(np.interp(rec_pts, mrec, mpre), rec_pts)
    f1 = 2 * p_curve * r_curve / (p_curve + r_curve + 1e-16)
    if k:
        nf = round(num_conf * 0.1 * 2) // 2 + 1  # box filter of width 0.1, edges replicated
        mean_f1 = f1.mean(0)
        padded = np.concatenate((np.full(nf // 2, mean_f1[0]), mean_f1, np.full(nf // 2, mean_f1[-1])))
        best = int(np.convolve(padded, np.ones(nf) / nf, mode="valid").argmax())
    else:
        best = 0
    return {"ap": ap, "precision": p_curve[:, best], "recall": r_curve[:, best], "classes": classes}


class DetectionMAP(Metric):
    """YOLOv5's validation metrics as a torchmetrics `Metric`: mAP@0.5, mAP@0.5:0.95, precision, recall, fitness.

    `update` matches each image's detections to its labels on the spot (`match_detections`) and keeps only
    (true-positive flags, score, class) per detection and the class of each label; DDP gathers those (list states,
    "cat"), and `compute` runs `ap_per_class` on the CPU.

    Args:
        iou_thresholds: matching thresholds; YOLOv5 uses linspace(0.5, 0.95, 10) (mAP@0.5 is the first).
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, iou_thresholds: Tensor | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        thresholds = torch.linspace(0.5, 0.95, 10) if iou_thresholds is None else iou_thresholds
        self.register_buffer("iou_thresholds", thresholds.float(), persistent=False)
        for name in ("tp", "conf", "pred_cls", "target_cls"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, preds: list[Tensor], targets: list[Tensor]) -> None:
        """Add a batch: per image (n, 6) detections [x1, y1, x2, y2, score, class] sorted by descending score, and
        (m, 5) labels [x1, y1, x2, y2, class], both in the same (original-image) pixels."""
        if len(preds) != len(targets):
            raise ValueError(f"DetectionMAP.update: {len(preds)} prediction lists for {len(targets)} target lists")
        iouv = self.iou_thresholds
        tp = [match_detections(d, g, iouv) for d, g in zip(preds, targets, strict=True)]
        dets = torch.cat([d.reshape(-1, 6) for d in preds]) if preds else torch.zeros((0, 6), device=iouv.device)
        # Always append, even empty: every rank then has a tensor of the right shape to gather.
        self.tp.append(torch.cat(tp).to(torch.uint8) if tp else torch.zeros((0, iouv.numel()), dtype=torch.uint8))
        self.conf.append(dets[:, 4].float())
        self.pred_cls.append(dets[:, 5].float())
        self.target_cls.append(torch.cat([g[:, 4].float() for g in targets]) if targets else dets.new_zeros(0))

    def compute(self) -> dict[str, Tensor]:
        """{"map", "map_50", "precision", "recall", "fitness"} as 0-dim float tensors (0 when there are no labels)."""

        def cat(state: list[Tensor] | Tensor, width: int | None = None) -> np.ndarray:
            parts = state if isinstance(state, list) else [state]
            parts = [p.reshape(-1, width) if width else p.reshape(-1) for p in parts]
            if not parts:
                return np.zeros((0, width) if width else (0,))
            return torch.cat(parts).cpu().double().numpy()

        t = self.iou_thresholds.numel()
        stats = ap_per_class(cat(self.tp, t), cat(self.conf), cat(self.pred_cls), cat(self.target_cls))
        ap = stats["ap"]
        device = self.iou_thresholds.device

        def mean(x: np.ndarray) -> Tensor:
            return torch.tensor(float(x.mean()) if x.size else 0.0, dtype=torch.float32, device=device)

        map_50, map_all = mean(ap[:, 0]), mean(ap.mean(1) if ap.size else ap)
        return {
            "map": map_all,
            "map_50": map_50,
            "precision": mean(stats["precision"]),
            "recall": mean(stats["recall"]),
            "fitness": fitness(map_50, map_all),
        }


class COCOMap(MeanAveragePrecision):
    """The COCO protocol (torchmetrics' `MeanAveragePrecision`, faster_coco_eval backend) with `DetectionMAP`'s
    interface: `update` takes the same per-image detection and label tensors, `compute` returns the same keys.

    Args:
        max_det: detections per image counted (YOLOv5's validation keeps 300).
    """

    def __init__(self, max_det: int = 300, **kwargs: object) -> None:
        super().__init__(
            box_format="xyxy",
            iou_type="bbox",
            backend="faster_coco_eval",
            max_detection_thresholds=[1, 10, max_det],
            extended_summary=True,
            compute_on_cpu=False,
            **kwargs,
        )
        self.warn_on_many_detections = False  # NMS caps detections at max_det already

    def update(self, preds: list[Tensor], targets: list[Tensor]) -> None:  # type: ignore[override]
        """Per image (n, 6) detections [x1, y1, x2, y2, score, class] and (m, 5) labels [x1, y1, x2, y2, class]."""
        super().update(
            [{"boxes": d[:, :4], "scores": d[:, 4], "labels": d[:, 5].long()} for d in preds],
            [{"boxes": g[:, :4], "labels": g[:, 4].long()} for g in targets],
        )

    def compute(self) -> dict[str, Tensor]:  # type: ignore[override]
        """{"map", "map_50", "precision", "recall", "fitness"} as 0-dim float tensors."""
        return summarize_map(super().compute())
