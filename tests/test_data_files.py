from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

import yolo5l.data.label_scan as scan_mod
from yolo5l.base.files import user_cache_dir
from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.data.images import ImageReadError, read_image
from yolo5l.data.label_scan import ScanReport, scan_labels
from yolo5l.data.layout import DatasetError, img2label_path, label_cache_path

RNG = np.random.default_rng(0)


def _jpg(path: Path, h: int = 40, w: int = 60) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), RNG.integers(0, 255, (h, w, 3), dtype=np.uint8))
    return path


def _label(img: Path, text: str) -> Path:
    lb = Path(img2label_path(img))
    lb.parent.mkdir(parents=True, exist_ok=True)
    lb.write_text(text)
    return lb


# ---------------------------------------------------------------------------------------------- dataset yaml


def test_img2label_path_replaces_last_images_folder():
    p = os.path.join(os.sep, "d", "images", "x", "images", "train", "a.b.JPG")
    assert img2label_path(p) == os.path.join(os.sep, "d", "images", "x", "labels", "train", "a.b.txt")
    assert img2label_path(Path("/d/imgs/a.png")) == "/d/imgs/a.txt"  # no /images/: label beside the image


def test_load_dataset_file_folder_list_and_names(tmp_path):
    root = tmp_path / "ds"
    a = _jpg(root / "images" / "train" / "a.jpg")
    b = _jpg(root / "images" / "train" / "sub" / "b.PNG")  # recursive, suffix case-insensitive
    (root / "images" / "train" / "notes.txt").write_text("not an image")
    v1 = _jpg(root / "images" / "val" / "v1.jpg")
    v2 = _jpg(root / "other" / "v2.jpg")
    # list entries: "./" and plain relative paths are relative to the list's folder, absolute kept
    (root / "val.txt").write_text(f"./images/val/v1.jpg\n\n# comment\nother/v2.jpg\n{a}\n")
    (root / "data.yaml").write_text(
        "path: .\ntrain: images/train\nval: [val.txt, images/val]\nnames: {0: cat, 1: dog}\n"
    )
    spec = load_dataset_file(root / "data.yaml")
    assert spec.root == root.resolve()
    assert spec.names == ["cat", "dog"]
    assert spec.num_classes == 2
    assert spec.train == [a, b]
    assert spec.val == [v1, v2, a, v1]
    assert spec.cache_path("train") == root / "labels" / "train.cache"
    assert spec.cache_path("val") == root / "labels" / "val.cache"  # two sources: beside the first labels
    # mapping input (relative paths start at the cwd) with names as a list and a matching nc
    spec2 = load_dataset_file(
        {"path": str(root), "train": "images/train", "val": "images/val", "names": ["x"], "nc": 1}
    )
    assert spec2.val == [v1]
    assert spec2.cache_path("val") == root / "labels" / "val.cache"


def test_load_dataset_file_relative_root_falls_back_to_cwd(tmp_path, monkeypatch):
    _jpg(tmp_path / "datasets" / "d" / "images" / "a.jpg")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "d.yaml").write_text("path: datasets/d\ntrain: images\nval: images\nnames: [a]\n")
    monkeypatch.chdir(tmp_path)
    assert load_dataset_file(tmp_path / "cfg" / "d.yaml").root == (tmp_path / "datasets" / "d").resolve()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("path: nowhere\ntrain: images\nval: images\nnames: [a]\n", r"path='nowhere' not found \(looked at .*nowhere"),
        ("path: .\ntrain: images\nval: missing.txt\nnames: [a]\n", r"val entry 'missing.txt' not found \(looked for"),
        ("path: .\ntrain: images\nval: empty\nnames: [a]\n", r"val folder .*empty holds no images"),
        ("path: .\ntrain: images\nnames: [a]\n", r"no 'val' key"),
        ("path: .\ntrain: images\nval: images\n", r"no 'names'"),
        ("path: .\ntrain: images\nval: images\nnames: [a, b]\nnc: 3\n", r"nc=3 but 2 names"),
        ("[1, 2]\n", r"must hold a mapping"),
    ],
)
def test_load_dataset_file_errors_name_the_file(tmp_path, content, match):
    _jpg(tmp_path / "images" / "a.jpg")
    (tmp_path / "empty").mkdir()
    (tmp_path / "data.yaml").write_text(content)
    with pytest.raises(DatasetError, match=match) as e:
        load_dataset_file(tmp_path / "data.yaml")
    assert str(tmp_path / "data.yaml") in str(e.value)
    assert isinstance(e.value, ValueError)


