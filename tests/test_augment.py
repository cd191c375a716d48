"""Augmentations: boxes are drawn as solid rectangles before a transform, and the transformed labels must still
enclose the transformed pixels tightly."""

from __future__ import annotations

import random

import cv2
import numpy as np
import pytest
from _reference_augment import reference_augment_hsv

from yolo5l.data import augment as aug
from yolo5l.data import letterbox as lbx
from yolo5l.data import mosaic as mos
from yolo5l.data.box_format import xywhn_to_xyxy, xyxy_to_xywhn
from yolo5l.data.dataset import YOLODataset
from yolo5l.data.label_scan import LabelIndex, ScanReport

PALETTE = np.array(
    [
        (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0),
        (255, 0, 255), (0, 255, 255), (255, 255, 255), (255, 128, 0),
    ],
    dtype=np.uint8,
)  # fmt: skip


def render(h: int, w: int, boxes_xyxy: np.ndarray, classes, bg: int = 0) -> np.ndarray:
    """Black image with a solid rectangle of colour PALETTE[cls] covering [x1, x2) x [y1, y2) per box."""
    img = np.full((h, w, 3), bg, np.uint8)
    for (x1, y1, x2, y2), c in zip(boxes_xyxy.astype(int), classes, strict=True):
        img[y1:y2, x1:x2] = PALETTE[int(c)]
    return img


def pixel_box(img: np.ndarray, cls: int, around: np.ndarray, margin: int = 4) -> np.ndarray | None:
    """Tight x1,y1,x2,y2 of the pixels close to colour ``cls`` inside ``around`` grown by ``margin``."""
    h, w = img.shape[:2]
    x1, y1 = max(int(around[0]) - margin, 0), max(int(around[1]) - margin, 0)
    x2, y2 = min(int(np.ceil(around[2])) + margin, w), min(int(np.ceil(around[3])) + margin, h)
    sub = img[y1:y2, x1:x2].astype(int)
    mask = (np.abs(sub - PALETTE[cls].astype(int)) <= 40).all(-1)
    if not mask.any():
        return None
    ys, xs = np.nonzero(mask)
    return np.array([xs.min() + x1, ys.min() + y1, xs.max() + 1 + x1, ys.max() + 1 + y1], dtype=float)


def assert_tight(img: np.ndarray, labels_xyxy: np.ndarray, tol: float = 2.0) -> None:
    for c, *box in labels_xyxy:
        box = np.array(box)
        found = pixel_box(img, int(c), box)
        assert found is not None, f"no pixels of class {int(c)} near {box}"
        np.testing.assert_allclose(found, box, atol=tol, err_msg=f"class {int(c)}")


def assert_tight_unless_cut(img: np.ndarray, labels_xyxy: np.ndarray, tol: float = 2.0) -> None:
    """Boxes inside the image are tight; a rotated/sheared box cut by the image edge keeps the extent of its clipped
    corners (YOLOv5 without segments), so its pixels only lie inside it."""
    h, w = img.shape[:2]
    inside = (labels_xyxy[:, 1:3] > 0.5).all(1) & (labels_xyxy[:, 3] < w - 0.5) & (labels_xyxy[:, 4] < h - 0.5)
    assert_tight(img, labels_xyxy[inside], tol)
    for c, *box in labels_xyxy[~inside]:
        found = pixel_box(img, int(c), np.array(box))
        assert found is not None, f"no pixels of class {int(c)} near {box}"
        assert (found[:2] >= np.array(box[:2]) - tol).all(), (found, box)
        assert (found[2:] <= np.array(box[2:]) + tol).all(), (found, box)


def seed(s: int = 0) -> None:
    random.seed(s)
    np.random.seed(s)


# --------------------------------------------------------------------------------------------- geometry
def test_box_candidates_hand_values():
    before = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 300, 1]], float).T
    after = np.array([[0, 0, 10, 10], [0, 0, 2, 10], [0, 0, 3, 3], [0, 0, 300, 2.5]], float).T
    # kept; w=2 is not > 2; area 9/100 = 0.09 <= 0.1; aspect 300/2.5 = 120 >= 100
    assert aug.box_candidates(before, after).tolist() == [True, False, False, False]


