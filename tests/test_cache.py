"""Image cache: RAM fill and fallback, disk .npy reuse, rebuild of corrupt/stale/truncated files, read-only
folders, memory-mapped reads that give the same items as no cache."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch

from yolo5l.data import cache as cache_mod
from yolo5l.data import layout
from yolo5l.data import letterbox as letterbox_mod
from yolo5l.data.cache import ImageCache
from yolo5l.data.dataset import YOLODataset
from yolo5l.data.images import read_image
from yolo5l.data.label_scan import LabelIndex, ScanReport
from yolo5l.data.letterbox import resize_long_side
from yolo5l.data.synthetic import render_sample


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "ds" / "images" / "train"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    files, shapes = [], []
    for i, (h, w) in enumerate([(90, 120), (150, 100), (64, 64), (200, 80)]):
        img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        p = folder / f"im{i}.png"
        cv2.imwrite(str(p), img)
        files.append(str(p))
        shapes.append((h, w))
    return files, np.array(shapes)


def expected(path: str, imgsz: int = 96, augment: bool = True) -> np.ndarray:
    return resize_long_side(read_image(path), imgsz, augment)


def test_ram_cache_holds_resized_images(images):
    files, shapes = images
    c = ImageCache(files, shapes, 96, "ram")
    line = c.fill([0, 2])
    assert "cached 2 images" in line
    assert c.ram[1] is None  # only the requested shard
    assert c.ram[3] is None
    for i in range(4):
        img = c.load(i)
        assert max(img.shape[:2]) == 96
        np.testing.assert_array_equal(img, expected(files[i]))
    assert c.load(0) is c.ram[0]


def test_ram_cache_falls_back_when_memory_is_short(images, monkeypatch):
    files, shapes = images
    c = ImageCache(files, shapes, 96, "ram")
    need = c.nbytes(range(4))
    # 96*72*3 + 96*64*3 + 64*64*3 + 96*38*3 (h, w resized to long side 96)
    assert need == 3 * (72 * 96 + 96 * 64 + 96 * 96 + 96 * 38)
    monkeypatch.setattr(cache_mod.psutil, "virtual_memory", lambda: SimpleNamespace(available=int(need * 1.05)))
    line = c.fill()
    assert c.mode == "none"
    assert "RAM cache disabled" in line
    assert all(a is None for a in c.ram)
    np.testing.assert_array_equal(c.load(1), expected(files[1]))  # still works, uncached


def test_disk_cache_writes_reuses_and_rebuilds(images):
    files, shapes = images
    c = ImageCache(files, shapes, 96, "disk")
    line = c.fill()
    assert "4 written, 0 reused" in line
    folder = Path(files[0]).parent.with_name("train.npycache") / "s96_linear_r"  # _r: reduced decoding
    assert c.folder == folder
    for i in range(4):
        np.testing.assert_array_equal(np.load(c.npy_path(i)), expected(files[i]))

    c2 = ImageCache(files, shapes, 96, "disk")
    assert "0 written, 4 reused" in c2.fill()

    # corrupt: garbage bytes; wrong shape; stale (image newer than its .npy)
    c2.npy_path(0).write_bytes(b"not a numpy file")
    np.save(c2.npy_path(1), np.zeros((5, 5, 3), np.uint8))
    future = c2.npy_path(2).stat().st_mtime + 100
    os.utime(files[2], (future, future))
    c3 = ImageCache(files, shapes, 96, "disk")
    assert "3 written, 1 reused" in c3.fill()
    for i in range(4):
        np.testing.assert_array_equal(c3.load(i), expected(files[i]))
    assert c3.npy_path(2).stat().st_mtime >= os.stat(files[2]).st_mtime
    assert "0 written, 4 reused" in ImageCache(files, shapes, 96, "disk").fill()


def test_disk_cache_rebuilds_files_of_another_size_rule(tmp_path, monkeypatch):
    """A .npy written when sides were rounded to the nearest pixel (100 x 300 -> 43 x 128) is rebuilt at v7.0's
    truncated 42 x 128; one whose size both rules agree on (the same resize, the same pixels) is reused."""
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(1)
    files = []
    for i, (h, w) in enumerate([(100, 300), (150, 300)]):  # 42.67 and 64.0 rows at 128 px
        files.append(str(folder / f"im{i}.png"))
        cv2.imwrite(files[-1], rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    shapes = np.array([(100, 300), (150, 300)])

    def nearest(h0, w0, imgsz):
        r = imgsz / max(h0, w0)
        return max(1, round(h0 * r)), max(1, round(w0 * r))

    with monkeypatch.context() as m:
        m.setattr(cache_mod, "resized_shape", nearest)
        m.setattr(letterbox_mod, "resized_shape", nearest)
        old = ImageCache(files, shapes, 128, "disk", augment=False)
        assert "2 written, 0 reused" in old.fill()
    assert np.load(old.npy_path(0)).shape == (43, 128, 3)
    c = ImageCache(files, shapes, 128, "disk", augment=False)
    assert "1 written, 1 reused" in c.fill()
    for i in range(2):
        np.testing.assert_array_equal(c.load(i), expected(files[i], 128, augment=False))
    assert c.load(0).shape == (42, 128, 3)


def test_disk_cache_load_rebuilds_file_corrupted_after_fill(images):
    files, shapes = images
    c = ImageCache(files, shapes, 96, "disk")
    c.fill()
    c.npy_path(3).write_bytes(b"\x93NUMPY broken")
    np.testing.assert_array_equal(c.load(3), expected(files[3]))
    np.testing.assert_array_equal(np.load(c.npy_path(3)), expected(files[3]))


def test_disk_cache_val_interp_separate_folder(images):
    files, shapes = images
    c = ImageCache(files, shapes, 96, "disk", augment=False)
    c.fill()
    assert c.folder.name == "s96_area_r"
    np.testing.assert_array_equal(c.load(1), expected(files[1], augment=False))


def test_disk_cache_full_decode_separate_folder(images):
    files, shapes = images
    folders = set()
    for augment in (True, False):
        for reduced in (True, False):
            c = ImageCache(files, shapes, 96, "disk", augment=augment, reduced_decode=reduced)
            assert "4 written, 0 reused" in c.fill()
            folders.add(c.folder)
    assert {f.name for f in folders} == {"s96_linear", "s96_linear_r", "s96_area", "s96_area_r"}


def test_disk_cache_load_is_a_read_only_memory_map(images):
    files, shapes = images
    c = ImageCache(files, shapes, 96, "disk")
    c.fill()
    img = c.load(1)
    assert isinstance(img, np.memmap)
    assert isinstance(img.base, mmap.mmap)  # the file's pages, not a private copy
    assert not img.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        img[0, 0, 0] = 1
    np.testing.assert_array_equal(img, expected(files[1]))


def test_disk_cache_load_rebuilds_truncated_file(images):
    files, shapes = images
    c = ImageCache(files, shapes, 96, "disk")
    c.fill()
    p = c.npy_path(2)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])  # a valid header, half the pixels
    np.testing.assert_array_equal(c.load(2), expected(files[2]))
    assert p.read_bytes() == data  # rewritten in full
    p.write_bytes(data[: len(data) // 2])
    assert "1 written, 3 reused" in ImageCache(files, shapes, 96, "disk").fill()  # fill's check sees it too
    assert p.read_bytes() == data


def test_disk_cache_read_only_dataset_uses_user_cache(images, tmp_path, monkeypatch):
    files, shapes = images
    ds_root = Path(files[0]).parents[2]
    monkeypatch.delenv("YOLO5L_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    os.chmod(ds_root, 0o555)
    for d in ds_root.rglob("*"):
        if d.is_dir():
            os.chmod(d, 0o555)
    if os.geteuid() == 0:  # root ignores permission bits: refuse writes under the dataset like a read-only mount
        real = layout.probe_write

        def probe(folder: Path) -> None:
            if str(folder).startswith(str(ds_root)):
                raise PermissionError(13, "Read-only file system", str(folder))
            real(folder)

        monkeypatch.setattr(layout, "probe_write", probe)
    try:
        c = ImageCache(files, shapes, 96, "disk")
        line = c.fill()
        assert c.mode == "disk"
        assert str(c.folder).startswith(str(tmp_path / "xdg" / "yolo5l" / "npy"))
        assert "4 written" in line
        assert any("not writable" in m for m in c.messages)
        np.testing.assert_array_equal(c.load(2), expected(files[2]))
        assert not (Path(files[0]).parent.with_name("train.npycache")).exists()
    finally:
        for d in [ds_root, *ds_root.rglob("*")]:
            if d.is_dir():
                os.chmod(d, 0o755)


def test_disk_cache_falls_back_when_disk_is_full(images, monkeypatch):
    files, shapes = images
    monkeypatch.setattr(cache_mod.shutil, "disk_usage", lambda p: SimpleNamespace(total=10**9, used=10**9, free=1000))
    c = ImageCache(files, shapes, 96, "disk")
    line = c.fill()
    assert c.mode == "none"
    assert "disk cache disabled" in line
    np.testing.assert_array_equal(c.load(0), expected(files[0]))


def test_bad_mode():
    with pytest.raises(ValueError, match=r"data\.cache"):
        ImageCache([], np.zeros((0, 2)), 64, "gpu")


@pytest.fixture
def camera_index(tmp_path) -> LabelIndex:
    """JPEGs large enough for reduced decoding at 128 px (and one too small for it) and a PNG, with labels."""
    folder = tmp_path / "ds" / "images" / "train"
    folder.mkdir(parents=True)
    files, labels, shapes = [], [], []
    for i, (h, w, ext) in enumerate([(390, 520, "jpg"), (610, 300, "jpg"), (200, 250, "jpg"), (300, 280, "png")]):
        img, lab, _ = render_sample(np.random.default_rng([7, i]), h, w)
        p = folder / f"im{i}.{ext}"
        cv2.imwrite(str(p), img[..., ::-1])
        files.append(str(p))
        labels.append(lab)
        shapes.append((h, w))
    return LabelIndex(files, labels, np.array(shapes), ScanReport())


@pytest.mark.parametrize("reduced", [True, False], ids=["reduced", "full"])
@pytest.mark.filterwarnings("error:.*not writable")  # torch.from_numpy of a read-only array: a missing copy
def test_disk_cached_items_equal_uncached(camera_index, tmp_path, reduced):
    for augment in (True, False):
        datasets = []
        for cache in ("none", "disk"):
            ds = YOLODataset(
                camera_index, imgsz=128, augment=augment, batch_size=2, cache=cache, cache_dir=tmp_path / "npy"
            )
            ds.cache.reduced_decode = reduced
            ds.fill_cache()
            datasets.append(ds)
        uncached, cached = datasets
        assert cached.cache.mode == "disk"
        assert isinstance(cached.load_image(0)[0], np.memmap)
        for i in range(len(uncached)):
            items = [(i, True, (0, 2, 0)), (i, False, (0, 2, 0))] if augment else [i]
            for item in items:
                a, b = uncached[item], cached[item]
                torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
                torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
                assert a[2:] == b[2:]
