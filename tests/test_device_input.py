"""The device input path against the host path and OpenCV: each batched op against the OpenCV call v7.0 makes, whole
samples (labels to the bit, pixels within a grey level) for every tile source, the host fallback, the loader that
makes a batch ahead, the device cache and the datamodule's wiring. All on the CPU: every op runs on CPU tensors."""

from __future__ import annotations

import shutil

import cv2
import numpy as np
import pytest
import torch
from _reference_augment import reference_augment_hsv, reference_load_mosaic, reference_random_perspective
from PIL import Image
from torch.utils.data import DataLoader

from yolo5l.data import augment as aug
from yolo5l.data import render
from yolo5l.data.box_format import xyxy_to_xywhn
from yolo5l.data.datamodule import YOLODataModule
from yolo5l.data.dataset import YOLODataset, collate_fn, sample_rng
from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.data.device_input import DeviceCache, DeviceInput, DeviceInputLoader
from yolo5l.data.images import _ORIENT
from yolo5l.data.jpeg_header import read_jpeg_header
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.letterbox import resized_shape
from yolo5l.data.mosaic import mixup
from yolo5l.data.plan import collate_plans
from yolo5l.data.synthetic import ensure_synthetic

S = 160
KEYS = [(i % 24, (0, i // 24, 0)) for i in range(48)]
NO_JITTER = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """24 training images of 100-400 px: up- and downscaled to 160, non-square, leaving fill in the mosaics."""
    yaml = ensure_synthetic(
        tmp_path_factory.mktemp("syn") / "synthetic", num_train=24, num_val=4, seed=0, min_side=100, max_side=400
    )
    spec = load_dataset_file(yaml)
    return scan_labels(spec.files("train"), spec.num_classes, spec.cache_path("train"))


def make_ds(index, source: str | None = None, cache: str = "none", **hyp) -> YOLODataset:
    ds = YOLODataset(index, imgsz=S, augment=True, hyp=hyp, cache=cache, reduced_decode=False)
    ds.fill_cache()
    if source is not None:
        ds.plan_on_device(source)
    return ds


def render_items(ds: YOLODataset, keys, device_input: DeviceInput | None = None):
    """(plans, images (B, H, W, 3) uint8 numpy) of the planned items ``keys``, made on the CPU."""
    plans = [ds[(i, True, key)] for i, key in keys]
    batch, targets, _paths, _shapes = collate_plans(plans)
    images = (device_input or DeviceInput("cpu"))(batch)
    assert images.dtype == torch.uint8
    assert images.is_contiguous(memory_format=torch.channels_last)
    return plans, images.permute(0, 2, 3, 1).numpy(), targets


def reference_sample(ds: YOLODataset, index: int, key) -> tuple[np.ndarray, np.ndarray]:
    """Sample (index, key) as ultralytics/yolov5 v7.0 makes it, the draws in ``YOLODataset._item``'s order: the
    canvas mosaic (or the letterbox + warp), mixup, albumentations, HSV through v7.0's tables, the flips. Returns
    (image, labels (n, 5) normalised)."""
    h = ds.hyp
    rng = sample_rng(index, key)
    if rng.random() < h["mosaic"]:
        img, labels = reference_load_mosaic(ds, index, rng)
        if rng.random() < h["mixup"]:
            img, labels = mixup(img, labels, *reference_load_mosaic(ds, int(rng.choice(ds.indices)), rng), rng=rng)
    else:
        img, labels, _ = ds._letterboxed(index)
        geometry = {k: h[k] for k in ("degrees", "translate", "scale", "shear", "perspective")}
        img, labels = reference_random_perspective(img, labels, **geometry, rng=rng)
    if len(labels):
        labels[:, 1:5] = xyxy_to_xywhn(labels[:, 1:5], img.shape[1], img.shape[0], clip=True)
    img = np.ascontiguousarray(ds.albumentations(img, rng=rng))
    reference_augment_hsv(img, h["hsv_h"], h["hsv_s"], h["hsv_v"], rng=rng)
    if rng.random() < h["flipud"]:
        img = aug.flip_ud(img, labels)
    if rng.random() < h["fliplr"]:
        img = aug.flip_lr(img, labels)
    return img, labels


# --------------------------------------------------------------------------------------------- the ops
def _jpeg(img: np.ndarray, **save) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", **save)
    return buf.getvalue()


def test_jpeg_header_from_bytes():
    rgb = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    base = read_jpeg_header(_jpeg(rgb))
    assert base[:2] == (37, 53)
    assert base.components == 3
    assert base.orientation == 1
    assert base.gpu_decodable
    progressive = read_jpeg_header(_jpeg(rgb, progressive=True))
    assert progressive.sof == 0xC2
    assert not progressive.gpu_decodable
    grey = read_jpeg_header(_jpeg(rgb[..., 0]))
    assert grey.components == 1
    assert not grey.gpu_decodable
    import io

    cmyk = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(cmyk, "JPEG")
    assert read_jpeg_header(cmyk.getvalue()).components == 4
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        header = read_jpeg_header(_jpeg(rgb, exif=exif.tobytes()))
        assert header.orientation == orientation
        assert header[:2] == (37, 53)
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, "PNG")
    assert read_jpeg_header(png.getvalue()) is None
    assert read_jpeg_header(_jpeg(rgb)[:20]) is None  # cut before the frame header


@pytest.mark.parametrize("target", [160, 320])  # down- and upscaling
def test_resize_tiles_is_opencv_inter_linear_with_exif_orientation(target):
    rng = np.random.default_rng(target)
    src, infos, out_info, refs, off, ooff = [], [], [], [], 0, 0
    for orientation in range(1, 9):
        h0, w0 = (int(v) for v in rng.integers(150, 400, 2))
        img = cv2.GaussianBlur(rng.integers(0, 256, (h0, w0, 3), dtype=np.uint8), (0, 0), 0.8)
        img[10:40, 20:90] = 255  # a sharp edge
        shown = img if orientation == 1 else _ORIENT[orientation](img)
        hd, wd = shown.shape[:2]
        h, w = resized_shape(hd, wd, target)
        refs.append(cv2.resize(shown, (w, h), interpolation=cv2.INTER_LINEAR))
        planar = torch.from_numpy(img).permute(2, 0, 1).reshape(-1)
        src.append(planar)
        infos.append([off, h0, w0, orientation])
        out_info.append([ooff, h, w])
        off, ooff = off + planar.numel(), ooff + h * w * 3
    out = torch.zeros(ooff, dtype=torch.uint8)
    render.resize_tiles(torch.cat(src), torch.tensor(infos), out, torch.tensor(out_info), max_pixels=150_000)
    for (o, h, w), ref in zip(out_info, refs, strict=True):
        diff = np.abs(out[o : o + 3 * h * w].reshape(h, w, 3).numpy().astype(int) - ref)
        if target == 160:
            assert diff.max() == 0  # OpenCV's fixed point, bit for bit
        else:
            assert diff.max() <= 1
            assert (diff > 0).mean() < 0.01


def test_hsv_is_opencv_on_every_8bit_colour():
    """OpenCV's 8-bit RGB -> HSV on all 2^24 colours and HSV -> RGB on all 180 x 256 x 256 HSV colours, equal; so
    v7.0's augment_hsv (cv2.cvtColor, three cv2.LUT tables, cv2.cvtColor) is equal too, whatever the tables: shown
    for v7.0's default gains and gains that wrap the hue."""
    r, g, b = np.meshgrid(np.arange(256), np.arange(256), np.arange(256), indexing="ij")
    colours = np.stack([r, g, b], -1).astype(np.uint8).reshape(4096, 4096, 3)
    hsv = render._rgb_to_hsv(torch.from_numpy(colours)[None])[0].numpy()
    assert np.array_equal(hsv, cv2.cvtColor(colours, cv2.COLOR_RGB2HSV))
    shown = colours[colours[..., 0] < 180].reshape(-1, 4096, 3)  # (h < 180, s, v): every HSV colour
    rgb = render._hsv_to_rgb(torch.from_numpy(shown).long()[None])[0].numpy()
    assert np.array_equal(rgb, cv2.cvtColor(shown, cv2.COLOR_HSV2RGB))
    # OpenCV converts each row in blocks of 64 pixels (AVX-512; 32 with AVX2) and the row's remainder with scalar
    # code that rounds where the vector code truncates: rows a multiple of 64 wide (v7.0's 640) are the vector path's
    some = np.ascontiguousarray(colours[::8, ::4])  # 512 x 1024
    for gain in (np.array([1.015, 1.7, 0.6]), np.array([1.3, 1.0, 1.0])):
        got = render.hsv_lut(torch.from_numpy(some)[None], torch.from_numpy(aug.hsv_tables(gain))[None])[0].numpy()
        ref = some.copy()
        lut = aug.hsv_tables(gain)
        h = cv2.cvtColor(ref, cv2.COLOR_RGB2HSV)
        h = cv2.merge([cv2.LUT(h[..., c], lut[c]) for c in range(3)])
        assert np.array_equal(got, cv2.cvtColor(h, cv2.COLOR_HSV2RGB)), gain


def test_device_hsv_tables_are_v7s():
    """The device builds v7.0's tables from the gains the worker drew, equal to NumPy's for any gain."""
    gains = np.random.default_rng(4).uniform(-1, 1, (64, 3)) * [0.3, 0.9, 0.9] + 1
    gains[0] = [1.0, 1.0, 1.0]
    gains[1] = [1.4, 2.0, 0.0]  # a hue that wraps, S and V clipped at 255 and at 0
    got = render.hsv_tables(torch.from_numpy(gains)).numpy()
    assert np.array_equal(got, np.stack([aug.hsv_tables(g) for g in gains]))


def test_hsv_tables_are_v7s_and_the_host_path_uses_them_for_large_gains():
    x = np.arange(256, dtype=np.float64)
    gain = np.array([1.2, 0.5, 1.9])
    lut = aug.hsv_tables(gain)
    assert np.array_equal(lut[0], ((x * 1.2) % 180).astype(np.uint8))
    assert np.array_equal(lut[2], np.clip(x * 1.9, 0, 255).astype(np.uint8))
    img = np.random.default_rng(3).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    ours, ref = img.copy(), img.copy()
    aug.augment_hsv(ours, 1.0, 0.5, 0.5, rng=np.random.default_rng(5))  # a hue gain beyond 255/179: the tables
    reference_augment_hsv(ref, 1.0, 0.5, 0.5, rng=np.random.default_rng(5))
    if aug.hsv_gains(1.0, 0.5, 0.5, np.random.default_rng(5))[0] * 179 >= 256:
        assert np.array_equal(ours, ref)


@pytest.mark.parametrize("perspective", [0.0, 0.0008])
def test_warp_layers_is_opencv_warp_of_the_canvas(perspective):
    """One image on a canvas of fill, warped: OpenCV's warpAffine / warpPerspective of the whole canvas, within a grey
    level on a few pixels (OpenCV's vector path rounds some coordinates after a fused multiply-add)."""
    rng = np.random.default_rng(1)
    size = (96, 128)
    for k in range(4):
        img = cv2.GaussianBlur(rng.integers(0, 256, (70, 90, 3), dtype=np.uint8), (0, 0), 1.0)
        img[20:40, 30:60] = 0
        canvas = np.full((160, 160, 3), 114, np.uint8)
        top, left = 30 + k, 40 - k
        canvas[top : top + 70, left : left + 90] = img
        M, _ = aug.perspective_matrix(
            (160, 160), (-32, -16), 10.0, 0.1, 0.3, 4.0, perspective, np.random.default_rng(k)
        )
        if perspective:
            ref = cv2.warpPerspective(canvas, M, size[::-1], borderValue=(114, 114, 114))
            inv = cv2.invert(M, flags=cv2.DECOMP_LU)[1]
        else:
            ref = cv2.warpAffine(canvas, M[:2], size[::-1], borderValue=(114, 114, 114))
            inv = np.vstack([cv2.invertAffineTransform(M[:2]), [0, 0, 1]])
        flat = torch.from_numpy(img.reshape(-1))
        slots = torch.zeros((1, 4, 7), dtype=torch.int64)
        slots[0, 3] = torch.tensor([-(top * 90 + left) * 3, 90, left, top, left + 90, top + 70, 0])
        for flip in ((False, False), (True, True)):
            got = render.warp_layers(
                flat, slots, torch.from_numpy(inv)[None], torch.zeros((1, 2), dtype=torch.int64),
                torch.tensor([flip]), size, perspective=bool(perspective),
            )[0].numpy()  # fmt: skip
            want = ref[::-1, ::-1] if flip[0] else ref
            diff = np.abs(got.astype(int) - want)
            assert diff.max() <= 1
            assert (diff > 0).mean() < 0.002


def test_blend_mixup_is_v7s():
    rng = np.random.default_rng(2)
    a, b = (rng.integers(0, 256, (2, 17, 23, 3), dtype=np.uint8) for _ in range(2))
    r = rng.beta(32.0, 32.0, 2)
    got = render.blend_mixup(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(r)).numpy()
    for k in range(2):
        ref = (a[k].astype(np.float32) * float(r[k]) + b[k].astype(np.float32) * (1 - float(r[k]))).astype(np.uint8)
        assert np.array_equal(got[k], ref)


# --------------------------------------------------------------------------------------------- whole samples
HYPS = [
    {},
    {"degrees": 10.0, "shear": 3.0, "mixup": 0.5, "flipud": 0.5},
    {"perspective": 0.0005, "scale": 0.3},
    {"mosaic": 0.5, "degrees": 5.0},  # letterboxed samples too
]


def compare_samples(index, keys, source="bytes", cache="none", cache_dir=None, **hyp):
    """Plan and make ``keys`` on the device path; check labels, shapes and targets against the host path's items
    (to the bit) and return the per-sample |pixel differences| from :func:`reference_sample`."""
    host = make_ds(index, None, "none", **hyp)
    ds = YOLODataset(index, imgsz=S, augment=True, hyp=hyp, cache=cache, cache_dir=cache_dir, reduced_decode=False)
    ds.fill_cache()
    ds.plan_on_device(source)
    plans, images, targets = render_items(ds, keys)
    diffs, fractional = [], 0
    for b, ((i, key), plan) in enumerate(zip(keys, plans, strict=True)):
        for t in (t for layer in plan.layers for t in layer.tiles if t is not None):
            # v7.0's load_image size, int(side * r) (ultralytics/yolov5 v7.0 utils/dataloaders.py), on both paths
            h0, w0 = (int(v) for v in host.shapes[t.index])
            r = S / max(h0, w0)
            assert t.hw == (int(h0 * r), int(w0 * r)) == host.load_image(t.index)[0].shape[:2]
            fractional += (round(h0 * r), round(w0 * r)) != t.hw
        _, labels, path, shapes = host[(i, True, key)]
        assert torch.equal(plan.labels[:, 1:], labels[:, 1:])
        assert path == plan.path
        assert shapes == plan.shapes
        assert torch.equal(targets[targets[:, 0] == b, 1:], labels[:, 1:])
        if plan.host is not None:  # CLAHE fired: the host made it, as the host path does
            assert np.array_equal(images[b], host[(i, True, key)][0].permute(1, 2, 0).numpy())
            continue
        ref = reference_sample(host, i, key)
        assert np.array_equal(ref[1], labels[:, 1:].numpy())
        diffs.append(np.abs(images[b].astype(int) - ref[0]))
    assert len(diffs) >= 0.75 * len(keys)
    assert fractional  # tiles whose size the nearest pixel would have made one larger
    return diffs


@pytest.mark.parametrize(
    ("source", "cache", "hyp"),
    [*((s, c, {}) for s, c in (("bytes", "none"), ("pixels", "ram"), ("pixels", "disk"))),
     *(("bytes", "none", h) for h in HYPS[1:]), ("pixels", "ram", HYPS[1])],
)  # fmt: skip
def test_device_mosaics_are_the_host_paths(index, source, cache, hyp, tmp_path):
    """The geometry (HSV gains 0; flips, mixup and letterboxes as drawn): pixels within interpolation rounding of
    v7.0's canvas path of the same draws, max 2 grey levels (measured: 1, on 0.01% of the pixels)."""
    diffs = compare_samples(index, KEYS[::2], source, cache, str(tmp_path), **hyp, **NO_JITTER)
    assert max(d.max() for d in diffs) <= 2
    assert np.mean([d.mean() for d in diffs]) < 0.01
    assert max(d.mean() for d in diffs) < 0.5


@pytest.mark.parametrize("hyp", [{}, {"mixup": 0.5, "flipud": 0.5}])
def test_device_samples_with_hsv_are_the_host_paths(index, hyp):
    """Whole samples, HSV on: OpenCV's 8-bit hue has 180 steps, so a grey level of rounding before the jitter moves
    a saturated pixel by up to one hue step (~8 levels); a few pixels in ten thousand, means far below 0.5."""
    diffs = compare_samples(index, KEYS, **hyp)
    assert np.mean([(d > 0).mean() for d in diffs]) < 0.005  # measured: 0.0009
    assert np.mean([d.mean() for d in diffs]) < 0.02  # measured: 0.002
    assert max(d.mean() for d in diffs) < 0.5


def test_albumentations_on_the_device_and_clahe_and_copy_paste_on_the_host(index):
    """Blur, MedianBlur and ToGray are made on the device (their draws as the host's); a sample CLAHE touches, or that
    copy-paste edits, comes whole from the host path."""
    ds = make_ds(index, "bytes")
    ds.albumentations = aug.Albumentations(p=0.3)
    host = make_ds(index)
    host.albumentations = aug.Albumentations(p=0.3)
    plans, images, _ = render_items(ds, KEYS[:24])
    on_device = [b for b, p in enumerate(plans) if p.host is None and any(p.albu)]
    on_host = [b for b, p in enumerate(plans) if p.host is not None]
    assert len(on_device) >= 6  # 1 - 0.7^3 = 66% touched on the device
    assert len(on_host) >= 3  # CLAHE: 30%
    assert {k for b in on_device for k, v in zip(("blur", "median", "grey"), plans[b].albu) if v} == {
        "blur", "median", "grey"}  # fmt: skip
    for b in on_host:
        i, key = KEYS[b]
        assert np.array_equal(images[b], host[(i, True, key)][0].permute(1, 2, 0).numpy())
    for b in on_device:
        i, key = KEYS[b]
        ref, labels = reference_sample(host, i, key)
        assert np.array_equal(labels, plans[b].labels[:, 1:].numpy())
        diff = np.abs(images[b].astype(int) - ref)
        assert diff.mean() < 0.2  # rounding before a blur spreads; the hue amplifies a level now and then
    plans, images, _ = render_items(make_ds(index, "bytes", copy_paste=0.5), KEYS[:6])
    assert all(p.host is not None for p in plans)


def test_device_albumentations_are_opencvs():
    """Blur and MedianBlur (3, 5, 7) and ToGray on the device against cv2.blur, cv2.medianBlur and cv2.cvtColor
    (albumentations' calls), equal; ToGray on every 8-bit colour."""
    rng = np.random.default_rng(6)
    img = cv2.GaussianBlur(rng.integers(0, 256, (2, 37, 53, 3), dtype=np.uint8)[0], (0, 0), 1.0)
    img[5:20, 8:30] = 255
    img[25:, :10] = 0
    t = torch.from_numpy(img)[None]
    for k in (3, 5, 7):
        assert np.array_equal(render.box_blur(t, k)[0].numpy(), cv2.blur(img, (k, k)))
        assert np.array_equal(render.median_blur(t, k)[0].numpy(), cv2.medianBlur(img, k))
    r, g, b = np.meshgrid(np.arange(256), np.arange(256), np.arange(256), indexing="ij")
    colours = np.stack([r, g, b], -1).astype(np.uint8).reshape(4096, 4096, 3)
    grey = render.to_grey(torch.from_numpy(colours)[None])[0].numpy()
    assert np.array_equal(grey[..., 0], cv2.cvtColor(colours, cv2.COLOR_RGB2GRAY))
    assert np.array_equal(grey[..., 0], grey[..., 2])
    ops = [(5, 0, 1), (0, 3, 0)]
    both = torch.from_numpy(np.stack([img, img[::-1].copy()]))
    got = render.albumentations(both, ops).numpy()
    want0 = np.repeat(cv2.cvtColor(cv2.blur(img, (5, 5)), cv2.COLOR_RGB2GRAY)[..., None], 3, 2)
    assert np.array_equal(got[0], want0)
    assert np.array_equal(got[1], cv2.medianBlur(np.ascontiguousarray(img[::-1]), 3))


def test_albumentations_device_draws_are_the_calls():
    """device_ops draws what a call draws, in the same order: the generator is left in the same state, and the
    kernels are the ones the call applies (CLAHE: None, the host makes those)."""
    a = aug.Albumentations(p=0.4)
    img = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    seen = set()
    for k in range(200):
        r1, r2 = np.random.default_rng(k), np.random.default_rng(k)
        ops = a.device_ops(r1)
        out = a(img, rng=r2)
        if ops is None:
            continue
        assert r1.bit_generator.state == r2.bit_generator.state
        assert np.array_equal(render.albumentations(torch.from_numpy(img)[None], [ops])[0].numpy(), out)
        seen.update(v for v in ops[:2] if v)
    assert seen == {3, 5, 7}


@pytest.fixture(scope="module")
def odd_index(tmp_path_factory, index):
    """A dataset of every kind of file: baseline JPEGs, EXIF-rotated JPEGs (3, 6, 8), PNG, greyscale, CMYK and
    progressive JPEGs; the labels follow the displayed image."""
    root = tmp_path_factory.mktemp("odd")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    kinds = ["jpg", "rot6", "rot3", "rot8", "png", "grey", "cmyk", "progressive"] * 2
    files = []
    for k, (src, kind) in enumerate(zip(index.im_files, kinds, strict=False)):
        img = Image.open(src).convert("RGB")
        stem = f"{k:02d}_{kind}"
        label = src.replace("/images/", "/labels/").rsplit(".", 1)[0] + ".txt"
        shutil.copy(label, root / "labels" / f"{stem}.txt")
        out = root / "images" / f"{stem}.{'png' if kind == 'png' else 'jpg'}"
        if kind.startswith("rot"):
            o = int(kind[3:])
            stored = img.transpose({6: Image.ROTATE_90, 3: Image.ROTATE_180, 8: Image.ROTATE_270}[o])
            exif = Image.Exif()
            exif[0x0112] = o
            stored.save(out, "JPEG", quality=92, exif=exif.tobytes())
        elif kind == "png":
            img.save(out, "PNG")
        elif kind == "grey":
            img.convert("L").save(out, "JPEG", quality=92)
        elif kind == "cmyk":
            img.convert("CMYK").save(out, "JPEG", quality=92)
        else:
            img.save(out, "JPEG", quality=92, progressive=kind == "progressive")
        files.append(str(out))
    return scan_labels(files, 4, root / "labels.cache", "train")


def test_exif_png_greyscale_cmyk_and_progressive_tiles(odd_index):
    """What a GPU decodes travels as bytes (EXIF-rotated JPEGs too, rotated on the device); the rest as the host's
    decoded pixels. Either way the samples are the host path's, within a grey level."""
    ds = YOLODataset(odd_index, imgsz=S, augment=True, hyp=NO_JITTER, reduced_decode=False)
    ds.plan_on_device("bytes")
    host = YOLODataset(odd_index, imgsz=S, augment=True, hyp=NO_JITTER, reduced_decode=False)
    keys = [(i, (0, 0, 0)) for i in range(16)] + [(i, (0, 1, 0)) for i in range(16)]
    plans, images, _ = render_items(ds, keys)
    kinds = {}
    for p in plans:
        for layer in p.layers:
            for t in layer.tiles:
                if t is not None:
                    kinds.setdefault(odd_index.im_files[t.index].rsplit("_", 1)[1].split(".")[0], set()).add(t.kind)
    assert kinds["jpg"] == kinds["rot6"] == kinds["rot3"] == kinds["rot8"] == {0}  # bytes
    assert kinds["png"] == kinds["grey"] == kinds["cmyk"] == kinds["progressive"] == {1}  # pixels
    for b, (i, key) in enumerate(keys):
        ref = reference_sample(host, i, key)
        if ref is None:
            continue
        assert np.array_equal(plans[b].labels[:, 1:].numpy(), ref[1])
        diff = np.abs(images[b].astype(int) - ref[0])
        assert diff.max() <= 2
        assert diff.mean() < 0.05


def test_device_cache_gives_the_bytes_paths_pixels(index):
    """data.cache=device: the images decoded once into one buffer; the batches are the bytes path's exactly."""
    ds = make_ds(index)
    cache = DeviceCache(ds, "cpu")
    assert cache.fill(range(len(ds)))
    assert "cached 24 images" in cache.message
    assert cache.buffer.numel() == ds.cache.nbytes(range(len(ds)))
    ds.plan_on_device("cache")
    _, cached, targets = render_items(ds, KEYS[:12], DeviceInput("cpu", cache))
    _, decoded, targets2 = render_items(make_ds(index, "bytes"), KEYS[:12])
    assert np.array_equal(cached, decoded)
    assert torch.equal(targets, targets2)


def test_device_cache_that_does_not_fit_says_so(index, monkeypatch):
    ds = make_ds(index)
    monkeypatch.setattr("psutil.virtual_memory", lambda: type("VM", (), {"available": 1000})())
    cache = DeviceCache(ds, "cpu")
    assert not cache.fill(range(len(ds)))
    assert cache.buffer is None
    assert "does not fit" in cache.message
    assert "24 images" in cache.message


def test_decode_chunks_bound_the_decoded_pixels(index, monkeypatch):
    """A small decode budget decodes a batch's JPEGs a few at a time, with the same result."""
    calls = []
    decode = render.decode_jpegs
    monkeypatch.setattr(render, "decode_jpegs", lambda data, device: (calls.append(len(data)), decode(data, device))[1])
    ds = make_ds(index, "bytes")
    _, whole, _ = render_items(ds, KEYS[:4])
    n_whole = len(calls)
    calls.clear()
    _, chunked, _ = render_items(ds, KEYS[:4], DeviceInput("cpu", decode_bytes=200_000, max_pixels=40_000))
    assert n_whole == 1
    assert len(calls) > 4
    assert max(calls) <= 2
    assert np.array_equal(whole, chunked)


# --------------------------------------------------------------------------------------------- batches
@pytest.mark.parametrize(("source", "cache"), [("bytes", "none"), ("pixels", "ram")])
def test_collate_plans_in_a_worker_is_in_shared_memory(index, source, cache):
    """The batch's bytes, pixels and host-made images are written straight into shared memory in the worker, so
    they reach the main process without another copy."""
    ds = make_ds(index, source, cache)
    ds.albumentations = aug.Albumentations(p=0.3)  # some samples made on the host
    loader = DataLoader(ds, batch_size=8, sampler=[(i, True, (0, 0, 0)) for i in range(16)], num_workers=1,
                        collate_fn=collate_plans)  # fmt: skip
    for plan, targets, paths, shapes in loader:
        data = plan.jpeg if source == "bytes" else plan.pixels
        assert data.numel()
        assert data.is_shared()
        assert len(plan.host_pos)
        assert plan.host.is_shared()
        assert len(plan) == 8
        assert len(paths) == 8
        assert bool(plan.pixels.numel()) == (source == "pixels")


def test_device_input_loader_makes_each_batch(index):
    """The loader hands out (images, targets, paths, shapes) batches equal to the plans made one by one, with
    workers; twice over (persistent workers)."""
    ds = make_ds(index, "pixels", "ram")
    sampler = [(i, True, (0, 0, 0)) for i in range(10)]
    loader = DeviceInputLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=collate_plans,
                               persistent_workers=True, device_input=DeviceInput("cpu"))  # fmt: skip
    assert len(loader) == 3
    for _ in range(2):
        batches = list(loader)
        assert [b[0].shape[0] for b in batches] == [4, 4, 2]
        for k, (images, targets, paths, _shapes) in enumerate(batches):
            keys = [(i, key) for i, _, key in sampler[4 * k : 4 * k + 4]]
            _, want, want_targets = render_items(ds, keys)
            assert np.array_equal(images.permute(0, 2, 3, 1).numpy(), want)
            assert torch.equal(targets, want_targets)
            assert list(paths) == [ds.im_files[i] for i, _ in keys]
    assert loader.device_wait_seconds() == 0.0  # no CUDA streams on the CPU


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("dm") / "synthetic"
    return {"root": str(root), "num_train": 16, "num_val": 4, "seed": 0, "min_side": 100, "max_side": 160}


def test_datamodule_device_pipeline_gives_the_host_pipelines_batches(synthetic):
    """data.pipeline=device: the loader is the device one; the targets are the host pipeline's, the images within
    rounding (the host warps each tile on its own and rounds its HSV differently at exact halves)."""
    args = {"synthetic": synthetic, "imgsz": 128, "batch_size": 8, "num_workers": 0, "cache": "none"}
    host, device = YOLODataModule(**args), YOLODataModule(**args, pipeline="device")
    host.setup("fit")
    device.setup("fit")
    assert host.input_pipeline == "host"
    assert device.input_pipeline == "device"
    loader = device.train_dataloader()
    assert isinstance(loader, DeviceInputLoader)
    assert loader.collate_fn is collate_plans
    assert not isinstance(host.train_dataloader(), DeviceInputLoader)
    for (a, ta, pa, _), (b, tb, pb, _) in zip(host.train_dataloader(), loader, strict=True):
        assert torch.equal(ta, tb)
        assert pa == pb
        assert a.shape == b.shape
        assert a.dtype == b.dtype == torch.uint8
        assert (a.float() - b.float()).abs().mean() < 0.5
    assert device.resolve_input(torch.device("cuda")) == ("device", "none", "")
    assert host.resolve_input(torch.device("cuda"))[:2] == ("device", "none")  # auto: device on CUDA
    rect = YOLODataModule(**args, pipeline="device", rect=True)
    assert rect.resolve_input(torch.device("cuda"))[0] == "host"
    with pytest.raises(ValueError, match=r"data\.pipeline"):
        YOLODataModule(**args, pipeline="gpu")


def test_datamodule_device_cache_and_its_fallback(synthetic, monkeypatch):
    args = {"synthetic": synthetic, "imgsz": 128, "batch_size": 8, "num_workers": 0, "pipeline": "device"}
    dm = YOLODataModule(**args, cache="device")
    dm.setup("fit")
    assert dm.cache_used == "device"
    assert dm.device_cache is not None
    assert dm.train_dataset.tile_reader.source == "cache"
    images, _targets, _, _ = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 3, 128, 128)
    assert dm.val_dataset.cache.mode == "ram"  # validation caches on the host
    monkeypatch.setattr("psutil.virtual_memory", lambda: type("VM", (), {"available": 1000})())
    small = YOLODataModule(**args, cache="device")
    small.setup("fit")
    assert small.cache_used == "none"
    assert small.train_dataset.tile_reader.source == "bytes"
    host = YOLODataModule(**{**args, "pipeline": "host"}, cache="device")
    assert host.resolve_input(torch.device("cpu"))[1] == "ram"