def test_random_perspective_boxes_follow_pixels():
    rng = np.random.default_rng(1)
    boxes = np.array([[40, 50, 140, 120], [300, 60, 380, 260], [150, 300, 330, 400], [420, 380, 600, 600]], float)
    img = render(640, 640, boxes, range(4))
    labels = np.concatenate([np.arange(4)[:, None], boxes], 1).astype(np.float32)
    for _ in range(8):
        out, lab = aug.random_perspective(img, labels.copy(), degrees=15, translate=0.1, scale=0.5, shear=3, rng=rng)
        assert out.shape == img.shape
        assert len(lab) >= 1
        assert (lab[:, 1:] >= 0).all()
        assert (lab[:, [1, 3]] <= 640).all()
        assert_tight_unless_cut(out, lab)


def test_random_perspective_identity_and_border():
    img = render(200, 200, np.array([[10, 20, 70, 80]], float), [0])
    labels = np.array([[0, 10, 20, 70, 80]], np.float32)
    out, lab = aug.random_perspective(img, labels.copy(), translate=0, scale=0)
    assert out is img  # M = I and no border: untouched
    np.testing.assert_array_equal(lab, labels)
    seed(0)
    out, lab = aug.random_perspective(img, labels.copy(), translate=0, scale=0, border=(-50, -50))
    assert out.shape == (100, 100, 3)  # 200 + 2 * (-50)
    # the centre crop [50, 150): the box [10, 70) x [20, 80) keeps x in [50, 70), y in [50, 80) -> 20 x 30 px,
    # area ratio 600 / 3600 > 0.1: kept
    assert len(lab) == 1
    np.testing.assert_allclose(lab[0, 1:], [0, 0, 20, 30], atol=1e-4)
    # [10, 60) keeps 10 x 30 = 300 of 3000 px: ratio 0.1 is not > 0.1, dropped (box_candidates)
    _, lab = aug.random_perspective(
        img, np.array([[0, 10, 20, 60, 80]], np.float32), translate=0, scale=0, border=(-50, -50)
    )
    assert len(lab) == 0


def test_mosaic4_labels_on_their_quadrant_content():
    s = 160
    sizes = [(160, 120), (100, 160), (160, 160), (80, 140)]  # (h, w)
    images, labels, expect_colour = [], [], []
    for k, (h, w) in enumerate(sizes):
        box = np.array([[w * 0.2, h * 0.3, w * 0.7, h * 0.9]])
        images.append(render(h, w, box.round(), [k]))
        b = box.round()[0]
        labels.append(np.concatenate([[[k]], xyxy_to_xywhn(b[None], w, h, clip=False)], 1))
        expect_colour.append(k)
    for center in [(160, 160), (100, 230), (230, 90)]:
        canvas, lab = mos.mosaic4(images, [lb.astype(np.float32) for lb in labels], s, center)
        assert canvas.shape == (2 * s, 2 * s, 3)
        assert (lab[:, 1:] >= 0).all()
        assert (lab[:, 1:] <= 2 * s).all()
        xc, yc = center
        # each label sits in its quadrant around the centre: 0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right
        for c, x1, y1, x2, y2 in lab:
            if x2 - x1 < 1 or y2 - y1 < 1:
                continue  # cut away entirely
            left, top = {0: (True, True), 1: (False, True), 2: (True, False), 3: (False, False)}[int(c)]
            assert (x2 <= xc) if left else (x1 >= xc)
            assert (y2 <= yc) if top else (y1 >= yc)
        visible = lab[(lab[:, 3] - lab[:, 1] >= 1) & (lab[:, 4] - lab[:, 2] >= 1)]
        assert_tight(canvas, visible, tol=1e-4)  # no interpolation: exact


def test_flips_mirror_boxes():
    boxes = np.array([[10, 20, 50, 70], [100, 5, 180, 40]], float)
    img = render(120, 200, boxes, [0, 1])
    norm = np.concatenate([[[0], [1]], xyxy_to_xywhn(boxes, 200, 120, clip=False)], 1).astype(np.float32)
    for flip in (aug.flip_lr, aug.flip_ud):
        lab = norm.copy()
        out = flip(img, lab)
        px = np.concatenate([lab[:, :1], xywhn_to_xyxy(lab[:, 1:], 200, 120)], 1)
        assert_tight(out, px, tol=1e-4)
    lab = norm.copy()
    aug.flip_lr(img, lab)
    np.testing.assert_allclose(lab[:, 1], 1 - norm[:, 1])
    # the pixels are exactly numpy's mirror views, dense and writable (cv2 does the copy)
    for flip, view in ((aug.flip_lr, img[:, ::-1]), (aug.flip_ud, img[::-1])):
        out = flip(img, norm.copy())
        np.testing.assert_array_equal(out, view)
        assert out.flags.c_contiguous
        assert out.flags.writeable


