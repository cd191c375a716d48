"""The three stages v7.0's val.py times per image, and the line it prints after a validation.

`Speed: 0.3ms pre-process, 7.1ms inference, 1.2ms NMS per image at shape (32, 3, 640, 640)`:

- pre-process: the copy of the batch to the device and the uint8 -> [0, 1] float conversion;
- inference: the forward pass and the decode (every augmented pass with `augment=true`);
- NMS: the suppression.

Loading the batch, the loss and the metric are outside the stages, as in v7.0. On CUDA the clock waits for the device
at each stage's start and end (v7.0's `Profile` does the same), so the stages hold the device's work, not the time to
queue it; on the CPU nothing waits.

`StageTimes` is the clock of a plain loop (`yolo5l.val_tasks.validation_loop`, `python -m yolo5l.predict`), and of
`yolo5l.callbacks.val_speed.ValidationSpeed` inside `trainer.validate`: there Lightning profiles the copy and the
conversion as its `batch_to_device` action, and `YOLOv5Module.validation_step` profiles the other two as `INFERENCE`
and `NMS` (no-ops under Lightning's default profiler).

Reference: ultralytics/yolov5 v7.0 `val.py::run` (`dt = Profile(), Profile(), Profile()`, the `Speed:` line),
`utils/general.py::Profile`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch

__all__ = ["INFERENCE", "NMS", "STAGES", "TRANSFER", "StageTimes", "speed_line"]

STAGES = ("pre-process", "inference", "NMS")
#: Profiler actions of `YOLOv5Module.validation_step`: the forward pass with the decode, and the NMS.
INFERENCE, NMS = "yolo5l.val_inference", "yolo5l.val_nms"
#: Lightning's action around the copy to the device and `on_after_batch_transfer` ends with this.
TRANSFER = ".batch_to_device"


class StageTimes:
    """Wall time of each stage, summed over batches, and the images they covered.

    Args:
        device: The device the stages run on: CUDA is synchronised at each stage's start and end.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = [0.0, 0.0, 0.0]
        self.images = 0

    @contextlib.contextmanager
    def stage(self, i: int) -> Iterator[None]:
        """Time stage `i` (0 pre-process, 1 inference, 2 NMS)."""
        t0 = self.now()
        yield
        self.seconds[i] += self.now() - t0

    def now(self) -> float:
        """The host clock, after the device's queued work on CUDA."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host sync, one per stage boundary (v7.0's Profile): see the module
        return time.perf_counter()

    def per_image_ms(self) -> list[float]:
        """Milliseconds per image of each stage."""
        return [s / max(self.images, 1) * 1e3 for s in self.seconds]


def speed_line(ms: Sequence[float], shape: Sequence[int]) -> str:
    """v7.0's line: `Speed: 0.3ms pre-process, 7.1ms inference, 1.2ms NMS per image at shape (32, 3, 640, 640)`."""
    stages = ", ".join(f"{t:.1f}ms {name}" for t, name in zip(ms, STAGES, strict=True))
    return f"Speed: {stages} per image at shape {tuple(shape)}"
