"""`ValidationSummary`: one console line per validation (P, R, mAP@0.5, mAP@0.5:0.95) and the best and last rows."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from yolo5l.eval.best_fitness import ReadsBestFitness

__all__ = ["ValidationSummary", "format_row"]

#: (column title, metric key) in ultralytics' order.
COLUMNS = (
    ("P", "val/precision"), ("R", "val/recall"), ("mAP@0.5", "val/map_50"), ("mAP@0.5:0.95", "val/map"),
)  # fmt: skip


def format_row(row: dict[str, float]) -> str:
    """`P 0.512  R 0.430  mAP@0.5 0.455  mAP@0.5:0.95 0.251` from a row of `val/*` values."""
    return "  ".join(f"{title} {row[key]:.3f}" for title, key in COLUMNS if key in row)


class ValidationSummary(ReadsBestFitness, Callback):
    """After each validation in training, print the epoch's precision, recall and mAPs on rank 0, and remember the
    last row for the closing summary; the best row is the module's record (`YOLOv5Module.best`, by YOLOv5's fitness
    0.1 mAP@0.5 + 0.9 mAP@0.5:0.95).

    The values are the ones the module logged (already gathered over ranks); reading them costs one host sync per
    validation, not per step.

    Args:
        verbose: print the line (off in conf/: `EpochLine` prints the epoch's validation on its line).
    """

    def __init__(self, verbose: bool = True) -> None:
        self.verbose = verbose
        self.last: dict[str, Any] | None = None

    @property
    def best(self) -> dict[str, Any] | None:
        """The best validation's row (`val/*` values and its epoch), None before the first."""
        record = self._record
        if record is None or record.row is None:
            return None
        return {**record.row, "epoch": record.epoch}

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = trainer.callback_metrics
        row: dict[str, Any] = {k: float(metrics[k]) for _, k in COLUMNS if k in metrics}
        if "val/fitness" not in metrics:
            return
        row["val/fitness"] = float(metrics["val/fitness"])
        row["epoch"] = trainer.current_epoch
        self.last = row
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        if self.verbose:
            rank_zero_info(f"epoch {trainer.current_epoch}{epochs} val: {format_row(row)}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last": self.last}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last = state_dict.get("last")
