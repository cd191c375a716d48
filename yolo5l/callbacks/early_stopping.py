"""`FitnessEarlyStopping`: YOLOv5's `--patience` on `val/fitness` (0.1 mAP@0.5 + 0.9 mAP@0.5:0.95)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

__all__ = ["FitnessEarlyStopping"]


class FitnessEarlyStopping(EarlyStopping):
    """Stop when `val/fitness` has not improved for `patience` validations, and say which epoch was best.

    Lightning's `EarlyStopping` underneath: it checks after each validation and its state (the count, the best score)
    is saved in checkpoints, so a resumed run keeps counting. `patience` counts validations: with the default
    validation every epoch that is YOLOv5's epochs; with `callbacks.val_interval.n=k` it is k x patience epochs. A
    fitness equal to the best does not count as an improvement (YOLOv5 counts it).

    Args:
        patience: validations without improvement before stopping (YOLOv5's default is 100 epochs).
        min_delta: the improvement that counts.
    """

    def __init__(self, patience: int = 100, min_delta: float = 0.0) -> None:
        # check_on_train_epoch_end=False: check right after each validation. At train-epoch end (Lightning's choice
        # when validating every epoch) an epoch that skipped validation would count the previous one again.
        super().__init__(
            monitor="val/fitness", mode="max", patience=patience, min_delta=min_delta, strict=False,
            check_on_train_epoch_end=False,
        )  # fmt: skip
        self.best_epoch: int | None = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._should_skip_check(trainer) or self.monitor not in trainer.callback_metrics:
            return
        if self.wait_count == 0:  # this validation improved on the best
            self.best_epoch = trainer.current_epoch
        if trainer.should_stop and self.stopped_epoch == trainer.current_epoch:
            rank_zero_info(
                f"early stopping at epoch {trainer.current_epoch}: val/fitness has not improved for {self.patience} "
                f"validations; the best was epoch {self.best_epoch} ({float(self.best_score):.4f}), kept as best.pt"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "best_epoch": self.best_epoch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        patience = self.patience  # the resumed run's setting wins over the checkpoint's
        super().load_state_dict(state_dict)
        self.patience = patience
        self.best_epoch = state_dict.get("best_epoch")
