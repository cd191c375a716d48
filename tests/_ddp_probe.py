"""A Lightning callback that records, on every rank, what that rank did: for tests/test_ddp.py.

Added to a training run with Hydra overrides (the tests folder must be on PYTHONPATH so re-launched ranks import it):
``+callbacks.probe._target_=_ddp_probe.Probe +callbacks.probe.out=<folder>``. Each rank writes
``<folder>/rank<r>.pt`` at the end of fit (plain Python containers and tensors, loadable with weights_only=True).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from yolo5l.callbacks import checkpoint as checkpoint_mod
from yolo5l.callbacks.ema import EMACallback
from yolo5l.models import weights as weights_mod

__all__ = ["Probe"]


def _cpu_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


class Probe(Callback):
    """Record this rank's shards, cache, sync decisions, checkpoint writes, weights and synced metrics.

    Args:
        out: Folder that receives ``rank<r>.pt``.
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.rec: dict[str, Any] = {
            "train_sampler": [],  # per epoch: the indices the train sampler yields
            "train_paths": [],  # per epoch: image paths of the training batches, in order
            "val_paths": [],  # per validation: image paths evaluated on this rank
            "val_metrics": [],  # per validation: trainer.callback_metrics val/* after the epoch's log
            "sync": [],  # per training micro-batch: (DDP all-reduces this backward, module steps the optimizer)
            "ckpt_writes": [],  # file names this rank wrote through yolo5l.models.weights.atomic_save
        }
        self._patched = False

    # ---- set-up --------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rec["rank"] = trainer.global_rank
        self.rec["world_size"] = trainer.world_size
        if self._patched:
            return
        self._patched = True
        # Every checkpoint file (last.ckpt through the strategy's AtomicCheckpointIO, weights.pt through
        # save_weights) is written by yolo5l.models.weights.atomic_save: record the calls made in this process.
        original = weights_mod.atomic_save
        writes = self.rec["ckpt_writes"]

        def recording(obj: Any, path: Any) -> Any:
            writes.append(os.path.basename(str(path)))
            return original(obj, path)

        weights_mod.atomic_save = recording
        checkpoint_mod.atomic_save = recording

    # ---- training ------------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = trainer.datamodule
        self.rec["train_sampler"].append([int(i) for i, _, _ in dm.train_sampler])
        self.rec["train_paths"].append([])
        ds = dm.train_dataset
        self.rec["train_shard"] = [int(i) for i in dm.train_sampler.indices]
        self.rec["train_cache_mode"] = ds.cache.mode
        self.rec["train_cached"] = [i for i, img in enumerate(ds.cache.ram) if img is not None]
        self.rec["train_files"] = list(ds.im_files)
        vds = dm.val_dataset
        self.rec["val_cache_mode"] = vds.cache.mode
        self.rec["val_cached"] = [i for i, img in enumerate(vds.cache.ram) if img is not None]
        self.rec["val_shard"] = [int(i) for i in dm.val_sampler.indices]
        self.rec["val_files"] = list(vds.im_files)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.rec["train_paths"][-1].extend(str(p) for p in batch[2])

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        ddp = trainer.strategy.model  # the DistributedDataParallel wrapper under DDP
        grad_sync = bool(getattr(ddp, "require_backward_grad_sync", True))
        self.rec["sync"].append((grad_sync, bool(pl_module._step_now)))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation has run (and swapped the EMA weights back out): the module holds the raw weights.
        self.rec["raw_state"] = _cpu_state(pl_module.state_dict())

    # ---- validation ----------------------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rec["val_paths"].append([])

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int, dataloader_idx: int = 0
    ) -> None:
        self.rec["val_paths"][-1].extend(str(p) for p in batch[2])

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the module's on_validation_epoch_end logged the synced metrics.
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        self.rec["val_metrics"].append(metrics)

    # ---- end -----------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ema = next(cb for cb in trainer.callbacks if isinstance(cb, EMACallback))
        self.rec["ema_state"] = _cpu_state(ema.ema_state_dict)
        self.rec["ema_updates"] = ema.updates
        self.rec["global_step"] = trainer.global_step

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.rec, self.out / f"rank{self.rec['rank']}.pt")
