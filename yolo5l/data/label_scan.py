"""The label scan of a split: every image and label file checked once, through a cache, with a bad-input report.

:func:`scan_labels` runs :func:`~yolo5l.data.label_check.verify_image_label` over a split's images (the
bad-input policy is in :mod:`yolo5l.data.label_check`), keeps the usable images in a :class:`LabelIndex`,
counts what it found in a :class:`ScanReport`, and stores both in a label cache rebuilt when any file changes.

Reference: ultralytics/yolov5 v7.0 ``utils/dataloaders.py::LoadImagesAndLabels.cache_labels``, re-written from
its behaviour.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from yolo5l.base.files import atomic_open, atomic_write, file_lock, user_cache_dir
from yolo5l.data.label_check import CORRUPT, EMPTY, MISSING, OK, Verified, empty_labels, verify_image_label
from yolo5l.data.layout import IMAGES_DIR, LABEL_SUFFIX, DatasetError, dir_writable, img2label_path, probe_write

__all__ = ["CACHE_VERSION", "MAX_SCAN_THREADS", "SHOWN_SKIPPED", "LabelIndex", "ScanReport", "scan_labels"]

# Bump when the cache layout or the verification rules change: old caches are then rebuilt.
CACHE_VERSION = "yolo5l-labels-2"
MAX_SCAN_THREADS = 8  # default verification threads: min(MAX_SCAN_THREADS, CPU cores)
_SCAN_CHUNK = 64  # images per task handed to a verification thread
SHOWN_SKIPPED = 3  # corrupt images named on the console under the scan's warning; the log names them all

_log = logging.getLogger(__name__)


@dataclass
class ScanReport:
    """Counts and per-file messages of a label scan.

    Attributes:
        total: Images given to the scan.
        found: Kept images with at least one box.
        missing: Kept images without a label file (backgrounds).
        empty: Kept images with an empty label file (backgrounds).
        corrupt: Images skipped (unreadable, too small, bad labels, ...).
        duplicates: Duplicate label rows removed.
        repaired: Images whose labels were repaired (clipped values, polygons, zero-size boxes dropped).
        converted: Kept images that are not 8-bit RGB/BGR (converted at read time).
        messages: One line per notable file, starting with the file to fix (see :mod:`yolo5l.data.label_check`):
            the ``corrupt`` skipped images' lines first (one each), then the others, in the images' order.
        log_path: The log file the messages were written to.
        from_cache: Whether this scan was read from the cache.
    """

    total: int = 0
    found: int = 0
    missing: int = 0
    empty: int = 0
    corrupt: int = 0
    duplicates: int = 0
    repaired: int = 0
    converted: int = 0
    messages: list[str] = field(default_factory=list)
    log_path: Path | None = None
    from_cache: bool = False

    @property
    def backgrounds(self) -> int:
        """Kept images without boxes (missing + empty label files)."""
        return self.missing + self.empty

    @property
    def kept(self) -> int:
        """Images kept in the index."""
        return self.found + self.missing + self.empty

    @property
    def skipped(self) -> list[str]:
        """The line of each skipped (corrupt) image."""
        return self.messages[: self.corrupt]

    def counts(self) -> dict[str, int]:
        """The integer counts (every ``int`` field), as stored in the cache."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}

    def summary(self, split: str = "train") -> str:
        """One line, e.g. ``train: 512 images, 12 backgrounds (1 empty label file, 11 without a label file),
        3 corrupt skipped (see labels.cache.log)``."""
        parts = [_count(self.kept, "image", "images"), _count(self.backgrounds, "background", "backgrounds")]
        kinds = [_count(self.empty, "empty label file", "empty label files")] if self.empty else []
        kinds += [f"{self.missing} without a label file"] if self.missing else []
        if kinds:
            parts[-1] += f" ({', '.join(kinds)})"
        if self.corrupt:
            parts.append(f"{self.corrupt} corrupt skipped")
        if self.duplicates:
            parts.append(f"{_count(self.duplicates, 'duplicate row', 'duplicate rows')} removed")
        if self.repaired:
            parts.append(f"{_count(self.repaired, 'label', 'labels')} repaired")
        if self.converted:
            parts.append(f"{self.converted} converted to 8-bit RGB")
        line = f"{split}: " + ", ".join(parts)
        if self.messages and self.log_path is not None:
            line += f" (see {self.log_path})"
        if self.from_cache:
            line += " [cached]"
        return line

    def warning(self, split: str = "train") -> str:
        """The summary and, under it, the first :data:`SHOWN_SKIPPED` skipped images' lines (the log has them all)."""
        shown = [f"  {m}" for m in self.skipped[:SHOWN_SKIPPED]]
        if (more := len(self.skipped) - len(shown)) > 0:
            shown.append(f"  ... and {more} more" + (f" in {self.log_path}" if self.log_path is not None else ""))
        return "\n".join([self.summary(split), *shown])


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


