"""`BatchPlotter`: the first training batches, drawn with their boxes, as `train_batch0..2.jpg` in the run folder
(YOLOv5's files), TensorBoard images, MLflow artifacts and W&B media."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import cv2
import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from typing_extensions import override

__all__ = ["BatchPlotter", "draw_batch", "write_jpeg"]

BOX_COLOR = (255, 255, 0)  # yellow (RGB)


def draw_batch(
    images: Tensor, targets: Tensor, names: list[str] | None = None, max_images: int = 16, max_size: int = 1920
) -> np.ndarray:
    """Draw (N, 6) normalised targets [image, class, cx, cy, w, h] on a (B, 3, H, W) batch (uint8, or float in
    [0, 1]); returns an (H', W', 3) uint8 RGB mosaic of up to `max_images` tiles, 4 a row, at most `max_size` px
    (YOLOv5's `plot_images` layout), drawn with OpenCV."""
    imgs = images[:max_images].detach()
    if imgs.is_floating_point():
        imgs = imgs * 255 if float(imgs.max()) <= 1.0 else imgs  # host sync: three batches per run
    imgs = imgs.clamp(0, 255).to("cpu").byte().permute(0, 2, 3, 1).numpy()  # (B, H, W, 3) RGB
    b, h, w, _ = imgs.shape
    cols = min(4, b)
    rows = math.ceil(b / cols)
    scale = min(1.0, max_size / max(rows * h, cols * w))
    hs, ws = max(1, round(h * scale)), max(1, round(w * scale))
    grid = np.full((rows * hs, cols * ws, 3), 255, np.uint8)
    t = targets.detach().float().cpu().numpy()
    for i in range(b):
        r, c = divmod(i, cols)
        tile = cv2.resize(imgs[i], (ws, hs), interpolation=cv2.INTER_AREA) if scale < 1 else imgs[i].copy()
        for _, cls, cx, cy, bw, bh in t[t[:, 0] == i]:
            x1, y1 = int((cx - bw / 2) * ws), int((cy - bh / 2) * hs)
            x2, y2 = int((cx + bw / 2) * ws), int((cy + bh / 2) * hs)
            cv2.rectangle(tile, (x1, y1), (x2, y2), BOX_COLOR, 2)  # YOLOv5 draws at least 2 px
            label = names[int(cls)] if names and int(cls) < len(names) else str(int(cls))
            cv2.putText(tile, label, (x1 + 1, max(y1 - 2, 8)), cv2.FONT_HERSHEY_SIMPLEX, 0.3, BOX_COLOR, 1, cv2.LINE_AA)
        grid[r * hs : (r + 1) * hs, c * ws : (c + 1) * ws] = tile
        cv2.rectangle(grid, (c * ws, r * hs), ((c + 1) * ws - 1, (r + 1) * hs - 1), (255, 255, 255), 1)
    return grid


def write_jpeg(experiment: Any, tag: str, rgb: np.ndarray, step: int, quality: int = 90) -> None:
    """Write an (H, W, 3) uint8 RGB image to a TensorBoard `SummaryWriter` as JPEG.

    `SummaryWriter.add_image` encodes PNG, whose lossless compression of a mosaic of photos costs far more than JPEG,
    and a run pays it for every plotted batch at its start (docs/benchmarks.md has the figures). TensorBoard shows
    any encoded image; this writes the summary `add_image` would, through the same file writer, with JPEG bytes (a
    writer without one gets `add_image`).
    """
    file_writer = getattr(experiment, "_get_file_writer", None)
    if file_writer is None:
        experiment.add_image(tag, rgb, step, dataformats="HWC")
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"BatchPlotter: JPEG encoding of {tag} failed")
    image = Summary.Image(height=rgb.shape[0], width=rgb.shape[1], colorspace=3, encoded_image_string=buf.tobytes())
    file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


class BatchPlotter(Callback):
    """Draw the first `num_batches` training batches with their boxes, once, on rank 0: as `train_batch{i}.jpg` in
    `out_dir` (a fresh run only: a resumed run keeps its start's files) and to the TensorBoard, MLflow and W&B loggers.

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
        from yolo5l.tracking import EXTRAS, log_image

        experiments = (getattr(lg, "experiment", None) for lg in trainer.loggers)
        tensorboards = [e for e in experiments if hasattr(e, "add_image")]
        trackers = [lg for lg in trainer.loggers if type(lg).__name__ in EXTRAS]
        files = self.plots and trainer.ckpt_path is None
        if not tensorboards and not trackers and not files:
            self.done = self.num_batches  # nowhere to draw into
            return
        names = list(getattr(pl_module, "names", []) or [])
        grid = draw_batch(batch[0], batch[1], names, self.max_images)
        if files:
            from yolo5l.plots import save_rgb

            save_rgb(grid, Path(self.out_dir or trainer.default_root_dir) / f"train_batch{self.done}.jpg")
        for experiment in tensorboards:
            write_jpeg(experiment, f"train/batch{self.done}", grid, trainer.global_step)
        for logger in trackers:
            log_image(logger, f"train/batch{self.done}", grid, trainer.global_step)
        self.done += 1
