"""`FitnessEarlyStopping`: YOLOv5's `--patience` on `val/fitness` (0.1 mAP@0.5 + 0.9 mAP@0.5:0.95)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from yolo5l.eval.best_fitness import ReadsBestFitness

__all__ = ["FitnessEarlyStopping"]


class FitnessEarlyStopping(ReadsBestFitness, EarlyStopping):
    """Stop when `val/fitness` has not improved for `patience` validations, and say which epoch was best.

    Lightning's `EarlyStopping` underneath: it checks after each validation and its state (the count, the best score)
    is saved in checkpoints, so a resumed run keeps counting. `patience` counts validations: with the default
    validation every epoch that is YOLOv5's epochs; with `callbacks.val_interval.n=k` it is k x patience epochs. A
    fitness equal to the best does not count as an improvement (YOLOv5 counts it). The best epoch it names is best.pt's
    (the module's record, `YOLOv5Module.best`).

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

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._should_skip_check(trainer) or self.monitor not in trainer.callback_metrics:
            return
        if trainer.should_stop and self.stopped_epoch == trainer.current_epoch:
            record = self._record
            best = f"epoch {record.epoch} ({record.fitness:.4f})" if record and record.fitness is not None else "kept"
            rank_zero_info(
                f"early stopping at epoch {trainer.current_epoch}: val/fitness has not improved for {self.patience} "
                f"validations; the best was {best}, kept as best.pt"
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        patience = self.patience  # the resumed run's setting wins over the checkpoint's
        super().load_state_dict(state_dict)
        self.patience = patience
