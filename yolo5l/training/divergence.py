"""A run that diverged stops, with one line that says why and how to go on (`TrainingDiverged`, exit status 65).

A learning rate too high for the model and data, or fp16 overflow on a GPU that gives NaN under it, makes the loss
grow by orders of magnitude; activations overflow, and the BatchNorm running statistics, then the weights and the
EMA, stop being finite. No usable file can be saved from there (checkpoints and weights files refuse non-finite
tensors), so training on only burns time. `YOLOv5Module` runs these checks and stops every rank at the same point:

- every `trainer.log_every_n_steps` batches and at each epoch's last batch, in the one host sync that reads the
  skipped-step streak: `max_nonfinite_steps` non-finite steps in a row, and the exploding-loss rule (`LossGrowth`);
- at each epoch's last batch, before its validation and its `last.ckpt`: weights, BatchNorm statistics and EMA all
  finite (`first_non_finite`, one host sync per epoch);
- at the end of each validation during fit: its loss and its predictions finite (one host sync per validation).

Under DDP each decision is one small all-reduce, so the ranks agree. The line names the epoch, what went wrong, the
likely cause and the last checkpoint to resume from with a lower `hyp.lr0` (`resume=` accepts a new `hyp.lr0`:
`yolo5l.training.optim.rescale_lr0`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from yolo5l.base.errors import EXIT_DIVERGED, shown_path
from yolo5l.base.run_files import last_checkpoint

__all__ = ["MIN_GROWTH_BATCHES", "LossGrowth", "TrainingDiverged", "diverged", "first_non_finite", "state_problem"]

#: Batches a running epoch mean must cover before the exploding-loss rule reads it (an epoch's end always counts):
#: the mean of one or two batches swings with their content (a batch of background images has almost no loss).
MIN_GROWTH_BATCHES = 10

# What went non-finite, by increasing code (the ranks agree on the largest): what the message calls it.
_WHAT = {1: "the weights", 2: "the BatchNorm running statistics", 3: "the EMA weights",
         4: "the EMA's BatchNorm running statistics"}  # fmt: skip


class TrainingDiverged(SystemExit):
    """The run diverged and stopped: exit status `EXIT_DIVERGED` (65); `str()` is the one-line message.

    A `SystemExit`, like `Preempted`: the command line exits with its status after the line printed on rank 0, and
    Lightning's `on_exception` hooks still run.
    """

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_DIVERGED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class LossGrowth:
    """The exploding-loss rule: stop when the training loss (box + obj + cls) averaged since the start of the epoch
    is more than `factor` times the lowest such average seen earlier in the run (docs/guide.md says why).

    Averages over fewer than `MIN_GROWTH_BATCHES` batches are neither compared nor kept, except at an epoch's end.
    The lowest average is part of the module's checkpoint, so a resumed run keeps watching from where it was.

    Args:
        factor: the growth that stops the run; None turns the rule off.
    """

    def __init__(self, factor: float | None) -> None:
        if factor is not None and not factor > 1:
            raise ValueError(f"module.max_loss_growth must be > 1 or null (off), got {factor}")
        self.factor = None if factor is None else float(factor)
        self.lowest: float | None = None

    def grew(self, mean: float, batches: int, epoch_end: bool) -> float | None:
        """Record an average `mean` over `batches` batches; returns the lowest one it exceeds `factor` times, if so.

        A non-finite average is left to the skipped-step streak (those steps were not applied).
        """
        if (
            self.factor is None
            or not math.isfinite(mean)
            or mean <= 0
            or (batches < MIN_GROWTH_BATCHES and not epoch_end)
        ):
            return None
        if self.lowest is not None and mean > self.factor * self.lowest:
            return self.lowest
        self.lowest = mean if self.lowest is None else min(self.lowest, mean)
        return None


def first_non_finite(named: Iterable[tuple[str, Tensor]]) -> str | None:
    """The name of the first floating tensor holding a NaN or inf, else None."""
    items = list(named)
    index = _first_non_finite([t for _, t in items])
    return None if index is None else items[index][0]


def _first_non_finite(tensors: list[Tensor]) -> int | None:
    """The index of the first floating tensor holding a NaN or inf, else None: one host sync per device (a stack of
    per-tensor flags on it), whatever the number of tensors."""
    finite = torch.ones(len(tensors), dtype=torch.bool)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        flags = torch.stack([torch.isfinite(tensors[i]).all() for i in indices]).cpu()  # the host sync
        finite[indices] = flags
    return None if bool(finite.all()) else int(torch.argmin(finite.to(torch.uint8)))


def state_problem(pl_module: Any) -> tuple[int, str]:
    """What in the model's state is not finite: (a code of `_WHAT`, 0 when all is finite; the tensor's name).

    Looks at `pl_module.model`'s parameters and buffers and at the EMA of any callback that keeps one
    (`EMACallback.ema_state_dict`).
    """
    params = {name for name, _ in pl_module.model.named_parameters()}
    named = [(f"model.{k}", v, 1 if k in params else 2) for k, v in pl_module.model.state_dict().items()]
    for cb in getattr(pl_module.trainer, "callbacks", []):
        ema = getattr(cb, "ema_state_dict", None)
        if isinstance(ema, dict):
            named += [(k, v, 3 if k.removeprefix("model.") in params else 4) for k, v in ema.items()]
    index = _first_non_finite([t for _, t, _ in named])
    if index is None:
        return 0, ""
    name, _, code = named[index]
    return code, name


def describe_state(code: int, name: str) -> str:
    """The message's words for `state_problem`'s result (`name` may be empty: found on another rank)."""
    where = f" ({name})" if name else " (on another rank)"
    return f"{_WHAT[code]} hold NaN or inf{where}"


def diverged(trainer: Any, lr0: float | None, what: str) -> TrainingDiverged:
    """The stop: prints the line on global rank 0 (once) and returns the exception for every rank to raise.

    Args:
        trainer: the Trainer (epoch, precision, device, the checkpoint callback's `last.ckpt`).
        lr0: the run's initial learning rate (`hyp.lr0`), None when unknown.
        what: what went wrong, e.g. "the validation loss is NaN or inf".
    """
    lower = f"hyp.lr0={lr0 / 10:g}" if lr0 else "a lower hyp.lr0"
    rate = f"the learning rate (hyp.lr0={lr0:g}) is too high" if lr0 else "the learning rate is too high"
    precision = str(getattr(trainer, "precision", ""))
    device = getattr(getattr(trainer, "strategy", None), "root_device", torch.device("cpu"))
    if device.type == "cuda" and precision.startswith("16"):
        cause = (
            "fp16 overflow (some GPUs, the GTX 16xx among them, give NaN under fp16: start again with "
            f"trainer.precision=32) or {rate}"
        )
    else:
        cause = rate
    last = last_checkpoint(trainer)
    if last is not None:
        command = f"python -m yolo5l.train resume={shown_path(last)} {lower}"
        advice = "resume from the last checkpoint, all finite, with a lower rate (or start again with it if that "
        advice += f"diverges too): {command}"
    else:
        advice = f"no checkpoint was written before it: start the run again with {lower}"
    message = f"training diverged at epoch {trainer.current_epoch}: {what}; likely cause: {cause}; {advice}"
    if getattr(trainer, "is_global_zero", True):
        print(f"\n{message}", file=sys.stderr, flush=True)
    return TrainingDiverged(message)
