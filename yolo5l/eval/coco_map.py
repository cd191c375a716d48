"""`COCOMap`: the COCO protocol (torchmetrics' `MeanAveragePrecision`, faster_coco_eval backend) with
`DetectionMAP`'s interface and per-class results (`conf/module/metric/coco.yaml`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torchmetrics.detection import MeanAveragePrecision

from yolo5l.eval.metrics import confusion_update, summarize_map
from yolo5l.eval.per_class import PerClassResults, PerClassState, confidence_curves, first_in_image, images_per_class

__all__ = ["COCOMap"]


class COCOMap(PerClassState, MeanAveragePrecision):
    """The COCO protocol (torchmetrics' `MeanAveragePrecision`, faster_coco_eval backend) with `DetectionMAP`'s
    interface: `update` takes the same per-image detection and label tensors, `compute` returns the same keys, and
    `per_class()` the per-class breakdown, read from COCOeval's per-class precision arrays (no per-class re-run).

    Args:
        max_det: detections per image counted (YOLOv5's validation keeps 300).
        num_classes: class count for YOLOv5's confusion matrix (or `set_num_classes`); None keeps none.
        confusion_conf: score a detection needs to count in the confusion matrix (YOLOv5: 0.25).
        confusion_iou: IoU a detection needs to match a label in the confusion matrix (YOLOv5: 0.45).
    """

    def __init__(
        self,
        max_det: int = 300,
        num_classes: int | None = None,
        confusion_conf: float = 0.25,
        confusion_iou: float = 0.45,
        **kwargs: object,
    ) -> None:
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
        self._init_per_class(num_classes, confusion_conf, confusion_iou)

    def update(self, preds: list[Tensor], targets: list[Tensor]) -> None:  # type: ignore[override]
        """Per image (n, 6) detections [x1, y1, x2, y2, score, class] and (m, 5) labels [x1, y1, x2, y2, class]."""
        super().update(
            [{"boxes": d[:, :4], "scores": d[:, 4], "labels": d[:, 5].long()} for d in preds],
            [{"boxes": g[:, :4], "labels": g[:, 4].long()} for g in targets],
        )
        if self.num_classes:
            for d, g in zip(preds, targets, strict=True):
                confusion_update(self.confusion, d, g, self.confusion_conf, self.confusion_iou)
        self.num_images += len(preds)

    def compute(self) -> dict[str, Tensor]:  # type: ignore[override]
        """{"map", "map_50", "precision", "recall", "fitness"} as 0-dim float tensors; the per-class breakdown is
        kept for `per_class()`."""
        result = super().compute()
        self._per_class = self._per_class_results(result)
        return summarize_map(result)

    def _per_class_results(self, result: dict[str, Tensor], num_conf: int = 1000) -> PerClassResults:
        labels = [g.reshape(-1).cpu().numpy() for g in self.groundtruth_labels]
        label_cls = np.concatenate(labels) if labels else np.zeros(0, np.int64)
        first = np.concatenate([first_in_image(g) for g in labels]) if labels else np.zeros(0, bool)
        classes, instances = np.unique(label_cls, return_counts=True)
        k = classes.shape[0]
        grid, rec = np.linspace(0, 1, num_conf), np.asarray(self.rec_thresholds, dtype=np.float64)
        p_curve, r_curve, pr_curve = np.zeros((k, num_conf)), np.zeros((k, num_conf)), np.zeros((k, rec.shape[0]))
        map_50, map_all, best = np.zeros(k), np.zeros(k), 0
        if "precision" in result and k:
            # precision: (T, R, K, A, M) over result["classes"] (ascending); IoU 0.5 first, area "all" first, the
            # largest detection cap last. A class with labels has every entry >= 0, one without has -1 throughout.
            prec = result["precision"][:, :, :, 0, -1].double()
            present = (prec[0] > -1).any(0).numpy()
            where = np.searchsorted(classes, result["classes"].numpy()[present])  # columns of present classes
            p = prec[:, :, torch.from_numpy(present)].clamp(min=0).numpy()  # (T, R, K')
            map_50[where], map_all[where] = p[0].mean(0), p.mean((0, 1))
            pr_curve[where] = p[0].T
            curves = confidence_curves(prec[0], result["scores"][0, :, :, 0, -1], num_conf)
            if curves is not None:
                _, pc, rc, best = curves
                p_curve[where], r_curve[where] = pc.T.numpy(), rc.T.numpy()
        f1 = 2 * p_curve * r_curve / (p_curve + r_curve + 1e-16)
        return PerClassResults(
            classes=classes.astype(np.int64),
            images=images_per_class(classes, label_cls, first),
            instances=instances.astype(np.int64),
            precision=p_curve[:, best] if k else np.zeros(0),
            recall=r_curve[:, best] if k else np.zeros(0),
            map_50=map_50,
            map=map_all,
            seen=int(self.num_images),
            confusion=self._confusion_numpy(),
            conf_grid=grid,
            p_curve=p_curve,
            r_curve=r_curve,
            f1_curve=f1,
            pr_recall=rec,
            pr_curve=pr_curve,
        )
