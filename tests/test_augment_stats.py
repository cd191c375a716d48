"""The fast paths of a training sample against the canvas oracle (tests/_reference_augment.py), sample by sample and
in distribution: the direct mosaic warp, the RGBA warp and the albumentations gate.

The mosaic samples are drawn at s = 160 from a small synthetic dataset (images 100-200 px, so upscaled, non-square
and leaving fill on the canvas)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _reference_augment import (
    reference_item,
    reference_load_mosaic,
    reference_mosaic4,
    reference_random_perspective,
)
from torch.utils.data import DataLoader

from yolo5l.data import augment as aug
from yolo5l.data import letterbox as lbx
from yolo5l.data.dataset import YOLODataset, sample_rng
from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.synthetic import ensure_synthetic

S = 160
KEYS = [(i % 32, (0, i // 32, 0)) for i in range(320)]  # (index, (seed, epoch, rank)): 10 epochs of 32 images


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    yaml = ensure_synthetic(
        tmp_path_factory.mktemp("syn") / "synthetic", num_train=32, num_val=4, seed=0, min_side=100, max_side=200
    )
    spec = load_dataset_file(yaml)
    return scan_labels(spec.files("train"), spec.num_classes, spec.cache_path("train"))


def make_ds(index, **hyp) -> YOLODataset:
    ds = YOLODataset(index, imgsz=S, augment=True, hyp=hyp, cache="ram")
    ds.fill_cache()
    return ds


@pytest.fixture(scope="module")
def ds(index):
    return make_ds(index)


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def seam_band(ds: YOLODataset, index: int, key) -> np.ndarray:
    """(S, S) bool: output pixels of the mosaic of (index, key) whose bilinear taps may straddle two regions of the
    canvas (one of the 4 images, or the fill, outside the canvas included), grown by a pixel for the warp's
    fixed-point rounding. Replays the sample's draws up to the perspective matrix."""
    rng = sample_rng(index, key)
    xc, yc = (int(rng.uniform(-b, 2 * S + b)) for b in ds.mosaic_border)
    idx = [index, *(int(i) for i in rng.choice(ds.indices, size=3))]
    idx = [idx[i] for i in rng.permutation(4)]
    h = ds.hyp
    M, _ = aug.perspective_matrix(
        (2 * S, 2 * S), ds.mosaic_border, h["degrees"], h["translate"], h["scale"], h["shear"], 0.0, rng
    )
    # the oracle's own placement, painted with region ids (the fill keeps its value, 114)
    ids = [np.full((*ds.load_image(i)[0].shape[:2], 1), k, np.uint8) for k, i in enumerate(idx)]
    region, _ = reference_mosaic4(ids, [np.zeros((0, 5), np.float32)] * 4, S, (xc, yc))
    region = np.pad(region[..., 0], 2, constant_values=lbx.FILL)  # outside the canvas reads as fill
    mixed = np.zeros_like(region, bool)  # canvas pixel (x, y) whose 2x2 block {x, x+1} x {y, y+1} is not uniform
    mixed[:-1, :-1] = (region[:-1, :-1] != region[1:, :-1]) | (region[:-1, :-1] != region[:-1, 1:])
    mixed[:-1, :-1] |= region[:-1, :-1] != region[1:, 1:]
    grown = mixed.copy()
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            grown |= np.roll(mixed, (dy, dx), (0, 1))
    inv = np.linalg.inv(M)
    ys, xs = np.mgrid[0:S, 0:S]
    cx = inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]
    cy = inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]
    fx = np.clip(np.floor(cx).astype(int) + 2, 0, region.shape[1] - 1)
    fy = np.clip(np.floor(cy).astype(int) + 2, 0, region.shape[0] - 1)
    return grown[fy, fx]


