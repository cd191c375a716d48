"""Two runs started at once on the same dataset both succeed and leave valid caches: the synthetic dataset's generation,
the label cache and the disk image cache, each under two processes released together on a fresh dataset root.

Each test starts two spawned processes that wait on one barrier and then call the data function at the same moment
(slowed a little where the race window would otherwise be a few milliseconds), and checks afterwards: both exited 0,
the work was done once where a lock promises it, and what is on disk is complete and exactly what one process alone
writes, with no temporary files or locks left behind. The last test does the same with two real training runs.

Downloads have the same guarantee and their own test: tests/test_download.py::test_two_processes_transfer_once (two
processes fetch one URL at once from a loopback server; one transfer, both succeed, no .part or .lock file left).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from yolo5l.data import cache as cache_mod
from yolo5l.data import label_scan as scan_mod
from yolo5l.data import synthetic as synth_mod
from yolo5l.data.cache import ImageCache
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.layout import DATA_YAML, IMAGES_DIR, LABEL_SUFFIX, LABELS_DIR
from yolo5l.data.synthetic import MARKER, NAMES, ensure_synthetic

SMALL = {"num_train": 12, "num_val": 4, "min_side": 64, "max_side": 96}
_CTX = mp.get_context("spawn")  # the children import only numpy, cv2 and yolo5l.data (no forked torch threads)
_TIMEOUT = 120


# ---- two processes at once -----------------------------------------------------------------------------------------
def _child(fn, barrier, results_queue, i: int, args: tuple) -> None:
    barrier.wait(timeout=_TIMEOUT)
    results_queue.put((i, fn(*args)))


def run_together(fn, *args) -> list:
    """Run ``fn(*args)`` in two spawned processes released by one barrier; returns their results (both exited 0)."""
    barrier, results_queue = _CTX.Barrier(2), _CTX.Queue()
    procs = [_CTX.Process(target=_child, args=(fn, barrier, results_queue, i, args)) for i in range(2)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        deadline = time.monotonic() + _TIMEOUT
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                i, out = results_queue.get(timeout=1)
                results[i] = out
            except queue.Empty:  # a child that failed never answers
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(timeout=_TIMEOUT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return [results[0], results[1]]


def _slowed(module, name: str, delay: float) -> None:
    """Slow ``module.name`` by ``delay`` seconds a call (in a child), so that both processes are inside at once."""
    real = getattr(module, name)

    def slow(*a, **k):
        time.sleep(delay)
        return real(*a, **k)

    setattr(module, name, slow)


def _counted(module, name: str) -> list[int]:
    """Count the calls of ``module.name`` (in a child)."""
    real, calls = getattr(module, name), []

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    setattr(module, name, counting)
    return calls


# ---- what the children do ------------------------------------------------------------------------------------------
def _ensure(root: str) -> tuple[str, int]:
    written = _counted(synth_mod, "_write_image")
    _slowed(synth_mod, "_write_image", 0.01)
    return str(ensure_synthetic(root, **SMALL)), len(written)


def _scan(files: list[str], num_classes: int, cache_path: str) -> tuple[bool, int]:
    verified = _counted(scan_mod, "verify_image_label")
    _slowed(scan_mod, "verify_image_label", 0.01)
    index = scan_labels(files, num_classes, cache_path, workers=1)
    return index.report.from_cache, len(verified)


def _fill_disk(files: list[str], shapes: np.ndarray, imgsz: int, augment: bool) -> tuple[str, list[str], list[str]]:
    _slowed(cache_mod, "_load_resized", 0.01)
    cache = ImageCache(files, shapes, imgsz, "disk", augment=augment, num_threads=2)
    cache.fill()
    digests = [hashlib.md5(cache.load(i).tobytes()).hexdigest() for i in range(len(files))]
    return cache.mode, digests, cache.messages


# ---- checks --------------------------------------------------------------------------------------------------------
def _files_under(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dataset_files(root: Path) -> dict[str, bytes]:
    """The dataset's own files: without the label caches (labels/<split>.cache*) and disk caches (*.npycache)."""
    return {
        k: v for k, v in _files_under(root).items()
        if not (k.startswith(f"{LABELS_DIR}/") and ".cache" in k) and ".npycache/" not in k
    }  # fmt: skip


