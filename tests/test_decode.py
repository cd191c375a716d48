"""Reduced-scale JPEG decoding for the image cache: pixels close to a full decode, labels and shapes untouched,
EXIF orientation kept, other formats and small JPEGs unchanged, and a label scan that decodes no pixels."""

from __future__ import annotations

import builtins
import io
import math
import os
from pathlib import Path

import cv2
import numpy as np
import PIL.ImageFile
import pytest
import simplejpeg
import torch
from PIL import Image

from yolo5l.data import images as images_mod
from yolo5l.data.cache import _load_resized
from yolo5l.data.dataset import YOLODataset
from yolo5l.data.images import dct_scale, read_image, read_image_reduced
from yolo5l.data.label_check import MISSING, verify_image_label
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.layout import format_labels
from yolo5l.data.letterbox import resize_long_side
from yolo5l.data.synthetic import NAMES, render_sample

_ORIENTATION = 0x0112
_REDUCED_FLAGS = {cv2.IMREAD_REDUCED_COLOR_2, cv2.IMREAD_REDUCED_COLOR_4, cv2.IMREAD_REDUCED_COLOR_8}


def write_jpeg(path: Path, rgb: np.ndarray, quality: int = 90) -> Path:
    ok, buf = cv2.imencode(".jpg", rgb[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    path.write_bytes(buf.tobytes())
    return path


def mad(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute difference in grey levels."""
    return float(np.abs(a.astype(np.int16) - b).mean())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255**2 / ((a.astype(np.float64) - b) ** 2).mean()))


@pytest.fixture(scope="module")
def camera_jpeg(tmp_path_factory) -> Path:
    """A noisy camera-sized JPEG whose sides 8 does not divide (the reduced image has a partial last block)."""
    img, _, _ = render_sample(np.random.default_rng(0), 1799, 2401)
    return write_jpeg(tmp_path_factory.mktemp("camera") / "camera.jpg", img)


class DecoderCalls(list):
    """The decodes made by yolo5l.data.images: the flags of each cv2.imdecode call, "simplejpeg" for each simplejpeg
    decode at reduced scale and "simplejpeg full" for each at full size; ``decoder`` is the reduced decoder under
    test."""

    def __init__(self, decoder: str):
        super().__init__()
        self.decoder = decoder

    def any_reduced(self) -> bool:
        return "simplejpeg" in self or bool(set(self) & _REDUCED_FLAGS)

    def reduced(self) -> bool:
        """Whether an image was decoded at reduced scale, and only by the decoder under test."""
        by_simplejpeg, by_cv2 = "simplejpeg" in self, bool(set(self) & _REDUCED_FLAGS)
        return (by_simplejpeg, by_cv2) == ((True, False) if self.decoder == "simplejpeg" else (False, True))


@pytest.fixture(params=["simplejpeg", "cv2"])
def decoder_calls(request, monkeypatch) -> DecoderCalls:
    """Runs a test with each reduced decoder (simplejpeg; OpenCV with simplejpeg made unavailable) and records the
    decodes made by yolo5l.data.images."""
    calls, real_imdecode = DecoderCalls(request.param), cv2.imdecode

    def imdecode(buf, flags):
        calls.append(flags)
        return real_imdecode(buf, flags)

    monkeypatch.setattr(images_mod.cv2, "imdecode", imdecode)
    if request.param == "cv2":
        monkeypatch.setattr(images_mod, "simplejpeg", None)
    else:
        real_decode = simplejpeg.decode_jpeg

        def decode_jpeg(data, *args, **kwargs):
            out = real_decode(data, *args, **kwargs)
            full = simplejpeg.decode_jpeg_header(data)[:2] == out.shape[:2]
            calls.append("simplejpeg full" if full else "simplejpeg")
            return out

        monkeypatch.setattr(images_mod.simplejpeg, "decode_jpeg", decode_jpeg)
    return calls


def test_dct_scale_keeps_the_target_size():
    assert dct_scale(3000, 4000, 320) == 8
    assert dct_scale(3000, 4000, 640) == 4
    assert dct_scale(3000, 4000, 1280) == 2
    assert dct_scale(4000, 3000, 640) == 4  # the long side, whichever it is
    assert dct_scale(1799, 2401, 320) == 4  # 2401 / 8 < 320
    assert dct_scale(1000, 1280, 640) == 2  # exactly twice
    assert dct_scale(1000, 1279, 640) == 1  # under twice: a full decode


@pytest.mark.parametrize("imgsz", [320, 640])
@pytest.mark.parametrize("augment", [True, False], ids=["linear", "area"])
def test_reduced_decode_pixel_error(camera_jpeg, imgsz, augment, decoder_calls):
    """A = reduced decode + resize, B = full decode + resize (the path without reduced decoding), R = full decode +
    INTER_AREA (an anti-aliased downscale), L = full decode + INTER_LINEAR."""
    full = read_image(camera_jpeg)
    reduced, hw = read_image_reduced(camera_jpeg, imgsz)
    f = dct_scale(*hw, imgsz)
    assert hw == full.shape[:2]
    assert reduced.shape == (math.ceil(hw[0] / f), math.ceil(hw[1] / f), 3)  # decoded at 1/f
    assert max(reduced.shape) >= imgsz  # so the resize only shrinks
    assert decoder_calls.reduced()

    A = _load_resized(str(camera_jpeg), imgsz, augment)
    B = _load_resized(str(camera_jpeg), imgsz, augment, reduced=False)
    np.testing.assert_array_equal(B, resize_long_side(full, imgsz, augment))
    assert A.shape == B.shape
    assert A.dtype == B.dtype == np.uint8
    R = cv2.resize(full, B.shape[1::-1], interpolation=cv2.INTER_AREA)
    L = cv2.resize(full, B.shape[1::-1], interpolation=cv2.INTER_LINEAR)
    # A is close to the anti-aliased downscale: measured mean 0.65-1.6 grey levels, PSNR 41-49 dB
    assert mad(A, R) < 2.0
    assert psnr(A, R) > 38
    if augment:
        # B is INTER_LINEAR from the full size, which aliases on this pixel noise (mean 3.7-4.1 from R): A, shrunk
        # mostly by libjpeg's block averaging, is nearer the anti-aliased result than B, and the same picture.
        assert mad(A, R) < mad(B, R) / 2
        assert psnr(A, B) > 30  # measured 33.9-34.7 dB
    else:
        # B is R: the difference stays far below the gap between the two interpolations (mean 3.7-4.1).
        assert mad(A, B) < mad(L, R) / 3  # measured 0.65-0.94
        assert psnr(A, B) > 40  # measured 46-49 dB


class TopDecodes(list):
    """The number of rows of each decode that stopped early (``_decode_top_rows_pil`` returning an image)."""


@pytest.fixture
def top_decodes(monkeypatch) -> TopDecodes:
    calls, real = TopDecodes(), images_mod._decode_top_rows_pil

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        if out is not None:
            calls.append(out.shape[0])
        return out

    monkeypatch.setattr(images_mod, "_decode_top_rows_pil", spy)
    return calls


@pytest.mark.parametrize("imgsz", [320, 640])
@pytest.mark.parametrize("top", [0.01, 0.2, 0.5, 0.72])
def test_top_rows_decode_is_the_whole_decode_cut(camera_jpeg, imgsz, top, top_decodes):
    """Asked for the top fraction ``top``, the decoder stops after the rows it needs: fewer rows decoded, and the
    resized rows are those of the whole image's, bit for bit (the image's sides are not multiples of 8)."""
    whole = _load_resized(str(camera_jpeg), imgsz, augment=True)
    cut = _load_resized(str(camera_jpeg), imgsz, augment=True, top=top)
    assert cut.shape[1:] == whole.shape[1:]
    assert cut.shape[0] == math.ceil(top * whole.shape[0])
    np.testing.assert_array_equal(cut, whole[: cut.shape[0]])
    assert len(top_decodes) == 1
    assert top_decodes[0] < 0.9 * math.ceil(1799 / dct_scale(1799, 2401, imgsz))
    # validation (INTER_AREA) and a top near 1 decode the whole image
    area = _load_resized(str(camera_jpeg), imgsz, augment=False, top=top)
    np.testing.assert_array_equal(area, _load_resized(str(camera_jpeg), imgsz, augment=False))
    assert _load_resized(str(camera_jpeg), imgsz, augment=True, top=0.95).shape == whole.shape
    assert len(top_decodes) == 1


@pytest.mark.parametrize("hw", [(479, 601), (803, 700), (480, 640)], ids=["enlarged", "shrunk", "kept"])
def test_top_rows_decode_at_full_size(tmp_path, hw, top_decodes):
    """A JPEG under twice the target size (decoded at full size) is cut after the rows a top fraction needs too: its
    resized rows are the whole image's, bit for bit, whether the resize enlarges, shrinks or keeps it."""
    img, _, _ = render_sample(np.random.default_rng(12), *hw)
    path = str(write_jpeg(tmp_path / "im.jpg", img))
    whole = _load_resized(path, 640, augment=True)
    for top in (0.02, 0.3, 0.6):
        cut = _load_resized(path, 640, augment=True, top=top)
        assert cut.shape[1:] == whole.shape[1:]
        assert cut.shape[0] == math.ceil(top * whole.shape[0])
        np.testing.assert_array_equal(cut, whole[: cut.shape[0]])
    assert len(top_decodes) == 3
    assert max(top_decodes) < 0.7 * hw[0]
    assert _load_resized(path, 640, augment=True, top=0.8).shape == whole.shape  # most of the rows: a whole decode
    assert len(top_decodes) == 3


@pytest.mark.parametrize("orientation", [3, 6])
def test_top_rows_decode_needs_an_upright_image(tmp_path, orientation, top_decodes):
    """A rotated image's top rows are not the file's first rows: it is decoded whole, as without ``top``."""
    stored, _, _ = render_sample(np.random.default_rng(1), 1200, 1600)
    exif = Image.Exif()
    exif[_ORIENTATION] = orientation
    Image.fromarray(stored).save(tmp_path / "rot.jpg", quality=90, exif=exif)
    whole = _load_resized(str(tmp_path / "rot.jpg"), 320, augment=True)
    np.testing.assert_array_equal(_load_resized(str(tmp_path / "rot.jpg"), 320, augment=True, top=0.3), whole)
    assert not top_decodes


def test_top_rows_decode_of_a_truncated_file(camera_jpeg, tmp_path, top_decodes):
    """A file that ends before the rows asked for is decoded the usual way (the tolerant whole decode)."""
    data = camera_jpeg.read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 3])
    whole = _load_resized(str(tmp_path / "cut.jpg"), 320, augment=True)
    cut = _load_resized(str(tmp_path / "cut.jpg"), 320, augment=True, top=0.7)
    np.testing.assert_array_equal(cut, whole)
    assert not top_decodes
    # rows that lie before the cut still decode early, and equal the whole decode's
    early = _load_resized(str(tmp_path / "cut.jpg"), 320, augment=True, top=0.1)
    assert len(top_decodes) == 1
    np.testing.assert_array_equal(early, whole[: early.shape[0]])