# --------------------------------------------------------------------------------------------- sample by sample
@pytest.mark.parametrize("hyp", [{}, {"degrees": 10.0, "shear": 3.0}, {"scale": 0.9, "translate": 0.3}])
def test_direct_mosaic_matches_canvas_oracle(index, hyp):
    """Same labels, bit for bit; the pixels differ along the seams, elsewhere only rarely by a grey level of
    rounding (the tile's own origin changes the warp's fixed-point coordinates), and the seams are a small part."""
    ds = make_ds(index, **hyp)
    keys = KEYS if not hyp else KEYS[::4]
    fractions, mean_abs, off_seam_differ, off_seam_pixels = [], [], 0, 0
    for i, key in keys:
        img, lab = ds.load_mosaic(i, sample_rng(i, key))
        ref_img, ref_lab = reference_load_mosaic(ds, i, sample_rng(i, key))
        assert lab.dtype == ref_lab.dtype == np.float32
        np.testing.assert_array_equal(lab, ref_lab)
        assert img.shape == ref_img.shape == (S, S, 3)
        assert img.flags.c_contiguous
        diff = np.abs(img.astype(int) - ref_img.astype(int))
        off_seam = diff.max(-1)[~seam_band(ds, i, key)]
        assert off_seam.max(initial=0) <= 1  # off the seams: interpolation rounding at most
        off_seam_differ += (off_seam > 0).sum()
        off_seam_pixels += off_seam.size
        fractions.append((diff.max(-1) > 0).mean())
        mean_abs.append(diff.mean())
    # measured at s=160, default hyp: ~1% of the pixels differ on average, 2.5% at most, mean |diff| 0.06 (0.16 at
    # most); off the seams 0.01% of the pixels, by one grey level
    assert off_seam_differ / off_seam_pixels < 1e-3
    assert np.mean(fractions) < 0.015
    assert np.max(fractions) < 0.04
    assert np.mean(mean_abs) < 0.1
    assert np.max(mean_abs) < 0.3


def test_direct_mosaic_loads_only_the_images_the_output_shows(index, monkeypatch):
    """An image whose placed rectangle the output never samples is not loaded (not decoded, without a cache); the
    result is still the oracle's, which loads all four. About one mosaic in five leaves one out."""
    ds = YOLODataset(index, imgsz=S, augment=True)  # no cache: every load is a decode
    loaded: list[int] = []
    load = ds.cache.load
    monkeypatch.setattr(ds.cache, "load", lambda i, rows=None: (loaded.append(i), load(i, rows))[1])
    per_mosaic = []
    for i, key in KEYS[::2]:
        loaded.clear()
        img, lab = ds.load_mosaic(i, sample_rng(i, key))
        per_mosaic.append(len(loaded))
        if len(loaded) < 4:  # the left-out image changes nothing
            ref_img, ref_lab = reference_load_mosaic(ds, i, sample_rng(i, key))
            np.testing.assert_array_equal(lab, ref_lab)
            assert np.abs(img.astype(int) - ref_img.astype(int)).mean() < 0.3
    per_mosaic = np.asarray(per_mosaic)
    assert per_mosaic.min() >= 1
    assert per_mosaic.max() == 4
    assert 3.3 < per_mosaic.mean() < 3.95, np.bincount(per_mosaic)


@pytest.mark.parametrize("hyp", [{"copy_paste": 0.5, "degrees": 5.0}, {"perspective": 0.0005, "shear": 2.0}])
def test_canvas_path_is_the_oracle_bit_for_bit(index, hyp):
    """Copy-paste and perspective keep the canvas; its RGBA warp gives the 3-channel warp's pixels exactly."""
    ds = make_ds(index, **hyp)
    for i, key in KEYS[::8]:
        img, lab = ds.load_mosaic(i, sample_rng(i, key))
        ref_img, ref_lab = reference_load_mosaic(ds, i, sample_rng(i, key))
        np.testing.assert_array_equal(lab, ref_lab)
        np.testing.assert_array_equal(img, ref_img)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"degrees": 20.0, "shear": 5.0, "scale": 0.8},
        {"perspective": 0.001, "degrees": 5.0},
        {"border": (-40, -30)},
        {"border": (16, 8), "translate": 0.3},
    ],
)
def test_random_perspective_equals_reference(kw):
    rng = np.random.default_rng(0)
    for k in range(6):
        img = rng.integers(0, 256, (int(rng.integers(90, 200)), int(rng.integers(90, 200)), 3), dtype=np.uint8)
        h, w = img.shape[:2]
        xy = np.sort(rng.uniform(0, [w, h], (12, 2, 2)), axis=1).reshape(12, 4)  # x1 < x2, y1 < y2
        labels = np.concatenate([rng.integers(0, 4, (12, 1)), xy[:, [0, 2, 1, 3]]], 1).astype(np.float32)
        out, lab = aug.random_perspective(img, labels.copy(), **kw, rng=np.random.default_rng(k))
        ref, ref_lab = reference_random_perspective(img, labels.copy(), **kw, rng=np.random.default_rng(k))
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(lab, ref_lab)


