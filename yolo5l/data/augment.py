"""YOLOv5 v7.0's training augmentations of one image, on RGB uint8 HWC numpy images: the perspective warp, HSV,
Albumentations, flips. Those that combine images are `yolo5l.data.mosaic`; sizes and the letterbox
`yolo5l.data.letterbox`.

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

from yolo5l.data.letterbox import FILL

_HUE_MAX = 179  # the largest hue of OpenCV's 8-bit HSV (degrees / 2)
_U8_LEVELS = 256

Rng = np.random.Generator


def pick_rng(rng: Rng | None) -> Any:
    """``rng``, or the global ``np.random`` module (only the methods both share are used: uniform, beta, random,
    choice, permutation)."""
    return np.random if rng is None else rng


def affine_bounds(m: Sequence[Sequence[float]], x1: float, y1: float, x2: float, y2: float) -> tuple[int, ...]:
    """(floor x, floor y, ceil x, ceil y) bounds of the rectangle [x1, x2] x [y1, y2] mapped by the 2x3 affine ``m``."""
    (a, b, c), (d, e, f) = m
    xs = (a * x1 + b * y1 + c, a * x2 + b * y1 + c, a * x1 + b * y2 + c, a * x2 + b * y2 + c)
    ys = (d * x1 + e * y1 + f, d * x2 + e * y1 + f, d * x1 + e * y2 + f, d * x2 + e * y2 + f)
    return math.floor(min(xs)), math.floor(min(ys)), math.ceil(max(xs)), math.ceil(max(ys))


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
def perspective_matrix(
    shape_hw: tuple[int, int],
    border: tuple[int, int] = (0, 0),
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float = 0.5,
    shear: float = 0.0,
    perspective: float = 0.0,
    rng: Rng | None = None,
) -> tuple[np.ndarray, float]:
    """The random 3x3 matrix M = T·S·R·P·C of :func:`random_perspective`, from input to output pixels.

    Draws, in this order: the two perspective terms, the angle, the scale, the two shears, the two translations
    (each even when its range is 0, so that the sequence of draws does not depend on the hyperparameters).

    Args:
        shape_hw: (h, w) of the input; the output is ``(h + 2 * border[0], w + 2 * border[1])``.
        border: (y, x) pixels added to each side of the output (negative crops).
        rng: Source of the draws (None: the global ``np.random``).

    Returns:
        ``(M, s)``: the matrix and the drawn scale (the box filter compares areas at that scale).
    """
    r = pick_rng(rng)
    height = shape_hw[0] + border[0] * 2
    width = shape_hw[1] + border[1] * 2
    C = np.eye(3)  # move the input centre to the origin
    C[0, 2] = -shape_hw[1] / 2
    C[1, 2] = -shape_hw[0] / 2
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
    return T @ S @ R @ P @ C, s


def warp_image(img: np.ndarray, M: np.ndarray, dsize: tuple[int, int], perspective: bool = False) -> np.ndarray:
    """``cv2.warpAffine`` by ``M[:2]`` (``warpPerspective`` by ``M`` when ``perspective``) into ``dsize`` (w, h),
    bilinear, with :data:`FILL` outside the input.

    A 3-channel image is warped as RGBA and converted back: OpenCV's bilinear warp is much faster on 4 channels
    than on 3, each channel is interpolated on its own with the same weights (so the colours come out identical),
    and the two conversions are cheap memory passes.
    """
    rgba = img.ndim == 3 and img.shape[2] == 3
    src = cv2.cvtColor(img, cv2.COLOR_RGB2RGBA) if rgba else img
    fill = (FILL,) * 4
    if perspective:
        out = cv2.warpPerspective(src, M, dsize=dsize, borderValue=fill)
    else:
        out = cv2.warpAffine(src, M[:2], dsize=dsize, borderValue=fill)
    return cv2.cvtColor(out, cv2.COLOR_RGBA2RGB) if rgba else out


def warp_boxes(
    labels: np.ndarray, M: np.ndarray, s: float, width: int, height: int, perspective: bool = False
) -> np.ndarray:
    """Boxes through ``M``: the bounding box of their 4 moved corners, clipped to the (width, height) output,
    filtered by :func:`box_candidates` against the input boxes at scale ``s``.

    Args:
        labels: (n, 5) [cls, x1, y1, x2, y2] input pixels.
        M: 3x3 input-to-output matrix (:func:`perspective_matrix`).
        perspective: Divide by the homogeneous coordinate.

    Returns:
        The surviving (m, 5) float32 labels in output pixels.
    """
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
    return labels.astype(np.float32, copy=False)


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
        The warped image (``img`` itself when M is the identity and there is no border) and the surviving
        labels, clipped to the output.

    Reference: YOLOv5 utils/augmentations.py random_perspective.
    """
    M, s = perspective_matrix(img.shape[:2], border, degrees, translate, scale, shear, perspective, rng)
    height = img.shape[0] + border[0] * 2
    width = img.shape[1] + border[1] * 2
    if border[0] != 0 or border[1] != 0 or (np.eye(3) != M).any():
        img = warp_image(img, M, (width, height), perspective=bool(perspective))
    return img, warp_boxes(labels, M, s, width, height, perspective=bool(perspective))