def test_exif_orientation_6(tmp_path, decoder_calls):
    stored, _, _ = render_sample(np.random.default_rng(1), 1200, 1600)
    stored[:, :200] = 255  # a white band on the left of the stored pixels: on top once displayed
    exif = Image.Exif()
    exif[_ORIENTATION] = 6  # rotate 90 degrees clockwise to display
    path = tmp_path / "rotated.jpg"
    Image.fromarray(stored).save(path, quality=90, exif=exif.tobytes())

    full = read_image(path)
    assert full.shape == (1600, 1200, 3)
    reduced, hw = read_image_reduced(path, 320)
    assert hw == (1600, 1200)
    assert reduced.shape == (400, 300, 3)  # 1/4, rotated
    assert decoder_calls.reduced()
    assert reduced[:45].mean() > 245  # the band is on top
    assert reduced[55:].mean() < 200
    assert mad(reduced, cv2.resize(full, (300, 400), interpolation=cv2.INTER_AREA)) < 2.0

    v = verify_image_label(str(path), len(NAMES))
    assert v.shape == (1600, 1200)  # the label scan's shape, EXIF applied
    for augment in (True, False):
        a = _load_resized(str(path), 320, augment)
        b = _load_resized(str(path), 320, augment, reduced=False)
        assert a.shape == b.shape == (320, 240, 3)
        assert mad(a, cv2.resize(full, (240, 320), interpolation=cv2.INTER_AREA)) < 2.0


