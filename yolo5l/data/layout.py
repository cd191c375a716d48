"""Where dataset files live: image suffixes, the label file of an image, and the label cache.

The layout is ultralytics' YOLO format: images under an ``images`` folder, one ``.txt`` label file per image
under the matching ``labels`` folder (the last ``/images/`` replaced by ``/labels/``), one row per box
``class cx cy w h`` normalised to [0, 1].

Also :class:`DatasetError`, the error every data module raises for a dataset that cannot be used.

This module imports only the standard library, so that the CLIs can list images without loading OpenCV.

Reference: ultralytics/yolov5 v7.0 ``utils/dataloaders.py`` (``IMG_FORMATS``, ``img2label_paths``, the label
cache path of ``LoadImagesAndLabels``), re-written from their behaviour.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from yolo5l.base.errors import UserError

__all__ = [
    "CACHE_SUFFIX",
    "DATA_YAML",
    "IMAGES_DIR",
    "IMG_FORMATS",
    "LABELS_DIR",
    "LABEL_SUFFIX",
    "LIST_SUFFIX",
    "PIL_FORMATS",
    "DatasetError",
    "dir_writable",
    "format_labels",
    "img2label_path",
    "is_image_file",
    "label_cache_path",
    "probe_write",
]

# The image file suffixes (lower case, without the dot) every part of yolo5l accepts as images.
IMG_FORMATS = ("bmp", "dng", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp", "pfm")
# PIL format names those suffixes may decode as (a .jpg that is really a GIF is rejected by the label scan).
PIL_FORMATS = frozenset({"BMP", "DNG", "JPEG", "MPO", "PNG", "TIFF", "WEBP", "PFM"})

IMAGES_DIR, LABELS_DIR = "images", "labels"
DATA_YAML = "data.yaml"  # the dataset yaml that coco2yolo and the synthetic dataset write
LABEL_SUFFIX = ".txt"  # a label file
LIST_SUFFIX = ".txt"  # a list of image files (a split given as ``train2017.txt``)
CACHE_SUFFIX = ".cache"


class DatasetError(UserError, ValueError):
    """A dataset file, folder or label set that cannot be used; the message names the file and the fix."""


def is_image_file(path: str | os.PathLike) -> bool:
    """Whether ``path``'s suffix is one of :data:`IMG_FORMATS` (case-insensitive); the file itself is not read."""
    return Path(path).suffix[1:].lower() in IMG_FORMATS


def img2label_path(p: str | os.PathLike) -> str:
    """The label file of an image: the last ``/images/`` becomes ``/labels/`` and the suffix ``.txt``.

    Example: ``datasets/coco/images/train2017/1.jpg`` -> ``datasets/coco/labels/train2017/1.txt``.
    """
    s = os.fspath(p)
    sa, sb = f"{os.sep}{IMAGES_DIR}{os.sep}", f"{os.sep}{LABELS_DIR}{os.sep}"
    if sa in s:
        head, _, tail = s.rpartition(sa)
        s = head + sb + tail
    return os.path.splitext(s)[0] + LABEL_SUFFIX


def format_labels(rows: Iterable[Sequence[float]]) -> str:
    """The text of a label file: one ``class cx cy w h`` line per ``[cls, cx, cy, w, h]`` row (6 decimals)."""
    return "".join(f"{int(c)} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}\n" for c, cx, cy, w, h in rows)


def label_cache_path(image_files: Sequence[str | Path], sources: Sequence[Path] = ()) -> Path:
    """The label cache file of a split, as ultralytics places it.

    A split given by one ``.txt`` list caches to ``<list>.cache`` (``datasets/coco/train2017.cache``);
    otherwise the cache sits beside the labels folder of the first image (``labels/train.cache``).

    Args:
        image_files: The split's image files (at least one).
        sources: The folders / lists the files came from, if known.

    Returns:
        The cache file path (its folder may be read-only: the label scan then falls back to
        :func:`yolo5l.base.files.user_cache_dir`).
    """
    if len(sources) == 1 and Path(sources[0]).suffix == LIST_SUFFIX:
        return Path(sources[0]).with_suffix(CACHE_SUFFIX)
    if not image_files:
        raise DatasetError("label_cache_path: the split has no image files")
    return Path(img2label_path(image_files[0])).parent.with_suffix(CACHE_SUFFIX)


def probe_write(folder: Path) -> None:
    """Raise OSError unless a file can be created in ``folder`` (created if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass


def dir_writable(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (created if missing); see :func:`probe_write`."""
    try:
        probe_write(folder)
        return True
    except OSError:
        return False
