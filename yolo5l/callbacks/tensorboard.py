"""`BatchPlotter`: the first training batches, drawn with their boxes, as TensorBoard images (YOLOv5's
train_batch0..2.jpg)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from torchvision.utils import draw_bounding_boxes, make_grid
from typing_extensions import override

from yolo5l.boxes import xywh2xyxy

__all__ = ["BatchPlotter", "draw_batch"]


def draw_batch(images: Tensor, targets: Tensor, names: list[str] | None = None, max_images: int = 16) -> Tensor:
    """Draw (N, 6) normalised targets on a (B, 3, H, W) batch (float in [0, 1] or uint8); returns a uint8 grid."""
    images = images[:max_images].detach().float().cpu()
    if images.max() <= 1.0:
        images = images * 255
    images = images.clamp(0, 255).to(torch.uint8)
    h, w = images.shape[2:]
    targets = targets.detach().float().cpu()
    drawn = []
    for i, img in enumerate(images):
        t = targets[targets[:, 0] == i]
        boxes = xywh2xyxy(t[:, 2:6] * torch.tensor([w, h, w, h]))
        labels = [names[int(c)] if names and int(c) < len(names) else str(int(c)) for c in t[:, 1]]
        drawn.append(draw_bounding_boxes(img, boxes, labels=labels, colors="yellow") if len(t) else img)
    return make_grid(torch.stack(drawn), nrow=min(4, len(drawn)))


class BatchPlotter(Callback):
    """Write the first `num_batches` training batches with their boxes to the TensorBoard logger, once, on rank 0.

    Args:
        num_batches: how many of the first batches to draw.
        max_images: images per batch drawn.
    """

    def __init__(self, num_batches: int = 3, max_images: int = 16) -> None:
        self.num_batches = int(num_batches)
        self.max_images = int(max_images)
        self.done = 0

    @override
    @rank_zero_only
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.done >= self.num_batches:
            return
        experiment = getattr(trainer.logger, "experiment", None)
        if experiment is None or not hasattr(experiment, "add_image"):
            self.done = self.num_batches  # no TensorBoard logger: nothing to draw into
            return
        names = list(getattr(pl_module, "names", []) or [])
        grid = draw_batch(batch[0], batch[1], names, self.max_images)  # a few host copies, three times per run
        experiment.add_image(f"train/batch{self.done}", grid, global_step=trainer.global_step)
        self.done += 1