@dataclass
class LabelIndex:
    """The kept images of a split with their labels and shapes.

    Attributes:
        im_files: Image paths (str).
        labels: Per image a (n, 5) float32 array ``[cls, cx, cy, w, h]``, normalised.
        shapes: (N, 2) int64 ``[h, w]`` after EXIF orientation.
        report: What the scan found.
    """

    im_files: list[str]
    labels: list[np.ndarray]
    shapes: np.ndarray
    report: ScanReport

    def __len__(self) -> int:
        return len(self.im_files)

    def require_labels(self, split: str = "train") -> LabelIndex:
        """This index, unless not one of its images has a label file: training on it would learn nothing (v7.0:
        "No labels found ..., can not start training"). Some images without one are backgrounds, and fine.

        Raises:
            DatasetError: Naming the labels folder v7.0's images -> labels rule gives for the first image.
        """
        r = self.report
        if not self.im_files or r.missing < r.kept:
            return self
        im = self.im_files[0]
        lb = Path(img2label_path(im))
        beside = f"{os.sep}{IMAGES_DIR}{os.sep}" not in im
        rule = f", beside the images: their path has no '{IMAGES_DIR}' folder" if beside else ""
        images = "its only image" if r.kept == 1 else f"any of its {r.kept} images"
        raise DatasetError(
            f"{split}: no label file for {images}, and training needs labels: looked for them in {lb.parent}{os.sep} "
            f"(e.g. {lb.name} for {Path(im).name}){rule}. Put one <image stem>{LABEL_SUFFIX} per "
            f"image there, in YOLO format (a 'class cx cy w h' line per object, normalised to [0, 1]); an image "
            f"without objects gets an empty file or none."
        )


# --------------------------------------------------------------------------------------------- the cache file
def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    except OSError:
        return -1, -1


def _files_hash(im_files: Sequence[str], num_classes: int) -> str:
    """md5 of the cache version, class count, and every image and label path with its size and mtime."""
    h = hashlib.md5(f"{CACHE_VERSION}|{num_classes}".encode())
    for f in im_files:
        lb = img2label_path(f)
        h.update(f"|{f}|{_stat(f)}|{_stat(lb)}".encode())
    return h.hexdigest()


def _fallback_cache_path(cache_path: Path) -> Path:
    """Where the cache goes when ``cache_path``'s folder is read-only: the user cache, keyed by the full path."""
    key = hashlib.md5(str(cache_path.resolve()).encode()).hexdigest()[:12]
    return user_cache_dir("labels") / f"{cache_path.stem}-{key}{cache_path.suffix}"


def _log_path(cache_path: Path) -> Path:
    """Where the per-file messages of a scan go: the user cache (``<stem>-<key>.cache.log``), not beside the
    user's labels, where v7.0 writes nothing but the cache itself."""
    fallback = _fallback_cache_path(cache_path)
    return fallback.with_name(fallback.name + ".log")


