"""YOLOv5's optimisation recipe: parameter groups, optimizer implementation, warmup and learning-rate schedules.

The optimizer itself comes from `conf/module/optimizer/*.yaml` as a partial (`torch.optim.SGD` with lr and momentum
bound); `YOLOv5Module` calls it with `yolov5_param_groups(...)` and the implementation kwargs of
`optimizer_impl_kwargs`. The schedules are `LambdaLR`s built from a partial (`conf/module/scheduler/*.yaml`) with
the run's epoch count.

Reference: ultralytics/yolov5 v7.0 `utils/torch_utils.py::smart_optimizer` (groups), `train.py` (nbs accumulation,
weight-decay scaling, warmup by `np.interp`, `lf` lambdas), `utils/general.py::one_cycle`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "OPTIMIZER_IMPLS",
    "CosineLR",
    "LinearLR",
    "extend_schedule",
    "interp",
    "optimizer_impl_kwargs",
    "param_groups",
    "rescale_lr0",
    "resolve_optimizer_impl",
    "yolov5_param_groups",
]

OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "loop")

_IMPL_KWARGS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}


def interp(x: float, xp: Sequence[float], fp: Sequence[float]) -> float:
    """`np.interp` for two points, in Python floats (clamped outside [xp[0], xp[1]])."""
    (x0, x1), (y0, y1) = xp, fp
    if x <= x0:
        return float(y0)
    if x >= x1:
        return float(y1)
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """Split trainable parameters as YOLOv5's `smart_optimizer`: (biases, decayed weights, norm-layer weights)."""
    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    biases: list[nn.Parameter] = []
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue  # frozen layers (freeze=) stay out of the optimizer
            if name == "bias":
                biases.append(p)
            elif name == "weight" and isinstance(module, norm_types):
                no_decay.append(p)
            else:
                decay.append(p)
    return biases, decay, no_decay


