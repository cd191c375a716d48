"""`check_amp`: does mixed precision give this model's detections on this GPU?

Some GPUs give wrong results in fp16 (NaN losses and no detections on the GTX 16xx series). Before training with a
mixed precision on CUDA, the model runs once in float32 and once under autocast on a fixed image; when the two
disagree, training falls back to 32-true with one line. "Agree" is YOLOv5's test: the same number of detections
(NMS at confidence 0.25, IoU 0.45) with normalised xywh within 0.1 of each other; yolo5l also requires the
autocast outputs to be finite (a model whose fp16 outputs are all NaN has no detections in either run, and would
pass the first test).

Reference: ultralytics/yolov5 v7.0 `utils/general.py::check_amp` (AutoShape on data/images/bus.jpg, fp32 vs AMP,
`allclose(atol=0.1)`; AMP off when they differ).
"""

from __future__ import annotations

import copy
from typing import Any

import cv2
import numpy as np
import torch
from torch import nn

__all__ = ["MIXED", "amp_agrees", "check_amp", "check_image"]

#: The Trainer precisions that autocast.
MIXED = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_ATOL = 0.1
_CONF, _IOU, _MAX_DET = 0.25, 0.45, 1000  # YOLOv5's AutoShape defaults


def check_image(size: int = 640) -> np.ndarray:
    """The fixed test image: (size, size, 3) uint8 RGB, a grey gradient with a few filled shapes (no file, no
    download; YOLOv5 uses its bus.jpg)."""
    ramp = np.linspace(40, 200, size, dtype=np.float32)
    img = np.repeat(((ramp[:, None] + ramp[None, :]) / 2)[..., None], 3, axis=2).astype(np.uint8)
    s = size / 640
    cv2.rectangle(img, (int(60 * s), int(80 * s)), (int(300 * s), int(420 * s)), (200, 40, 40), -1)
    cv2.circle(img, (int(460 * s), int(200 * s)), int(110 * s), (30, 160, 60), -1)
    cv2.rectangle(img, (int(360 * s), int(420 * s)), (int(600 * s), int(600 * s)), (30, 60, 190), -1)
    cv2.line(img, (int(20 * s), int(620 * s)), (int(620 * s), int(470 * s)), (250, 250, 250), max(1, int(8 * s)))
    return img


def _detections(model: nn.Module, x: torch.Tensor, size: int) -> tuple[torch.Tensor, bool]:
    """Normalised xywh of the detections, and whether every decoded output was finite."""
    from yolo5l_kernels.reference import xyxy_to_xywh

    from yolo5l.infer.boxes import non_max_suppression

    pred = model.decode(model(x)).float()  # type: ignore[operator]
    finite = bool(torch.isfinite(pred).all())
    det = non_max_suppression(pred, _CONF, _IOU, max_det=_MAX_DET)[0]
    return xyxy_to_xywh(det[:, :4]) / size, finite


@torch.no_grad()
def amp_agrees(model: nn.Module, device: torch.device | str, dtype: torch.dtype, size: int = 640) -> bool:
    """Whether a copy of `model` (eval mode) gives the same detections on `check_image` in float32 and under
    autocast to `dtype` on `device`: as many boxes, within 0.1 of the image size, and finite autocast outputs.

    The model needs ``forward(images) -> heads`` and ``decode(heads) -> (B, N, 5 + C)`` (`yolo5l.models.yolo.YOLOv5`).
    """
    device = torch.device(device)
    m = copy.deepcopy(model).float().eval().to(device)
    x = torch.from_numpy(check_image(size)).permute(2, 0, 1)[None].float().div(255).to(device)
    a, _ = _detections(m, x, size)
    with torch.autocast(device.type, dtype=dtype):
        b, finite = _detections(m, x, size)
    return finite and a.shape == b.shape and torch.allclose(a, b.to(a.dtype), atol=_ATOL)


def check_amp(
    model: nn.Module, precision: Any, accelerator: str, device: torch.device | str | None = None
) -> tuple[Any, str | None]:
    """The precision to train with: `precision`, or "32-true" when it is a mixed precision on CUDA and the model's
    fp32 and autocast detections disagree (`amp_agrees`). An error in the check counts as a disagreement, as in
    YOLOv5.

    Args:
        model: The model about to be trained (on the CPU; a copy is moved to the device).
        precision: The Trainer precision resolved so far.
        accelerator: `trainer.accelerator`.
        device: Where to run the check; None: this process's CUDA device (`LOCAL_RANK` under DDP).

    Returns:
        (precision to use, the console line saying why it changed, or None).
    """
    import os

    from yolo5l.base.hardware import uses_cuda

    dtype = MIXED.get(str(precision))
    if dtype is None or (device is None and not (uses_cuda(accelerator) and torch.cuda.is_available())):
        return precision, None
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count()))
    try:
        agrees = amp_agrees(model, device, dtype)
    except Exception as e:  # the check itself failing under autocast is an answer too
        agrees, why = False, f" ({type(e).__name__}: {e})"
    else:
        why = ""
    if agrees:
        return precision, None
    return "32-true", (
        f"AMP check: the model's float32 and {precision} detections of a test image disagree on {device}{why} "
        "(mixed precision is broken on some GPUs, e.g. fp16 on the GTX 16xx): training with trainer.precision=32-true"
    )