# --------------------------------------------------------------------------------------------- distributions
class PixelMoments:
    """Per-channel mean and std and the fraction of fill pixels over many images, from running sums."""

    def __init__(self) -> None:
        self.n, self.sum, self.sq, self.fill = 0, np.zeros(3), np.zeros(3), 0

    def add(self, img: np.ndarray) -> None:
        px = img.reshape(-1, 3)
        self.n += len(px)
        self.sum += px.sum(0, dtype=np.float64)
        self.sq += np.einsum("ij,ij->j", px, px, dtype=np.float64)
        self.fill += int((px == lbx.FILL).all(1).sum())

    def stats(self) -> tuple[np.ndarray, np.ndarray, float]:
        mean = self.sum / self.n
        return mean, np.sqrt(self.sq / self.n - mean**2), self.fill / self.n


def test_mosaic_pixel_statistics_match_oracle(ds):
    """Over many mosaics: per-channel means and stds and the fill fraction agree within a fraction of a grey level."""
    new, ref = PixelMoments(), PixelMoments()
    for i, key in KEYS:
        new.add(ds.load_mosaic(i, sample_rng(i, key))[0])
        ref.add(reference_load_mosaic(ds, i, sample_rng(i, key))[0])
    (mean, std, fill), (ref_mean, ref_std, ref_fill) = new.stats(), ref.stats()
    # measured: means and stds within 0.04 grey levels, the fill fractions equal to 1e-4
    np.testing.assert_allclose(mean, ref_mean, atol=0.1)
    np.testing.assert_allclose(std, ref_std, atol=0.1)
    assert ref_fill > 0.05  # the test sees fill at all
    assert abs(fill - ref_fill) < 0.001


def _channel_mean_std(img: np.ndarray) -> np.ndarray:
    px = img.reshape(-1, 3).astype(np.float64)
    return np.stack([px.mean(0), px.std(0)])


def _box_table(labels: list[np.ndarray]) -> dict[str, np.ndarray]:
    lab = np.concatenate(labels)
    return {"cx": lab[:, 1], "cy": lab[:, 2], "w": lab[:, 3], "h": lab[:, 4]}


def test_training_samples_distribution_matches_oracle(index):
    """Whole samples (mosaic, albumentations, HSV, flips) of the new path and of the oracle, the same keys: the
    geometry draws are shared, the later draws differ (the albumentations gate draws from the sample generator), so
    the samples are compared in distribution: boxes by KS statistic, mean, std and quantiles; pixels by channel."""
    ds = make_ds(index, flipud=0.5)
    ds.albumentations = aug.Albumentations(p=0.1)  # each transform fires in some samples (both paths use it)
    new_lab, ref_lab, n_new, n_ref, new_px, ref_px = [], [], [], [], [], []
    for i, key in KEYS:
        img, lab, _, shapes = ds[(i, True, key)]
        assert shapes is None
        new_lab.append(lab[:, 1:].numpy())
        new_px.append(_channel_mean_std(img.permute(1, 2, 0).numpy()))
        n_new.append(len(lab))
        rimg, rlab = reference_item(ds, i, sample_rng(i, key))
        ref_lab.append(rlab)
        ref_px.append(_channel_mean_std(rimg))
        n_ref.append(len(rlab))
    assert n_new == n_ref  # the geometry (hence which boxes survive) is shared
    new_box, ref_box = _box_table(new_lab), _box_table(ref_lab)
    assert len(new_box["w"]) > 500
    for k in ("w", "h"):  # flips do not change sizes: identical multisets
        np.testing.assert_array_equal(np.sort(new_box[k]), np.sort(ref_box[k]))
    for k in ("cx", "cy"):  # flips redrawn: equal in distribution
        a, b = new_box[k], ref_box[k]
        assert ks_statistic(a, b) < 0.06, k
        assert abs(a.mean() - b.mean()) < 0.03, k
        assert abs(a.std() - b.std()) < 0.02, k
        np.testing.assert_allclose(np.quantile(a, [0.1, 0.5, 0.9]), np.quantile(b, [0.1, 0.5, 0.9]), atol=0.05)
    # per image channel means and stds (the HSV gains are redrawn too): the averages agree within 4 standard errors
    new_px, ref_px = np.array(new_px), np.array(ref_px)  # (n, 2, 3)
    standard_error = np.sqrt((new_px.var(0) + ref_px.var(0)) / len(new_px))
    assert (np.abs(new_px.mean(0) - ref_px.mean(0)) < 4 * standard_error).all()
    for c in range(3):
        assert ks_statistic(new_px[:, 0, c], ref_px[:, 0, c]) < 0.15