def _load_cache(path: Path, expect_hash: str) -> LabelIndex | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("version") != CACHE_VERSION or meta.get("hash") != expect_hash:
                return None
            counts = z["counts"]
            flat = z["labels"]
            labels = np.split(flat, np.cumsum(counts)[:-1]) if len(counts) else []
            report = ScanReport(**meta["report"], messages=[str(m) for m in z["messages"]], from_cache=True)
            return LabelIndex([str(f) for f in z["im_files"]], list(labels), z["shapes"].astype(np.int64), report)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None  # absent, partial or from another version: rebuild


def _save_cache(path: Path, index: LabelIndex, files_hash: str) -> None:
    """Write the cache atomically (`yolo5l.base.files.atomic_open`)."""
    r = index.report
    meta = {"version": CACHE_VERSION, "hash": files_hash, "report": r.counts()}
    counts = np.array([len(lb) for lb in index.labels], dtype=np.int64)
    flat = np.concatenate(index.labels, 0) if index.labels else empty_labels()
    with atomic_open(path) as f:
        np.savez(
            f,
            meta=np.array(json.dumps(meta)),
            im_files=np.array(index.im_files, dtype=str),
            counts=counts,
            labels=flat.astype(np.float32),
            shapes=index.shapes.astype(np.int64),
            messages=np.array(r.messages, dtype=str),
        )


def _save_cache_or_warn(path: Path, index: LabelIndex, files_hash: str, split: str) -> None:
    """`_save_cache`, or a warning when the disk refuses it (full, over quota, file-size limit): the scan is in
    memory and training goes on; the next run scans again."""
    try:
        _save_cache(path, index, files_hash)
    except OSError as e:
        reason = e.strerror or e
        _log.warning("%s: label cache %s not written (%s): the labels are scanned again next time", split, path, reason)


@contextlib.contextmanager
def _scan_lock(cache_path: Path, split: str) -> Iterator[None]:
    """An exclusive lock (`yolo5l.base.files.file_lock`) so that one process per machine builds a cache
    while the others (DDP ranks, sweep jobs) wait and then read it. The lock file lives in the user cache and is
    removed by its holder; without a writable user cache (or flock) there is no lock, and the atomic cache write
    keeps concurrent builders correct."""
    folder = user_cache_dir("locks")
    try:
        probe_write(folder)
    except OSError:
        yield
        return
    key = hashlib.md5(str(cache_path.absolute()).encode()).hexdigest()[:16]
    with file_lock(folder / f"labels-{key}.lock", f"{split}: the label scan into {cache_path}"):
        yield


def _write_log(log_path: Path, report: ScanReport, split: str) -> Path | None:
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write(log_path, report.summary(split) + "\n" + "".join(m + "\n" for m in report.messages))
    except OSError:
        return None


# --------------------------------------------------------------------------------------------- the scan
def _default_workers() -> int:
    return max(1, min(MAX_SCAN_THREADS, os.cpu_count() or 1))


def _build(im_files: Sequence[str], num_classes: int, workers: int) -> LabelIndex:
    report = ScanReport(total=len(im_files))
    skipped: list[str] = []
    kept_files: list[str] = []
    labels: list[np.ndarray] = []
    shapes: list[tuple[int, int]] = []
    results: Iterable[Verified]
    if workers > 1 and len(im_files) > 1:
        # Threads rather than processes: PIL header reads and file I/O release the GIL, and threads need no
        # process start-up and no pickling of the results.
        pool = ThreadPoolExecutor(workers)
        results = pool.map(verify_image_label, im_files, [num_classes] * len(im_files), chunksize=_SCAN_CHUNK)
    else:
        pool = None
        results = (verify_image_label(f, num_classes) for f in im_files)
    try:
        for v in results:
            if v.kind == CORRUPT:
                skipped.extend(v.messages)  # one line
                report.corrupt += 1
                continue
            report.messages.extend(v.messages)
            report.found += v.kind == OK
            report.missing += v.kind == MISSING
            report.empty += v.kind == EMPTY
            report.duplicates += v.duplicates
            report.repaired += v.repaired
            report.converted += v.converted
            if v.converted:
                report.messages.append(f"{v.im_file}: not 8-bit RGB, converted at read time")
            kept_files.append(v.im_file)
            labels.append(v.labels)
            shapes.append(v.shape)
    finally:
        if pool is not None:
            pool.shutdown()
    report.messages = skipped + report.messages  # both in the images' order
    shape_arr = np.asarray(shapes, dtype=np.int64).reshape(-1, 2)
    return LabelIndex(kept_files, labels, shape_arr, report)


