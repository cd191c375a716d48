"""Image sizes and the model's stride, one owner for all of it: an image size is a positive multiple of the model's
largest stride (32 for YOLOv5's P5 models, 64 for P6). A size typed that is not one is rounded up with a warning by
every command, as ultralytics/yolov5 v7.0 `utils/general.py::check_img_size` (training to at least twice the stride,
as v7.0's train.py); the one-line refusal is for sizes that cannot be rounded for the user (a dataset component
built on its own, val's study sizes).
"""

from __future__ import annotations

import re

from yolo5l.base.errors import UserError

__all__ = [
    "MAX_STRIDE", "ImageSizeError", "check_image_size", "fit_to_stride", "round_up", "rounding_note", "rounding_of",
]  # fmt: skip

MAX_STRIDE = 32  # the largest stride of YOLOv5's P5 heads: letterboxed and rectangular batch shapes are multiples of it


class ImageSizeError(UserError, ValueError):
    """An image size that is not a positive multiple of the stride; the message names the key and sizes that work."""


def check_image_size(imgsz: int, stride: int = MAX_STRIDE, key: str = "data.imgsz", of: str = "") -> int:
    """Refuse an image size that is not a positive multiple of ``stride``; returns it.

    Args:
        imgsz: the size, in pixels.
        stride: the model's largest stride.
        key: the option that gave it, for the message.
        of: what the stride belongs to, for the message (``"yolov5s6: ..."``; empty: YOLOv5's).

    Raises:
        ImageSizeError: One line naming ``key``, the stride and the nearest sizes that work.
    """
    imgsz, stride = int(imgsz), int(stride)
    if imgsz > 0 and imgsz % stride == 0:
        return imgsz
    lower, upper = imgsz // stride * stride, max(stride, -(-imgsz // stride) * stride)
    fits = f"{lower} or {upper}" if lower > 0 and lower != upper else str(upper)
    whose = f" of {of}" if of else ""
    raise ImageSizeError(f"{key}={imgsz} is not a positive multiple of {stride}, the largest stride{whose}: try {fits}")


def fit_to_stride(imgsz: int, stride: int, key: str = "data.imgsz", floor: int = 0) -> int:
    """An image size rounded up to a multiple of ``stride`` (at least 32) and to at least ``floor``, with one warning
    line naming the new size when it changes, as v7.0's train.py (floor: twice the stride), val.py, detect.py and
    export.py do.

    Reference: ultralytics/yolov5 v7.0 `utils/general.py::check_img_size`.
    """
    from yolo5l.base.console import warn

    stride = max(int(stride), MAX_STRIDE)
    fitted = round_up(imgsz, stride, floor)
    if fitted != int(imgsz):
        if int(imgsz) % stride:
            warn(f"{key}={imgsz} is not a multiple of {stride}, the model's largest stride: using {key}={fitted}")
        else:
            warn(f"{key}={imgsz} is below {floor}, twice the model's largest stride: using {key}={fitted}")
    return fitted


def round_up(imgsz: int, stride: int, floor: int = 0) -> int:
    """``imgsz`` rounded up to a multiple of ``stride`` and to at least ``floor`` (no warning: see `fit_to_stride`)."""
    return max(-(-int(imgsz) // int(stride)) * int(stride), int(floor))


#: How a run records a size it rounded up, in `sources.data.imgsz` (`rounding_note`, read back by `rounding_of`).
_NOTE = "{typed} rounded up to a multiple of {stride}, at least {floor}"
_NOTE_RE = re.compile(_NOTE.format(typed=r"(\d+)", stride=r"(\d+)", floor=r"(\d+)"))


def rounding_note(typed: int, stride: int, floor: int) -> str:
    """The record of a size `round_up` changed: `100 rounded up to a multiple of 32, at least 64`."""
    return _NOTE.format(typed=typed, stride=stride, floor=floor)


def rounding_of(source: str) -> tuple[int, int] | None:
    """(stride, floor) of the `rounding_note` in `source` (a recorded source: `command line: 100 rounded up ...`);
    None when it holds none."""
    m = _NOTE_RE.search(source)
    return (int(m[2]), int(m[3])) if m else None
