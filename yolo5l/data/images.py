"""Image reading: any accepted image file as 8-bit RGB, EXIF orientation applied.

Reference: ultralytics/yolov5 v7.0 ``utils/dataloaders.py::LoadImagesAndLabels.load_image`` and ``exif_size``
(behaviour); yolo5l returns RGB where ultralytics returns BGR.
"""

from __future__ import annotations

import contextlib
import os

import cv2
import numpy as np
from PIL import Image, ImageOps

from yolo5l.data.layout import DatasetError

__all__ = ["ImageReadError", "exif_hw", "read_image"]

_EXIF_ORIENTATION = 0x0112  # the EXIF tag
_ROTATED_90 = (5, 6, 7, 8)  # orientations that turn the image by 90 degrees (swap height and width)
_PIL_16BIT_MODES = ("I;16", "I;16B", "I;16L", "I")
_U8_MAX = 255.0


class ImageReadError(DatasetError):
    """An image file that cannot be decoded."""


def read_image(path: str | os.PathLike) -> np.ndarray:
    """Read an image as RGB uint8 (H, W, 3), EXIF orientation applied.

    Grayscale, RGBA (alpha dropped), palette and 16-bit images are converted to 8-bit RGB; PFM (float) images
    are scaled from [0, 1] to [0, 255]. OpenCV decodes (it applies the EXIF orientation and converts 16 to 8
    bits itself); PIL is the fallback for what OpenCV cannot open.

    Args:
        path: Image file.

    Returns:
        (H, W, 3) uint8 RGB array.

    Raises:
        ImageReadError: The file is missing or cannot be decoded.
    """
    path = os.fspath(path)
    if path.lower().endswith(".pfm"):
        im = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        if im is not None:
            im = np.clip(im * (_U8_MAX if im.max() <= 1.0 else 1.0), 0, _U8_MAX).astype(np.uint8)
            im = np.repeat(im[..., None], 3, axis=2) if im.ndim == 2 else im[..., ::-1]
            return np.ascontiguousarray(im)
    im = cv2.imread(path, cv2.IMREAD_COLOR_RGB)
    if im is not None:
        return im
    try:
        with Image.open(path) as pil:
            pil = ImageOps.exif_transpose(pil)
            if pil.mode in _PIL_16BIT_MODES:
                arr = np.asarray(pil, dtype=np.uint32) >> 8  # the high byte of each 16-bit value
                return np.ascontiguousarray(np.repeat(arr.astype(np.uint8)[..., None], 3, axis=2))
            return np.asarray(pil.convert("RGB"))
    except FileNotFoundError as e:
        raise ImageReadError(f"Image {path} not found.") from e
    except Exception as e:
        raise ImageReadError(f"Image {path} cannot be decoded ({type(e).__name__}: {e}); remove or replace it.") from e


def exif_hw(im: Image.Image) -> tuple[int, int]:
    """(height, width) of an open PIL image once its EXIF orientation is applied (from the header only)."""
    w, h = im.size
    with contextlib.suppress(Exception):
        if im.getexif().get(_EXIF_ORIENTATION, 1) in _ROTATED_90:
            return w, h
    return h, w