def _without_simplejpeg(monkeypatch, path: Path, imgsz: int) -> np.ndarray:
    """read_image_reduced through OpenCV's reduced decode (simplejpeg made unavailable)."""
    with monkeypatch.context() as m:
        m.setattr(images_mod, "simplejpeg", None)
        return read_image_reduced(path, imgsz)[0]


@pytest.mark.parametrize("kind", ["420", "444", "progressive", "gray"])
@pytest.mark.parametrize("imgsz", [160, 320, 640])
def test_simplejpeg_matches_opencv_reduced(tmp_path, monkeypatch, kind, imgsz):
    """simplejpeg and OpenCV's reduced mode (both libjpeg-turbo's 1/f DCT scaling) give the same image."""
    img, _, _ = render_sample(np.random.default_rng(6), 1299, 1283)  # f = 8, 4 and 2, partial last blocks
    path = tmp_path / f"{kind}.jpg"
    if kind == "420":
        write_jpeg(path, img)
    elif kind == "gray":
        Image.fromarray(img).convert("L").save(path, quality=90)
    else:
        Image.fromarray(img).save(path, quality=90, subsampling=0, progressive=kind == "progressive")
    a, hw = read_image_reduced(path, imgsz)
    b = _without_simplejpeg(monkeypatch, path, imgsz)
    f = dct_scale(*hw, imgsz)
    assert f == {160: 8, 320: 4, 640: 2}[imgsz]
    assert a.shape == b.shape == (math.ceil(1299 / f), math.ceil(1283 / f), 3)
    assert a.dtype == np.uint8
    assert a.flags.c_contiguous
    assert mad(a, b) < 0.1  # measured 0: the same decoder


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations(tmp_path, orientation, decoder_calls):
    """Each of the 8 EXIF orientations gives read_image's (OpenCV's) oriented image, at reduced scale."""
    stored, _, _ = render_sample(np.random.default_rng(7), 1203, 1601)
    stored[:300, :400] = 255  # a white corner, top left of the stored pixels
    exif = Image.Exif()
    exif[_ORIENTATION] = orientation
    path = tmp_path / f"o{orientation}.jpg"
    Image.fromarray(stored).save(path, quality=90, exif=exif.tobytes())

    full = read_image(path)
    h0, w0 = (1601, 1203) if orientation >= 5 else (1203, 1601)
    assert full.shape == (h0, w0, 3)
    reduced, hw = read_image_reduced(path, 320)  # f = 4
    assert hw == (h0, w0)
    assert reduced.shape == (math.ceil(h0 / 4), math.ceil(w0 / 4), 3)
    assert reduced.flags.c_contiguous
    assert decoder_calls.reduced()
    expected = cv2.resize(full, reduced.shape[1::-1], interpolation=cv2.INTER_AREA)
    assert mad(reduced, expected) < 2.0  # measured 1.6
    # The other orientations of this shape (the shape tells 90-degree turns apart) are far: measured 46-54.
    assert min(mad(x, expected) for x in (reduced[::-1], reduced[:, ::-1], reduced[::-1, ::-1])) > 30


