"""`ValidationSpeed`: v7.0's per-image pre-process / inference / NMS times of a `trainer.validate` run.

The stages are Lightning profiler actions (`yolo5l.eval.stage_times`): `StageProfiler` times them and
`ValidationSpeed` counts the images they covered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from typing_extensions import override

from yolo5l.eval.stage_times import INFERENCE, NMS, TRANSFER, StageTimes, speed_line

__all__ = ["StageProfiler", "ValidationSpeed"]


def _stage_of(action: str) -> int | None:
    if action.endswith(TRANSFER):
        return 0
    return 1 if action == INFERENCE else 2 if action == NMS else None


class StageProfiler(Profiler):
    """A Lightning profiler that adds the time of v7.0's three validation stages into `times` and ignores every
    other action; its summary is empty (`ValidationSpeed.line` says what it measured).

    Args:
        device: The device the validation runs on (CUDA is synchronised at each stage's start and end).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.times = StageTimes(device)
        self._started: dict[str, float] = {}

    @override
    def start(self, action_name: str) -> None:
        if _stage_of(action_name) is not None:
            self._started[action_name] = self.times.now()

    @override
    def stop(self, action_name: str) -> None:
        t0, stage = self._started.pop(action_name, None), _stage_of(action_name)
        if t0 is not None and stage is not None:
            self.times.seconds[stage] += self.times.now() - t0


class ValidationSpeed(Callback):
    """Count the images of this rank's validation batches for `profiler`, which times the stages: give the Trainer
    both (`callbacks=[..., speed], profiler=speed.profiler`).

    Args:
        device: The device the validation runs on.
    """

    def __init__(self, device: torch.device) -> None:
        self.profiler = StageProfiler(device)

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self.profiler.times.images += int(batch[0].shape[0])  # a shape: no host sync

    def line(self, shape: Sequence[int]) -> str:
        """v7.0's `Speed: ...ms pre-process, ...ms inference, ...ms NMS per image at shape (...)` line."""
        return speed_line(self.profiler.times.per_image_ms(), shape)