# --------------------------------------------------------------------------------------------- determinism
def _items(ds: YOLODataset, keys) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [ds[(i, True, key)][:2] for i, key in keys]


def _assert_same(a, b) -> None:
    for (ia, la), (ib, lb) in zip(a, b, strict=True):
        assert torch.equal(ia, ib)
        assert torch.equal(la, lb)


def _by_key(item):
    return item


def test_sample_is_a_function_of_its_key(index):
    """Two fresh datasets, the keys in another order, and worker processes all give the same samples."""
    keys = [*KEYS[:24], (3, (7, 2, 1)), (3, (7, 2, 0))]
    first = _items(make_ds(index), keys)
    np.random.seed(123)  # the global state plays no part
    second = make_ds(index)
    order = np.random.default_rng(1).permutation(len(keys))
    shuffled = dict(zip(order.tolist(), _items(second, [keys[j] for j in order]), strict=True))
    _assert_same(first, [shuffled[j] for j in range(len(keys))])
    loader = DataLoader(
        second, batch_size=None, sampler=[(i, True, key) for i, key in keys], num_workers=2, collate_fn=_by_key
    )
    _assert_same(first, [item[:2] for item in loader])
    assert not torch.equal(first[-1][0], first[-2][0])  # the rank is part of the key


# --------------------------------------------------------------------------------------------- albumentations
def _count_fires(a: aug.Albumentations) -> list[int]:
    """Counts, per transform, the calls in which it fired (its parameters are drawn only then)."""
    counts = [0] * len(a.transform.transforms)
    for k, t in enumerate(a.transform.transforms):

        def counted(*args, _k=k, _get=t.get_params, **kw):
            counts[_k] += 1
            return _get(*args, **kw)

        t.get_params = counted
    return counts


def test_albumentations_gate_fires_each_transform_with_p():
    n, p = 800, 0.5
    a = aug.Albumentations(p=p)
    counts = _count_fires(a)
    img = np.random.default_rng(0).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    rng = np.random.default_rng(0)
    untouched, fired = 0, []
    for _ in range(n):
        before = list(counts)
        out = a(img, rng=rng)
        fired.append([c - b for c, b in zip(counts, before, strict=True)])
        untouched += out is img
        assert out.shape == img.shape
        assert out.dtype == np.uint8
    fired = np.array(fired, bool)
    # binomial(800, 0.5): sd 0.018 of the rate; the bounds are ~4 sd
    np.testing.assert_allclose(fired.mean(0), p, atol=0.07)
    np.testing.assert_allclose((fired[:, 0] & fired[:, 3]).mean(), p * p, atol=0.06)  # independent
    assert untouched == (~fired.any(1)).sum()  # the image comes back as it is exactly when none fired
    np.testing.assert_allclose(untouched / n, (1 - p) ** 4, atol=0.03)
    # the same generator state gives the same result
    a2 = aug.Albumentations(p=p)
    for k in range(20):
        np.testing.assert_array_equal(a2(img, rng=np.random.default_rng(k)), a2(img, rng=np.random.default_rng(k)))


def test_albumentations_default_p_rarely_fires_and_without_rng_uses_its_own_generators():
    a = aug.Albumentations()
    counts = _count_fires(a)
    img = np.random.default_rng(1).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    rng = np.random.default_rng(1)
    outs = [a(img, rng=rng) for _ in range(2000)]
    assert 40 < sum(counts) < 120  # 4 transforms at p 0.01: 80 expected
    assert sum(o is img for o in outs) > 1850
    b = aug.Albumentations(p=0.5)
    counts = _count_fires(b)
    b.reseed(3)
    first = [b(img) for _ in range(30)]
    assert 30 < sum(counts) < 90  # the Compose's own draws fire them too
    b.reseed(3)
    for x, y in zip(first, [b(img) for _ in range(30)], strict=True):
        np.testing.assert_array_equal(x, y)


# --------------------------------------------------------------------------------------------- the device path
def _device_items(ds: YOLODataset, keys, chunk: int = 40) -> list[tuple[np.ndarray, np.ndarray]]:
    """(image HWC, labels (n, 5)) of the training samples ``keys`` as the device input path makes them (on the CPU)."""
    from yolo5l.data.device_input import DeviceInput
    from yolo5l.data.plan import collate_plans

    out = []
    for s in range(0, len(keys), chunk):
        plans = [ds[(i, True, key)] for i, key in keys[s : s + chunk]]
        images = DeviceInput("cpu")(collate_plans(plans)[0]).permute(0, 2, 3, 1).numpy()
        out += [(img, p.labels[:, 1:].numpy()) for img, p in zip(images, plans, strict=True)]
    return out