@pytest.mark.parametrize(("shape", "target"), [((300, 200), (352, 352)), ((180, 320), (224, 352)), ((90, 60), 64)])
def test_letterbox_shapes_round_trip(shape, target):
    h0, w0 = shape
    boxes = np.array([[w0 * 0.1, h0 * 0.2, w0 * 0.5, h0 * 0.6]]).round()
    img = render(h0, w0, boxes, [2])
    out, (rh, rw), (pw, ph) = lbx.letterbox(img, target, scaleup=False)
    th, tw = (target, target) if isinstance(target, int) else target
    assert out.shape == (th, tw, 3)
    assert out[0, 0].tolist() == [114, 114, 114] or (pw == 0 and ph == 0)
    mapped = boxes * [rw, rh, rw, rh] + [pw, ph, pw, ph]
    assert_tight(out, np.concatenate([[[2]], mapped], 1), tol=1.5)
    back = (mapped - [pw, ph, pw, ph]) / [rw, rh, rw, rh]
    np.testing.assert_allclose(back, boxes, atol=1e-6)
    assert rh <= 1
    assert rw <= 1


@pytest.mark.parametrize(
    ("h0", "w0", "imgsz", "want"),
    [
        (100, 300, 128, (42, 128)),  # 42.67: round() would give 43
        (1000, 1500, 640, (426, 640)),  # 426.67
        (77, 50, 640, (639, 415)),  # 77 * (640 / 77) = 639.999...: v7.0's long side is 639 here
        (1, 5000, 640, (1, 640)),  # 0.128: at least one pixel
        (240, 240, 128, (128, 128)),
    ],
)
def test_resized_shape_truncates_as_v7(h0, w0, imgsz, want):
    """v7.0's load_image: ``int(side * (imgsz / long side))``, not the nearest pixel."""
    assert lbx.resized_shape(h0, w0, imgsz) == want
    assert lbx.resized_shape(w0, h0, imgsz) == want[::-1]
    img = np.zeros((h0, w0, 3), np.uint8)
    assert lbx.resize_long_side(img, imgsz, augment=False).shape[:2] == want


def test_letterbox_returns_v7s_unrounded_pad():
    """An odd total padding: the borders split it 29 + 30 and the pad returned is v7.0's 29.5 (labels and the box
    rescaling use it), the ratio v7.0's (r, r)."""
    img = np.zeros((101, 100, 3), np.uint8)
    out, ratio, pad = lbx.letterbox(img, 160, scaleup=False)
    assert (out[:29] == lbx.FILL).all()
    assert (out[29:130, 30:130] == 0).all()
    assert (out[130:] == lbx.FILL).all()
    assert ratio == (1.0, 1.0)
    assert pad == (30.0, 29.5)
    _, ratio, pad = lbx.letterbox(np.zeros((50, 75, 3), np.uint8), (64, 96))
    assert ratio == (1.28, 1.28)
    assert pad == (0.0, 0.0)


@pytest.mark.parametrize(("shape", "target", "scaleup"), [((480, 640), 128, False), ((90, 60), 128, True)])
def test_letterbox_resizes_bilinear_shrinking_too(shape, target, scaleup):
    """v7.0's letterbox resizes with INTER_LINEAR whichever way (what predict's frames and the int8 calibration
    images go through; datasets arrive resized by `resize_long_side`, INTER_AREA for validation)."""
    img = np.random.default_rng(0).integers(0, 256, (*shape, 3), dtype=np.uint8)
    out, _, _ = lbx.letterbox(img, target, scaleup=scaleup)
    (w, h), (top, _, left, _), _, _ = lbx.letterbox_layout(shape, target, scaleup=scaleup)
    np.testing.assert_array_equal(out[top : top + h, left : left + w], cv2.resize(img, (w, h)))
    assert not np.array_equal(cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA), cv2.resize(img, (w, h)))


