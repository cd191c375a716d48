"""`BatchPlotter`: the first training batches, drawn with their boxes, as `train_batch0..2.jpg` in the run folder
(YOLOv5's files), TensorBoard images, MLflow artifacts and W&B media."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from yolo5l.infer.annotate import draw_batch, save_rgb
from yolo5l.tracking.trackers import EXTRAS, add_jpeg, log_image

__all__ = ["BatchPlotter"]


class BatchPlotter(Callback):
    """Draw the first `num_batches` training batches with their boxes, once, on rank 0, at the start of a new run: as
    `train_batch{i}.jpg` in `out_dir` and to the TensorBoard, MLflow and W&B loggers. A resumed run (`trainer.fit`
    with a `ckpt_path`) draws nothing: its start drew them, and they would come again at the resumed step.

    Args:
        num_batches: how many of the first batches to draw.
        max_images: images per batch drawn.
        plots: write the files (the root `plots` of train.yaml); the loggers get the images either way.
        out_dir: folder of the files; None: the trainer's `default_root_dir` (the run folder).
    """

    def __init__(
        self, num_batches: int = 3, max_images: int = 16, plots: bool = True, out_dir: str | None = None
    ) -> None:
        self.num_batches = int(num_batches)
        self.max_images = int(max_images)
        self.plots = bool(plots)
        self.out_dir = out_dir
        self.done = 0

    @override
    @rank_zero_only
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.done >= self.num_batches:
            return
        if trainer.ckpt_path is not None:  # a resumed run: its first batches are not the run's first
            self.done = self.num_batches
            return
        experiments = (getattr(lg, "experiment", None) for lg in trainer.loggers)
        tensorboards = [e for e in experiments if hasattr(e, "add_image")]
        trackers = [lg for lg in trainer.loggers if type(lg).__name__ in EXTRAS]
        if not tensorboards and not trackers and not self.plots:
            self.done = self.num_batches  # nowhere to draw into
            return
        names = list(getattr(pl_module, "names", []) or [])
        grid = draw_batch(batch[0], batch[1], names, self.max_images)
        if self.plots:
            save_rgb(grid, Path(self.out_dir or trainer.default_root_dir) / f"train_batch{self.done}.jpg")
        for experiment in tensorboards:
            add_jpeg(experiment, f"train/batch{self.done}", grid, trainer.global_step)
        for logger in trackers:
            log_image(logger, f"train/batch{self.done}", grid, trainer.global_step)
        self.done += 1
