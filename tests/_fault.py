"""`CrashAtEpoch`: kill the training process abruptly at the start of an epoch (a testing aid for resume).

A real interruption (power cut, OOM kill, preempted node) gives no Python a chance to clean up: no `finally`
blocks, no `on_exception` hooks, no last checkpoint. `os._exit` reproduces that, so a test can check that
`resume=<last.ckpt>` with the same config continues exactly where the run stopped. Tests add it with
`+callbacks.crash._target_=_fault.CrashAtEpoch` (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["CRASH_EXIT_CODE", "CrashAtEpoch"]

CRASH_EXIT_CODE = 1


class CrashAtEpoch(Callback):
    """Exit the process with `os._exit(1)` at `on_train_epoch_start` of epoch `epoch` (0-based).

    The `last.ckpt` of epoch `epoch - 1` exists by then, and nothing after it is written. On a resumed run whose
    restored epoch is already past `epoch` the callback never fires, but a resume that starts *at* `epoch`
    crashes again: resume without it (drop `debug=crash`).

    For tests only: it ends every process that reaches the hook (each DDP rank), without cleanup.

    Args:
        epoch: the epoch at whose start the process dies; >= 1 so that a checkpoint exists.
    """

    def __init__(self, epoch: int = 1) -> None:
        if int(epoch) < 1:
            raise ValueError(f"CrashAtEpoch: epoch must be >= 1 (a last.ckpt must exist to resume from), got {epoch}")
        self.epoch = int(epoch)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch != self.epoch:
            return
        print(f"[yolo5l] CrashAtEpoch: killing the process at the start of epoch {self.epoch}", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)
