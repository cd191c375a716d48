"""`AutoAnchor`: before training, check how well the model's anchors fit the training boxes and re-fit them when
they fit poorly (YOLOv5's AutoAnchor, `yolo5l.training.autoanchor`).

Reference: ultralytics/yolov5 v7.0 `train.py::train` (`check_anchors` before training unless `--noautoanchor` or
`--resume`), `utils/autoanchor.py::check_anchors`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from yolo5l.training.autoanchor import AnchorCheck, check_anchors

__all__ = ["AutoAnchor", "apply_anchors"]


@torch.no_grad()
def apply_anchors(pl_module: pl.LightningModule, anchors_px: Tensor) -> Tensor:
    """Give the module's model, and its loss, new anchors.

    The anchors become grid units of each level and are rounded to half precision, the precision every weights file
    stores them in, so that training, `best.pt` and `weights.pt` use the same values (YOLOv5 rounds its whole model
    to half precision at this point for the same reason).

    Args:
        pl_module: A module with ``model`` (``anchors`` (nl, na, 2) grid units, ``stride`` (nl,)) and optionally a
            ``loss`` with ``set_anchors``.
        anchors_px: (nl, na, 2) anchors in pixels, smallest first (the stride order).

    Returns:
        The anchors in grid units, as set.
    """
    model = pl_module.model
    current = model.anchors
    stride = model.stride.to(device=current.device, dtype=torch.float32).view(-1, 1, 1)
    grid = (anchors_px.to(current.device).float().view_as(current) / stride).half().to(current.dtype)
    current.copy_(grid)
    loss = getattr(pl_module, "loss", None)
    if hasattr(loss, "set_anchors"):
        loss.set_anchors(grid)  # type: ignore[union-attr]
    return grid


class AutoAnchor(Callback):
    """At the start of a fresh fit, on global rank 0: the best possible recall (BPR) and anchors per target of the
    model's anchors on the training labels at the datamodule's ``imgsz``; at or below 0.98, a k-means + evolution
    re-fit kept only when its BPR is higher. The result is broadcast to every rank and set in the model (so every
    checkpoint and weights file carries it) and in the loss.

    Skipped when resuming (the checkpoint holds the run's anchors) and inside Lightning's batch-size search. It must
    run before `EMACallback` copies the model at fit start (the default callbacks list it first).

    Args:
        noautoanchor: True turns the check off (YOLOv5's ``--noautoanchor``).
        thr: The anchor-multiple threshold, ``hyp.anchor_t``.
        seed: Seeds the scale jitter, k-means starts and mutations.
        generations: Evolution generations.
        population: Mutants evaluated together per generation.
    """

    def __init__(
        self,
        noautoanchor: bool = False,
        thr: float = 4.0,
        seed: int = 0,
        generations: int = 100,
        population: int = 10,
    ) -> None:
        self.enabled = not bool(noautoanchor)
        self.thr = float(thr)
        self.seed = int(seed)
        self.generations = int(generations)
        self.population = int(population)
        #: What the last check found (global rank 0 only; None before a check).
        self.result: AnchorCheck | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or trainer.ckpt_path is not None:
            return
        if any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
            return  # data.batch_size=-1's search: it measures memory, and restores the model afterwards
        for cb in trainer.callbacks:
            if cb is self:
                break
            if getattr(cb, "ema_state_dict", None):  # an EMA built before this callback would keep the old anchors
                raise RuntimeError("AutoAnchor must come before EMACallback in the callbacks list")
        anchors = None
        if trainer.is_global_zero:
            anchors = self._check(trainer, pl_module)
        anchors = trainer.strategy.broadcast(anchors, src=0)
        if anchors is not None:
            apply_anchors(pl_module, anchors)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Tensor | None:
        datamodule: Any = trainer.datamodule
        dataset = getattr(datamodule, "train_dataset", None)
        if dataset is None or not hasattr(dataset, "labels") or not hasattr(pl_module.model, "anchor_pixels"):
            rank_zero_info("AutoAnchor: no training labels or anchors to check; skipped")
            return None
        self.result = check_anchors(
            pl_module.model.anchor_pixels().detach().cpu(),
            dataset.labels,
            dataset.shapes,
            int(datamodule.imgsz),
            thr=self.thr,
            seed=self.seed,
            generations=self.generations,
            population=self.population,
        )
        for line in self.result.lines:
            rank_zero_info(f"AutoAnchor: {line}")
        return self.result.anchors
