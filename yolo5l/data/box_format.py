"""Box format conversions of numpy label arrays: normalised centre boxes <-> pixel corner boxes.

Labels are stored as ``[cx, cy, w, h]`` normalised by the image size (``xywhn``); the geometric augmentations
work on ``[x1, y1, x2, y2]`` in pixels (``xyxy``). The torch conversions of model outputs live in
``yolo5l_kernels.reference`` (re-exported by :mod:`yolo5l.infer.boxes`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["xywhn_to_xyxy", "xyxy_to_xywhn"]


def xywhn_to_xyxy(x: np.ndarray, w: float, h: float, padw: float = 0.0, padh: float = 0.0) -> np.ndarray:
    """Normalised (n, 4) cx,cy,w,h -> pixel x1,y1,x2,y2 on a (h, w) image placed at offset (padw, padh)."""
    y = np.empty_like(x)
    y[:, 0] = w * (x[:, 0] - x[:, 2] / 2) + padw
    y[:, 1] = h * (x[:, 1] - x[:, 3] / 2) + padh
    y[:, 2] = w * (x[:, 0] + x[:, 2] / 2) + padw
    y[:, 3] = h * (x[:, 1] + x[:, 3] / 2) + padh
    return y


def xyxy_to_xywhn(x: np.ndarray, w: float, h: float, clip: bool = True, eps: float = 1e-3) -> np.ndarray:
    """Pixel (n, 4) x1,y1,x2,y2 -> normalised cx,cy,w,h, optionally clipped to the image (minus ``eps``)."""
    x = x.copy()
    if clip:
        x[:, [0, 2]] = x[:, [0, 2]].clip(0, w - eps)
        x[:, [1, 3]] = x[:, [1, 3]].clip(0, h - eps)
    y = np.empty_like(x)
    y[:, 0] = (x[:, 0] + x[:, 2]) / 2 / w
    y[:, 1] = (x[:, 1] + x[:, 3]) / 2 / h
    y[:, 2] = (x[:, 2] - x[:, 0]) / w
    y[:, 3] = (x[:, 3] - x[:, 1]) / h
    return y
