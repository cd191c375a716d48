"""Training callbacks: AutoAnchor, label plots, EMA, checkpoints, validation interval, throughput, batch images,
console output."""

from __future__ import annotations

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