# --------------------------------------------------------------------------------------------- photometric
def hsv_gains(hgain: float, sgain: float, vgain: float, rng: Rng | None = None) -> np.ndarray | None:
    """The HSV jitter's draw: gains r = U(-1, 1) * gain + 1 for H, S and V, or None (and no draw) when all three
    gains are 0, as v7.0's ``augment_hsv``."""
    if not (hgain or sgain or vgain):
        return None
    return pick_rng(rng).uniform(-1, 1, 3) * [hgain, sgain, vgain] + 1


def hsv_tables(r: np.ndarray) -> np.ndarray:
    """v7.0's three lookup tables of the HSV jitter for gains ``r``: (3, 256) uint8, ``floor(x * r)`` with the hue
    modulo 180 and S and V clipped to 255 (``utils/augmentations.py::augment_hsv``)."""
    x = np.arange(_U8_LEVELS, dtype=r.dtype)
    luts = ((x * r[0]) % (_HUE_MAX + 1), np.clip(x * r[1], 0, 255), np.clip(x * r[2], 0, 255))
    return np.stack(luts).astype(np.uint8)


def augment_hsv(
    img: np.ndarray, hgain: float = 0.5, sgain: float = 0.5, vgain: float = 0.5, rng: Rng | None = None
) -> None:
    """HSV jitter in place: gains r = U(-1, 1) * gain + 1 on OpenCV's 8-bit H (0-179), S and V, hue modulo 180.

    YOLOv5 maps each channel through a lookup table, ``floor(x * r)`` (clipped to 255 for S and V, modulo 180 for
    H). Here one ``cv2.transform`` scales the three channels together, in a single pass over the pixels instead of
    a split, three lookups and a merge: it rounds ``x * r - 0.5`` to the nearest integer, which is the floor except
    at exact halves (one value in millions), and saturates at 255. The hue stays unwrapped (at most
    179 * 1.015 = 181.7 with YOLOv5's gains, up to 255 with any gain) and OpenCV's HSV-to-RGB conversion reads
    the hue modulo 180 itself, as the table's ``% 180`` would; a hue gain large enough to exceed 255 falls back
    to the table (so does a negative one).

    Args:
        img: RGB uint8 HWC, modified in place.
        rng: Source of the draws (None: the global ``np.random``).

    Reference: ultralytics/yolov5 v7.0 ``utils/augmentations.py::augment_hsv`` (behaviour).
    """
    r = hsv_gains(hgain, sgain, vgain, rng)
    if r is None:
        return
    hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV)
    if 0 <= _HUE_MAX * r[0] < _U8_LEVELS:  # the scaled hue fits in 8 bits
        m = np.array([[r[0], 0, 0, -0.5], [0, r[1], 0, -0.5], [0, 0, r[2], -0.5]])
        cv2.transform(hsv, m, dst=hsv)
    else:
        cv2.LUT(hsv, np.ascontiguousarray(hsv_tables(r).T).reshape(_U8_LEVELS, 1, 3), dst=hsv)
    cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB, dst=img)


class Albumentations:
    """YOLOv5's albumentations set: Blur, MedianBlur, ToGray and CLAHE, each with p 0.01, on RGB uint8.

    They are all photometric, so labels pass through untouched. Called with ``rng``, whether each transform fires
    is one draw from it (independently, with the transform's p), and those that fire are applied in order, their
    parameters drawn from ``rng`` (and from a ``random.Random`` seeded from it) for that call only; when none
    fires (most calls) the image comes back as it is, without a pass through albumentations. Without ``rng``,
    the Compose runs as usual on albumentations' own generators, which ``reseed`` (called from the worker init
    function) sets.

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

    def draw(self, rng: Rng) -> np.ndarray:
        """Which transforms fire in this call: one draw from ``rng`` per transform (the first draws of a call)."""
        transforms = self.transform.transforms
        return rng.random(len(transforms)) < [t.p for t in transforms]

    def device_ops(self, rng: Rng) -> tuple[int, int, int] | None:
        """The draws of a call with ``rng``, without the image: ``(blur kernel, median kernel, grey)`` of the
        transforms that fire (0 for those that do not), which a device applies as ``cv2.blur``,
        ``cv2.medianBlur`` and ``cv2.cvtColor(RGB2GRAY)`` do (``yolo5l.data.render``); None when CLAHE fires,
        whose LAB round trip only the host makes. ``rng`` is left as the call would leave it."""
        fire = self.draw(rng)
        if not fire.any():
            return 0, 0, 0
        if fire[3]:
            return None
        self.transform.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        blur, median, _, _ = self.transform.transforms
        return (
            blur.get_params()["kernel"] if fire[0] else 0,
            median.get_params()["kernel"] if fire[1] else 0,
            int(fire[2]),
        )

    def __call__(self, img: np.ndarray, rng: Rng | None = None) -> np.ndarray:
        """Apply the transforms to ``img``; with ``rng`` every draw of this call comes from it."""
        if rng is None:
            return self.transform(image=img)["image"]
        fire = self.draw(rng)
        if not fire.any():
            return img
        self.transform.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        for t, on in zip(self.transform.transforms, fire, strict=True):
            if on:
                img = t(image=img, force_apply=True)["image"]
        return img


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