def test_the_start_up_says_why_a_device_cache_or_pipeline_does_not_fit_the_device(synthetic, capsys):
    """data.cache=device without CUDA says there is no GPU (not "needs data.pipeline=device", which on the CPU is the
    slower path); with CUDA and the host pipeline it names the pipeline; data.pipeline=device typed on the CPU is a
    warning; auto on the CPU says nothing."""
    from yolo5l.data.plan import input_notes

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert input_notes("device", "host", "ram", cpu) == [
        ("cache", "train: data.cache=device keeps images in GPU memory, and this run trains on cpu (no CUDA): caching "
                  "in RAM instead")
    ]  # fmt: skip
    assert input_notes("device", "host", "ram", cuda) == [
        ("cache", "train: data.cache=device needs data.pipeline=device: caching in RAM instead")
    ]
    assert input_notes("none", "device", "none", cuda) == []
    assert input_notes("none", "host", "none", cpu) == []
    [(key, line)] = input_notes("none", "device", "none", cpu)
    assert key == "pipeline"
    assert line.startswith("warning: data.pipeline=device on cpu: the GPU input path's ops run there, slower than the")
    dm = YOLODataModule(synthetic=synthetic, imgsz=128, batch_size=8, num_workers=0, pipeline="device")
    capsys.readouterr()
    dm.setup("fit")
    assert "warning: data.pipeline=device on cpu" in capsys.readouterr().out


