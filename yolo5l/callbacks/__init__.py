"""Training callbacks, one a module: AutoAnchor, label plots, EMA, checkpoints, validation interval, throughput,
batch images, console output.

The names below are imported when first used (`from yolo5l.callbacks import EMACallback`), so that importing one
callback module (`python -m yolo5l.val` needs `save_predictions` only) does not import every other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AtomicCheckpointIO": "checkpoint",
    "AutoAnchor": "autoanchor",
    "BatchPlotter": "batch_plotter",
    "EMACallback": "ema",
    "FitnessEarlyStopping": "early_stopping",
    "LabelPlots": "label_plots",
    "LastCheckpoint": "checkpoint",
    "LostRankWatch": "lost_rank",
    "ThroughputMonitor": "throughput",
    "ValEveryNEpochs": "val_interval",
    "ValidationPlots": "val_plots",
    "ValidationSummary": "val_summary",
    "YOLOProgressBar": "progress_bar",
}

__all__ = [
    "AtomicCheckpointIO",
    "AutoAnchor",
    "BatchPlotter",
    "EMACallback",
    "FitnessEarlyStopping",
    "LabelPlots",
    "LastCheckpoint",
    "LostRankWatch",
    "ThroughputMonitor",
    "ValEveryNEpochs",
    "ValidationPlots",
    "ValidationSummary",
    "YOLOProgressBar",
]

if TYPE_CHECKING:  # pragma: no cover
    from yolo5l.callbacks.autoanchor import AutoAnchor
    from yolo5l.callbacks.batch_plotter import BatchPlotter
    from yolo5l.callbacks.checkpoint import AtomicCheckpointIO, LastCheckpoint
    from yolo5l.callbacks.early_stopping import FitnessEarlyStopping
    from yolo5l.callbacks.ema import EMACallback
    from yolo5l.callbacks.label_plots import LabelPlots
    from yolo5l.callbacks.lost_rank import LostRankWatch
    from yolo5l.callbacks.progress_bar import YOLOProgressBar
    from yolo5l.callbacks.throughput import ThroughputMonitor
    from yolo5l.callbacks.val_interval import ValEveryNEpochs
    from yolo5l.callbacks.val_plots import ValidationPlots
    from yolo5l.callbacks.val_summary import ValidationSummary


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
