"""Storage faults: a damaged checkpoint at every entry point, a checkpoint write that the disk refuses, and the label
and image caches on a full disk.

A full disk is a file-size limit here (`RLIMIT_FSIZE` set in the subprocess; Python ignores SIGXFSZ, so a write past
the limit fails with EFBIG as one past the end of a full disk fails with ENOSPC): no mount and no root needed.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from yolo5l.base.errors import UserError, shown_path
from yolo5l.callbacks.checkpoint import (
    AtomicCheckpointIO,
    CheckpointWriteError,
    stop_on_write_error,
    write_error_message,
)
from yolo5l.io.archive import archive_damage
from yolo5l.resume import read_resume_state

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def _file_size_limit(nbytes: int):
    def limit() -> None:  # runs in the child before exec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return limit


def _checkpoint(path: Path) -> Path:
    torch.save({"epoch": 0, "global_step": 1, "state_dict": {"w": torch.arange(300_000.0)}}, path)
    return path


def _damaged(src: Path, dst: Path, how: str) -> Path:
    data = bytearray(src.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "overwritten":  # a run of bytes inside a tensor's data changed: the archive itself is intact
        data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    dst.write_bytes(bytes(data))
    return dst


def test_archive_damage_finds_truncated_and_changed_files(tmp_path):
    good = _checkpoint(tmp_path / "good.ckpt")
    assert archive_damage(good) is None
    assert archive_damage(_damaged(good, tmp_path / "cut.ckpt", "truncated")) == "cut short: its end is missing"
    assert "does not match its checksum" in archive_damage(_damaged(good, tmp_path / "bad.ckpt", "overwritten"))
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert archive_damage(tmp_path / "empty.ckpt") == "empty file"
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    assert archive_damage(tmp_path / "text.ckpt") is None  # not a zip at all: the loader says what it is
    # torch.load reads the changed bytes without a word; resume names the file instead
    assert torch.load(tmp_path / "bad.ckpt", weights_only=True)["epoch"] == 0
    with pytest.raises(UserError, match=r"bad\.ckpt is damaged \(\w+/data/\d+ does not match its checksum\)"):
        read_resume_state(tmp_path / "bad.ckpt")


@pytest.mark.heavy
def test_damaged_files_are_named_in_one_line_at_every_entry_point(tmp_path):
    """A truncated last.ckpt and a truncated weights.pt given to train resume=, train weights=, val, predict and
    convert: one `error:` line naming the file, exit code 2, no traceback."""
    import cv2
    import numpy as np

    from yolo5l.data.synthetic import ensure_synthetic

    synthetic = tmp_path / "synthetic"
    ensure_synthetic(root=synthetic, num_train=32, num_val=16, seed=0)
    img = tmp_path / "a.jpg"
    cv2.imwrite(str(img), np.zeros((32, 32, 3), np.uint8))
    good = _checkpoint(tmp_path / "good.ckpt")
    files = [_damaged(good, tmp_path / name, "truncated") for name in ("last.ckpt", "weights.pt")]
    run = ["hydra.run.dir={run}"]
    entries = {
        "train resume=": ["yolo5l.train", "resume={f}"],
        "train weights=": ["yolo5l.train", "experiment=smoke", "weights={f}", f"data.synthetic.root={synthetic}", *run],
        "val": ["yolo5l.val", "weights={f}", f"data.synthetic.root={synthetic}", *run],
        "predict": ["yolo5l.predict", "weights={f}", f"source={img}", *run],
        "convert": ["yolo5l.convert", "{f}", "{run}.pt"],
    }
    cases = [(name, f, i) for name in entries for i, f in enumerate(files)]

    def run_case(case: tuple[str, Path, int]) -> subprocess.CompletedProcess:
        name, f, i = case
        argv = [a.format(f=f, run=tmp_path / f"run{i}-{name.split()[0]}") for a in entries[name]]
        return subprocess.run(
            [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path
        )

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run_case, cases))
    for (name, f, _), r in zip(cases, results, strict=True):
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, f"{name} {f.name}: {r.stderr[-2000:]}"
        assert "Traceback" not in r.stderr, f"{name} {f.name}"
        assert len(lines) == 1, f"{name} {f.name}: {r.stderr[-2000:]}"
        assert lines[0].startswith("error: "), lines[0]
        assert f.name in lines[0], lines[0]
        assert "is damaged" in lines[0], lines[0]  # resume and the weights loaders check the archive alike


@pytest.mark.heavy  # two runs: CI runs it (make test-ci), `make test` stays light
def test_a_refused_checkpoint_write_stops_the_run_and_keeps_the_previous_last_ckpt(tmp_path):
    """Epoch 0 writes last.ckpt; the run resumed for one more epoch under a 10 MB file-size limit cannot write its
    21 MB last.ckpt: one line naming the folder and the space needed, exit code 2, the previous file byte-identical
    and resumable."""
    from yolo5l.data.synthetic import ensure_synthetic

    synthetic = tmp_path / "synthetic"
    ensure_synthetic(root=synthetic, num_train=32, num_val=16, seed=0)
    train = [sys.executable, "-m", "yolo5l.train"]
    args = [
        "experiment=smoke", f"hydra.run.dir={tmp_path / 'run'}", f"data.synthetic.root={synthetic}",
        "trainer.limit_val_batches=1", "~callbacks.batch_plotter", "logger=csv",
    ]  # fmt: skip
    r = subprocess.run([*train, *args], capture_output=True, text=True, timeout=600, env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    assert len(before) > 10_000_000

    r = subprocess.run(
        [*train, f"resume={last}", "trainer.max_epochs=2"], capture_output=True, text=True, timeout=600, env=ENV,
        cwd=tmp_path, preexec_fn=_file_size_limit(10_000_000),
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: could not write last.ckpt in run/checkpoints (the file is larger than"), line
    assert re.search(r"it needs about [\d.]+ MB, [\d.]+ [MG]B free there\)", line), line
    assert line.endswith("the previous last.ckpt there is whole: lift the limit, then resume with python -m "
                         "yolo5l.train resume=run/checkpoints/last.ckpt"), line  # fmt: skip
    assert last.read_bytes() == before
    assert read_resume_state(last).epochs_done == 1
    assert [p.name for p in last.parent.iterdir() if p.name.endswith(".tmp")] == []  # nothing half-written left


def test_write_error_messages(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    full = write_error_message(folder / "last.ckpt", OSError(errno.ENOSPC, "No space left on device"), 21_300_000)
    shown = shown_path(folder)
    assert full.startswith(f"could not write last.ckpt in {shown} (the disk is full: it needs about 21.3 MB, ")
    assert full.endswith("free there); no earlier last.ckpt was written there")
    (folder / "best.pt").write_bytes(b"x")
    ro = write_error_message(folder / "best.pt", OSError(errno.EROFS, "Read-only file system"), None)
    assert ro.startswith(f"could not write best.pt in {shown} (the folder is on a read-only filesystem: ")
    assert ro.endswith("free there); the previous best.pt there is whole")


def test_every_rank_stops_on_rank_zeros_failed_write():
    """The error reaches the ranks that wrote nothing: rank 0's outcome is broadcast after the write."""
    told = SimpleNamespace(message="")

    def broadcast(obj: str, src: int = 0) -> str:
        told.message = obj
        return "could not write last.ckpt in ck (the disk is full)"  # what rank 0 sends

    trainer = SimpleNamespace(
        world_size=2, strategy=SimpleNamespace(checkpoint_io=AtomicCheckpointIO(), broadcast=broadcast)
    )
    with pytest.raises(CheckpointWriteError, match="the disk is full"):
        with stop_on_write_error(trainer):
            pass  # this rank wrote nothing and saw no error
    assert told.message == ""  # what this rank offered
    single = SimpleNamespace(world_size=1, strategy=SimpleNamespace(checkpoint_io=AtomicCheckpointIO()))
    with pytest.raises(CheckpointWriteError, match=r"could not write best\.pt in ck \(the disk is full"):
        with stop_on_write_error(single, Path("ck/best.pt"), 1000):
            raise OSError(errno.ENOSPC, "No space left on device")  # a weights write (save_weights) failing
    with stop_on_write_error(single):  # nothing failed: nothing raised
        pass


