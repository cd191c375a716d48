"""Image sizes of YOLOv5 v7.0's loaders: the long-side resize, the letterbox, and the shapes of rectangular batches.

Reference: ultralytics/yolov5 v7.0 utils/augmentations.py (`letterbox`) and utils/dataloaders.py
(`LoadImagesAndLabels`: `load_image`, `rect`) (behaviour, not code).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import cv2
import numpy as np

from yolo5l.base.image_size import MAX_STRIDE

__all__ = [
    "FILL",
    "RECT_PAD",
    "letterbox",
    "letterbox_layout",
    "rect_batch_shapes",
    "resize_long_side",
    "resized_shape",
]

FILL = 114  # grey used for every border, as in YOLOv5
RECT_PAD = 0.5  # rectangular batch padding, in units of the stride (YOLOv5's val pad)


def resized_shape(h0: int, w0: int, imgsz: int) -> tuple[int, int]:
    """(h, w) after resizing by ``r = imgsz / max(h0, w0)``: each side ``int(side * r)``, truncated, at least 1 px.

    The long side is ``imgsz``, or ``imgsz - 1`` where the float product ``side * (imgsz / side)`` falls just short
    of it (77 px to 640 gives 639). Reference: ultralytics/yolov5 v7.0
    utils/dataloaders.py::LoadImagesAndLabels.load_image (``int(w0 * r), int(h0 * r)``).
    """
    r = imgsz / max(h0, w0)
    if r == 1:
        return int(h0), int(w0)
    return max(1, int(h0 * r)), max(1, int(w0 * r))


def resize_long_side(img: np.ndarray, imgsz: int, augment: bool) -> np.ndarray:
    """Resize to :func:`resized_shape`: INTER_LINEAR when augmenting or enlarging (``imgsz`` above the long side),
    else INTER_AREA."""
    h0, w0 = img.shape[:2]
    h, w = resized_shape(h0, w0, imgsz)
    if (h, w) == (h0, w0):
        return img
    interp = cv2.INTER_LINEAR if (augment or imgsz > max(h0, w0)) else cv2.INTER_AREA
    return cv2.resize(img, (w, h), interpolation=interp)


def letterbox(
    img: np.ndarray,
    new_shape: int | Sequence[int] = 640,
    color: int = FILL,
    auto: bool = False,
    scaleup: bool = True,
    stride: int = MAX_STRIDE,
) -> tuple[np.ndarray, tuple[float, float], tuple[float, float]]:
    """Resize keeping the aspect ratio and pad to ``new_shape`` (h, w) with ``color``.

    Args:
        img: HWC uint8.
        new_shape: target (h, w), or an int for a square.
        auto: pad only up to the next multiple of ``stride`` (minimum rectangle) instead of to ``new_shape``.
        scaleup: allow enlarging; validation uses False (only shrink).

    Returns:
        ``(image, (r, r), (pad_w, pad_h))``, as v7.0's: ``r`` the scale, and the pad half of each axis' total
        padding, a float that ends in .5 where the total is odd. The image itself then sits at ``pad - 0.5`` on
        that axis (its borders, :func:`letterbox_layout`, are whole pixels); v7.0's labels and box rescaling use the
        unrounded pad, so boxes mapped with it agree with v7.0's. The resize is INTER_LINEAR, enlarging or
        shrinking, as v7.0's (predict's frames, the int8 calibration images; a dataset's images arrive resized by
        :func:`resize_long_side`, which shrinks with INTER_AREA for validation). Reference: ultralytics/yolov5 v7.0
        utils/augmentations.py::letterbox.
    """
    shape = img.shape[:2]
    new_unpad, (top, bottom, left, right), r, pad = letterbox_layout(shape, new_shape, auto, scaleup, stride)
    if shape[::-1] != new_unpad:
        img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
    if top or bottom or left or right:
        img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(color, color, color))
    return img, (r, r), pad


def letterbox_layout(
    shape_hw: Sequence[int],
    new_shape: int | Sequence[int] = 640,
    auto: bool = False,
    scaleup: bool = True,
    stride: int = MAX_STRIDE,
) -> tuple[tuple[int, int], tuple[int, int, int, int], float, tuple[float, float]]:
    """Where :func:`letterbox` puts an image of ``shape_hw``: its resized ``(w, h)``, the borders
    ``(top, bottom, left, right)``, the scale ``r`` and the pad ``(pad_w, pad_h)`` it returns (the arguments as
    :func:`letterbox`'s)."""
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    r = min(new_shape[0] / shape_hw[0], new_shape[1] / shape_hw[1])
    if not scaleup:
        r = min(r, 1.0)
    new_unpad = (round(shape_hw[1] * r), round(shape_hw[0] * r))  # (w, h)
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = dw % stride, dh % stride
    dw, dh = dw / 2, dh / 2
    borders = (round(dh - 0.1), round(dh + 0.1), round(dw - 0.1), round(dw + 0.1))
    return new_unpad, borders, r, (float(dw), float(dh))


def rect_batch_shapes(
    shapes_hw: np.ndarray, batch_size: int, imgsz: int, stride: int = MAX_STRIDE, pad: float = RECT_PAD
) -> tuple[np.ndarray, np.ndarray]:
    """Order images by aspect ratio and give each batch one letterbox shape.

    Args:
        shapes_hw: (n, 2) original [h, w].

    Returns:
        ``(order, batch_shapes)``: the (n,) permutation that sorts by h/w, and (nb, 2) int [h, w] per batch of
        ``batch_size`` consecutive images in that order: ``ceil(shape * imgsz / stride + pad) * stride`` where
        shape is [max h/w, 1] for tall-free batches (all h/w < 1), [1, 1 / min h/w] when all h/w > 1, else [1, 1].

    Reference: YOLOv5 utils/dataloaders.py LoadImagesAndLabels (rect).
    """
    ar = shapes_hw[:, 0] / shapes_hw[:, 1]
    order = ar.argsort(kind="stable")
    ar = ar[order]
    n = len(ar)
    nb = max(1, math.ceil(n / batch_size))
    rel = np.ones((nb, 2))
    for b in range(nb):
        ari = ar[b * batch_size : (b + 1) * batch_size]
        if len(ari) == 0:
            continue
        lo, hi = ari.min(), ari.max()
        if hi < 1:
            rel[b] = [hi, 1]
        elif lo > 1:
            rel[b] = [1, 1 / lo]
    batch_shapes = (np.ceil(rel * imgsz / stride + pad).astype(int) * stride).astype(int)
    return order, batch_shapes
