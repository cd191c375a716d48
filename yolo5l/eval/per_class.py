"""Per-class results and the curves behind them, shared by both mAP metrics (`DetectionMAP` in `yolo5l.eval.metrics`,
`COCOMap` in `yolo5l.eval.coco_map`).

- `PerClassResults`: what ultralytics' val.py prints and plots per class.
- `PerClassState`: the metric mixin that keeps YOLOv5's confusion matrix and the last `PerClassResults`.
- `ap_per_class`: YOLOv5's per-class AP and P/R/F1-confidence curves from matched detections.
- `confidence_curves`: precision and recall against confidence from COCOeval's interpolated curves.
- `images_per_class`, `first_in_image`: the image count of each class.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PerClassResults",
    "PerClassState",
    "ap_per_class",
    "best_f1_index",
    "confidence_curves",
    "first_in_image",
    "images_per_class",
]


def confidence_curves(precision: Tensor, scores: Tensor, num_conf: int) -> tuple[Tensor, Tensor, Tensor, int] | None:
    """Precision and recall against confidence from COCOeval's interpolated curves (`precision_recall_at_best_f1`).

    Returns:
        (present (K,) bool: classes with labels, precision (G, K'), recall (G, K') of those classes on
        linspace(0, 1, num_conf), index of the best smoothed mean F1), or None when no class has labels.
    """
    precision, scores = precision.double(), scores.double()
    present = (precision > -1).any(0)
    p, s = precision[:, present], scores[:, present]  # (R, K')
    if p.shape[1] == 0:
        return None
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
    return present, prec, recall, int(f1.argmax())


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
        {"ap": (K, T), "precision": (K,), "recall": (K,), "classes": (K,), "instances": (K,)} over the K classes
        that have labels (a class without detections has AP, precision and recall 0), and the curves ultralytics
        plots: "conf_grid" (G,) with "p_curve", "r_curve" (K, G) against confidence, and "pr_curve" (K, G), the
        precision envelope at IoU 0.5 against recall on the same grid.

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
    pr_curve = np.zeros((k, num_conf))
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
            if j == 0:
                pr_curve[ci] = np.interp(grid, mrec, mpre)
    f1 = 2 * p_curve * r_curve / (p_curve + r_curve + 1e-16)
    best = best_f1_index(f1)
    return {
        "ap": ap, "precision": p_curve[:, best], "recall": r_curve[:, best], "classes": classes, "instances": counts,
        "conf_grid": grid, "p_curve": p_curve, "r_curve": r_curve, "pr_curve": pr_curve,
    }  # fmt: skip


def best_f1_index(f1: np.ndarray) -> int:
    """Index of the highest mean F1 over classes (rows) after YOLOv5's box filter of width 0.1, edges replicated."""
    if not f1.shape[0]:
        return 0
    nf = round(f1.shape[1] * 0.1 * 2) // 2 + 1
    mean_f1 = f1.mean(0)
    padded = np.concatenate((np.full(nf // 2, mean_f1[0]), mean_f1, np.full(nf // 2, mean_f1[-1])))
    return int(np.convolve(padded, np.ones(nf) / nf, mode="valid").argmax())


# ---- per-class results ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PerClassResults:
    """What ultralytics' val.py prints and plots per class, over the K classes that have labels (ascending ids).

    The overall figures `compute()` returns are the means of `precision`, `recall`, `map_50` and `map`.

    Attributes:
        classes: (K,) class ids.
        images: (K,) images with at least one label of the class.
        instances: (K,) labels of the class.
        precision: (K,) at the confidence of the best smoothed mean F1 (over all classes).
        recall: (K,) at that confidence.
        map_50: (K,) AP at IoU 0.5.
        map: (K,) AP averaged over the IoU thresholds (0.5:0.95).
        seen: images validated, with or without labels.
        confusion: (nc + 1, nc + 1) counts [predicted, true] with background last (`confusion_update`), or None
            when the metric was not given the class count (`set_num_classes`).
        conf_grid: (G,) confidences of `p_curve`, `r_curve` and `f1_curve` ((K, G) each).
        pr_recall: (R,) recall grid of `pr_curve` ((K, R), precision at IoU 0.5).
    """

    classes: np.ndarray
    images: np.ndarray
    instances: np.ndarray
    precision: np.ndarray
    recall: np.ndarray
    map_50: np.ndarray
    map: np.ndarray
    seen: int
    confusion: np.ndarray | None
    conf_grid: np.ndarray
    p_curve: np.ndarray
    r_curve: np.ndarray
    f1_curve: np.ndarray
    pr_recall: np.ndarray
    pr_curve: np.ndarray

    def overall(self) -> dict[str, float]:
        """The `all` row: {"images": seen, "instances", "precision", "recall", "map_50", "map"} (means over classes,
        0 without classes)."""

        def mean(x: np.ndarray) -> float:
            return float(x.mean()) if x.size else 0.0

        return {
            "images": self.seen, "instances": int(self.instances.sum()), "precision": mean(self.precision),
            "recall": mean(self.recall), "map_50": mean(self.map_50), "map": mean(self.map),
        }  # fmt: skip


def images_per_class(classes: np.ndarray, label_cls: np.ndarray, first_in_image: np.ndarray) -> np.ndarray:
    """Images holding each of `classes`: the labels that are the first of their class in their image, counted."""
    firsts = label_cls[first_in_image.astype(bool)]
    return np.array([(firsts == c).sum() for c in classes], dtype=np.int64)


class PerClassState:
    """The confusion-matrix state and the per-class results `DetectionMAP` and `COCOMap` share (a mixin of
    torchmetrics `Metric`s: `add_state`, `device`, `compute` come from there)."""

    num_classes: int | None
    confusion_conf: float
    confusion_iou: float
    _per_class: PerClassResults | None

    def _init_per_class(self, num_classes: int | None, confusion_conf: float, confusion_iou: float) -> None:
        self.num_classes = None
        self.confusion_conf, self.confusion_iou = float(confusion_conf), float(confusion_iou)
        self._per_class = None
        self.add_state("num_images", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")  # type: ignore[attr-defined]
        if num_classes is not None:
            self.set_num_classes(num_classes)

    def set_num_classes(self, num_classes: int) -> None:
        """Keep YOLOv5's confusion matrix for `num_classes` classes from now on: a (nc + 1, nc + 1) count state on the
        metric's device, summed over ranks (`confusion_update` in every `update`)."""
        if num_classes < 1:
            raise ValueError(f"set_num_classes: {num_classes} classes")
        if num_classes == self.num_classes:
            return
        self.num_classes = int(num_classes)
        zeros = torch.zeros((num_classes + 1, num_classes + 1), dtype=torch.long, device=self.device)  # type: ignore[attr-defined]
        self.add_state("confusion", default=zeros, dist_reduce_fx="sum")  # type: ignore[attr-defined]

    def per_class(self) -> PerClassResults:
        """The per-class results of the last `compute()`, which runs now if the states changed since (in DDP, call
        it on every rank then, as `compute()`). They survive `reset()`: a Lightning module computes and resets at
        the end of its validation epoch, and callbacks read them after."""
        if self._per_class is None or (self._update_count > 0 and self._computed is None):  # type: ignore[attr-defined]
            self.compute()  # type: ignore[attr-defined]
        assert self._per_class is not None
        return self._per_class

    def _confusion_numpy(self) -> np.ndarray | None:
        return self.confusion.cpu().numpy().copy() if self.num_classes else None  # type: ignore[attr-defined]


def first_in_image(label_cls: np.ndarray) -> np.ndarray:
    """(M,) bool: the label is the first of its class among one image's labels."""
    first = np.zeros(label_cls.shape[0], dtype=bool)
    first[np.unique(label_cls, return_index=True)[1]] = True
    return first
