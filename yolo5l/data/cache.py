"""The image cache: resized uint8 images held in RAM or as ``.npy`` files on disk.

Both caches store the image already resized so that its long side equals ``imgsz`` (what every epoch needs; the
size is :func:`~yolo5l.data.letterbox.resized_shape`'s, v7.0's truncated sides), so a cache hit skips both the JPEG
decode and the resize. The bytes needed are known exactly from the label scan's shapes, so the up-front fit check
needs no sampling.

With ``reduced_decode`` (the default), a JPEG at least twice ``imgsz`` on its long side is decoded at 1/2, 1/4 or
1/8 scale (:func:`~yolo5l.data.images.read_image_reduced`) and then resized to the same shape as a full decode
would give, so labels (normalised) and the shape checks below hold either way.

- ``ram``: filled by a thread pool for the given indices (under DDP, the rank's shard only). Falls back to no
  cache, with a message, when ``need * HEADROOM > available`` (psutil's available memory).
- ``disk``: ``.npy`` files in ``cache_dir`` (default: a ``<images dir>.npycache/s<imgsz>_<interp>[_r]`` folder
  beside the images, ``_r`` for reduced decoding, so the pixels of the two decodes never mix; when that is
  read-only, ``<user cache>/npy/<hash>``, see :func:`~yolo5l.base.files.user_cache_dir`). A file that is
  unreadable, of the wrong shape or dtype, or older than its image is rebuilt. In a folder the pixels are a
  function of the image and its resized shape, so the shape check also keeps out a file written under another size
  rule: it is rebuilt unless both rules give the image the same size, and then its pixels are the same. Falls back
  to no cache when the free space is short (same ``HEADROOM``). Files are read as read-only memory maps: every
  dataloader worker and every DDP rank of a node then shares the page cache's one copy of an image instead of
  holding its own.

Reference: YOLOv5 v7.0 ``check_cache_ram`` / ``cache_images`` (behaviour); YOLOX ``CacheDataset``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
import psutil

from yolo5l.base.files import atomic_open, user_cache_dir
from yolo5l.data.images import dct_scale, read_image, read_image_reduced
from yolo5l.data.layout import dir_writable, probe_write
from yolo5l.data.letterbox import resize_long_side, resized_shape

log = logging.getLogger(__name__)

CACHE_MODES = ("none", "ram", "disk", "device")  # data.cache; "device" is yolo5l.data.device_input.DeviceCache
HOST_CACHE_MODES = CACHE_MODES[:3]  # what ImageCache holds
HEADROOM = 1.1  # YOLOv5's safety factor on the memory or disk space estimate
MAX_FILL_THREADS = 8  # default fill threads: min(MAX_FILL_THREADS, CPU cores)
_NPY_HEADER_BYTES = 128  # upper bound of one .npy file's header
_GB = 1e9


def _load_resized(path: str, imgsz: int, augment: bool, reduced: bool = True, top: float = 1.0) -> np.ndarray:
    """Image ``path`` resized to long side ``imgsz`` (see :func:`~yolo5l.data.augment.resize_long_side`), decoded
    at reduced scale when ``reduced`` and the image allows it.

    ``top`` (< 1 counts in training only, where the resize is bilinear): the consumer reads only that fraction of
    the rows, from the top. The result may then end after row ``ceil(top * h)`` of the ``h`` rows of the whole
    result, identical to those rows of it: the decode stops early, at reduced scale or at full size (see
    :func:`~yolo5l.data.images.read_image_reduced`).
    """
    if not reduced:
        return resize_long_side(read_image(path), imgsz, augment)
    img, (h0, w0) = read_image_reduced(path, imgsz, top if augment else 1.0)
    if img.shape[:2] == (h0, w0):  # decoded whole at full size
        return resize_long_side(img, imgsz, augment)
    # Decoded at 1/f: ceil(h0 / f) x ceil(w0 / f), long side >= imgsz when f > 1, so this only shrinks. Resizing to
    # the shape of the full image (not of the reduced one) keeps the result's shape exactly that of a full decode;
    # when f does not divide a side, the partial last block stretches the image by under one output pixel at that
    # edge. f = 1 here is a full-size decode cut by ``top``, resized as resize_long_side would (bilinear).
    h, w = resized_shape(h0, w0, imgsz)
    interp = cv2.INTER_LINEAR if augment else cv2.INTER_AREA
    f = dct_scale(h0, w0, imgsz)
    hf, wf = -(-h0 // f), -(-w0 // f)
    if img.shape[0] < hf:  # the top rows only: resized at the whole image's scales, so its rows are the same
        out = img if (h, w) == (hf, wf) else cv2.resize(img, None, fx=w / wf, fy=h / hf, interpolation=interp)
        return out[: min(h, math.ceil(top * h))]  # the rows after these read past the decoded ones
    return cv2.resize(img, (w, h), interpolation=interp)


class ImageCache:
    """Loads the resized image of index ``i``, through a RAM or disk cache.

    Args:
        im_files: Image paths.
        shapes: (n, 2) original [h, w] (EXIF applied), from the label scan.
        imgsz: Long side after resizing.
        mode: "none", "ram" or "disk".
        augment: Whether the images feed augmentation (INTER_LINEAR) or not (INTER_AREA when shrinking).
        cache_dir: Disk cache folder; default beside the images (see the module docstring).
        num_threads: Threads that fill the cache; default min(:data:`MAX_FILL_THREADS`, CPU cores).
        prefix: Prefix of the messages (e.g. "train: ").
        reduced_decode: Decode large JPEGs at reduced scale (see the module docstring).
    """

    def __init__(
        self,
        im_files: Sequence[str],
        shapes: np.ndarray,
        imgsz: int,
        mode: str = "none",
        augment: bool = True,
        cache_dir: str | os.PathLike | None = None,
        num_threads: int | None = None,
        prefix: str = "",
        reduced_decode: bool = True,
    ) -> None:
        if mode not in HOST_CACHE_MODES:
            raise ValueError(f"data.cache of a host image cache must be one of {HOST_CACHE_MODES}, got {mode!r}")
        self.im_files = list(im_files)
        self.shapes = np.asarray(shapes)
        self._resized: list[tuple[int, int]] | None = None
        self.imgsz = int(imgsz)
        self.augment = augment
        self.reduced_decode = reduced_decode
        self.requested = mode
        self.mode = mode
        self.num_threads = num_threads or min(MAX_FILL_THREADS, os.cpu_count() or 1)
        self.prefix = prefix
        self.ram: list[np.ndarray | None] = [None] * len(self.im_files)
        self.messages: list[str] = []
        self.folder: Path | None = None
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._disk_warned = False  # a .npy write failed: no more are tried (see _write_npy)

    # ----------------------------------------------------------------------------------------- helpers
    @property
    def _interp(self) -> str:
        return "linear" if self.augment else "area"

    def resized_hw(self, i: int) -> tuple[int, int]:
        """(h, w) of image ``i`` once resized."""
        if self._resized is None:  # every image's, once: a sample asks for 4 to 8 of them
            self._resized = [resized_shape(int(h0), int(w0), self.imgsz) for h0, w0 in self.shapes.tolist()]
        return self._resized[i]

    def nbytes(self, indices: Sequence[int]) -> int:
        """Bytes of the resized uint8 RGB images at ``indices``."""
        hw = np.array([self.resized_hw(i) for i in indices], dtype=np.int64).reshape(-1, 2)
        return int((hw[:, 0] * hw[:, 1] * 3).sum())

    def _say(self, msg: str) -> None:
        self.messages.append(msg)
        log.warning(msg)

    def npy_path(self, i: int) -> Path:
        """The ``.npy`` file of image ``i`` (disk mode; after :meth:`fill` chose the folder)."""
        assert self.folder is not None
        rel = os.path.relpath(self.im_files[i], self._image_root)
        return (self.folder / rel).with_suffix(".npy")

    def _choose_folder(self) -> Path:
        self._image_root = Path(os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in self.im_files]))
        tag = f"s{self.imgsz}_{self._interp}" + ("_r" if self.reduced_decode else "")
        preferred = (
            (self._cache_dir / tag)
            if self._cache_dir
            else self._image_root.with_name(self._image_root.name + ".npycache") / tag
        )
        if dir_writable(preferred):
            return preferred
        key = hashlib.sha1(f"{self._image_root.resolve()}|{tag}".encode()).hexdigest()[:16]
        fallback = user_cache_dir("npy") / key
        self._say(f"{self.prefix}disk cache folder {preferred} is not writable; using {fallback} instead.")
        probe_write(fallback)
        return fallback

    # ----------------------------------------------------------------------------------------- fill
    def fill(self, indices: Sequence[int] | None = None) -> str:
        """Fill the cache for ``indices`` (default all), after checking that it fits.

        Returns:
            One summary line, e.g. ``train: cached 128 images (0.12 GB) in RAM``.
        """
        indices = list(range(len(self.im_files))) if indices is None else list(indices)
        if self.mode == "none" or not indices:
            return f"{self.prefix}no image cache"
        need = self.nbytes(indices)
        gb = need / _GB
        if self.mode == "ram":
            avail = psutil.virtual_memory().available
            if need * HEADROOM > avail:
                self._say(
                    f"{self.prefix}RAM cache disabled: {len(indices)} images need {gb:.2f} GB (x{HEADROOM} headroom) "
                    f"but only {avail / _GB:.2f} GB is available; set data.cache=disk or free memory."
                )
                self.mode = "none"
                return self.messages[-1]
            self._run(self._fill_ram, indices)
            return f"{self.prefix}cached {len(indices)} images ({gb:.2f} GB) in RAM"
        # disk
        try:
            self.folder = self._choose_folder()
        except OSError as e:
            self._say(f"{self.prefix}disk cache disabled: no writable cache folder ({e}); set data.cache_dir.")
            self.mode = "none"
            return self.messages[-1]
        missing = [i for i in indices if not self._npy_valid(i)]
        need_missing = self.nbytes(missing) + _NPY_HEADER_BYTES * len(missing)
        free = shutil.disk_usage(self.folder).free
        if need_missing * HEADROOM > free:
            self._say(
                f"{self.prefix}disk cache disabled: {len(missing)} .npy files need {need_missing / _GB:.2f} GB "
                f"but {self.folder} has {free / _GB:.2f} GB free; set data.cache_dir elsewhere or data.cache=none."
            )
            self.mode = "none"
            return self.messages[-1]
        self._run(self._fill_disk, missing)
        if self._disk_warned:  # the disk filled up (or the folder failed) part-way: the rest is read from the images
            return (
                f"{self.prefix}disk cache {self.folder}: partly written ({self.messages[-1].removeprefix(self.prefix)})"
            )
        return (
            f"{self.prefix}disk cache {self.folder}: {len(indices)} images ({gb:.2f} GB), "
            f"{len(missing)} written, {len(indices) - len(missing)} reused"
        )

    def _run(self, fn: Callable[[int], None], indices: list[int]) -> None:
        if self.num_threads <= 1 or len(indices) < 2:
            for i in indices:
                fn(i)
            return
        with ThreadPoolExecutor(self.num_threads) as pool:
            list(pool.map(fn, indices))

    def _decode(self, i: int, rows: int | None = None) -> np.ndarray:
        top = 1.0 if rows is None else rows / self.resized_hw(i)[0]
        return _load_resized(self.im_files[i], self.imgsz, self.augment, self.reduced_decode, top)

    def _fill_ram(self, i: int) -> None:
        self.ram[i] = self._decode(i)

    def _npy_valid(self, i: int) -> bool:
        """Whether image ``i``'s .npy exists, is newer than the image, and holds the right shape and dtype."""
        p = self.npy_path(i)
        try:
            if p.stat().st_mtime < os.stat(self.im_files[i]).st_mtime:
                return False
            arr = np.load(p, mmap_mode="r")  # header only
        except (OSError, ValueError, EOFError):
            return False
        return arr.dtype == np.uint8 and arr.shape == (*self.resized_hw(i), 3)

    def _fill_disk(self, i: int) -> None:
        if not self._disk_warned:  # after a failed write (a full disk) the remaining images are not even decoded
            self._write_npy(i)

    def _write_npy(self, i: int) -> np.ndarray:
        img = self._decode(i)
        if self._disk_warned:
            # A write already failed (full disk, quota, file-size limit): a full disk stays full for this run, and
            # trying again would create and delete a temporary file for every image of every step.
            return img
        p = self.npy_path(i)
        try:
            with atomic_open(p) as f:  # a reader never sees half a file
                np.save(f, img)
            t_img = os.stat(self.im_files[i]).st_mtime
            if p.stat().st_mtime < t_img:  # image stamped in the future (clock skew): never look stale again
                os.utime(p, (t_img, t_img))
        except OSError as e:
            if not self._disk_warned:
                self._disk_warned = True
                try:  # numpy's short write loses the errno: the free space tells a full disk apart
                    free = f"; {shutil.disk_usage(p.parent).free / _GB:.2f} GB free there"
                except OSError:
                    free = ""
                self._say(
                    f"{self.prefix}could not write {p} ({e.strerror or e}{free}); no more .npy files are written, "
                    "images without one are read directly."
                )
        return img

    # ----------------------------------------------------------------------------------------- load
    def load(self, i: int, rows: int | None = None) -> np.ndarray:
        """The resized RGB uint8 HWC image ``i`` (from RAM, from its .npy, or decoded); never to be modified.

        ``rows``: only that many rows from the top are read. Without a cache, the image may then end after them
        (and the decode stops early, see :func:`_load_resized`); from a cache it comes whole.

        In disk mode the image is a read-only ``np.memmap`` of its .npy file: the pages are read on first access
        and shared through the page cache. The files are only ever replaced whole (see :meth:`_write_npy`), so a
        mapping stays valid while the array lives.
        """
        if self.mode == "ram":
            img = self.ram[i]
            if img is not None:
                return img
        elif self.mode == "disk":
            p = self.npy_path(i)
            try:
                img = np.load(p, mmap_mode="r")
                if img.dtype == np.uint8 and img.shape == (*self.resized_hw(i), 3):
                    return img
            except (OSError, ValueError, EOFError):  # a truncated file's mapping fails here (ValueError)
                pass
            return self._write_npy(i)  # corrupt or removed since fill(): rebuild it
        return self._decode(i, rows)