def yolov5_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The three optimizer groups in YOLOv5's order: biases (no decay; the warmup ramps their lr from
    `warmup_bias_lr`), weights (`weight_decay`), norm-layer weights (no decay)."""
    biases, decay, no_decay = param_groups(model)
    return [
        {"params": biases, "weight_decay": 0.0},
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def resolve_optimizer_impl(impl: str, device_type: str, grad_scaler: bool) -> str:
    """The optimizer implementation to build: "fused", "foreach" or "loop".

    "auto" picks fused (one kernel over all parameters; bit-identical to the loop for SGD) on CPU and CUDA, except
    when a GradScaler (16-mixed) is in use: a fused step unscales inside `step()`, after the point where YOLOv5
    clips at norm 10, and Lightning's `MixedPrecision.clip_gradients` refuses fused optimizers; foreach there.
    Under bf16-mixed and 32-true there is no scaler and the module clips the gradients itself, so fused and
    clipping coexist.

    Args:
        impl: one of `OPTIMIZER_IMPLS` ("loop" = torch's per-tensor reference implementation).
        device_type: the parameters' device type.
        grad_scaler: whether a GradScaler unscales the gradients (16-mixed).

    Raises:
        ValueError: unknown `impl`, or "fused" with a GradScaler.
    """
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"module.optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got {impl!r}")
    if impl == "fused" and grad_scaler:
        raise ValueError(
            "module.optimizer_impl=fused cannot be clipped under 16-mixed (the GradScaler unscales inside the fused "
            "step): use module.optimizer_impl=foreach or auto, or trainer.precision=bf16-mixed"
        )
    if impl != "auto":
        return impl
    return "fused" if device_type in ("cpu", "cuda") and not grad_scaler else "foreach"


def optimizer_impl_kwargs(impl: str) -> dict[str, bool]:
    """The `torch.optim` constructor kwargs of a resolved implementation ("fused", "foreach" or "loop")."""
    return dict(_IMPL_KWARGS[impl])


class _Factor:
    """An epoch -> lr factor as a picklable object (LambdaLR saves and restores its `__dict__`).

    `extend` stretches the schedule to more epochs: from the epoch it is called at, the factor runs linearly from
    its value there to `lrf` at the new last epoch (a finished linear run continues at lr0 x lrf).
    """

    def __init__(self, epochs: int, lrf: float) -> None:
        self.epochs, self.lrf = int(epochs), float(lrf)
        self.tail_from: int | None = None  # the epoch an extension started at, and the factor there
        self.tail_factor = 1.0

    def curve(self, epoch: int) -> float:
        raise NotImplementedError

    def __call__(self, epoch: int) -> float:
        if self.tail_from is None or epoch < self.tail_from:
            return self.curve(epoch)
        span = max(self.epochs - self.tail_from, 1)
        return self.tail_factor + (self.lrf - self.tail_factor) * min(epoch - self.tail_from, span) / span

    def extend(self, epoch: int, epochs: int) -> None:
        """Continue the schedule at `epoch` towards `lrf` at `epochs` (more than before)."""
        self.tail_factor, self.tail_from, self.epochs = self(epoch), int(epoch), int(epochs)


class _LinearFactor(_Factor):
    """YOLOv5's `lf(x) = (1 - x / epochs) (1 - lrf) + lrf`."""

    def curve(self, epoch: int) -> float:
        return (1 - epoch / self.epochs) * (1.0 - self.lrf) + self.lrf


class _OneCycleFactor(_Factor):
    """`lf(x) = ((1 - cos(x pi / epochs)) / 2) (lrf - 1) + 1`: YOLOv5's `one_cycle(1, lrf, epochs)`."""

    def curve(self, epoch: int) -> float:
        return ((1 - math.cos(epoch * math.pi / self.epochs)) / 2) * (self.lrf - 1) + 1


def extend_schedule(scheduler: LambdaLR, epoch: int, epochs: int) -> tuple[float, float] | None:
    """Stretch a `LinearLR`/`CosineLR` schedule to `epochs` when a resumed run asks for more than it was built for.

    Returns:
        (factor now, factor at the end) when the schedule was extended, else None.
    """
    factor = scheduler.lr_lambdas[0]
    if not isinstance(factor, _Factor) or epochs <= factor.epochs:
        return None
    for f in {id(f): f for f in scheduler.lr_lambdas}.values():  # LambdaLR repeats one factor for every group
        f.extend(epoch, epochs)
    return factor.tail_factor, factor.lrf


def rescale_lr0(scheduler: LambdaLR, lr0: float) -> float | None:
    """Give a restored schedule another initial learning rate (`resume=... hyp.lr0=<lower>` after a divergence):
    the schedule's `base_lrs`, every group's `initial_lr` (the warmup's target) and its current `lr` are scaled by
    `lr0` over the restored one, so the schedule goes on from the same point at the new scale.

    Returns:
        The restored lr0 when it was changed, else None (the same rate: a resume stays exact).
    """
    old = max(scheduler.base_lrs, default=0.0)
    if old <= 0 or math.isclose(old, lr0, rel_tol=1e-9):
        return None
    ratio = lr0 / old
    scheduler.base_lrs = [b * ratio for b in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    return old


class _FactorLR(LambdaLR):
    """An epoch-stepped `LambdaLR` over `epochs` whose factor is the class's `factor` (`_LinearFactor`, ...).

    Args:
        optimizer: the optimizer.
        epochs: the run's epoch count (the Trainer's `max_epochs`).
        lrf: final learning rate as a fraction of lr0 (`hyp.lrf`).
    """

    factor: type[_Factor]

    def __init__(self, optimizer: Optimizer, epochs: int, lrf: float, last_epoch: int = -1) -> None:
        if epochs is None or epochs < 1:
            raise ValueError("set trainer.max_epochs: the learning-rate schedule spans it")
        super().__init__(optimizer, self.factor(epochs, lrf), last_epoch=last_epoch)


class LinearLR(_FactorLR):
    """YOLOv5's default schedule: lr falls linearly from lr0 to lr0 * lrf over `epochs` (stepped per epoch)."""

    factor = _LinearFactor


class CosineLR(_FactorLR):
    """YOLOv5's `--cos-lr` schedule: one cosine half-cycle from lr0 to lr0 * lrf over `epochs`."""

    factor = _OneCycleFactor