def test_rect_batch_shapes_hand_values():
    shapes = np.array([[100, 200], [200, 100], [150, 150]])  # h/w = 0.5, 2, 1
    order, bs = lbx.rect_batch_shapes(shapes, batch_size=2, imgsz=320)
    assert order.tolist() == [0, 2, 1]
    # batch 0: h/w in [0.5, 1] -> [1, 1] -> ceil(10 + 0.5) * 32 = 352; batch 1: h/w = 2 -> [1, 0.5] -> [352, 192]
    assert bs.tolist() == [[352, 352], [352, 192]]


# --------------------------------------------------------------------------------------------- photometric
def test_hsv_value_gain_on_gray():
    img = np.full((4, 4, 3), 100, np.uint8)
    np.random.seed(3)
    r = np.random.uniform(-1, 1, 3) * [0, 0, 0.4] + 1
    np.random.seed(3)
    aug.augment_hsv(img, 0.0, 0.0, 0.4)
    expect = int(np.clip(100 * r[2], 0, 255))  # gray has S = 0, H = 0: only V moves
    assert (img == expect).all()


def test_hsv_changes_colour_in_place_keeps_dtype():
    seed(0)
    img = render(32, 32, np.array([[4, 4, 28, 28]], float), [7], bg=60)
    before = img.copy()
    aug.augment_hsv(img, 0.015, 0.7, 0.4)
    assert img.dtype == np.uint8
    assert img.shape == before.shape
    assert not np.array_equal(img, before)


@pytest.mark.parametrize("hgain", [0.015, 0.4, 1.5])
def test_hsv_one_pass_matches_yolov5_tables(hgain):
    """The one-pass jitter against YOLOv5's three lookup tables (the oracle's copy), on every hue, saturation and
    value: at most one grey level apart, and that on under 0.1% of the values (ties of the rounding, and hues that
    OpenCV's HSV-to-RGB conversion wraps past 179 in floating point); a hue gain that leaves 8 bits (r > 1.43 or
    r < 0, which hgain 1.5 draws about half the time) takes the tables themselves: identical."""
    hsv = np.stack(np.meshgrid(np.arange(180), np.arange(0, 256, 5), np.arange(0, 256, 5), indexing="ij"), -1)
    img = cv2.cvtColor(hsv.reshape(180, -1, 3).astype(np.uint8), cv2.COLOR_HSV2RGB)
    differing, checked, tables = 0, 0, 0
    for k in range(40):
        ours, ref = img.copy(), img.copy()
        aug.augment_hsv(ours, hgain, 0.7, 0.4, rng=np.random.default_rng(k))
        reference_augment_hsv(ref, hgain, 0.7, 0.4, rng=np.random.default_rng(k))
        r_hue = np.random.default_rng(k).uniform(-1, 1, 3)[0] * hgain + 1
        by_tables = not 0 <= 179 * r_hue < 256
        diff = np.abs(ours.astype(int) - ref.astype(int))
        assert diff.max() <= (0 if by_tables else 1), (k, r_hue)
        differing, checked, tables = differing + int((diff > 0).sum()), checked + diff.size, tables + by_tables
    assert differing <= checked * 1e-3
    assert (tables > 10) == (hgain > 1)
    big = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    before = big.copy()
    aug.augment_hsv(big, 0.0, 0.0, 0.0)  # no gains: untouched
    assert np.array_equal(big, before)


def test_albumentations_rgb_uint8():
    a = aug.Albumentations(p=1.0)
    a.reseed(0)
    img = np.random.default_rng(0).integers(0, 255, (64, 48, 3), dtype=np.uint8)
    out = a(img)
    assert out.shape == img.shape
    assert out.dtype == np.uint8
    # ToGray at p=1 (then CLAHE on L*, which keeps gray up to LAB rounding): channels (nearly) equal
    spread = out.astype(int).max(-1) - out.astype(int).min(-1)
    assert spread.max() <= 2
    assert (img.astype(int).max(-1) - img.astype(int).min(-1)).max() > 100


def test_mixup_blend():
    np.random.seed(5)
    r = np.random.beta(32.0, 32.0)
    np.random.seed(5)
    a, b = np.full((8, 8, 3), 100, np.uint8), np.full((8, 8, 3), 200, np.uint8)
    la, lb = np.ones((2, 5), np.float32), np.zeros((1, 5), np.float32)
    out, lab = mos.mixup(a, la, b, lb)
    assert (out == np.uint8(100 * r + 200 * (1 - r))).all()
    assert len(lab) == 3