def test_host_collate_is_unchanged(index):
    """The host pipeline's items still collate as before (the device path adds a collate, it changes none)."""
    ds = make_ds(index)
    images, _targets, _, _ = collate_fn([ds[(i, True, (0, 0, 0))] for i in range(3)])
    assert images.shape == (3, 3, S, S)


# --------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize(("source", "cache"), [("bytes", "none"), ("pixels", "ram")])
def test_cuda_makes_the_cpus_batch(index, source, cache):
    """The same plans made on CUDA and on the CPU: equal pixels from the host's tiles; from nvjpeg's decode within
    its rounding of the IDCT and chroma upsampling (a few grey levels, rarely)."""
    ds = make_ds(index, source, cache)
    plans = [ds[(i, True, key)] for i, key in KEYS]
    batch = collate_plans(plans)[0]
    cpu = DeviceInput("cpu")(batch)
    gpu = DeviceInput("cuda")(batch.pin_memory()).cpu()
    diff = (cpu.int() - gpu.int()).abs()
    if source == "pixels":
        assert diff.max() <= 1
        assert (diff > 0).float().mean() < 1e-4
    else:
        assert diff.float().mean() < 0.5


@pytest.mark.gpu
def test_cuda_loader_makes_batches_ahead_on_a_side_stream(index):
    """Batch k + 1 is made on the side stream while k is handed out; every batch equals its synchronous making, and
    the main stream's waits for it are counted."""
    ds = make_ds(index, "bytes")
    sampler = [(i, True, (0, 0, 0)) for i in range(24)]
    loader = DeviceInputLoader(ds, batch_size=8, sampler=sampler, num_workers=2, collate_fn=collate_plans,
                               pin_memory=True, device_input=DeviceInput("cuda"))  # fmt: skip
    assert loader.stream is not None
    for k, (images, targets, _, _) in enumerate(loader):
        assert images.is_cuda
        keys = [(i, key) for i, _, key in sampler[8 * k : 8 * k + 8]]
        plans = [ds[(i, True, key)] for i, key in keys]
        want = DeviceInput("cuda")(collate_plans(plans)[0])
        assert torch.equal(images, want)
    torch.cuda.synchronize()
    assert loader.device_wait_seconds() >= 0.0


