"""`LabelPlots`: `labels.jpg` and `labels_correlogram.jpg` in the run folder before the first epoch (YOLOv5's first
look at a dataset's training labels; `yolo5l.eval.label_plots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

__all__ = ["LabelPlots"]


class LabelPlots(Callback):
    """At the start of a fresh fit, on global rank 0, plot the datamodule's training labels (``train_dataset.labels``:
    per image, (n, 5) ``[cls, x, y, w, h]`` normalised) into ``out_dir``. A resumed run keeps the files its start
    wrote; a failure to draw is a warning.

    Args:
        plots: False writes nothing (the root `plots: false` of train.yaml).
        out_dir: Folder of the files; None: the trainer's `default_root_dir` (the run folder).
    """

    def __init__(self, plots: bool = True, out_dir: str | None = None) -> None:
        self.plots = bool(plots)
        self.out_dir = out_dir
        #: Files written (name -> path).
        self.files: dict[str, Path] = {}

    @override
    @rank_zero_only
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.plots or trainer.ckpt_path is not None:
            return
        dataset: Any = getattr(trainer.datamodule, "train_dataset", None)
        labels = [np.asarray(lb).reshape(-1, 5) for lb in getattr(dataset, "labels", None) or []]
        if not labels or not sum(len(lb) for lb in labels):
            return
        from yolo5l.eval.label_plots import write_label_plots

        out = Path(self.out_dir or trainer.default_root_dir)
        names = list(getattr(pl_module, "names", []) or [])
        try:
            self.files = write_label_plots(np.concatenate(labels), names, out)
        except Exception as e:  # a figure must not stop a run before it starts
            rank_zero_warn(f"LabelPlots: the label plots were not written: {type(e).__name__}: {e}")
            return
        rank_zero_info(f"plotted the training labels to {out / 'labels.jpg'} and labels_correlogram.jpg")