def test_copy_paste_boxes():
    random.seed(0)
    boxes = np.array([[10, 20, 50, 60]], float)
    img = render(100, 200, boxes, [4])
    out, lab = mos.copy_paste_boxes(img.copy(), np.array([[4, 10, 20, 50, 60]], np.float32), p=1.0)
    assert len(lab) == 2
    np.testing.assert_allclose(lab[1], [4, 150, 20, 190, 60])
    assert_tight(out, lab, tol=1e-4)
    # a centred box overlaps its own mirror (IoA >= 0.3): nothing pasted
    _, lab = mos.copy_paste_boxes(img.copy(), np.array([[4, 80, 20, 120, 60]], np.float32), p=1.0)
    assert len(lab) == 1


# --------------------------------------------------------------------------------------------- dataset
def _fake_index(tmp_path, n=6):
    rng = np.random.default_rng(0)
    files, labels, shapes = [], [], []
    for i in range(n):
        h, w = int(rng.integers(120, 220)), int(rng.integers(120, 220))
        bw, bh = int(rng.integers(20, 60)), int(rng.integers(20, 60))
        x1, y1 = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
        box = np.array([[x1, y1, x1 + bw, y1 + bh]], float)
        img = render(h, w, box, [i])
        p = tmp_path / f"im{i}.png"
        cv2.imwrite(str(p), img[..., ::-1])
        files.append(str(p))
        labels.append(np.concatenate([[[i]], xyxy_to_xywhn(box, w, h, clip=False)], 1).astype(np.float32))
        shapes.append((h, w))
    return LabelIndex(files, labels, np.array(shapes), ScanReport())


def _item_pixels(item):
    img = item[0].permute(1, 2, 0).numpy()
    lab = item[1].numpy()[:, 1:]
    h, w = img.shape[:2]
    return img, np.concatenate([lab[:, :1], xywhn_to_xyxy(lab[:, 1:], w, h)], 1)


def test_train_item_mosaic_pipeline_keeps_boxes_on_pixels(tmp_path):
    hyp = {"hsv_h": 0, "hsv_s": 0, "hsv_v": 0, "degrees": 5, "shear": 2, "flipud": 0.5}
    ds = YOLODataset(_fake_index(tmp_path), imgsz=192, augment=True, hyp=hyp)
    ds.albumentations = None  # photometric ops would change the colours the test looks for
    seed(2)
    n_boxes = 0
    for i in range(len(ds)):
        item = ds[i]
        assert item[0].shape == (3, 192, 192)
        assert item[3] is None
        assert item[1].shape[1] == 6
        assert (item[1][:, 0] == 0).all()
        assert ((item[1][:, 2:] >= 0) & (item[1][:, 2:] <= 1)).all()
        img, px = _item_pixels(item)
        assert_tight_unless_cut(img, px, tol=2.5)
        n_boxes += len(px)
    assert n_boxes > len(ds)


def test_train_item_without_mosaic(tmp_path):
    ds = YOLODataset(_fake_index(tmp_path), imgsz=192, augment=True, hyp={"hsv_h": 0, "hsv_s": 0, "hsv_v": 0})
    ds.albumentations = None
    seed(0)
    for i in range(len(ds)):
        item = ds[(i, False)]  # close_mosaic: letterbox + random perspective with border 0
        assert item[0].shape == (3, 192, 192)
        assert item[3] is not None
        img, px = _item_pixels(item)
        assert_tight(img, px, tol=2.5)


def test_val_item_shapes_map_back_to_original(tmp_path):
    index = _fake_index(tmp_path)
    ds = YOLODataset(index, imgsz=160, augment=False, batch_size=4)
    orig = {f: (lb, s) for f, lb, s in zip(index.im_files, index.labels, index.shapes, strict=True)}
    for i in range(len(ds)):
        img_t, _lab, path, ((h0, w0), ((rh, rw), (pw, ph))) = ds[i]
        assert tuple(img_t.shape[1:]) == tuple(ds.batch_shapes[i // 4])
        img, px = _item_pixels(ds[i])
        assert_tight(img, px, tol=1.5)
        lb0, s0 = orig[path]
        assert (h0, w0) == tuple(s0)
        back = (px[:, 1:] - [pw, ph, pw, ph]) / [rw, rh, rw, rh]
        np.testing.assert_allclose(back, xywhn_to_xyxy(lb0[:, 1:], w0, h0), atol=1.0)