@pytest.mark.gpu
def test_cuda_device_cache(index):
    ds = make_ds(index)
    cache = DeviceCache(ds, "cuda", reserve=0)
    assert cache.fill(range(len(ds)))
    assert cache.buffer.is_cuda
    assert "cuda" in cache.message
    too_much = DeviceCache(ds, "cuda", reserve=1 << 50)
    assert not too_much.fill(range(len(ds)))
    assert "does not fit" in too_much.message
    ds.plan_on_device("cache")
    plans = [ds[(i, True, key)] for i, key in KEYS[:8]]
    got = DeviceInput("cuda", cache)(collate_plans(plans)[0]).cpu()
    want = DeviceInput("cuda")(collate_plans([make_ds(index, "bytes")[(i, True, k)] for i, k in KEYS[:8]])[0]).cpu()
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------- the Triton kernels
_TRITON_CHECK = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from yolo5l.data import render
from yolo5l.data.dataset import YOLODataset
from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.data.device_input import DeviceInput
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.letterbox import resized_shape
from yolo5l.data.plan import collate_plans
from yolo5l.data.synthetic import ensure_synthetic

# the resize, every EXIF orientation, down and up
g = torch.Generator().manual_seed(0)
src, info, out_info, off, ooff = [], [], [], 0, 0
for o in range(1, 9):
    hs, ws = (int(v) for v in torch.randint(20, 50, (2,), generator=g))
    src.append(torch.randint(0, 256, (3 * hs * ws,), dtype=torch.uint8, generator=g))
    h, w = (int(v) for v in torch.randint(10, 70, (2,), generator=g))
    info.append([off, hs, ws, o]); out_info.append([ooff, h, w]); off += 3 * hs * ws; ooff += 3 * h * w
