"""`BatchSizeSearch`: `data.batch_size=-1` finds the largest batch that fits (conf/train.yaml's `tune` node)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yolo5l.base.console import info
from yolo5l.base.errors import UserError

__all__ = ["BatchSizeSearch"]


@dataclass(frozen=True)
class BatchSizeSearch:
    """Lightning's `Tuner.scale_batch_size` on one device, as `trainer.fit` would run it.

    Args:
        mode: `power` (double until a batch fails) or `binsearch` (then bisect).
        init_val: the first batch tried.
        max_val: the largest batch tried.
        steps_per_trial: training steps per batch tried.
    """

    mode: str = "power"
    init_val: int = 2
    max_val: int = 256
    steps_per_trial: int = 3

    def __call__(self, trainer: Any, module: Any, datamodule: Any) -> int:
        """Search; returns the batch found (the datamodule's `batch_size` is set to it).

        Raises:
            UserError: No batch fits.
        """
        from lightning.pytorch.tuner import Tuner

        datamodule.batch_size = int(self.init_val)
        found = Tuner(trainer).scale_batch_size(
            module, datamodule=datamodule, mode=self.mode, init_val=int(self.init_val), max_val=int(self.max_val),
            steps_per_trial=int(self.steps_per_trial),
        )  # fmt: skip
        if not found:
            raise UserError("data.batch_size=-1: the batch size search found no batch that fits; pass data.batch_size")
        info(f"batch size search: using data.batch_size={found}")
        return int(found)
