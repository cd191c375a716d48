"""Detection metrics: torchmetrics' COCO mAP plus YOLOv5's precision, recall and fitness.

Choices (see docs/design.md, "Training"):
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

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.detection import MeanAveragePrecision

__all__ = ["fitness", "make_map_metric", "precision_recall_at_best_f1", "summarize_map"]

# faster_coco_eval prints its 12-line COCO summary at INFO on every compute(); yolo5l logs the numbers itself.
logging.getLogger("faster_coco_eval").setLevel(logging.WARNING)


def make_map_metric(max_det: int = 300) -> MeanAveragePrecision:
    """The validation mAP metric (COCO protocol, faster_coco_eval backend, up to `max_det` detections per image)."""
    metric = MeanAveragePrecision(
        box_format="xyxy",
        iou_type="bbox",
        backend="faster_coco_eval",
        max_detection_thresholds=[1, 10, max_det],
        extended_summary=True,
        compute_on_cpu=False,
    )
    metric.warn_on_many_detections = False  # NMS caps detections at max_det already
    return metric


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
        result: output of a metric made by `make_map_metric` (needs the extended summary).

    Returns:
        {"map", "map_50", "precision", "recall", "fitness"} as 0-dim float tensors (mAP values of -1, i.e. no
        labels at all, are reported as 0).
    """
    map_50 = result["map_50"].float().clamp(min=0)
    map_all = result["map"].float().clamp(min=0)
    # precision: (T, R, K, A, M); IoU 0.5 first, area "all" first, the largest detection cap last.
    p, r = precision_recall_at_best_f1(result["precision"][0, :, :, 0, -1], result["scores"][0, :, :, 0, -1])
    return {"map": map_all, "map_50": map_50, "precision": p, "recall": r, "fitness": fitness(map_50, map_all)}
