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
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchvision.ops import box_iou

__all__ = [
    "DetectionMAP",
    "PerClassResults",
    "ap_per_class",
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
    curves = _confidence_curves(precision, scores, num_conf)
    if curves is None:
        zero = torch.zeros((), dtype=torch.float32)
        return zero, zero.clone()
    _, prec, recall, best = curves
    return prec[best].mean().float(), recall[best].mean().float()


def _confidence_curves(precision: Tensor, scores: Tensor, num_conf: int) -> tuple[Tensor, Tensor, Tensor, int] | None:
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
    best = _best_f1_index(f1)
    return {
        "ap": ap, "precision": p_curve[:, best], "recall": r_curve[:, best], "classes": classes, "instances": counts,
        "conf_grid": grid, "p_curve": p_curve, "r_curve": r_curve, "pr_curve": pr_curve,
    }  # fmt: skip


def _best_f1_index(f1: np.ndarray) -> int:
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


def _images_per_class(classes: np.ndarray, label_cls: np.ndarray, first_in_image: np.ndarray) -> np.ndarray:
    """Images holding each of `classes`: the labels that are the first of their class in their image, counted."""
    firsts = label_cls[first_in_image.astype(bool)]
    return np.array([(firsts == c).sum() for c in classes], dtype=np.int64)


class _PerClassState:
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


class DetectionMAP(_PerClassState, Metric):
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
            images=_images_per_class(stats["classes"], target_cls, cat(self.target_first)),
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


def _first_in_image(label_cls: np.ndarray) -> np.ndarray:
    """(M,) bool: the label is the first of its class among one image's labels."""
    first = np.zeros(label_cls.shape[0], dtype=bool)
    first[np.unique(label_cls, return_index=True)[1]] = True
    return first


def __getattr__(name: str) -> object:
    # COCOMap lives in yolo5l/coco_map.py (it builds on this module); `yolo5l.metrics.COCOMap` still finds it.
    if name == "COCOMap":
        from yolo5l.coco_map import COCOMap

        return COCOMap
    raise AttributeError(f"module 'yolo5l.metrics' has no attribute {name!r}")
