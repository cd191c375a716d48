"""YOLOv5 v7.0 training augmentations and validation letterboxing, on RGB uint8 HWC numpy images.

Labels inside the geometric transforms are ``(n, 5)`` float32 ``[cls, x1, y1, x2, y2]`` in pixels; the dataset
converts them to normalised ``[cls, cx, cy, w, h]`` before the photometric ops and flips.

Every random op takes ``rng``: a ``np.random.Generator``. The dataset builds one per sample from
``(seed, epoch, rank, index)`` (the training sampler sends that key), so a sample's augmentation is a pure
function of it: independent of the worker that runs it, of ``num_workers`` and of the process's history, which is
what makes a resumed run replay an uninterrupted one exactly. ``rng=None`` draws from the global ``np.random``
state instead (handy in notebooks and tests; the worker init function seeds it per worker).

Reference: ultralytics/yolov5 v7.0 utils/augmentations.py and utils/dataloaders.py (behaviour, not code).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from yolo5l.data.box_format import xywhn_to_xyxy

FILL = 114  # grey used for every border, as in YOLOv5
MAX_STRIDE = 32  # the model's largest stride: letterboxed and rectangular batch shapes are multiples of it
RECT_PAD = 0.5  # rectangular batch padding, in units of the stride (YOLOv5's val pad)
_MIXUP_BETA = 32.0  # mixup ratio r ~ Beta(_MIXUP_BETA, _MIXUP_BETA), as YOLOv5
_PASTE_MAX_IOA = 0.30  # copy-paste skips a box whose mirror covers this much of an existing box

Rng = np.random.Generator


def _rng(rng: Rng | None) -> Any:
    """``rng``, or the global ``np.random`` module (only the methods both share are used: uniform, beta, random,
    choice, permutation)."""
    return np.random if rng is None else rng


# The augmentation keys of ultralytics/yolov5 v7.0 data/hyps/hyp.scratch-low.yaml: used when the hyp mapping lacks one.
DEFAULT_HYP: dict[str, float] = {
    "hsv_h": 0.015,
    "hsv_s": 0.7,
    "hsv_v": 0.4,
    "degrees": 0.0,
    "translate": 0.1,
    "scale": 0.5,
    "shear": 0.0,
    "perspective": 0.0,
    "flipud": 0.0,
    "fliplr": 0.5,
    "mosaic": 1.0,
    "mixup": 0.0,
    "copy_paste": 0.0,
}


def augment_hyp(hyp: Mapping | None) -> dict[str, float]:
    """The augmentation hyperparameters: ``DEFAULT_HYP`` overridden by the keys present in ``hyp``."""
    out = dict(DEFAULT_HYP)
    if hyp is not None:
        out.update({k: float(hyp[k]) for k in DEFAULT_HYP if k in hyp})
    return out


# --------------------------------------------------------------------------------------------- box filter
def box_candidates(
    box1: np.ndarray, box2: np.ndarray, wh_thr: float = 2, ar_thr: float = 100, area_thr: float = 0.1, eps=1e-16
) -> np.ndarray:
    """Which boxes survive an augmentation.

    Args:
        box1: (4, n) x1,y1,x2,y2 before the transform (already multiplied by the transform's scale).
        box2: (4, n) after the transform.
        wh_thr: minimum width and height in pixels (strictly greater).
        ar_thr: maximum aspect ratio (strictly smaller).
        area_thr: minimum area ratio after/before (strictly greater).

    Returns:
        (n,) bool mask.
    """
    w1, h1 = box1[2] - box1[0], box1[3] - box1[1]
    w2, h2 = box2[2] - box2[0], box2[3] - box2[1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


# --------------------------------------------------------------------------------------------- geometry
def resized_shape(h0: int, w0: int, imgsz: int) -> tuple[int, int]:
    """(h, w) after resizing so that the long side equals ``imgsz`` (aspect kept, at least 1 px)."""
    r = imgsz / max(h0, w0)
    if r == 1:
        return int(h0), int(w0)
    return max(1, round(h0 * r)), max(1, round(w0 * r))


def resize_long_side(img: np.ndarray, imgsz: int, augment: bool) -> np.ndarray:
    """Resize so the long side equals ``imgsz``: INTER_LINEAR when augmenting or upscaling, else INTER_AREA."""
    h0, w0 = img.shape[:2]
    h, w = resized_shape(h0, w0, imgsz)
    if (h, w) == (h0, w0):
        return img
    interp = cv2.INTER_LINEAR if (augment or h > h0) else cv2.INTER_AREA
    return cv2.resize(img, (w, h), interpolation=interp)


def letterbox(
    img: np.ndarray,
    new_shape: int | Sequence[int] = 640,
    color: int = FILL,
    auto: bool = False,
    scaleup: bool = True,
    stride: int = MAX_STRIDE,
) -> tuple[np.ndarray, tuple[float, float], tuple[float, float]]:
    """Resize keeping the aspect ratio and pad to ``new_shape`` (h, w) with ``color``.

    Args:
        img: HWC uint8.
        new_shape: target (h, w), or an int for a square.
        auto: pad only up to the next multiple of ``stride`` (minimum rectangle) instead of to ``new_shape``.
        scaleup: allow enlarging; validation uses False (only shrink, which then uses INTER_AREA).

    Returns:
        ``(image, (ratio_h, ratio_w), (pad_w, pad_h))`` where pad is the left/top padding (half of the total).
    """
    shape = img.shape[:2]
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    r = min(new_shape[0] / shape[0], new_shape[1] / shape[1])
    if not scaleup:
        r = min(r, 1.0)
    new_unpad = (round(shape[1] * r), round(shape[0] * r))  # (w, h)
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = dw % stride, dh % stride
    dw, dh = dw / 2, dh / 2
    if shape[::-1] != new_unpad:
        interp = cv2.INTER_LINEAR if r > 1 else cv2.INTER_AREA
        img = cv2.resize(img, new_unpad, interpolation=interp)
    top, bottom = round(dh - 0.1), round(dh + 0.1)
    left, right = round(dw - 0.1), round(dw + 0.1)
    if top or bottom or left or right:
        img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(color, color, color))
    ratio = (new_unpad[1] / shape[0], new_unpad[0] / shape[1])
    return img, ratio, (float(left), float(top))


def random_perspective(
    img: np.ndarray,
    labels: np.ndarray,
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float = 0.5,
    shear: float = 0.0,
    perspective: float = 0.0,
    border: tuple[int, int] = (0, 0),
    rng: Rng | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Random affine (or perspective) warp M = T·S·R·P·C, boxes moved by their 4 corners and filtered.

    Args:
        img: HWC uint8 (a 2s x 2s mosaic with ``border=(-s//2, -s//2)``, or an s x s letterboxed image with 0).
        labels: (n, 5) [cls, x1, y1, x2, y2] pixels.
        border: (y, x) pixels added to each side of the output (negative crops): output is
            ``(h + 2 * border[0], w + 2 * border[1])``.
        rng: Source of the draws (None: the global ``np.random``).

    Returns:
        The warped image and the surviving labels, clipped to the output.

    Reference: YOLOv5 utils/augmentations.py random_perspective.
    """
    r = _rng(rng)
    height = img.shape[0] + border[0] * 2
    width = img.shape[1] + border[1] * 2

    C = np.eye(3)  # move the input centre to the origin
    C[0, 2] = -img.shape[1] / 2
    C[1, 2] = -img.shape[0] / 2
    P = np.eye(3)
    P[2, 0] = r.uniform(-perspective, perspective)
    P[2, 1] = r.uniform(-perspective, perspective)
    R = np.eye(3)
    a = r.uniform(-degrees, degrees)
    s = r.uniform(1 - scale, 1 + scale)
    R[:2] = cv2.getRotationMatrix2D(center=(0, 0), angle=a, scale=s)
    S = np.eye(3)
    S[0, 1] = math.tan(r.uniform(-shear, shear) * math.pi / 180)
    S[1, 0] = math.tan(r.uniform(-shear, shear) * math.pi / 180)
    T = np.eye(3)
    T[0, 2] = r.uniform(0.5 - translate, 0.5 + translate) * width
    T[1, 2] = r.uniform(0.5 - translate, 0.5 + translate) * height
    M = T @ S @ R @ P @ C

    if border[0] != 0 or border[1] != 0 or (np.eye(3) != M).any():
        fill = (FILL, FILL, FILL)
        if perspective:
            img = cv2.warpPerspective(img, M, dsize=(width, height), borderValue=fill)
        else:
            img = cv2.warpAffine(img, M[:2], dsize=(width, height), borderValue=fill)

    n = len(labels)
    if n:
        xy = np.ones((n * 4, 3))
        xy[:, :2] = labels[:, [1, 2, 3, 4, 1, 4, 3, 2]].reshape(n * 4, 2)  # x1y1, x2y2, x1y2, x2y1
        xy = xy @ M.T
        xy = xy[:, :2] / xy[:, 2:3] if perspective else xy[:, :2]
        xy = xy.reshape(n, 8)
        x, y = xy[:, [0, 2, 4, 6]], xy[:, [1, 3, 5, 7]]
        new = np.stack([x.min(1), y.min(1), x.max(1), y.max(1)], 1)
        new[:, [0, 2]] = new[:, [0, 2]].clip(0, width)
        new[:, [1, 3]] = new[:, [1, 3]].clip(0, height)
        keep = box_candidates(labels[:, 1:5].T * s, new.T)
        labels = labels[keep]
        labels[:, 1:5] = new[keep]
    return img, labels.astype(np.float32, copy=False)


def mosaic4(
    images: Sequence[np.ndarray], labels: Sequence[np.ndarray], s: int, center: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Place 4 images around ``center`` on a 2s x 2s canvas filled with :data:`FILL`.

    Image 0 ends at the centre from the top-left, 1 starts there towards the top-right, 2 towards the
    bottom-left, 3 towards the bottom-right; each is cut where it leaves the canvas.

    Args:
        images: 4 HWC uint8 images (long side <= s usually).
        labels: 4 arrays (n_i, 5) [cls, cx, cy, w, h] normalised to their own image.
        center: (xc, yc) in canvas pixels.

    Returns:
        The canvas and the (n, 5) [cls, x1, y1, x2, y2] labels in canvas pixels, clipped to [0, 2s].
    """
    xc, yc = center
    canvas = np.full((2 * s, 2 * s, images[0].shape[2]), FILL, dtype=np.uint8)
    out = []
    for i, (img, lab) in enumerate(zip(images, labels, strict=True)):
        h, w = img.shape[:2]
        if i == 0:
            x1a, y1a, x2a, y2a = max(xc - w, 0), max(yc - h, 0), xc, yc
            x1b, y1b, x2b, y2b = w - (x2a - x1a), h - (y2a - y1a), w, h
        elif i == 1:
            x1a, y1a, x2a, y2a = xc, max(yc - h, 0), min(xc + w, 2 * s), yc
            x1b, y1b, x2b, y2b = 0, h - (y2a - y1a), min(w, x2a - x1a), h
        elif i == 2:
            x1a, y1a, x2a, y2a = max(xc - w, 0), yc, xc, min(2 * s, yc + h)
            x1b, y1b, x2b, y2b = w - (x2a - x1a), 0, w, min(y2a - y1a, h)
        else:
            x1a, y1a, x2a, y2a = xc, yc, min(xc + w, 2 * s), min(2 * s, yc + h)
            x1b, y1b, x2b, y2b = 0, 0, min(w, x2a - x1a), min(y2a - y1a, h)
        canvas[y1a:y2a, x1a:x2a] = img[y1b:y2b, x1b:x2b]
        padw, padh = x1a - x1b, y1a - y1b  # offset of this image's origin on the canvas
        if len(lab):
            box = xywhn_to_xyxy(lab[:, 1:5], w, h, padw, padh)
            out.append(np.concatenate([lab[:, :1], box], 1))
    lab4 = np.concatenate(out, 0).astype(np.float32) if out else np.zeros((0, 5), np.float32)
    np.clip(lab4[:, 1:], 0, 2 * s, out=lab4[:, 1:])
    return canvas, lab4


def mixup(
    im: np.ndarray, labels: np.ndarray, im2: np.ndarray, labels2: np.ndarray, rng: Rng | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Blend two images with r ~ Beta(``_MIXUP_BETA``, ``_MIXUP_BETA``) and keep both label sets (Zhang et al., 2017).

    ``rng``: source of the draw (None: the global ``np.random``).
    """
    r = _rng(rng).beta(_MIXUP_BETA, _MIXUP_BETA)
    out = (im.astype(np.float32) * r + im2.astype(np.float32) * (1 - r)).astype(np.uint8)
    return out, np.concatenate((labels, labels2), 0)


def _ioa(box: np.ndarray, boxes: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """Intersection of ``box`` (4,) with each of ``boxes`` (n, 4) over the area of each of ``boxes``."""
    iw = (np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0])).clip(0)
    ih = (np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1])).clip(0)
    return iw * ih / ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) + eps)