def scan_labels(
    image_files: Sequence[str | os.PathLike],
    num_classes: int,
    cache_path: str | os.PathLike,
    split: str = "train",
    workers: int | None = None,
) -> LabelIndex:
    """Verify a split's images and labels, through a cache rebuilt when any file changes.

    The cache is rebuilt when the hash of the image and label paths, sizes and mtimes, the class count, or
    :data:`CACHE_VERSION` differ. It is written atomically into ``cache_path``'s folder, or, if that folder
    is read-only, into :func:`~yolo5l.base.files.user_cache_dir` ``("labels")``. A lock in the user cache
    lets one process per machine build it while concurrent callers (DDP ranks, sweep jobs) wait and then read
    it. The per-file messages go to a ``.cache.log`` in the user cache (``report.log_path``); nothing but the
    cache is written beside the labels. The bad-input policy is in :mod:`yolo5l.data.label_check`.

    Args:
        image_files: The split's image files.
        num_classes: Number of classes; class ids outside [0, num_classes) make an image corrupt.
        cache_path: Preferred cache file (see :func:`~yolo5l.data.layout.label_cache_path`).
        split: Split name, for messages.
        workers: Verification threads; default min(:data:`MAX_SCAN_THREADS`, CPU cores).

    Returns:
        The :class:`LabelIndex` of the kept images.

    Raises:
        DatasetError: No images were given, or none survived the checks.
    """
    cache_path = Path(cache_path)
    im_files = [os.fspath(f) for f in image_files]
    if not im_files:
        raise DatasetError(f"{split}: no images to scan (label cache {cache_path}); check the dataset yaml's {split}.")
    files_hash = _files_hash(im_files, num_classes)
    fallback = _fallback_cache_path(cache_path)
    index = None
    for candidate in (cache_path, fallback):
        index = _load_cache(candidate, files_hash)
        if index is not None:
            target = candidate
            break
    if index is None:
        target = cache_path if dir_writable(cache_path.parent) else fallback
        with contextlib.suppress(OSError):  # a full disk: the cache is not written (a warning says so)
            target.parent.mkdir(parents=True, exist_ok=True)
        with _scan_lock(target, split):
            index = _load_cache(target, files_hash)  # another process may have built it while we waited
            if index is None:
                t0 = time.perf_counter()
                index = _build(im_files, num_classes, workers or _default_workers())
                _save_cache_or_warn(target, index, files_hash, split)
                with contextlib.suppress(OSError):  # the last scan's messages, if any, no longer apply
                    _log_path(cache_path).unlink()
                took = time.perf_counter() - t0
                _log.info("%s: scanned %s in %.2f s", split, _count(len(im_files), "image", "images"), took)
    log_path = _log_path(cache_path)
    if index.report.messages and not log_path.exists():
        _write_log(log_path, index.report, split)
    index.report.log_path = log_path if index.report.messages and log_path.exists() else None
    if not index.im_files:
        n = index.report.total
        raise DatasetError(
            f"{split}: {'the only image is' if n == 1 else f'all {n} images are'} corrupt (first: "
            f"{index.report.messages[0]}); see {log_path} for every file."
        )
    if index.report.corrupt or index.report.duplicates or index.report.repaired:
        _log.warning(index.report.warning(split))
    else:  # the data module prints the summary line with the image cache's
        _log.debug(index.report.summary(split))
    return index
