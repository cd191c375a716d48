"""`ThroughputMonitor`: training images/s and the share of time spent waiting for data, once per epoch.

Unlike Lightning's `ThroughputMonitor` (a `torch.cuda.synchronize()` every batch), this one never syncs inside the
epoch: it reads host clocks at batch boundaries and synchronises the device only at the epoch's start and end.
"""

from __future__ import annotations

import time
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

    data_wait = time between the end of one training batch and the start of the next (fetch, collate, host-to-device
    copy) / epoch wall time. Without per-step syncs the host runs ahead of the GPU and blocks on kernel launches when
    the GPU is the bottleneck, so the waiting it does for data is what this measures.

    Args:
        warn_above: data-wait share above which a hint is printed (YOLOv5 feels it above ~10 %).
        verbose: print a one-line summary every epoch on rank 0.
    """

    def __init__(self, warn_above: float = 0.10, verbose: bool = True) -> None:
        self.warn_above = float(warn_above)
        self.verbose = verbose
        self.last: dict[str, float] = {}
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self._t0 = self._t_end = now
        self._wait = 0.0
        self._images = 0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync(pl_module.device)
        self._reset(time.perf_counter())

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._wait += time.perf_counter() - self._t_end
        images = batch[0] if isinstance(batch, list | tuple) else batch
        self._images += int(images.shape[0])  # shape is host metadata: no sync

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._t_end = time.perf_counter()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync(pl_module.device)
        total = max(time.perf_counter() - self._t0, 1e-9)
        ips, share = self._images / total, self._wait / total
        self.last = {"images_per_sec": ips, "data_wait": share}
        pl_module.log("train/images_per_sec", ips, rank_zero_only=True)
        pl_module.log("train/data_wait", share, rank_zero_only=True)
        if self.verbose:
            rank_zero_info(
                f"epoch {trainer.current_epoch}: {ips:.1f} images/s per device, "
                f"{share:.0%} of the time waiting for data"
            )
        if share > self.warn_above:
            rank_zero_warn(
                f"Training waited for data {share:.0%} of epoch {trainer.current_epoch}. The input pipeline is the "
                "bottleneck: raise data.num_workers (one per free CPU core), cache decoded images with "
                "data.cache=ram (or data.cache=disk when RAM is short), keep data.persistent_workers=true and "
                "data.pin_memory=true, or raise data.prefetch_factor."
            )