def test_cmyk_jpeg(tmp_path, decoder_calls):
    """A CMYK JPEG decodes at reduced scale to read_image's colours (libjpeg-turbo converts CMYK to RGB)."""
    img, _, _ = render_sample(np.random.default_rng(8), 1000, 1403)
    path = tmp_path / "cmyk.jpg"
    Image.fromarray(img).convert("CMYK").save(path, "JPEG", quality=90)
    with Image.open(path) as im:
        assert im.mode == "CMYK"
    full = read_image(path)
    reduced, hw = read_image_reduced(path, 320)  # f = 4
    assert hw == (1000, 1403)
    assert reduced.shape == (250, 351, 3)
    assert decoder_calls.any_reduced()
    assert mad(reduced, cv2.resize(full, (351, 250), interpolation=cv2.INTER_AREA)) < 2.0


@pytest.mark.parametrize("failure", ["raises", "wrong_scale"])
def test_simplejpeg_failure_falls_back_to_opencv(camera_jpeg, monkeypatch, failure):
    """A file simplejpeg rejects, or a decode at another scale, goes through OpenCV's reduced decode."""
    expected = _without_simplejpeg(monkeypatch, camera_jpeg, 320)
    real_decode, calls = simplejpeg.decode_jpeg, []

    def decode_jpeg(data, *args, **kwargs):
        calls.append("simplejpeg")
        if failure == "raises":
            raise ValueError("unsupported JPEG")
        return real_decode(data, *args)  # no min_height / min_width: full size

    monkeypatch.setattr(images_mod.simplejpeg, "decode_jpeg", decode_jpeg)
    real_imdecode = cv2.imdecode
    monkeypatch.setattr(images_mod.cv2, "imdecode", lambda b, flags: calls.append(flags) or real_imdecode(b, flags))
    reduced, hw = read_image_reduced(camera_jpeg, 320)
    assert calls == ["simplejpeg", cv2.IMREAD_REDUCED_COLOR_4]
    assert hw == (1799, 2401)
    np.testing.assert_array_equal(reduced, expected)


