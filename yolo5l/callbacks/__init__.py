"""Training callbacks: EMA, checkpoints, validation interval, throughput, TensorBoard batch images."""

from __future__ import annotations

from yolo5l.callbacks.checkpoint import AtomicCheckpointIO, LastCheckpoint, strip_weights
from yolo5l.callbacks.ema import EMACallback
from yolo5l.callbacks.fault import CrashAtEpoch
from yolo5l.callbacks.tensorboard import BatchPlotter
from yolo5l.callbacks.throughput import ThroughputMonitor
from yolo5l.callbacks.val_interval import ValEveryNEpochs

__all__ = [
    "AtomicCheckpointIO",
    "BatchPlotter",
    "CrashAtEpoch",
    "EMACallback",
    "LastCheckpoint",
    "ThroughputMonitor",
    "ValEveryNEpochs",
    "strip_weights",
]