outs = []
for backend in ("torch", "triton"):
    out = torch.zeros(ooff, dtype=torch.uint8)
    render.resize_tiles(torch.cat(src), torch.tensor(info), out, torch.tensor(out_info), backend=backend)
    outs.append(out)
assert torch.equal(*outs), "resize"
# whole batches: mixup, letterboxes, flips, HSV; a perspective warp; bytes and pixel tiles
yaml = ensure_synthetic(sys.argv[2], num_train=12, num_val=2, seed=0, min_side=60, max_side=140)
spec = load_dataset_file(yaml)
index = scan_labels(spec.files("train"), spec.num_classes, spec.cache_path("train"))
for hyp, source, cache in [({"mixup": 0.5, "flipud": 0.5, "mosaic": 0.7, "degrees": 5.0}, "bytes", "none"),
                           ({"perspective": 0.001}, "pixels", "ram")]:
    ds = YOLODataset(index, imgsz=64, augment=True, hyp=hyp, cache=cache, reduced_decode=False)
    ds.fill_cache()
    ds.plan_on_device(source)
    ds.albumentations = None
    batch = collate_plans([ds[(i % 12, True, (0, i // 12, 0))] for i in range(8)])[0]
    a = DeviceInput("cpu", backend="torch")(batch)
    b = DeviceInput("cpu", backend="triton")(batch)
    assert torch.equal(a, b), (hyp, int((a != b).sum()))
    assert set(batch.layers.tolist()) >= ({1, 2} if hyp.get("mixup") else {1})
print("TRITON_INPUT_OK")
"""


def test_triton_kernels_are_the_torch_ops_under_the_interpreter(tmp_path):
    """The two Triton kernels (resize; warp + mixup + HSV + flips) give the torch ops' bytes exactly: the resize for
    every EXIF orientation, whole batches with mixup, letterboxes, flips and HSV, a perspective warp."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path

    # A subprocess: TRITON_INTERPRET must be set before triton is imported and must not leak into other tests.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    repo = str(Path(__file__).resolve().parents[1])
    res = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK, repo, str(tmp_path / "syn")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TRITON_INPUT_OK" in res.stdout


@pytest.mark.gpu
def test_triton_kernels_are_the_torch_ops_on_cuda(index):
    """On CUDA: the kernels (the default there) give the torch ops' bytes, for every tile source."""
    for source, cache in (("bytes", "none"), ("pixels", "ram")):
        ds = make_ds(index, source, cache, mixup=0.5, flipud=0.5, mosaic=0.8)
        batch = collate_plans([ds[(i, True, key)] for i, key in KEYS])[0]
        a = DeviceInput("cuda", backend="torch")(batch)
        b = DeviceInput("cuda")(batch)
        assert torch.equal(a, b)
