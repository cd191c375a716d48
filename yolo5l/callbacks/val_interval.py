"""`ValEveryNEpochs`: validate every n epochs and always after the last one (YOLOv5's `--noval` is n = max_epochs)."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from yolo5l.base.errors import UserError

__all__ = ["ValEveryNEpochs"]


class ValEveryNEpochs(Callback):
    """Run validation after epochs n-1, 2n-1, ... (0-based) and after the final epoch.

    Lightning's `check_val_every_n_epoch` cannot add "and the last epoch", so this sets that public Trainer
    attribute per epoch: 1 on epochs that validate, a never-matching period otherwise. Pair it with
    `LastCheckpoint`, which saves at train-epoch end, so skipped validations do not skip checkpoints.

    Args:
        n: validation period in epochs (1 validates every epoch).
    """

    def __init__(self, n: int = 1) -> None:
        if int(n) != n or n < 1:
            raise ValueError(f"ValEveryNEpochs: n must be a positive integer, got {n!r}")
        self.n = int(n)
        self._set: int | None = None  # the value this callback last gave the Trainer

    def should_validate(self, epoch: int, max_epochs: int | None) -> bool:
        """Whether validation runs after 0-based `epoch`."""
        last = max_epochs is not None and max_epochs > 0 and epoch == max_epochs - 1
        return (epoch + 1) % self.n == 0 or last

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # This callback owns the interval: an experiment's own trainer.check_val_every_n_epoch would be overwritten.
        if trainer.check_val_every_n_epoch not in (None, 1, self._set):
            raise UserError(
                f"trainer.check_val_every_n_epoch={trainer.check_val_every_n_epoch} conflicts with ValEveryNEpochs: "
                f"set the interval with callbacks.val_interval.n={trainer.check_val_every_n_epoch} instead"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed inside an epoch starts without that epoch's on_train_epoch_start.
        self.on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        validate = self.should_validate(trainer.current_epoch, trainer.max_epochs)
        # (current_epoch + 1) % check_val_every_n_epoch == 0 is Lightning's test; sys.maxsize never divides it.
        trainer.check_val_every_n_epoch = self._set = 1 if validate else sys.maxsize