def test_png_and_small_jpeg_take_the_full_path(tmp_path, decoder_calls):
    rng = np.random.default_rng(2)
    big, _, _ = render_sample(rng, 1000, 1400)
    small, _, _ = render_sample(rng, 500, 600)
    cv2.imwrite(str(tmp_path / "big.png"), big[..., ::-1])
    (tmp_path / "png_named.jpg").write_bytes(cv2.imencode(".png", big[..., ::-1])[1].tobytes())
    write_jpeg(tmp_path / "small.jpg", small)  # 600 < 2 x 320
    for name in ("big.png", "png_named.jpg", "small.jpg"):
        path = tmp_path / name
        img, hw = read_image_reduced(path, 320)
        np.testing.assert_array_equal(img, read_image(path))
        assert hw == img.shape[:2]
        for augment in (True, False):
            np.testing.assert_array_equal(
                _load_resized(str(path), 320, augment), resize_long_side(read_image(path), 320, augment)
            )
    assert not decoder_calls.any_reduced()


def test_reduced_decode_falls_back_on_a_bad_jpeg(tmp_path):
    img, _, _ = render_sample(np.random.default_rng(3), 900, 1300)
    data = write_jpeg(tmp_path / "ok.jpg", img).read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[:600])  # the header survives, the entropy-coded data does not
    with pytest.raises(images_mod.ImageReadError, match=r"cut\.jpg"):
        read_image_reduced(tmp_path / "cut.jpg", 320)
    with pytest.raises(images_mod.ImageReadError, match=r"missing\.jpg not found"):
        read_image_reduced(tmp_path / "missing.jpg", 320)


def _camera_dataset(root: Path) -> list[str]:
    """Camera-sized JPEGs (landscape, portrait, not multiples of 8), a small JPEG and a PNG, with labels."""
    (root / "images" / "train").mkdir(parents=True)
    (root / "labels" / "train").mkdir(parents=True)
    sizes = [(1200, 1600, "jpg"), (1603, 1201, "jpg"), (900, 1300, "jpg"), (400, 500, "jpg"), (700, 900, "png")]
    files = []
    for i, (h, w, ext) in enumerate(sizes):
        img, labels, _ = render_sample(np.random.default_rng([4, i]), h, w)
        path = root / "images" / "train" / f"im{i}.{ext}"
        if ext == "jpg":
            write_jpeg(path, img)
        else:
            cv2.imwrite(str(path), img[..., ::-1])
        (root / "labels" / "train" / f"im{i}.txt").write_text(format_labels(labels.tolist()))
        files.append(str(path))
    return files


def _dataset(index, augment: bool, reduced: bool) -> YOLODataset:
    return YOLODataset(index, imgsz=320, augment=augment, batch_size=2, reduced_decode=reduced)


def test_labels_and_shapes_do_not_depend_on_reduced_decode(tmp_path):
    files = _camera_dataset(tmp_path / "ds")
    index = scan_labels(files, len(NAMES), tmp_path / "ds" / "labels" / "train.cache")
    assert len(index.im_files) == len(files)
    for augment in (True, False):
        on, off = _dataset(index, augment, True), _dataset(index, augment, False)
        np.testing.assert_array_equal(on.shapes, off.shapes)
        assert on.im_files == off.im_files
        for a, b in zip(on.labels, off.labels, strict=True):
            np.testing.assert_array_equal(a, b)
        differ = 0
        for i in range(len(on)):
            img_on, hw0_on, hw_on = on.load_image(i)
            img_off, hw0_off, hw_off = off.load_image(i)
            assert (img_on.shape, hw0_on, hw_on) == (img_off.shape, hw0_off, hw_off)
            assert max(hw_on) == 320
            differ += not np.array_equal(img_on, img_off)
            key = (0, 3, 0) if augment else None
            item_on = on[(i, True, key)] if augment else on[i]
            item_off = off[(i, True, key)] if augment else off[i]
            assert item_on[0].shape == item_off[0].shape
            torch.testing.assert_close(item_on[1], item_off[1], rtol=0, atol=0)
            assert item_on[2:] == item_off[2:]
            if augment:  # the letterbox path too, not only mosaics
                single_on, single_off = on[(i, False, key)], off[(i, False, key)]
                torch.testing.assert_close(single_on[1], single_off[1], rtol=0, atol=0)
                assert single_on[3] == single_off[3]
        assert differ == 3  # the three large JPEGs were decoded at reduced scale; the small one and the PNG not