_CACHES_ON_A_FULL_DISK = """
import logging, sys
from pathlib import Path
from yolo5l.data.cache import ImageCache
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.dataset_yaml import load_dataset_file

logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
root, limit = Path(sys.argv[1]), int(sys.argv[2])
spec = load_dataset_file(root / "data.yaml")
import resource
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # from here on, the disk is "full" (Python ignores SIGXFSZ)
index = scan_labels(spec.files("val"), spec.num_classes, root / "labels.cache", "val")
print("scanned", len(index.im_files), "cache written:", (root / "labels.cache").exists())
cache = ImageCache(index.im_files, index.shapes, 128, "disk", cache_dir=root / "npy", num_threads=1, prefix="val: ")
print("fill:", cache.fill())
print("loaded", sum(cache.load(i).shape[0] > 0 for i in range(len(index.im_files))), "mode", cache.mode)
"""


def test_label_and_image_caches_fall_back_to_none_on_a_full_disk(tmp_path):
    from yolo5l.data.synthetic import ensure_synthetic

    root = tmp_path / "synthetic"
    ensure_synthetic(root=root, num_train=8, num_val=16, seed=0)
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CACHES_ON_A_FULL_DISK), str(root), "2000"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert re.search(r"val: label cache \S+ not written \(File too large\): the labels are scanned again next", out)
    assert "scanned 16 cache written: False" in out
    assert re.search(r"val: could not write \S+\.npy \(.+ GB free there\); no more \.npy files are written", out)
    assert len(re.findall(r"^val: could not write", out, re.MULTILINE)) == 1  # one warning, no retry per image
    assert re.search(r"fill: val: disk cache \S+: partly written \(could not write", out)
    assert "loaded 16 mode disk" in out  # every image still loads, decoded from its file
    assert not list((root / "npy").rglob("*.npy"))