def assert_synthetic_complete(root: Path, tmp: Path) -> None:
    """``root`` holds exactly the files of the synthetic dataset, byte for byte those one process alone writes, and
    its folder holds nothing else (no temporary, stale or lock entry)."""
    expected = {DATA_YAML, MARKER}
    for split, n in (("train", SMALL["num_train"]), ("val", SMALL["num_val"])):
        expected |= {f"{IMAGES_DIR}/{split}/{split}_{i:06d}.jpg" for i in range(n)}
        expected |= {f"{LABELS_DIR}/{split}/{split}_{i:06d}{LABEL_SUFFIX}" for i in range(n)}
    found = _dataset_files(root)
    assert set(found) == expected
    reference = ensure_synthetic(tmp / "reference" / "synthetic", **SMALL).parent
    assert found == _files_under(reference)  # complete and identical: no partial or mixed file
    assert [p.name for p in root.parent.iterdir()] == [root.name]
    assert not [p for p in root.rglob("*") if p.name.endswith((".tmp", ".part")) or ".tmp-" in p.name]


def _split_files(root: Path, split: str) -> list[str]:
    return sorted(str(p) for p in (root / IMAGES_DIR / split).glob("*.jpg"))


def assert_label_cache_valid(files: list[str], num_classes: int, cache_path: Path, tmp: Path) -> None:
    """The label cache loads (current version and file hash) and equals a fresh scan of the same files."""
    cached = scan_mod._load_cache(cache_path, scan_mod._files_hash(files, num_classes))
    assert cached is not None
    fresh = scan_labels(files, num_classes, tmp / "fresh" / cache_path.name)
    assert not fresh.report.from_cache
    assert cached.im_files == fresh.im_files
    assert len(cached.labels) == len(fresh.labels)
    for a, b in zip(cached.labels, fresh.labels, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(cached.shapes, fresh.shapes)
    assert cached.report.counts() == fresh.report.counts()
    assert cached.report.messages == fresh.report.messages
    leftovers = [p.name for p in cache_path.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def assert_disk_cache_valid(
    files: list[str], shapes: np.ndarray, imgsz: int, augment: bool, reduced: bool = True
) -> None:
    """One .npy per image and nothing else in the cache folder; each loads with the resized shape, uint8, and the
    pixels of the image decoded (at reduced scale where `reduced`) and resized anew."""
    cache = ImageCache(files, shapes, imgsz, "disk", augment=augment, reduced_decode=reduced)
    cache.folder = cache._choose_folder()
    expected = {cache.npy_path(i) for i in range(len(files))}
    assert {p for p in cache.folder.rglob("*") if p.is_file()} == expected  # no .tmp file left
    for i, f in enumerate(files):
        arr = np.load(cache.npy_path(i))
        assert arr.dtype == np.uint8
        assert arr.shape == (*cache.resized_hw(i), 3)
        np.testing.assert_array_equal(arr, cache_mod._load_resized(f, imgsz, augment, reduced))


def _damage_labels(root: Path) -> None:
    """A background (label file removed), a duplicate row and an out-of-range class: a scan report with messages."""
    labels = root / LABELS_DIR / "train"
    (labels / f"train_000000{LABEL_SUFFIX}").unlink()
    dup = labels / f"train_000001{LABEL_SUFFIX}"
    first = dup.read_text().splitlines()[0]
    dup.write_text(dup.read_text() + first + "\n")
    (labels / f"train_000002{LABEL_SUFFIX}").write_text(f"{len(NAMES)} 0.5 0.5 0.2 0.2\n")


# ---- tests ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("start", ["empty", "stale"])
def test_two_processes_generate_the_synthetic_dataset_once(tmp_path, start):
    """Two processes call `ensure_synthetic` at once on an empty root (or on one holding a dataset of other
    parameters): both get its yaml, its images are written once, and the root holds exactly the expected files, with
    no temporary folder, moved-aside stale copy or lock left beside it."""
    root = tmp_path / "data" / "synthetic"
    if start == "stale":
        ensure_synthetic(root, **{**SMALL, "num_train": 5})
    results = run_together(_ensure, str(root))
    assert [y for y, _ in results] == [str(root / DATA_YAML)] * 2
    assert sum(n for _, n in results) == SMALL["num_train"] + SMALL["num_val"]  # one process generated it
    assert_synthetic_complete(root, tmp_path)


def test_two_processes_build_the_label_cache_once(tmp_path):
    """Two processes scan the same fresh split at once: the images are verified once (the second waits on the lock
    and reads the cache), and the cache loads and equals a fresh scan, report and messages included."""
    root = ensure_synthetic(tmp_path / "data" / "synthetic", **SMALL).parent
    _damage_labels(root)
    files = _split_files(root, "train")
    cache_path = root / LABELS_DIR / "train.cache"
    results = run_together(_scan, files, len(NAMES), str(cache_path))
    assert sorted(from_cache for from_cache, _ in results) == [False, True]
    assert sum(n for _, n in results) == len(files)
    assert_label_cache_valid(files, len(NAMES), cache_path, tmp_path)
    fresh = scan_labels(files, len(NAMES), tmp_path / "again.cache")
    assert (fresh.report.missing, fresh.report.duplicates, fresh.report.corrupt) == (1, 1, 1)  # the damage was seen


@pytest.mark.parametrize("augment", [True, False], ids=["train", "val"])
def test_two_processes_fill_the_disk_cache(tmp_path, augment):
    """Two processes fill the same `data.cache=disk` folder at once, writing the same .npy files over each other:
    both keep the disk cache without a failed write and load the same pixels, and every .npy file is complete."""
    root = ensure_synthetic(tmp_path / "data" / "synthetic", **SMALL).parent
    files = _split_files(root, "train")
    shapes = scan_labels(files, len(NAMES), tmp_path / "l.cache").shapes
    imgsz = 64
    (a_mode, a, a_said), (b_mode, b, b_said) = run_together(_fill_disk, files, shapes, imgsz, augment)
    assert (a_mode, b_mode) == ("disk", "disk")
    assert a_said == b_said == []  # no write failed ("could not write ...; reading images directly")
    assert a == b
    assert_disk_cache_valid(files, shapes, imgsz, augment)


@pytest.mark.heavy  # two training subprocesses: make test-ci (CI)
def test_two_training_runs_started_together_on_a_fresh_dataset(tmp_path):
    """Two `python -m yolo5l.train experiment=smoke data.cache=disk` runs started at once on the same fresh synthetic
    root both finish; the dataset, both label caches and the train and val disk caches are complete and valid."""
    root = tmp_path / "data" / "synthetic"
    imgsz = 64
    # min_side and max_side are not in conf/data/synthetic.yaml's mapping: added with +.
    synthetic = [f"{'+' * k.endswith('_side')}data.synthetic.{k}={v}" for k, v in SMALL.items()]
    args = [
        "experiment=smoke", f"data.synthetic.root={root}", *synthetic,
        f"data.imgsz={imgsz}", "data.batch_size=4", "data.cache=disk", "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1", "~callbacks.batch_plotter", "logger=csv", "trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    commands = [[sys.executable, "-m", "yolo5l.train", *args, f"hydra.run.dir={tmp_path / 'runs' / n}"] for n in "ab"]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in commands]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    for out, _ in outs:
        assert "disk cache" in out  # both trained from the disk cache
    assert_synthetic_complete(root, tmp_path)
    # as YOLODataModule decodes them: training images at reduced scale, validation images in full
    for split, augment in (("train", True), ("val", False)):
        files = _split_files(root, split)
        assert_label_cache_valid(files, len(NAMES), root / LABELS_DIR / f"{split}.cache", tmp_path / split)
        shapes = scan_labels(files, len(NAMES), tmp_path / split / "shapes.cache").shapes
        assert_disk_cache_valid(files, shapes, imgsz, augment, reduced=augment)
