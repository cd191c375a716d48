"""`EpochLine`: one console line per training epoch, the record of a run in a log file.

    epoch 3/39  box 0.05121  obj 0.02310  cls 0.01040  P 0.512  R 0.430  mAP@0.5 0.455  mAP@0.5:0.95 0.251  \
123.4 images/s  data wait 2%  14.2 s

The losses are the epoch's means over all ranks, the figures metrics.csv, results.csv and TensorBoard hold; P, R and
the mAPs are the validation of that epoch (left out when it did not validate); images/s (the whole job's: all ranks'
images) and the data-wait share (global rank 0's) are `ThroughputMonitor`'s. On a terminal the line is written above
the progress bar (tqdm's `write`), never on the bar's own line.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from yolo5l.callbacks.val_summary import COLUMNS

__all__ = ["EpochLine", "format_epoch_line"]


def format_epoch_line(
    epoch: int, max_epochs: int | None, losses: dict[str, float], val: dict[str, float], speed: dict[str, float],
    seconds: float | None = None,
) -> str:  # fmt: skip
    """The line: `epoch E/N`, the losses, the validation's P, R, mAPs, images/s, data wait and the epoch's time. Epochs
    count from 0 to N = max_epochs - 1, as v7.0's train.py and Lightning's progress bar show them."""
    parts = [f"epoch {epoch}/{max_epochs - 1}" if max_epochs and max_epochs > 0 else f"epoch {epoch}"]
    parts += [f"{name} {value:.5f}" for name, value in losses.items()]
    parts += [f"{title} {val[key]:.3f}" for title, key in COLUMNS if key in val]
    if "images_per_sec" in speed:
        parts.append(f"{speed['images_per_sec']:.1f} images/s")
    if "data_wait" in speed:
        parts.append(f"data wait {speed['data_wait']:.0%}")
    if seconds is not None:
        parts.append(f"{seconds:.1f} s")
    return "  ".join(parts)


class EpochLine(Callback):
    """Print `format_epoch_line` at the end of every training epoch on global rank 0, and count the epochs this
    process trained (`epochs_run`, `first_epoch`: a resumed run starts at its checkpoint's epoch).

    The losses are the module's running means (`YOLOv5Module.running_losses`), under DDP averaged over the ranks as
    Lightning averages the `train/loss_*` the module logs (`_mean_over_ranks`): every rank takes part, rank 0 prints.

    List it after `ThroughputMonitor`: callbacks run in list order, and the figures are that epoch's only once the
    monitor has seen the epoch end (conf/callbacks/default.yaml keeps that order).
    """

    def __init__(self) -> None:
        self.first_epoch: int | None = None
        self.epochs_run = 0
        self._t0 = time.perf_counter()
        self._validated = False

    @override
    def state_dict(self) -> dict[str, Any]:
        # In checkpoints for the process that waits while launched ones train (yolo5l.callbacks.spawned): the
        # epoch this command started at. A resumed fit counts its own from on_train_start.
        return {"first_epoch": self.first_epoch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.first_epoch = state_dict.get("first_epoch")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.first_epoch, self.epochs_run = trainer.current_epoch, 0
        self._t0 = time.perf_counter()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0, self._validated = time.perf_counter(), False

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._validated = True

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs_run += 1
        running = getattr(pl_module, "running_losses", None)
        losses = running() if callable(running) else {}  # one host sync per epoch
        if trainer.world_size > 1:
            losses = _mean_over_ranks(trainer, pl_module, losses)  # collectives: before rank 0 alone goes on
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        val = {key: float(metrics[key]) for _, key in COLUMNS if key in metrics} if self._validated else {}
        speed = _throughput(trainer)
        line = format_epoch_line(
            trainer.current_epoch, trainer.max_epochs, losses, val, speed, time.perf_counter() - self._t0
        )
        _write(line)


def _mean_over_ranks(trainer: pl.Trainer, pl_module: pl.LightningModule, losses: dict[str, float]) -> dict[str, float]:
    """Each loss averaged over the ranks as Lightning averages the module's `train/loss_*` for metrics.csv (logged with
    `sync_dist=True`): the same float32 value of each rank, the same `strategy.reduce(..., "mean")` of one scalar, so
    the line shows the file's figures to the last bit. Lightning's means exist only once every `on_train_epoch_end`
    has run (the module's comes after the callbacks'), after the line; hence a reduction of its own, once an epoch,
    which every rank joins. `float` of the result is a host sync, once an epoch."""
    device = pl_module.device
    return {
        name: float(trainer.strategy.reduce(torch.tensor(value, device=device), reduce_op="mean"))
        for name, value in losses.items()
    }


def _throughput(trainer: pl.Trainer) -> dict[str, float]:
    from yolo5l.callbacks.throughput import ThroughputMonitor

    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, ThroughputMonitor)), None)  # type: ignore[attr-defined]
    if monitor is None or monitor.last.get("epoch") != trainer.current_epoch:
        return {}
    return {k: v for k, v in monitor.last.items() if k != "epoch"}


def _write(line: str) -> None:
    """Print `line` above any active tqdm bar (a plain print when there is none)."""
    import sys

    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
