from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.data.images import read_image
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.synthetic import COLORS, MARKER, NAMES, ensure_synthetic, render_sample

SMALL = {"num_train": 24, "num_val": 8}


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in (".jpg", ".txt", ".yaml")
    }


def test_deterministic_and_layout(tmp_path):
    a = ensure_synthetic(tmp_path / "a", **SMALL)
    b = ensure_synthetic(tmp_path / "b", **SMALL)
    assert a == tmp_path / "a" / "data.yaml"
    da, db = _digest(a.parent), _digest(b.parent)
    assert da == db
    assert len(da) == 2 * (24 + 8) + 1
    assert len(list((a.parent / "images" / "train").glob("*.jpg"))) == 24
    assert len(list((a.parent / "labels" / "val").glob("*.txt"))) == 8
    c = ensure_synthetic(tmp_path / "c", seed=1, **SMALL)
    assert _digest(c.parent) != da
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_reused_not_regenerated(tmp_path):
    y = ensure_synthetic(tmp_path / "s", **SMALL)
    img = y.parent / "images" / "train" / "train_000000.jpg"
    stamps = (img.stat().st_mtime_ns, (y.parent / MARKER).stat().st_mtime_ns, y.stat().st_mtime_ns)
    assert ensure_synthetic(tmp_path / "s", **SMALL) == y
    assert (img.stat().st_mtime_ns, (y.parent / MARKER).stat().st_mtime_ns, y.stat().st_mtime_ns) == stamps
    # other parameters: regenerated in place
    ensure_synthetic(tmp_path / "s", num_train=5, num_val=2)
    assert len(list((y.parent / "images" / "train").glob("*.jpg"))) == 5
    # a folder without the marker (interrupted, or hand-made) is replaced
    (y.parent / MARKER).unlink()
    ensure_synthetic(tmp_path / "s", **SMALL)
    assert len(list((y.parent / "images" / "train").glob("*.jpg"))) == 24


def test_concurrent_callers_see_a_complete_dataset(tmp_path):
    out, errors = [], []

    def call():
        try:
            y = ensure_synthetic(tmp_path / "s", **SMALL)
            out.append(len(list((y.parent / "labels" / "train").glob("*.txt"))))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert out == [24, 24, 24]
    assert [p.name for p in tmp_path.iterdir()] == ["s"]


