"""`ThroughputMonitor`: the job's training images/s (all ranks) and the share of time spent waiting for data, once per
epoch.

Unlike Lightning's `ThroughputMonitor` (a `torch.cuda.synchronize()` every batch), this one never syncs inside the
epoch: it reads host clocks at batch boundaries and synchronises the device only at the epoch's start and end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

__all__ = ["ThroughputMonitor"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # epoch boundary only: makes the epoch's wall time include queued GPU work


class ThroughputMonitor(Callback):
    """Log `train/images_per_sec` and `train/data_wait` each epoch; warn when the input pipeline is the bottleneck.

    images/s is the whole job's: the images this process trained x the world size, over this process's training time.
    Every rank trains the same number of images an epoch (the distributed sampler gives each rank an equal shard,
    padded by wrapping around), and the ranks step together (gradients are all-reduced each optimizer step), so this
    counts every rank's images without a collective; one process's is that / `trainer.world_size`. The data-wait
    share is global rank 0's.

    data_wait = time between the end of one training batch and the start of the next (fetch, collate, host-to-device
    copy), plus, with the device input pipeline, the time the device's training stream waited for the side stream
    that makes the images (read from CUDA events at the epoch's end) / the epoch's training time. Both figures count
    the training batches only: the clock stops at the end of the epoch's last training batch, since Lightning runs
    validation before `on_train_epoch_end`. Without per-step syncs the host runs ahead of the GPU and blocks on kernel
    launches when the GPU is the bottleneck, so the waiting it does for data is what this measures.

    The hint is printed once, and again only when the share has doubled since; it suggests only the settings the
    datamodule does not already use.

    Args:
        warn_above: data-wait share above which a hint is printed.
        verbose: print a one-line summary every epoch on rank 0 (off in conf/: `EpochLine` prints the figures).
        clock: seconds of a monotonic clock (tests pass a clock they move by hand).
    """

    def __init__(
        self, warn_above: float = 0.10, verbose: bool = True, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.warn_above = float(warn_above)
        self.verbose = verbose
        self.clock = clock
        self.last: dict[str, float] = {}
        self._warned_at: float | None = None  # the share of the last hint
        self._reset(self.clock())

    def _reset(self, now: float) -> None:
        self._t0 = self._t_end = now
        self._wait = 0.0
        self._images = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset(self.clock())  # a run resumed inside an epoch starts without its on_train_epoch_start

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync(pl_module.device)
        self._reset(self.clock())

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._wait += self.clock() - self._t_end
        images = batch[0] if isinstance(batch, list | tuple) else batch
        self._images += int(images.shape[0])  # shape is host metadata: no sync

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx + 1 >= trainer.num_training_batches:
            _sync(pl_module.device)  # the epoch's last training batch: its queued device work counts
        self._t_end = self.clock()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = max(self._t_end - self._t0, 1e-9)  # up to the last training batch: validation is not counted
        device_wait = getattr(getattr(trainer, "datamodule", None), "device_wait_seconds", None)
        if callable(device_wait):  # after the sync of the epoch's last batch: the events are complete
            self._wait += device_wait()
        world = max(1, int(trainer.world_size))
        ips, share = self._images * world / total, self._wait / total  # every rank's images: see the docstring
        self.last = {"images_per_sec": ips, "data_wait": share, "epoch": trainer.current_epoch}
        pl_module.log("train/images_per_sec", ips, rank_zero_only=True)
        pl_module.log("train/data_wait", share, rank_zero_only=True)
        if self.verbose:
            rate = f"{ips:.1f} images/s" + (f" in all ({world} processes)" if world > 1 else " per device")
            rank_zero_info(f"epoch {trainer.current_epoch}: {rate}, {share:.0%} of the time waiting for data")
        if share > self.warn_above and (self._warned_at is None or share > 2 * self._warned_at):
            self._warned_at = share
            advice = _advice(trainer.datamodule if hasattr(trainer, "datamodule") else None)
            rank_zero_warn(
                f"Training waited for data {share:.0%} of epoch {trainer.current_epoch}: the input pipeline is the "
                f"bottleneck. {advice}"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"warned_at": self._warned_at}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._warned_at = state_dict.get("warned_at")


def _advice(datamodule: Any) -> str:
    """What to try, leaving out what the datamodule already does (unknown settings are suggested) and what does not
    fit the run: on the CPU, where `data.num_workers=auto` is 0 by design (the compute threads own the cores), no
    workers are suggested, nor where the rank's share of the cores has none free (a core per CPU rank computes), and
    the device pipeline there is the slower path."""
    workers = getattr(datamodule, "train_workers", None)
    n_workers = workers() if callable(workers) else None
    device = datamodule.train_device() if hasattr(datamodule, "train_device") else None
    on_cpu = device is not None and device.type == "cpu"
    cpu_auto = on_cpu and str(getattr(datamodule, "num_workers", "")) == "auto"
    pipeline = getattr(datamodule, "input_pipeline", "host")
    world = int(getattr(getattr(datamodule, "trainer", None), "world_size", 1) or 1)
    spare = (os.cpu_count() or 1) // world - on_cpu - (n_workers or 0)  # this rank's share of the cores, not busy
    tips = []
    if device is not None and device.type == "cuda" and pipeline == "host":
        tips.append("decode and augment on the GPU with data.pipeline=device")
    if on_cpu and pipeline == "device":
        tips.append("make the images on the host with data.pipeline=auto (the device path is for CUDA)")
    if not cpu_auto and (n_workers is None or spare >= 1):
        tips.append("raise data.num_workers (one per free CPU core)")
    fell_back = getattr(datamodule, "cache_reason", "")  # the cache asked for did not fit: what it says to do
    if fell_back:
        tips.append(f"cache decoded images (data.cache={getattr(datamodule, 'cache', '?')}: {fell_back})")
    elif getattr(datamodule, "cache_used", getattr(datamodule, "cache", "none")) == "none":
        tips.append("cache decoded images with data.cache=ram (data.cache=disk when RAM is short)")
    if n_workers != 0 and not getattr(datamodule, "persistent_workers", False):
        tips.append("set data.persistent_workers=true")
    if tips:
        return "Try: " + "; ".join(tips) + "."
    if cpu_auto:
        return "On the CPU the batches are made between steps by the cores that compute them; the cache is on."
    return "Workers, cache and persistent workers are already on: the CPU cores cannot prepare batches faster."