def test_mosaics_from_top_rows_decodes_equal_those_from_whole_images(tmp_path, top_decodes):
    """Without a cache the mosaic's tiles that the output cuts off below are decoded only down to the rows it
    shows; the samples are those made from whole images (the RAM cache), pixel for pixel."""
    files = _camera_dataset(tmp_path / "ds")
    index = scan_labels(files, len(NAMES), tmp_path / "ds" / "labels" / "train.cache")
    lazy = YOLODataset(index, imgsz=320, augment=True, cache="none")
    ram = YOLODataset(index, imgsz=320, augment=True, cache="ram")
    ram.fill_cache()
    for epoch in range(6):
        for i in range(len(lazy)):
            a, b = lazy[(i, True, (0, epoch, 0))], ram[(i, True, (0, epoch, 0))]
            torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
            torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert len(top_decodes) >= 10  # 22 in 30 mosaics when written


def test_label_scan_reads_headers_only(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    img = rng.integers(0, 255, (60, 100, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[_ORIENTATION] = 6
    Image.fromarray(img).save(tmp_path / "plain.jpg", quality=90)
    Image.fromarray(img).save(tmp_path / "exif.jpg", quality=90, exif=exif.tobytes())
    Image.fromarray(img).save(tmp_path / "plain.png")
    Image.fromarray(img).save(tmp_path / "exif.png", exif=exif.tobytes())  # eXIf before the image data
    Image.fromarray(img).convert("P", palette=Image.Palette.ADAPTIVE).save(tmp_path / "palette.png")
    # eXIf after the image data (allowed by the PNG spec; OpenCV applies it): move the chunk behind the IDATs
    data = (tmp_path / "exif.png").read_bytes()
    chunks, pos = [], 8
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        chunks.append(data[pos : pos + 12 + n])
        pos += 12 + n
    exif_chunk = next(c for c in chunks if c[4:8] == b"eXIf")
    rest = [c for c in chunks if c is not exif_chunk]
    (tmp_path / "late_exif.png").write_bytes(data[:8] + b"".join(rest[:-1]) + exif_chunk + rest[-1])
    assert cv2.imread(str(tmp_path / "late_exif.png")).shape[:2] == (100, 60)

    calls: list[str] = []

    def counted(name, real):
        def fn(*a, **k):
            calls.append(name)
            return real(*a, **k)

        return fn

    monkeypatch.setattr(cv2, "imread", counted("cv2.imread", cv2.imread))
    monkeypatch.setattr(cv2, "imdecode", counted("cv2.imdecode", cv2.imdecode))
    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", counted("ImageFile.load", PIL.ImageFile.ImageFile.load))
    expected = {"plain.jpg": (60, 100), "exif.jpg": (100, 60), "plain.png": (60, 100), "exif.png": (100, 60)}
    expected |= {"palette.png": (60, 100), "late_exif.png": (100, 60)}
    for name, shape in expected.items():
        v = verify_image_label(str(tmp_path / name), len(NAMES))
        assert v.kind == MISSING, v.messages  # kept, as a background: no label file
        assert v.shape == shape, name
    assert calls == []


@pytest.mark.parametrize(
    ("override", "train", "val"),
    [([], True, False), (["data.reduced_decode=false"], False, False), (["data.val_reduced_decode=true"], True, True)],
    ids=["default", "off", "val-on"],
)
def test_data_reduced_decode_reaches_both_caches(tmp_path, override, train, val):
    """``data.reduced_decode`` (on by default) reaches the training split's image cache, ``data.val_reduced_decode``
    (off by default: v7.0's val.py decodes in full) the validation split's."""
    from hydra.utils import instantiate

    from yolo5l.config import compose_config

    root = tmp_path / "syn"
    cfg = compose_config(
        [f"data.synthetic={{root: {root}, num_train: 4, num_val: 2}}", "data.imgsz=64", *override],
        output_dir=str(tmp_path / "run"),
    )
    dm = instantiate(cfg.data, _convert_="all")
    dm.setup("fit")
    assert (dm.reduced_decode, dm.val_reduced_decode) == (train, val)
    assert dm.train_dataset.cache.reduced_decode is train
    assert dm.val_dataset.cache.reduced_decode is val


@pytest.fixture
def opens(monkeypatch) -> dict[str, int]:
    """How many times each file is opened: Python's opens (``builtins.open``/``io.open``, ``os.open``; PIL opens
    through them) and OpenCV's own (``cv2.imread`` of a path), by absolute path."""
    counts: dict[str, int] = {}

    def count(path) -> None:
        if isinstance(path, (str, Path)):
            key = str(Path(path).absolute())
            counts[key] = counts.get(key, 0) + 1

    def spy(real):
        def fn(path, *args, **kwargs):
            count(path)
            return real(path, *args, **kwargs)

        return fn

    monkeypatch.setattr(builtins, "open", spy(builtins.open))
    monkeypatch.setattr(io, "open", spy(io.open))
    monkeypatch.setattr(os, "open", spy(os.open))
    monkeypatch.setattr(images_mod.cv2, "imread", spy(cv2.imread))
    return counts


def test_each_image_load_opens_its_file_once(tmp_path, opens):
    """Header, decode and every decoder's fallback work on one read of the file: large JPEGs (reduced decode, its
    top rows only, a rotated one), a small JPEG (full decode), a PNG, and the image cache's load of each."""
    big, _, _ = render_sample(np.random.default_rng(9), 1203, 1601)
    small, _, _ = render_sample(np.random.default_rng(10), 500, 700)
    write_jpeg(tmp_path / "big.jpg", big)
    write_jpeg(tmp_path / "small.jpg", small)
    exif = Image.Exif()
    exif[_ORIENTATION] = 6
    Image.fromarray(big).save(tmp_path / "rotated.jpg", quality=90, exif=exif.tobytes())
    cv2.imwrite(str(tmp_path / "im.png"), small[..., ::-1])
    loads = [
        lambda p: read_image(p),
        lambda p: read_image_reduced(p, 320),
        lambda p: read_image_reduced(p, 320, top=0.3),
        lambda p: read_image_reduced(p, 640, top=0.3),
        lambda p: _load_resized(str(p), 320, augment=True, top=0.3),
        lambda p: _load_resized(str(p), 320, augment=False),
        lambda p: _load_resized(str(p), 320, augment=True, reduced=False),
    ]
    for name in ("big.jpg", "small.jpg", "rotated.jpg", "im.png"):
        path = tmp_path / name
        for load in loads:
            opens.clear()
            load(path)
            assert opens == {str(path): 1}, name


@pytest.mark.parametrize("kind", ["420", "422", "444", "progressive", "gray", "cmyk"])
def test_full_decode_is_opencvs(tmp_path, kind, decoder_calls):
    """A JPEG decoded at full size (by simplejpeg where it is greyscale or YCbCr) has OpenCV's pixels, bit for bit, in
    each EXIF orientation; a CMYK one goes to OpenCV."""
    img, _, _ = render_sample(np.random.default_rng(11), 481, 603)  # partial last blocks
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[_ORIENTATION] = orientation
        path = tmp_path / f"{kind}{orientation}.jpg"
        pil = Image.fromarray(img).convert({"gray": "L", "cmyk": "CMYK"}.get(kind, "RGB"))
        subsampling = {"420": 2, "422": 1, "444": 0}.get(kind, -1)
        pil.save(path, quality=90, subsampling=subsampling, progressive=kind == "progressive", exif=exif.tobytes())
        decoder_calls.clear()
        np.testing.assert_array_equal(read_image(path), cv2.imread(str(path), cv2.IMREAD_COLOR_RGB))
        by_simplejpeg = decoder_calls.decoder == "simplejpeg" and kind != "cmyk"
        assert decoder_calls == (["simplejpeg full"] if by_simplejpeg else [cv2.IMREAD_COLOR_RGB])