@pytest.mark.heavy
def test_device_path_mosaic_statistics_match_oracle(index):
    """The same moments and fill fraction as the canvas oracle's mosaics (HSV and flips off: the geometry alone)."""
    off = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0, "fliplr": 0.0}
    ds = make_ds(index, **off)
    ds.plan_on_device("pixels")
    ds.albumentations = None  # every sample on the device
    new, ref = PixelMoments(), PixelMoments()
    for (img, _), (i, key) in zip(_device_items(ds, KEYS), KEYS, strict=True):
        new.add(img)
        rng = sample_rng(i, key)
        rng.random()  # the mosaic's draw
        ref.add(reference_load_mosaic(ds, i, rng)[0])
    (mean, std, fill), (ref_mean, ref_std, ref_fill) = new.stats(), ref.stats()
    np.testing.assert_allclose(mean, ref_mean, atol=0.1)
    np.testing.assert_allclose(std, ref_std, atol=0.1)
    assert ref_fill > 0.05
    assert abs(fill - ref_fill) < 0.001


@pytest.mark.heavy
def test_device_path_training_samples_distribution_matches_oracle(index):
    """Whole samples of the device path (albumentations' samples made on the host) against the oracle's, in
    distribution, as the host path's are in test_training_samples_distribution_matches_oracle."""
    ds = make_ds(index, flipud=0.5)
    ds.albumentations = aug.Albumentations(p=0.1)
    ds.plan_on_device("pixels")
    new_lab, ref_lab, new_px, ref_px = [], [], [], []
    for (img, lab), (i, key) in zip(_device_items(ds, KEYS), KEYS, strict=True):
        new_lab.append(lab)
        new_px.append(_channel_mean_std(img))
        rimg, rlab = reference_item(ds, i, sample_rng(i, key))
        ref_lab.append(rlab)
        ref_px.append(_channel_mean_std(rimg))
    assert [len(a) for a in new_lab] == [len(b) for b in ref_lab]
    new_box, ref_box = _box_table(new_lab), _box_table(ref_lab)
    for k in ("w", "h"):
        np.testing.assert_array_equal(np.sort(new_box[k]), np.sort(ref_box[k]))
    for k in ("cx", "cy"):
        a, b = new_box[k], ref_box[k]
        assert ks_statistic(a, b) < 0.06, k
        assert abs(a.mean() - b.mean()) < 0.03, k
    new_px, ref_px = np.array(new_px), np.array(ref_px)
    standard_error = np.sqrt((new_px.var(0) + ref_px.var(0)) / len(new_px))
    assert (np.abs(new_px.mean(0) - ref_px.mean(0)) < 4 * standard_error).all()
    for c in range(3):
        assert ks_statistic(new_px[:, 0, c], ref_px[:, 0, c]) < 0.15


def test_device_path_sample_is_a_function_of_its_key(index):
    """Two fresh datasets, another order, worker processes: the same planned samples, made into the same pixels."""
    keys = [*KEYS[:16], (3, (7, 2, 1)), (3, (7, 2, 0))]
    first = make_ds(index)
    first.plan_on_device("pixels")
    a = _device_items(first, keys)
    second = make_ds(index)
    second.plan_on_device("pixels")
    order = np.random.default_rng(1).permutation(len(keys))
    b = dict(zip(order.tolist(), _device_items(second, [keys[j] for j in order]), strict=True))
    for j, (img, lab) in enumerate(a):
        np.testing.assert_array_equal(img, b[j][0])
        np.testing.assert_array_equal(lab, b[j][1])
    from yolo5l.data.plan import collate_plans

    loader = DataLoader(second, batch_size=6, sampler=[(i, True, key) for i, key in keys], num_workers=2,
                        collate_fn=collate_plans)  # fmt: skip
    for k, (_, targets, _, _) in enumerate(loader):
        in_process = collate_plans([first[(i, True, key)] for i, key in keys[6 * k : 6 * k + 6]])[1]
        assert torch.equal(targets, in_process)
    assert not np.array_equal(a[-1][0], a[-2][0])  # the rank is part of the key
