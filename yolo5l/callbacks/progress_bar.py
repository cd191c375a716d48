"""`YOLOProgressBar`: Lightning's TQDM bar with the epoch's running box / obj / cls losses, read at refresh only."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

__all__ = ["YOLOProgressBar"]


class YOLOProgressBar(TQDMProgressBar):
    """The training bar shows `box`, `obj` and `cls`: this epoch's mean losses so far, as ultralytics' bar does.

    Lightning turns a `prog_bar=True` step metric into a Python number every step (a host sync each time). This bar
    instead asks the module for its running means (`YOLOv5Module.running_losses`, accumulated on the device) only
    when it redraws: every `refresh_rate` batches and at the end of the epoch.

    Args:
        refresh_rate: batches between redraws (each redraw reads the losses once).
    """

    def __init__(self, refresh_rate: int = 10, leave: bool = True) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        running = getattr(pl_module, "running_losses", None)
        if callable(running) and trainer.training:
            items.update({name: f"{value:.4g}" for name, value in running().items()})
        return items
