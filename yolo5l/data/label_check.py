"""Checking one image and its label file: the bad-input policy of the label scan.

:func:`verify_image_label` never raises: every problem becomes a kind and a message, which the scan
(:mod:`yolo5l.data.label_scan`) counts in its report and writes, except for backgrounds, to ``<cache>.log``.

- unreadable, zero-byte, truncated or non-image files, images with a side under :data:`MIN_IMAGE_SIDE` px,
  suffixes outside :data:`~yolo5l.data.layout.IMG_FORMATS`: the image is skipped as corrupt. A JPEG missing
  its end marker is decoded in full: if that succeeds it is kept with a warning, otherwise it is skipped (the
  file is never re-saved in place, unlike ultralytics, so read-only datasets work and nothing is silently
  recompressed).
- grayscale, RGBA, palette and 16-bit images are accepted and converted to 8-bit RGB by
  :func:`~yolo5l.data.images.read_image`.
- EXIF orientation is applied to the recorded shape (and by ``read_image`` to the pixels).
- label rows: :data:`LABEL_COLS` values are a box; :data:`MIN_POLYGON_VALUES` or more with an even number of
  coordinates are a polygon, converted to its enclosing box; any other count, a non-numeric value, a
  non-integer or out-of-range class id, or a value outside [0, 1] by more than :data:`COORD_TOL` makes the
  image corrupt (dropping one row would teach the model that the object is background). Values outside [0, 1]
  by at most ``COORD_TOL`` are clipped (a repair), boxes of zero width or height are dropped with a warning,
  duplicate rows are removed with a warning.
- a missing label file makes the image a background; an empty one likewise (counted apart).

Every message is a whole line that starts with the file to fix: ``<image>: corrupt, skipped: <why>`` for an image,
``<label file> line <n>: <why>; image <image> skipped`` for a label file that makes its image corrupt, and
``<label file> line <n>: <what>`` for a repair.

Reference: ultralytics/yolov5 v7.0 ``utils/dataloaders.py::verify_image_label``, re-written from its behaviour;
this policy is stricter about reporting and never edits the user's files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from yolo5l.data.box_format import xyxy_to_xywhn
from yolo5l.data.images import JPEG_TRUNCATED, exif_hw, jpeg_end_damage
from yolo5l.data.layout import IMG_FORMATS, PIL_FORMATS, img2label_path

__all__ = [
    "COORD_TOL",
    "CORRUPT",
    "EMPTY",
    "LABEL_COLS",
    "MIN_IMAGE_SIDE",
    "MIN_POLYGON_VALUES",
    "MISSING",
    "OK",
    "Verified",
    "empty_labels",
    "verify_image_label",
]

MIN_IMAGE_SIDE = 10  # pixels; smaller images are skipped as corrupt (ultralytics: size > 9)
COORD_TOL = 1e-3  # label values this far outside [0, 1] are clipped; further out the image is corrupt
LABEL_COLS = 5  # a label row: class cx cy w h
MIN_POLYGON_VALUES = 1 + 2 * 3  # class and at least 3 points x y

# Kinds returned by verify_image_label.
OK, MISSING, EMPTY, CORRUPT = "ok", "missing", "empty", "corrupt"

_RGB_MODES = ("RGB", "YCbCr", "CMYK")  # PIL modes OpenCV decodes to 8-bit colour without a conversion
_SAVE_CONF_COLS = LABEL_COLS + 1  # a detect.py --save-conf output row: a label row plus a score


def empty_labels() -> np.ndarray:
    """A (0, 5) float32 label array."""
    return np.zeros((0, LABEL_COLS), np.float32)


@dataclass
class Verified:
    """What :func:`verify_image_label` found for one image.

    Attributes:
        kind: :data:`OK`, :data:`MISSING`, :data:`EMPTY` or :data:`CORRUPT`.
        im_file: The image path.
        labels: (n, 5) float32 ``[cls, cx, cy, w, h]``, normalised.
        shape: (h, w) after EXIF orientation; (0, 0) when corrupt.
        messages: What was repaired or wrong, one line each, starting with the file concerned.
        duplicates: Duplicate label rows removed.
        repaired: Whether the labels were repaired.
        converted: Whether the image is not 8-bit RGB (converted at read time).
    """

    kind: str
    im_file: str
    labels: np.ndarray
    shape: tuple[int, int]
    messages: list[str]
    duplicates: int = 0
    repaired: bool = False
    converted: bool = False


class _Corrupt(Exception):
    pass


class _BadLabel(_Corrupt):
    """A label file that makes its image corrupt: what is wrong, and at which line (None: the whole file)."""

    def __init__(self, line: int | None, what: str) -> None:
        super().__init__(what)
        self.line, self.what = line, what

    def message(self, lb_file: str, im_file: str) -> str:
        where = lb_file if self.line is None else f"{lb_file} line {self.line}"
        return f"{where}: {self.what}; image {im_file} skipped"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _class_problem(text: str, cls: float, num_classes: int) -> str | None:
    """Why ``cls`` (written ``text``) is no class id of a dataset of ``num_classes`` classes; None when it is one."""
    ids = "id 0" if num_classes == 1 else f"ids 0 to {num_classes - 1}"
    if cls != int(cls):
        return f"class {text} is not a whole number (class {ids})"
    if cls < 0:
        return f"class {text} is negative (class {ids})"
    if cls >= num_classes:
        named = _count(num_classes, "class", "classes")
        return f"class {text} is not below nc={num_classes} (the dataset yaml names {named}: {ids})"
    return None


def _too_small(h: int, w: int) -> None:
    if h < MIN_IMAGE_SIDE or w < MIN_IMAGE_SIDE:
        raise _Corrupt(f"image too small ({w}x{h} px, need at least {MIN_IMAGE_SIDE} px per side)")


def _check_image(im_file: str) -> tuple[tuple[int, int], bool, list[str]]:
    """Header checks of one image: (h, w) after EXIF, whether it needs conversion, warnings. Raises on corrupt."""
    warnings: list[str] = []
    suffix = Path(im_file).suffix[1:].lower()
    if suffix not in IMG_FORMATS:
        raise _Corrupt(f"unsupported format '.{suffix}' (allowed: {', '.join(IMG_FORMATS)})")
    try:
        size = os.path.getsize(im_file)
    except OSError as e:
        raise _Corrupt(f"cannot read image ({e.strerror or e})") from None
    if size == 0:
        raise _Corrupt("empty image file (0 bytes)")
    if suffix == "pfm":  # PIL reads only grayscale PFM: decode with OpenCV (PFM is rare and small)
        im = cv2.imread(im_file, cv2.IMREAD_UNCHANGED)
        if im is None:
            raise _Corrupt("unreadable PFM image")
        h, w = im.shape[:2]
        _too_small(h, w)
        return (h, w), True, warnings
    try:
        with Image.open(im_file) as im:
            im.verify()  # structure check without decoding the pixels
        with Image.open(im_file) as im:  # verify() leaves the image unusable: reopen for size and EXIF
            fmt, mode = im.format, im.mode
            h, w = exif_hw(im)
    except Exception as e:
        raise _Corrupt(f"unreadable image ({type(e).__name__}: {e})") from None
    if fmt not in PIL_FORMATS:
        raise _Corrupt(f"unsupported image format {fmt} (file named .{suffix})")
    _too_small(h, w)
    damage = jpeg_end_damage(im_file) if fmt in ("JPEG", "MPO") else None
    if damage == JPEG_TRUNCATED:
        raise _Corrupt(damage)
    if damage:  # extra bytes after the image: kept, as it decodes in full
        warnings.append(f"{damage}: kept")
    return (h, w), mode not in _RGB_MODES, warnings


def _parse_labels(lb_file: str, num_classes: int) -> tuple[np.ndarray, list[str], int, bool]:
    """Parse one label file. Returns (labels (n, 5), warnings, duplicates removed, repaired). Raises _BadLabel."""
    try:
        with open(lb_file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise _BadLabel(None, "not UTF-8 text") from None
    except OSError as e:
        raise _BadLabel(None, f"cannot be read ({e.strerror or e})") from None
    rows: list[list[float]] = []
    warnings: list[str] = []
    repaired = False
    for n, line in enumerate(text.splitlines(), 1):
        values = line.split()
        if not values:
            continue
        try:
            v = [float(x) for x in values]
        except ValueError:
            raise _BadLabel(n, f"non-numeric value in {line.strip()!r}") from None
        if not all(np.isfinite(v)):
            raise _BadLabel(n, f"non-finite value in {line.strip()!r}")
        cls = v[0]
        if (problem := _class_problem(values[0], cls, num_classes)) is not None:
            raise _BadLabel(n, problem)
        coords = np.asarray(v[1:], dtype=np.float64)
        is_polygon = len(v) >= MIN_POLYGON_VALUES and len(coords) % 2 == 0
        if len(v) != LABEL_COLS and not is_polygon:
            extra = " (a detect.py --save-conf output?)" if len(v) == _SAVE_CONF_COLS else ""
            raise _BadLabel(
                n, f"{len(v)} values, expected {LABEL_COLS} (cls cx cy w h) or {MIN_POLYGON_VALUES}+ "
                f"(cls x1 y1 x2 y2 ...){extra}",
            )  # fmt: skip
        bad = (coords < -COORD_TOL) | (coords > 1 + COORD_TOL)
        if bad.any():
            what = "negative value" if (coords < -COORD_TOL).any() else "value above 1"
            raise _BadLabel(n, f"{what} in {line.strip()!r} (coordinates must be normalised to [0, 1])")
        if ((coords < 0) | (coords > 1)).any():
            coords = coords.clip(0.0, 1.0)
            repaired = True
            warnings.append(f"{lb_file} line {n}: values within {COORD_TOL} outside [0, 1] clipped")
        if is_polygon:
            pts = coords.reshape(-1, 2)
            corners = np.concatenate((pts.min(0), pts.max(0)))[None]  # (1, 4) x1 y1 x2 y2, already normalised
            box = xyxy_to_xywhn(corners, 1.0, 1.0, clip=False)[0]
            repaired = True
            warnings.append(f"{lb_file} line {n}: polygon of {len(pts)} points converted to its box")
        else:
            box = coords
        if box[2] <= 0 or box[3] <= 0:
            repaired = True
            warnings.append(f"{lb_file} line {n}: zero-size box dropped")
            continue
        rows.append([cls, *box.tolist()])
    if not rows:
        return empty_labels(), warnings, 0, repaired
    lb = np.asarray(rows, dtype=np.float32)
    _, first = np.unique(lb, axis=0, return_index=True)
    duplicates = len(lb) - len(first)
    if duplicates:
        lb = lb[np.sort(first)]
        warnings.append(f"{lb_file}: {_count(duplicates, 'duplicate label row', 'duplicate label rows')} removed")
    return lb, warnings, duplicates, repaired


def verify_image_label(im_file: str, num_classes: int) -> Verified:
    """Check one image and its label file; never raises.

    Args:
        im_file: Image path; its label file is :func:`~yolo5l.data.layout.img2label_path` of it.
        num_classes: Class ids must lie in [0, num_classes).

    Returns:
        A record with the kind (``ok``/``missing``/``empty``/``corrupt``), labels, (h, w) and messages (whole
        lines, each naming its file; a corrupt image has exactly one).
    """
    lb_file = img2label_path(im_file)
    try:
        shape, converted, warnings = _check_image(im_file)
        msgs = [f"{im_file}: {w}" for w in warnings]
        if not os.path.isfile(lb_file):
            return Verified(MISSING, im_file, empty_labels(), shape, msgs, converted=converted)
        lb, lb_msgs, dups, repaired = _parse_labels(lb_file, num_classes)
        kind = OK if len(lb) else EMPTY
        return Verified(kind, im_file, lb, shape, msgs + lb_msgs, dups, repaired, converted)
    except _BadLabel as e:
        return Verified(CORRUPT, im_file, empty_labels(), (0, 0), [e.message(lb_file, im_file)])
    except _Corrupt as e:
        return Verified(CORRUPT, im_file, empty_labels(), (0, 0), [f"{im_file}: corrupt, skipped: {e}"])
    except Exception as e:  # anything unforeseen is still a per-file report, never a crash of the whole scan
        why = f"{type(e).__name__}: {e}"
        return Verified(CORRUPT, im_file, empty_labels(), (0, 0), [f"{im_file}: corrupt, skipped: {why}"])
