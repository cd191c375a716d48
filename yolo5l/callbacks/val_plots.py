"""`ValidationPlots`: what ultralytics leaves after its final validation, for training's last validation and for
`trainer.validate` (`python -m yolo5l.val`): the per-class table, printed and as per_class.csv, and, unless
`plots=false`, the confusion matrix, the PR and F1/P/R-confidence curves, the first validation batches with their
labels and detections, and (after training) results.png, as files in the run folder and, in a fit, images in
TensorBoard (a run's TensorBoard holds its fit: a `trainer.validate` of its trainer writes files only).

Cost: every validation keeps device references to the first `num_batches` batches (their first 16 images as uint8,
no host sync) and the metric keeps its per-class breakdown of the compute it runs anyway; drawing, encoding and
writing happen once, after the last validation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

if TYPE_CHECKING:
    from yolo5l.eval.per_class import PerClassResults

__all__ = ["ValidationPlots", "write_outputs"]


class ValidationPlots(Callback):
    """The per-class table and ultralytics' validation plots after the last validation of a run.

    In `fit`, each validation's per-class results (`map_metric.per_class()`) and first batches replace the previous
    ones, and `on_train_end` writes those of the last validation that ran (so early stopping and a validation
    interval are covered). In `validate`, they are written when it ends. Only global rank 0 writes; a failure to
    draw or write is a warning, never the end of a finished training run.

    The module must have `map_metric` with `per_class()` (`DetectionMAP`, `COCOMap`) and `names`; for the batch
    images its `validation_step` returns the per-image detections in original-image pixels.

    Args:
        plots: draw the figures and batches; False writes and prints the table only (and keeps no confusion matrix).
        out_dir: folder for the files; None: the trainer's `default_root_dir` (the run folder).
        num_batches: first validation batches drawn (val_batch0..).
        max_images: images drawn per batch.
        print_table: print the table (`yolo5l.val` prints it itself, after its summary).
    """

    def __init__(
        self,
        plots: bool = True,
        out_dir: str | None = None,
        num_batches: int = 2,
        max_images: int = 16,
        print_table: bool = True,
    ) -> None:
        self.plots = bool(plots)
        self.out_dir = out_dir
        self.num_batches = int(num_batches)
        self.max_images = int(max_images)
        self.print_table = bool(print_table)
        self.results: PerClassResults | None = None
        #: Files written by the last `write` (name -> path), for an entry point's output listing.
        self.files: dict[str, Path] = {}
        self._batches: dict[int, tuple[Any, ...]] = {}

    # ---- collecting ------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        metric = getattr(pl_module, "map_metric", None)
        names = getattr(pl_module, "names", None)
        if self.plots and names and hasattr(metric, "set_num_classes"):
            metric.set_num_classes(len(names))  # type: ignore[union-attr]

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.plots or trainer.sanity_checking or batch_idx >= self.num_batches or not trainer.is_global_zero:
            return
        if not isinstance(outputs, list | tuple) or not isinstance(batch, list | tuple) or len(batch) < 2:
            return  # a module whose validation_step returns no detections: nothing to draw
        images, targets = batch[0], batch[1]
        shapes = batch[3] if len(batch) > 3 else None
        k = min(self.max_images, images.shape[0])
        img = images[:k].detach()
        if img.is_floating_point():  # the datamodule's [0, 1] floats; uint8 keeps the copy small until the end
            img = img.mul(255).round_().clamp_(0, 255).to(torch.uint8)
        shapes = list(shapes[:k]) if shapes is not None else [None] * k
        self._batches[batch_idx] = (img, targets.detach(), [d.detach() for d in outputs[:k]], shapes)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metric = getattr(pl_module, "map_metric", None)
        if not hasattr(metric, "per_class"):
            return
        # Every rank: the module computed the metric already, so this reads its kept results (no collective).
        self.results = metric.per_class()  # type: ignore[union-attr]
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._write(trainer, pl_module, results_png=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.results is not None:
            self._write(trainer, pl_module, results_png=True)

    # ---- writing ---------------------------------------------------------------------------------------------------
    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, results_png: bool) -> None:
        if not trainer.is_global_zero or self.results is None:
            return
        from yolo5l.eval.plots import format_per_class_table, results_figure

        out = Path(self.out_dir or trainer.default_root_dir)
        names = list(getattr(pl_module, "names", []) or [])
        fit = trainer.state.fn == TrainerFn.FITTING  # after a fit, a validate's images would open a new event file
        tensorboards = [lg.experiment for lg in trainer.loggers if fit and isinstance(lg, TensorBoardLogger)]
        step = trainer.global_step
        if self.print_table:
            print("\n" + format_per_class_table(self.results, names), flush=True)

        def log(stem: str, rgb: np.ndarray) -> None:
            for tb in tensorboards:
                tb.add_image(f"val/{stem}", rgb, step, dataformats="HWC")

        figures: dict[str, Any] = {}
        if self.plots and results_png:
            with _warn_on_failure("results.png"):
                fig = results_figure(_metrics_rows(trainer))
                figures = {"results": fig} if fig is not None else {}
        self.files = write_outputs(self.results, names, out, self.plots, figures, log)
        if self.plots:
            with _warn_on_failure("the validation batches"):
                self._draw_batches(names, out, tensorboards, step)
        self._batches = {}
        for tb in tensorboards:
            tb.flush()

    def _draw_batches(self, names: Sequence[str], out: Path, tensorboards: Sequence[Any], step: int) -> None:
        from yolo5l.eval.plots import draw_val_batch, to_letterbox
        from yolo5l.infer.annotate import save_rgb
        from yolo5l.tracking.trackers import add_jpeg

        for i, (img, targets, dets, shapes) in sorted(self._batches.items()):
            hw = img.shape[2:]
            dets = [to_letterbox(d, hw, s) for d, s in zip(dets, shapes, strict=True)]
            drawn = draw_val_batch(img, targets, dets, names, self.max_images)
            for kind, rgb in zip(("labels", "pred"), drawn, strict=True):
                self.files[f"val_batch{i}_{kind}.jpg"] = save_rgb(rgb, out / f"val_batch{i}_{kind}.jpg")
                for tb in tensorboards:
                    add_jpeg(tb, f"val/batch{i}_{kind}", rgb, step)


def write_outputs(
    results: PerClassResults,
    names: Sequence[str],
    out_dir: str | Path,
    plots: bool = True,
    figures: Mapping[str, Any] | None = None,
    on_image: Callable[[str, np.ndarray], None] | None = None,
) -> dict[str, Path]:
    """`yolo5l.eval.plots.write_validation_files` where a failure is a warning: per_class.csv is still written when a
    figure fails, and nothing raises (a finished training or validation run keeps its other outputs)."""
    from yolo5l.eval.plots import write_per_class_csv, write_validation_files

    try:
        return write_validation_files(results, names, out_dir, plots, figures, on_image)
    except Exception as e:  # a figure or a full disk must not fail a finished run
        rank_zero_warn(f"ValidationPlots: validation outputs not (all) written: {type(e).__name__}: {e}")
    try:  # the table at least (it comes first, so this is a second try only when it failed itself)
        return {"per_class.csv": write_per_class_csv(results, names, Path(out_dir) / "per_class.csv")}
    except OSError:
        return {}


@contextlib.contextmanager
def _warn_on_failure(what: str) -> Iterator[None]:
    try:
        yield
    except Exception as e:  # a figure must not fail a finished run
        rank_zero_warn(f"ValidationPlots: {what} not written: {type(e).__name__}: {e}")


def _metrics_rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    """The run's metrics.csv rows (`EpochCSVLogger`, saved first so that the last epoch is in), or none."""
    from yolo5l.tracking.loggers import EpochCSVLogger, read_metrics_csv

    for lg in trainer.loggers:
        if isinstance(lg, EpochCSVLogger):
            lg.save()
            return read_metrics_csv(lg.path) if lg.path.is_file() else []
    return []