@pytest.mark.parametrize("seed", range(6))
def test_labels_are_exact_extents_of_the_drawn_shapes(seed):
    rng = np.random.default_rng(seed)
    h, w = 300, 380
    img, labels, masks = render_sample(rng, h, w)
    assert 1 <= len(labels) <= 6
    assert len(masks) == len(labels)
    union = np.zeros((h, w), int)
    for (cls, cx, cy, bw, bh), m in zip(labels, masks, strict=True):
        ys, xs = np.nonzero(m)
        np.testing.assert_allclose(
            [cx * w, cy * h, bw * w, bh * h],
            [(xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2, np.ptp(xs) + 1, np.ptp(ys) + 1],
            atol=1e-3,
        )
        assert 20 <= bw * w <= 150
        assert 20 <= bh * h <= 150
        # the shape is painted in its class colour (+-15 jitter) and covers a class-typical share of its box
        assert np.abs(img[m].astype(int) - COLORS[int(cls)]).max() <= 15
        fill = m.sum() / (bw * w * bh * h)
        assert {0: 0.99, 1: 0.7, 2: 0.45, 3: 0.45}[int(cls)] <= fill <= {0: 1, 1: 0.88, 2: 0.62, 3: 0.72}[int(cls)]
        union += m
    assert union.max() == 1  # objects never overlap, so no label hides behind another shape


def test_jpeg_boxes_enclose_coloured_pixels(tmp_path):
    y = ensure_synthetic(tmp_path / "s", **SMALL)
    shapes = set()
    for img_path in sorted((y.parent / "images" / "val").glob("*.jpg")):
        im = read_image(img_path).astype(int)
        h, w = im.shape[:2]
        shapes.add((h, w))
        rows = np.loadtxt(str(img_path).replace("/images/", "/labels/").replace(".jpg", ".txt"), ndmin=2)
        for cls, cx, cy, bw, bh in rows:
            x1, y1 = round((cx - bw / 2) * w), round((cy - bh / 2) * h)
            x2, y2 = round((cx + bw / 2) * w), round((cy + bh / 2) * h)
            coloured = np.abs(im - COLORS[int(cls)]).max(2) < 50
            inside = coloured[y1:y2, x1:x2]
            assert inside.mean() > 0.4
            # tight: the coloured pixels reach every side of the box (within JPEG blur), and none lie 3 px out
            ys, xs = np.nonzero(inside)
            assert xs.min() <= 2
            assert ys.min() <= (2 if cls != 2 else 10)  # a triangle apex is a thin tip, blurred by JPEG
            assert xs.max() >= x2 - x1 - 3
            assert ys.max() >= y2 - y1 - 3
            outer = coloured.copy()
            outer[max(y1 - 3, 0) : y2 + 3, max(x1 - 3, 0) : x2 + 3] = False
            band = outer[max(y1 - 4, 0) : y2 + 4, max(x1 - 4, 0) : x2 + 4]
            assert band.mean() < 0.05
    assert len(shapes) > 1
    assert any(h != w for h, w in shapes)
    assert all(240 <= s <= 400 for hw in shapes for s in hw)


def test_yaml_loads_and_scans_clean(tmp_path):
    y = ensure_synthetic(tmp_path / "s", **SMALL)
    spec = load_dataset_file(y)
    assert spec.names == list(NAMES)
    assert (len(spec.train), len(spec.val)) == (24, 8)
    for split in ("train", "val"):
        idx = scan_labels(spec.files(split), spec.num_classes, spec.cache_path(split), split)
        r = idx.report
        assert (r.corrupt, r.duplicates, r.repaired, r.converted, r.backgrounds) == (0, 0, 0, 0, 0)
        assert len(idx) == len(spec.files(split))
        assert all(1 <= len(lb) <= 6 for lb in idx.labels)
        assert sorted({int(c) for lb in idx.labels for c in lb[:, 0]}) == [0, 1, 2, 3]
        # recorded shapes are the decoded image shapes
        assert tuple(idx.shapes[0]) == read_image(idx.im_files[0]).shape[:2]


def test_default_root_is_under_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    y = ensure_synthetic(num_train=2, num_val=1)
    assert y == tmp_path / "datasets" / "synthetic" / "data.yaml"


def test_camera_options_noise_and_object_size(tmp_path):
    """``noise`` sets the JPEG size (the camera-sized benchmark set uses a phone photo's), ``max_object_side`` the
    box sizes; the defaults leave the marker as it was, so existing datasets are not regenerated."""
    base = ensure_synthetic(tmp_path / "base", **SMALL)
    quiet = ensure_synthetic(tmp_path / "quiet", noise=4, **SMALL)
    big = ensure_synthetic(tmp_path / "big", min_side=600, max_side=800, max_object_side=400, **SMALL)
    assert set(json.loads((base.parent / MARKER).read_text())) == {
        "version", "num_train", "num_val", "seed", "min_side", "max_side", "quality"
    }  # fmt: skip
    assert json.loads((quiet.parent / MARKER).read_text())["noise"] == 4

    def jpeg_bytes(y: Path) -> int:
        return sum(p.stat().st_size for p in (y.parent / "images" / "train").glob("*.jpg"))

    assert jpeg_bytes(quiet) < 0.6 * jpeg_bytes(base)

    def largest_side(y: Path) -> float:
        spec = load_dataset_file(y)
        index = scan_labels(spec.files("train"), spec.num_classes, spec.cache_path("train"), "train")
        return max(float((lb[:, 3:5] * np.asarray(s)[::-1]).max()) for lb, s in zip(index.labels, index.shapes))

    assert largest_side(base) <= 150 < largest_side(big)