def copy_paste_boxes(
    img: np.ndarray, labels: np.ndarray, p: float = 0.5, rng: Rng | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Copy-paste for box labels (a simplified YOLOv5 copy_paste, which needs polygon segments).

    YOLOv5 pastes left-right-mirrored segments at their mirrored position when they cover less than
    ``_PASTE_MAX_IOA`` of any existing box. Without segments this pastes the mirrored rectangular crop of a box
    instead, under the same rule: each box with probability ``p``, at x -> w - x, if its IoA with every existing
    box is below ``_PASTE_MAX_IOA``.

    Args:
        img: HWC uint8, modified in place.
        labels: (n, 5) [cls, x1, y1, x2, y2] pixels.
        rng: Source of the draws (None: the global ``np.random``).

    Returns:
        The image and the labels with the pasted boxes appended.
    """
    n = len(labels)
    if not (p and n):
        return img, labels
    w = img.shape[1]
    new = [labels]
    for j in _rng(rng).choice(n, size=round(p * n), replace=False):
        c, x1, y1, x2, y2 = labels[j]
        box = np.array([w - x2, y1, w - x1, y2], dtype=np.float32)
        current = np.concatenate(new, 0)[:, 1:5]
        if (_ioa(box, current) < _PASTE_MAX_IOA).all():
            xa, ya, xb, yb = (round(float(v)) for v in (x1, y1, x2, y2))
            if xb - xa < 1 or yb - ya < 1:
                continue
            crop = img[ya:yb, xa:xb][:, ::-1].copy()
            img[ya:yb, w - xb : w - xa] = crop
            new.append(np.array([[c, w - xb, ya, w - xa, yb]], dtype=np.float32))
    return img, np.concatenate(new, 0)


# --------------------------------------------------------------------------------------------- photometric
def augment_hsv(
    img: np.ndarray, hgain: float = 0.5, sgain: float = 0.5, vgain: float = 0.5, rng: Rng | None = None
) -> None:
    """HSV jitter in place through lookup tables: gains r = U(-1, 1) * gain + 1, hue modulo 180.

    Args:
        img: RGB uint8 HWC, modified in place.
        rng: Source of the draws (None: the global ``np.random``).
    """
    if not (hgain or sgain or vgain):
        return
    r = _rng(rng).uniform(-1, 1, 3) * [hgain, sgain, vgain] + 1
    hue, sat, val = cv2.split(cv2.cvtColor(img, cv2.COLOR_RGB2HSV))
    x = np.arange(0, 256, dtype=r.dtype)
    lut_hue = ((x * r[0]) % 180).astype(np.uint8)
    lut_sat = np.clip(x * r[1], 0, 255).astype(np.uint8)
    lut_val = np.clip(x * r[2], 0, 255).astype(np.uint8)
    hsv = cv2.merge((cv2.LUT(hue, lut_hue), cv2.LUT(sat, lut_sat), cv2.LUT(val, lut_val)))
    cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB, dst=img)


class Albumentations:
    """YOLOv5's albumentations set: Blur, MedianBlur, ToGray and CLAHE, each with p 0.01, on RGB uint8.

    They are all photometric, so labels pass through untouched. Called with ``rng``, the transforms draw from it
    (and from a ``random.Random`` seeded from it) for that call only; without, from albumentations' own
    generators, which ``reseed`` (called from the worker init function) sets.

    Args:
        p: probability of each transform (YOLOv5 uses 0.01).
    """

    def __init__(self, p: float = 0.01) -> None:
        import albumentations as A

        self.transform = A.Compose(
            [
                A.Blur(blur_limit=(3, 7), p=p),
                A.MedianBlur(blur_limit=(3, 7), p=p),
                A.ToGray(p=p),
                A.CLAHE(clip_limit=(1, 4.0), tile_grid_size=(8, 8), p=p),
            ],
            seed=0,
        )

    def reseed(self, seed: int) -> None:
        """Reseed the transforms' generators (deterministic per worker)."""
        self.transform.set_random_seed(seed)

    def __call__(self, img: np.ndarray, rng: Rng | None = None) -> np.ndarray:
        """Apply the transforms to ``img``; with ``rng`` every draw of this call comes from it."""
        if rng is not None:
            self.transform.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        return self.transform(image=img)["image"]


# --------------------------------------------------------------------------------------------- flips
def flip_lr(img: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Mirror left-right; ``labels`` (n, 5) normalised [cls, cx, cy, w, h] updated in place."""
    if len(labels):
        labels[:, 1] = 1 - labels[:, 1]
    return cv2.flip(img, 1)  # a SIMD copy: far cheaper than materialising numpy's reversed view


def flip_ud(img: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Mirror up-down; ``labels`` (n, 5) normalised [cls, cx, cy, w, h] updated in place."""
    if len(labels):
        labels[:, 2] = 1 - labels[:, 2]
    return cv2.flip(img, 0)


# --------------------------------------------------------------------------------------------- rect batches
def rect_batch_shapes(
    shapes_hw: np.ndarray, batch_size: int, imgsz: int, stride: int = MAX_STRIDE, pad: float = RECT_PAD
) -> tuple[np.ndarray, np.ndarray]:
    """Order images by aspect ratio and give each batch one letterbox shape.

    Args:
        shapes_hw: (n, 2) original [h, w].

    Returns:
        ``(order, batch_shapes)``: the (n,) permutation that sorts by h/w, and (nb, 2) int [h, w] per batch of
        ``batch_size`` consecutive images in that order: ``ceil(shape * imgsz / stride + pad) * stride`` where
        shape is [max h/w, 1] for tall-free batches (all h/w < 1), [1, 1 / min h/w] when all h/w > 1, else [1, 1].

    Reference: YOLOv5 utils/dataloaders.py LoadImagesAndLabels (rect).
    """
    ar = shapes_hw[:, 0] / shapes_hw[:, 1]
    order = ar.argsort(kind="stable")
    ar = ar[order]
    n = len(ar)
    nb = max(1, math.ceil(n / batch_size))
    rel = np.ones((nb, 2))
    for b in range(nb):
        ari = ar[b * batch_size : (b + 1) * batch_size]
        if len(ari) == 0:
            continue
        lo, hi = ari.min(), ari.max()
        if hi < 1:
            rel[b] = [hi, 1]
        elif lo > 1:
            rel[b] = [1, 1 / lo]
    batch_shapes = (np.ceil(rel * imgsz / stride + pad).astype(int) * stride).astype(int)
    return order, batch_shapes