def test_load_dataset_file_missing_file():
    with pytest.raises(DatasetError, match=r"Dataset file .*nope\.yaml not found"):
        load_dataset_file("/definitely/nope.yaml")


# ---------------------------------------------------------------------------------------------- read_image


def test_read_image_modes(tmp_path):
    rgb = RNG.integers(0, 255, (30, 40, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    np.testing.assert_array_equal(read_image(tmp_path / "rgb.png"), rgb)  # RGB order, not BGR

    gray = RNG.integers(0, 255, (30, 40), dtype=np.uint8)
    Image.fromarray(gray).save(tmp_path / "gray.png")
    np.testing.assert_array_equal(read_image(tmp_path / "gray.png"), np.repeat(gray[..., None], 3, 2))

    rgba = RNG.integers(0, 255, (30, 40, 4), dtype=np.uint8)
    Image.fromarray(rgba).save(tmp_path / "rgba.png")
    np.testing.assert_array_equal(read_image(tmp_path / "rgba.png"), rgba[..., :3])

    pal = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.save(tmp_path / "pal.png")
    np.testing.assert_array_equal(read_image(tmp_path / "pal.png"), np.asarray(pal.convert("RGB")))

    u16 = RNG.integers(0, 65535, (30, 40, 3), dtype=np.uint16)
    cv2.imwrite(str(tmp_path / "u16.png"), u16[..., ::-1])
    np.testing.assert_array_equal(read_image(tmp_path / "u16.png"), (u16 >> 8).astype(np.uint8))

    g16 = RNG.integers(0, 65535, (30, 40), dtype=np.uint16)
    cv2.imwrite(str(tmp_path / "g16.png"), g16)
    np.testing.assert_array_equal(read_image(tmp_path / "g16.png")[..., 1], (g16 >> 8).astype(np.uint8))

    pfm = RNG.random((20, 30, 3), dtype=np.float32)
    cv2.imwrite(str(tmp_path / "f.pfm"), pfm[..., ::-1])
    out = read_image(tmp_path / "f.pfm")
    assert out.dtype == np.uint8
    assert out.shape == (20, 30, 3)
    np.testing.assert_allclose(out, pfm * 255, atol=1.01)

    for im in map(read_image, tmp_path.iterdir()):
        assert im.dtype == np.uint8
        assert im.ndim == 3
        assert im.shape[2] == 3


def test_read_image_applies_exif_orientation(tmp_path):
    arr = np.zeros((30, 40, 3), np.uint8)
    arr[:, :10] = 255  # white band on the left
    ex = Image.Exif()
    ex[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.fromarray(arr).save(tmp_path / "e.jpg", exif=ex, quality=100)
    im = read_image(tmp_path / "e.jpg")
    assert im.shape == (40, 30, 3)
    assert im[:8].mean() > 200  # the left band is now on top
    assert im[12:].mean() < 50


def test_read_image_errors(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"this is not an image")
    with pytest.raises(ImageReadError, match=r"bad\.jpg cannot be decoded"):
        read_image(tmp_path / "bad.jpg")
    with pytest.raises(ImageReadError, match=r"missing\.jpg not found"):
        read_image(tmp_path / "missing.jpg")


# ---------------------------------------------------------------------------------------------- scan_labels

BOX = "0 0.5 0.5 0.2 0.2\n"


def _bad_dataset(root: Path) -> dict[str, Path]:
    """One image per kind of bad input; returns name -> image path."""
    d = root / "images" / "train"
    f: dict[str, Path] = {}

    f["good"] = _jpg(d / "good.jpg")
    _label(f["good"], BOX + "1 0.25 0.75 0.1 0.3\n")

    f["truncated"] = _jpg(d / "truncated.jpg", 200, 200)
    data = f["truncated"].read_bytes()
    f["truncated"].write_bytes(data[: len(data) // 2])
    _label(f["truncated"], BOX)

    f["trailing"] = _jpg(d / "trailing.jpg")  # complete JPEG + extra bytes: no end marker at the end of the file
    f["trailing"].write_bytes(f["trailing"].read_bytes() + b"\x00garbage")
    _label(f["trailing"], BOX)

    f["zero"] = d / "zero.jpg"
    f["zero"].write_bytes(b"")
    f["garbage"] = d / "garbage.png"
    f["garbage"].write_bytes(b"\x89PNG not really")
    f["tiny"] = _jpg(d / "tiny.jpg", 9, 50)
    f["gif_named_jpg"] = d / "gif.jpg"
    Image.fromarray(RNG.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(f["gif_named_jpg"], format="GIF")
    f["gif"] = d / "real.gif"
    Image.fromarray(RNG.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(f["gif"])

    f["gray"] = d / "gray.png"
    Image.fromarray(RNG.integers(0, 255, (30, 40), dtype=np.uint8)).save(f["gray"])
    _label(f["gray"], BOX)
    f["rgba"] = d / "rgba.png"
    Image.fromarray(RNG.integers(0, 255, (30, 40, 4), dtype=np.uint8)).save(f["rgba"])
    f["u16"] = d / "u16.png"
    cv2.imwrite(str(f["u16"]), RNG.integers(0, 65535, (30, 40), dtype=np.uint16))

    f["pfm"] = d / "float.pfm"  # PIL cannot read colour PFM: checked through OpenCV
    cv2.imwrite(str(f["pfm"]), RNG.random((30, 40, 3), dtype=np.float32))

    f["exif"] = d / "exif.jpg"
    ex = Image.Exif()
    ex[0x0112] = 8
    Image.fromarray(RNG.integers(0, 255, (30, 50, 3), dtype=np.uint8)).save(f["exif"], exif=ex)
    _label(f["exif"], BOX)

    cases = {
        "polygon": "1 0.1 0.2 0.5 0.2 0.3 0.6\n" + BOX,  # triangle -> box x 0.1..0.5, y 0.2..0.6
        "six_cols": "0 0.5 0.5 0.2 0.2 0.9\n",
        "four_cols": "0 0.5 0.5 0.2\n",
        "odd_polygon": "0 0.1 0.2 0.5 0.2 0.3 0.6 0.7\n",
        "non_numeric": "0 0.5 abc 0.2 0.2\n",
        "nan": "0 0.5 nan 0.2 0.2\n",
        "out_of_range": "0 0.5 0.5 1.2 0.2\n",
        "slightly_out": "0 1.0005 0.5 0.2 0.2\n1 0.5 -0.0004 0.2 0.2\n",
        "negative_size": "0 0.5 0.5 -0.2 0.2\n",
        "class_too_big": "2 0.5 0.5 0.2 0.2\n",
        "class_negative": "-1 0.5 0.5 0.2 0.2\n",
        "class_fraction": "0.5 0.5 0.5 0.2 0.2\n",
        "duplicates": BOX + BOX + "1 0.3 0.3 0.1 0.1\n" + BOX,
        "zero_size": BOX + "1 0.3 0.3 0.0 0.1\n",
        "empty": "",
        "blank_lines": "\n  \n",
    }
    for name, text in cases.items():
        f[name] = _jpg(d / f"{name}.jpg")
        _label(f[name], text)
    f["missing_label"] = _jpg(d / "missing_label.jpg")
    return f


CORRUPT = {
    "truncated": "truncated JPEG",
    "zero": "0 bytes",
    "garbage": "unreadable image",
    "tiny": "too small (50x9 px",
    "gif_named_jpg": "unsupported image format GIF",
    "gif": "unsupported format '.gif'",
    "six_cols": "6 values, expected 5",
    "four_cols": "4 values, expected 5",
    "odd_polygon": "8 values, expected 5",
    "non_numeric": "non-numeric value",
    "nan": "non-finite value",
    "out_of_range": "value above 1",
    "negative_size": "negative value",
    "class_too_big": "line 1: class 2 is not below nc=2 (the dataset yaml names 2 classes: ids 0 to 1)",
    "class_negative": "line 1: class -1 is negative (class ids 0 to 1)",
    "class_fraction": "line 1: class 0.5 is not a whole number (class ids 0 to 1)",
}


def test_scan_reports_every_bad_input(tmp_path):
    f = _bad_dataset(tmp_path)
    files = sorted(f.values())
    idx = scan_labels(files, 2, tmp_path / "labels" / "train.cache", workers=2)
    r = idx.report
    kept = {Path(p).stem: i for i, p in enumerate(idx.im_files)}
    msgs = "\n".join(r.messages)

    # corrupt images are skipped, each named with its reason
    for name, why in CORRUPT.items():
        assert f[name].stem not in kept, name
        assert any(str(f[name]) in m and why in m for m in r.messages), (name, why, msgs)
    assert r.corrupt == len(CORRUPT)
    assert r.total == len(files)
    assert len(idx) == len(files) - len(CORRUPT) == r.kept

    def labels(name):
        return idx.labels[kept[f[name].stem]]

    np.testing.assert_allclose(labels("good"), [[0, 0.5, 0.5, 0.2, 0.2], [1, 0.25, 0.75, 0.1, 0.3]])
    assert labels("good").dtype == np.float32
    # JPEG with bytes after its end: decodes in full, kept with a warning
    assert any("trailing.jpg" in m and "without end marker" in m for m in r.messages)
    # polygon -> enclosing box; other row unchanged
    np.testing.assert_allclose(labels("polygon"), [[1, 0.3, 0.4, 0.4, 0.4], [0, 0.5, 0.5, 0.2, 0.2]], atol=1e-6)
    # values within 1e-3 outside [0, 1] clipped
    np.testing.assert_allclose(labels("slightly_out"), [[0, 1.0, 0.5, 0.2, 0.2], [1, 0.5, 0.0, 0.2, 0.2]])
    assert f"{img2label_path(f['slightly_out'])} line 1: values within 0.001 outside [0, 1] clipped" in r.messages
    # duplicates removed, first-occurrence order kept
    np.testing.assert_allclose(labels("duplicates"), [[0, 0.5, 0.5, 0.2, 0.2], [1, 0.3, 0.3, 0.1, 0.1]], atol=1e-6)
    assert r.duplicates == 2
    assert f"{img2label_path(f['duplicates'])}: 2 duplicate label rows removed" in r.messages
    # zero-size box dropped, image kept
    np.testing.assert_allclose(labels("zero_size"), [[0, 0.5, 0.5, 0.2, 0.2]])
    assert f"{img2label_path(f['zero_size'])} line 2: zero-size box dropped" in r.messages
    assert r.repaired == 3  # polygon, slightly_out, zero_size
    # backgrounds
    for name in ("empty", "blank_lines", "missing_label", "rgba", "u16", "pfm"):
        assert labels(name).shape == (0, 5), name
    assert r.missing == 4  # missing_label, rgba, u16, pfm
    assert r.empty == 2
    assert r.backgrounds == 6
    # non-RGB images accepted and counted
    assert r.converted == 4
    assert idx.shapes[kept["float"]].tolist() == [30, 40]
    assert any("gray.png: not 8-bit RGB" in m for m in r.messages)
    # EXIF orientation 8 swaps the recorded shape to (w, h)
    assert idx.shapes[kept["exif"]].tolist() == [50, 30]
    assert idx.shapes[kept["good"]].tolist() == [40, 60]
    assert r.found == len(idx) - r.backgrounds

    # summary line and the log file in the user cache (nothing but the cache beside the labels)
    assert r.summary("train") == (
        f"train: {len(idx)} images, 6 backgrounds (2 empty label files, 4 without a label file), "
        f"{len(CORRUPT)} corrupt skipped, "
        f"2 duplicate rows removed, 3 labels repaired, 4 converted to 8-bit RGB (see {r.log_path})"
    )
    assert r.log_path == scan_mod._log_path(tmp_path / "labels" / "train.cache")
    assert r.log_path.parent == user_cache_dir("labels")
    assert sorted(p.name for p in (tmp_path / "labels").parent.iterdir() if p.suffix in (".log", ".lock")) == []
    log = r.log_path.read_text()
    assert log.splitlines()[0] == r.summary("train").split(" (see ")[0]
    assert str(f["truncated"]) in log


def _bad_class_lines(images: list[Path], bad: list[int]) -> list[str]:
    """Label files for ``images`` (nc=4) whose line 3 has class 7 for the images at ``bad``; their expected lines."""
    for i, im in enumerate(images):
        _label(im, BOX + "1 0.3 0.3 0.1 0.1\n" + ("7" if i in bad else "2") + " 0.7 0.7 0.1 0.1\n")
    return [
        f"{img2label_path(images[i])} line 3: class 7 is not below nc=4 (the dataset yaml names 4 classes: ids 0 to "
        f"3); image {images[i]} skipped"
        for i in bad
    ]


def test_a_bad_class_id_names_the_label_file_its_line_and_the_image_cached_or_not(tmp_path, caplog):
    """One bad label line: the log and the console name its label file, line and image, a cached scan the same."""
    images = [_jpg(tmp_path / "images" / "train" / f"{i}.jpg") for i in range(5)]
    expected = _bad_class_lines(images, [2])
    cache = tmp_path / "labels" / "train.cache"
    for cached in (False, True):
        caplog.clear()
        r = scan_labels(images, 4, cache, "train").report
        assert r.from_cache is cached
        assert (r.corrupt, r.skipped) == (1, expected)
        summary = f"train: 4 images, 0 backgrounds, 1 corrupt skipped (see {r.log_path})" + " [cached]" * cached
        assert [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"] == [
            f"{summary}\n  {expected[0]}"
        ]
        assert r.log_path.read_text().splitlines() == [summary.split(" (see ")[0], expected[0]]


def test_the_console_names_the_first_three_skipped_images_and_the_log_the_rest(tmp_path, caplog):
    images = [_jpg(tmp_path / "images" / "train" / f"{i}.jpg") for i in range(7)]
    expected = _bad_class_lines(images, [1, 2, 3, 5, 6])
    _jpg(tmp_path / "images" / "train" / "0.jpg", 5, 5)  # too small: a corrupt image first, then the label files
    r = scan_labels(images, 4, tmp_path / "labels" / "train.cache", "train").report
    first = f"{images[0]}: corrupt, skipped: image too small (5x5 px, need at least 10 px per side)"
    assert r.skipped == [first, *expected]
    (warning,) = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert warning.splitlines()[1:] == [
        f"  {first}",
        *(f"  {m}" for m in expected[:2]),
        f"  ... and 3 more in {r.log_path}",
    ]
    assert r.log_path.read_text().splitlines()[1:] == [first, *expected]


def test_the_summary_says_one_of_each_in_the_singular():
    one = ScanReport(total=4, found=1, missing=1, empty=1, corrupt=1, duplicates=1, repaired=1, converted=1)
    assert one.summary("val") == (
        "val: 3 images, 2 backgrounds (1 empty label file, 1 without a label file), 1 corrupt skipped, "
        "1 duplicate row removed, 1 label repaired, 1 converted to 8-bit RGB"
    )
    assert ScanReport(total=1, empty=1).summary() == "train: 1 image, 1 background (1 empty label file)"
    assert ScanReport(total=3, missing=3).summary() == "train: 3 images, 3 backgrounds (3 without a label file)"
    two = ScanReport(total=5, found=1, empty=2, duplicates=2, repaired=2)
    assert two.summary() == (
        "train: 3 images, 2 backgrounds (2 empty label files), 2 duplicate rows removed, 2 labels repaired"
    )


def test_cache_reused_then_invalidated(tmp_path, monkeypatch):
    imgs = [_jpg(tmp_path / "images" / f"{i}.jpg") for i in range(4)]
    lbs = [_label(p, BOX) for p in imgs]
    cache = tmp_path / "labels.cache"
    first = scan_labels(imgs, 2, cache)
    assert not first.report.from_cache
    assert cache.is_file()

    def boom(*a, **k):
        raise AssertionError("verifier called although the cache is valid")

    monkeypatch.setattr(scan_mod, "verify_image_label", boom)
    second = scan_labels(imgs, 2, cache)
    assert second.report.from_cache
    assert second.im_files == first.im_files
    for a, b in zip(second.labels, first.labels, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(second.shapes, first.shapes)
    assert second.report.summary() == first.report.summary() + " [cached]"

    # a label file changes (same size, new content and mtime) -> rebuilt
    monkeypatch.undo()
    lbs[0].write_text("1 0.5 0.5 0.2 0.2\n")
    st = lbs[0].stat()
    os.utime(lbs[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = scan_labels(imgs, 2, cache)
    assert not third.report.from_cache
    assert third.labels[0][0, 0] == 1

    # a different class count or cache version -> rebuilt
    assert not scan_labels(imgs, 3, cache).report.from_cache
    assert scan_labels(imgs, 3, cache).report.from_cache
    monkeypatch.setattr(scan_mod, "CACHE_VERSION", "other")
    assert not scan_labels(imgs, 3, cache).report.from_cache

    # a label file deleted -> rebuilt, the image becomes a background
    monkeypatch.undo()
    lbs[1].unlink()
    r = scan_labels(imgs, 3, cache).report
    assert (r.from_cache, r.missing, r.found) == (False, 1, 3)


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    imgs = [_jpg(tmp_path / "images" / f"{i}.jpg") for i in range(3)]
    for p in imgs:
        _label(p, BOX)
    cache = tmp_path / "labels.cache"
    scan_labels(imgs, 2, cache)
    before = cache.read_bytes()
    _label(imgs[0], "1 0.5 0.5 0.3 0.3\n")

    def savez_dies_midway(file, **arrays):
        file.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(scan_mod.np, "savez", savez_dies_midway)
    with pytest.raises(KeyboardInterrupt):
        scan_labels(imgs, 2, cache)
    assert cache.read_bytes() == before  # the old cache is untouched, no half-written file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "labels", "labels.cache"]  # no lock, no log
    monkeypatch.undo()
    assert scan_labels(imgs, 2, cache).labels[0][0, 0] == 1  # stale cache detected and rebuilt
    # a corrupt cache file is rebuilt too
    cache.write_bytes(b"garbage")
    assert not scan_labels(imgs, 2, cache).report.from_cache


def test_read_only_dataset_uses_user_cache(tmp_path, monkeypatch):
    ds = tmp_path / "ds"
    imgs = [_jpg(ds / "images" / f"{i}.jpg") for i in range(3)]
    for p in imgs:
        _label(p, BOX)
    user = tmp_path / "usercache"
    monkeypatch.setenv("YOLO5L_CACHE_DIR", str(user))
    real_writable = scan_mod.dir_writable
    if os.geteuid() == 0:  # root writes through permission bits: judge writability by the bits instead
        monkeypatch.setattr(
            scan_mod, "dir_writable", lambda d: bool(d.stat().st_mode & stat.S_IWUSR) and real_writable(d)
        )
    dirs = [ds, *[p for p in ds.rglob("*") if p.is_dir()]]
    for d in dirs:
        d.chmod(0o555)
    try:
        cache = ds / "labels.cache"
        idx = scan_labels(imgs, 2, cache)
        assert not cache.exists()
        written = list((user / "labels").glob("labels-*.cache"))
        assert len(written) == 1
        assert idx.report.log_path is None or idx.report.log_path.parent == user / "labels"
        again = scan_labels(imgs, 2, cache)
        assert again.report.from_cache
        assert len(again) == 3
    finally:
        for d in dirs:
            d.chmod(0o755)


def test_concurrent_scans_build_once(tmp_path, monkeypatch):
    imgs = [_jpg(tmp_path / "images" / f"{i}.jpg") for i in range(6)]
    for p in imgs:
        _label(p, BOX)
    calls = []
    real = scan_mod.verify_image_label

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(scan_mod, "verify_image_label", counting)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(scan_labels(imgs, 2, tmp_path / "l.cache"))) for _ in "ab"
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    assert len(calls) == len(imgs)  # the second caller waited on the lock and read the cache
    assert sorted(r.report.from_cache for r in results) == [False, True]


def test_empty_and_all_corrupt_splits_raise(tmp_path):
    with pytest.raises(DatasetError, match=r"val: no images to scan"):
        scan_labels([], 2, tmp_path / "x.cache", split="val")
    bad = tmp_path / "images" / "bad.jpg"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"nope")
    with pytest.raises(DatasetError, match=r"train: the only image is corrupt .*bad\.jpg.*x-[0-9a-f]+\.cache\.log"):
        scan_labels([bad], 2, tmp_path / "x.cache")


def test_label_cache_path(tmp_path):
    files = [tmp_path / "d" / "images" / "train" / "a.jpg"]
    assert label_cache_path(files) == tmp_path / "d" / "labels" / "train.cache"
    assert label_cache_path(files, [tmp_path / "d" / "train2017.txt"]) == tmp_path / "d" / "train2017.cache"


def test_shared_folder_splits_get_separate_caches(tmp_path):
    _jpg(tmp_path / "images" / "a.jpg")
    (tmp_path / "d.yaml").write_text("train: images\nval: images\nnames: [a]\n")
    spec = load_dataset_file(tmp_path / "d.yaml")
    assert spec.root == tmp_path.resolve()
    assert spec.cache_path("train") != spec.cache_path("val")
