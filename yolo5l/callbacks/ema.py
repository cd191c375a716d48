"""`EMACallback`: YOLOv5's exponential moving average of the weights, with a ramped decay.

Reference: ultralytics/yolov5 v7.0 `utils/torch_utils.py::ModelEMA` (d = decay (1 - exp(-updates / tau)), applied
to every floating tensor of the state dict after each optimizer step); hooks and checkpoint layout follow
Lightning's `WeightAveraging`; the update is timm `ModelEmaV3`'s foreach lerp.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

__all__ = ["EMACallback"]

_CURRENT = "current_model_state"


class EMACallback(Callback):
    """Keep an EMA of the LightningModule's state dict, validate and checkpoint with it.

    - One `torch._foreach_lerp_(ema, model, 1 - d)` per optimizer step (a step is detected by `trainer.global_step`
      increasing), d = decay (1 - exp(-updates / tau)) computed on the host; integer buffers are copied.
    - The EMA tensors live on the callback, not in the module (out of DDP and the optimizer). Every rank computes
      the same EMA of the parameters from the same all-reduced updates. Buffers are not synchronised by DDP after
      the forward pass (it broadcasts rank 0's at the start of the next one), so each rank's BatchNorm running
      statistics, and their EMA, drift apart; before the EMA is used (each validation, the end of training) rank
      0's EMA buffers are broadcast to all ranks (one small collective), as YOLOv5 keeps the EMA on rank 0 only.
    - Validation runs on the EMA weights (swapped in and back out); at the end of training the EMA weights become
      the model's, and a validation after that (the final validation of best.pt) runs on the module's weights.
    - Checkpoints (the `WeightAveraging` layout): `state_dict` holds the EMA weights, so any loader that reads only
      `state_dict` gets the EMA model; `current_model_state` holds the raw weights; `updates` is in the callback
      state. Resuming restores both exactly.

    Args:
        decay: asymptotic decay (YOLOv5: 0.9999).
        tau: ramp time constant in updates (YOLOv5: 2000).
        foreach: one multi-tensor `torch._foreach_lerp_` per update (fast); False updates tensor by tensor in a
            Python loop, as ultralytics' `ModelEMA` does (the baseline `scripts/bench_train.py` measures). Both give
            the same weights.
    """

    def __init__(self, decay: float = 0.9999, tau: float = 2000, foreach: bool = True) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMACallback: decay must be in [0, 1), got {decay}")
        if tau <= 0:
            raise ValueError(f"EMACallback: tau must be > 0, got {tau}")
        self.decay = float(decay)
        self.tau = float(tau)
        self.foreach = bool(foreach) and hasattr(torch, "_foreach_lerp_")  # private API: guarded as timm does
        self.updates = 0
        self._names: list[str] = []
        self._ema: list[Tensor] = []  # EMA copies, aligned with self._names
        self._pending: dict[str, Tensor] | None = None  # EMA state read from a checkpoint, applied once set up
        self._model: list[Tensor] = []
        self._ema_floats: list[Tensor] = []
        self._model_floats: list[Tensor] = []
        self._int_pairs: list[tuple[Tensor, Tensor]] = []
        self._ema_buffers: list[Tensor] = []  # EMA copies of the buffers (BN running stats): rank-dependent
        self._last_step = -1
        self._swapped = False
        self._applied = False  # on_train_end copied the EMA into the model: later validations use the model as is

    def decay_at(self, updates: int) -> float:
        """The decay used by the `updates`-th update (1-based), as a Python float."""
        return self.decay * (1 - math.exp(-updates / self.tau))

    # ---- state ------------------------------------------------------------------------------------------------
    def _build(self, pl_module: pl.LightningModule) -> None:
        sd = pl_module.state_dict(keep_vars=True)
        self._names = list(sd)
        src = self._pending if self._pending is not None else {n: t.detach() for n, t in sd.items()}
        missing = [n for n in self._names if n not in src]
        if missing:
            raise KeyError(f"EMACallback: the checkpoint's EMA state lacks {missing[:5]}; was it saved by this model?")
        self._ema = [src[n].detach().to(device=sd[n].device, dtype=sd[n].dtype, copy=True) for n in self._names]
        # Cached references: parameters and buffers are updated in place by the optimizer and load_state_dict.
        self._model = [sd[n].detach() for n in self._names]
        params = {n for n, _ in pl_module.named_parameters()}
        floats = [i for i, t in enumerate(self._ema) if t.is_floating_point()]
        self._ema_floats = [self._ema[i] for i in floats]
        self._model_floats = [self._model[i] for i in floats]
        self._int_pairs = [(self._ema[i], self._model[i]) for i in range(len(self._ema)) if i not in set(floats)]
        self._ema_buffers = [t for n, t in zip(self._names, self._ema, strict=True) if n not in params]
        self._pending = None

    @property
    def ema_state_dict(self) -> dict[str, Tensor]:
        """The EMA weights by state-dict name (empty before fit starts)."""
        return dict(zip(self._names, self._ema, strict=True))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.updates = int(state_dict["updates"])

    # ---- hooks ------------------------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._applied = False
        self._build(pl_module)  # after the strategy moved the model to its device (and after any checkpoint restore)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # the loops' state (global_step) is restored only after on_fit_start

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step <= self._last_step:
            return  # accumulation micro-batch: no optimizer step happened
        self._last_step = trainer.global_step
        self.updates += 1
        d = self.decay_at(self.updates)
        applied = getattr(pl_module, "step_finite", None)  # YOLOv5Module: False when it skipped a non-finite step
        if isinstance(applied, Tensor):
            self._update_guarded(applied, 1.0 - d)
            return
        with torch.no_grad():
            if self._ema_floats and self.foreach:
                # v = d v + (1 - d) m  ==  lerp(v, m, 1 - d); the weight is a Python float: no host sync
                torch._foreach_lerp_(self._ema_floats, self._model_floats, 1.0 - d)
            else:
                for e, m in zip(self._ema_floats, self._model_floats, strict=True):
                    e.lerp_(m, 1.0 - d)
            for e, m in self._int_pairs:
                e.copy_(m)

    @torch.no_grad()
    def _update_guarded(self, applied: Tensor, weight: float) -> None:
        """The EMA update when the module reports whether its step was applied (YOLOv5Module skips non-finite ones).

        No host sync: the lerp weight is a device tensor, 0 after a skipped step, which left the parameters as they
        were. BatchNorm running statistics are the exception: the forward pass of a non-finite step may already
        have put NaN in the model's, and lerp(e, NaN, 0) is NaN. A run in that state stops after
        `max_nonfinite_steps` and no checkpoint takes those values (AtomicCheckpointIO refuses non-finite ones).
        """
        ema, model = self._ema_floats, self._model_floats
        w = applied.to(ema[0].dtype if ema else torch.float32) * weight
        if ema and self.foreach:
            torch._foreach_lerp_(ema, model, w)
        else:
            for e, m in zip(ema, model, strict=True):
                e.lerp_(m, w)
        for e, m in self._int_pairs:
            e.copy_(m)

    def _broadcast_buffers(self, trainer: pl.Trainer) -> None:
        """Give every rank rank 0's EMA buffers (DDP keeps the parameters, not the running statistics, in sync)."""
        if not self._ema_buffers or getattr(trainer, "world_size", 1) < 2:
            return
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in self._ema_buffers:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for tensors in by_dtype.values():  # one collective per dtype (float stats, int64 batch counters)
                flat = torch.cat([t.reshape(-1) for t in tensors])
                torch.distributed.broadcast(flat, src=0)
                for t, v in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                    t.copy_(v.view_as(t))

    def _swap(self, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            for e, m in zip(self._ema, self._model, strict=True):
                tmp = m.clone()
                m.copy_(e)
                e.copy_(tmp)
        self._swapped = not self._swapped

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._applied:
            return
        if not self._ema and self._pending is not None:
            self._build(pl_module)  # trainer.validate(ckpt_path=...) with this callback: evaluate the EMA weights
        if self._ema and not self._swapped:
            self._broadcast_buffers(trainer)  # every rank validates rank 0's EMA (the one checkpoints hold)
            self._swap(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._swapped:
            self._swap(pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ema:
            self._broadcast_buffers(trainer)
            with torch.no_grad():
                for e, m in zip(self._ema, self._model, strict=True):
                    m.copy_(e)
            self._applied = True

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self._ema:
            return  # outside fit: the module's own weights are what there is
        raw = checkpoint["state_dict"]
        ema = self.ema_state_dict
        if self._swapped:  # saved during validation: the module holds the EMA weights, the callback the raw ones
            raw, ema = ema, raw
        checkpoint[_CURRENT] = {n: t.detach().clone() for n, t in raw.items()}
        checkpoint["state_dict"] = {n: (ema[n].detach().clone() if n in ema else t) for n, t in raw.items()}

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if _CURRENT not in checkpoint:
            return  # not written with EMA: the EMA starts from the loaded weights
        # Lightning has already loaded checkpoint["state_dict"] (the EMA) into the module: keep it for the EMA and
        # put the raw weights back.
        self._pending = dict(checkpoint["state_dict"])
        pl_module.load_state_dict(checkpoint[_CURRENT])
        self._ema, self._names, self._model = [], [], []
