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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from yolo5l.data.box_format import xywhn_to_xyxy

FILL = 114  # grey used for every border, as in YOLOv5
MAX_STRIDE = 32  # the model's largest stride: letterboxed and rectangular batch shapes are multiples of it
RECT_PAD = 0.5  # rectangular batch padding, in units of the stride (YOLOv5's val pad)
_MIXUP_BETA = 32.0  # mixup ratio r ~ Beta(_MIXUP_BETA, _MIXUP_BETA), as YOLOv5
_PASTE_MAX_IOA = 0.30  # copy-paste skips a box whose mirror covers this much of an existing box
_HUE_MAX = 179  # the largest hue of OpenCV's 8-bit HSV (degrees / 2)
_U8_LEVELS = 256

Rng = np.random.Generator
# Where a mosaic image lands: (canvas rectangle x1a, y1a, x2a, y2a), (image rectangle x1b, y1b, x2b, y2b)
Placement = tuple[tuple[int, int, int, int], tuple[int, int, int, int]]


def _rng(rng: Rng | None) -> Any:
    """``rng``, or the global ``np.random`` module (only the methods both share are used: uniform, beta, random,
    choice, permutation)."""
    return np.random if rng is None else rng


def _affine_bounds(m: Sequence[Sequence[float]], x1: float, y1: float, x2: float, y2: float) -> tuple[int, ...]:
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
    r = _rng(rng)
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


def mosaic4_layout(shapes_hw: Sequence[tuple[int, int]], s: int, center: tuple[int, int]) -> list[Placement]:
    """Where :func:`mosaic4` puts 4 images of sizes ``shapes_hw`` around ``center`` on its 2s x 2s canvas.

    Image 0 ends at the centre from the top-left, 1 starts there towards the top-right, 2 towards the
    bottom-left, 3 towards the bottom-right; each is cut where it leaves the canvas.

    Returns:
        Per image ``((x1a, y1a, x2a, y2a), (x1b, y1b, x2b, y2b))``: the canvas rectangle it covers and the
        rectangle of the image (same size) that lands there.
    """
    xc, yc = center
    out = []
    for i, (h, w) in enumerate(shapes_hw):
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
        out.append(((x1a, y1a, x2a, y2a), (x1b, y1b, x2b, y2b)))
    return out


def mosaic4_labels(
    labels: Sequence[np.ndarray], shapes_hw: Sequence[tuple[int, int]], layout: Sequence[Placement], s: int
) -> np.ndarray:
    """The labels of the 4 placed images in canvas pixels: (n, 5) [cls, x1, y1, x2, y2] clipped to [0, 2s].

    Args:
        labels: 4 arrays (n_i, 5) [cls, cx, cy, w, h] normalised to their own image.
        shapes_hw: The images' (h, w).
        layout: :func:`mosaic4_layout` of them.
    """
    out = []
    for lab, (h, w), ((x1a, y1a, _, _), (x1b, y1b, _, _)) in zip(labels, shapes_hw, layout, strict=True):
        if len(lab):  # the image's origin lands at (x1a - x1b, y1a - y1b) on the canvas
            box = xywhn_to_xyxy(lab[:, 1:5], w, h, x1a - x1b, y1a - y1b)
            out.append(np.concatenate([lab[:, :1], box], 1))
    lab4 = np.concatenate(out, 0).astype(np.float32) if out else np.zeros((0, 5), np.float32)
    np.clip(lab4[:, 1:], 0, 2 * s, out=lab4[:, 1:])
    return lab4


def mosaic4(
    images: Sequence[np.ndarray], labels: Sequence[np.ndarray], s: int, center: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Place 4 images around ``center`` on a 2s x 2s canvas filled with :data:`FILL` (see :func:`mosaic4_layout`).

    Args:
        images: 4 HWC uint8 images (long side <= s usually).
        labels: 4 arrays (n_i, 5) [cls, cx, cy, w, h] normalised to their own image.
        center: (xc, yc) in canvas pixels.

    Returns:
        The canvas and the (n, 5) [cls, x1, y1, x2, y2] labels in canvas pixels, clipped to [0, 2s].
    """
    shapes = [im.shape[:2] for im in images]
    layout = mosaic4_layout(shapes, s, center)
    canvas = np.full((2 * s, 2 * s, images[0].shape[2]), FILL, dtype=np.uint8)
    for img, ((x1a, y1a, x2a, y2a), (x1b, y1b, x2b, y2b)) in zip(images, layout, strict=True):
        canvas[y1a:y2a, x1a:x2a] = img[y1b:y2b, x1b:x2b]
    return canvas, mosaic4_labels(labels, shapes, layout, s)


# An image, or a function that loads it given how many of its rows, from the top, are read (it may return only
# those rows, or more).
Tile = np.ndarray | Callable[[int], np.ndarray]


def warp_mosaic4(
    images: Sequence[Tile], layout: Sequence[Placement], M: np.ndarray, dsize: tuple[int, int], channels: int = 3
) -> np.ndarray:
    """The bilinear affine warp by ``M`` of the canvas that :func:`mosaic4` would build, without building it.

    Each image is warped on its own, straight from its placed rectangle into the part of the output that
    rectangle maps to: its placement offset and that output region's origin go into the matrix (passed
    inverted, output to image, as OpenCV uses it), and only the part of the rectangle the output samples is
    read. The output starts as :data:`FILL` and each warp leaves the output pixels whose source lies outside its
    image alone (``BORDER_TRANSPARENT``), so what no image covers stays fill, as on the canvas.

    An output pixel whose bilinear taps all lie in one image, or all in the fill, is the canvas warp's. One whose
    taps straddle an image edge (a band about one canvas pixel wide along each edge) differs where the other side
    is another image: OpenCV 5 mixes the image's taps with what the output already holds there instead of with
    the other image's taps (next to the fill, which the output holds, that is the canvas value); OpenCV 4 leaves
    such a pixel as it was, next to the fill too.

    Args:
        images: The 4 HWC uint8 images, or functions that load them (of the shapes the layout was made for): a
            function is called only when the output shows part of its image, so an image that falls outside the
            output (on average about one mosaic in five has one) is never decoded, and it is told how many rows
            from the top are read, so that a decoder can stop after them (the image may come with only those).
        layout: Their :func:`mosaic4_layout`.
        M: 3x3 affine canvas-to-output matrix (last row 0, 0, 1).
        dsize: Output (w, h).
        channels: Channels of the images (of the first one that is an array, when there is one).

    Returns:
        The (h, w, c) uint8 output. 3-channel images are warped as RGBA (see :func:`warp_image`).
    """
    width, height = dsize
    channels = next((im.shape[2] for im in images if isinstance(im, np.ndarray)), channels)
    rgba = channels == 3
    out = np.full((height, width, 4 if rgba else channels), FILL, np.uint8)
    inv = cv2.invertAffineTransform(M[:2]).tolist()  # output pixel -> canvas point
    (i00, i01, i02), (i10, i11, i12) = inv
    # the canvas area the output samples: the inverse image of the output, grown by the bilinear neighbours
    vx1, vy1, vx2, vy2 = _affine_bounds(inv, 0, 0, width, height)
    vx1, vy1, vx2, vy2 = vx1 - 2, vy1 - 2, vx2 + 2, vy2 + 2
    for img, ((x1a, y1a, x2a, y2a), (x1b, y1b, _, _)) in zip(images, layout, strict=True):
        ax1, ay1, ax2, ay2 = max(x1a, vx1), max(y1a, vy1), min(x2a, vx2), min(y2a, vy2)  # the part that is read
        if ax2 <= ax1 or ay2 <= ay1:
            continue
        # the output pixels with a bilinear neighbour in it: its box grown by a pixel, mapped by M
        ox1, oy1, ox2, oy2 = _affine_bounds(M[:2].tolist(), ax1 - 1, ay1 - 1, ax2, ay2)
        ox1, oy1, ox2, oy2 = max(ox1, 0), max(oy1, 0), min(ox2 + 1, width), min(oy2 + 1, height)
        if ox2 <= ox1 or oy2 <= oy1:
            continue
        if callable(img):
            img = img(y1b + ay2 - y1a)
        tile = img[y1b + ay1 - y1a : y1b + ay2 - y1a, x1b + ax1 - x1a : x1b + ax2 - x1a]
        if rgba:
            tile = cv2.cvtColor(tile, cv2.COLOR_RGB2RGBA)
        # output region pixel -> tile pixel: the inverse with both origins moved into its translation
        m = np.array([[i00, i01, i02 + i00 * ox1 + i01 * oy1 - ax1], [i10, i11, i12 + i10 * ox1 + i11 * oy1 - ay1]])
        cv2.warpAffine(
            tile,
            m,
            (ox2 - ox1, oy2 - oy1),
            dst=out[oy1:oy2, ox1:ox2],
            flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
            borderMode=cv2.BORDER_TRANSPARENT,
        )
    return cv2.cvtColor(out, cv2.COLOR_RGBA2RGB) if rgba else out


def mosaic4_perspective(
    images: Sequence[Tile],
    labels: Sequence[np.ndarray],
    s: int,
    center: tuple[int, int],
    border: tuple[int, int],
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float = 0.5,
    shear: float = 0.0,
    rng: Rng | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
    channels: int = 3,
) -> tuple[np.ndarray, np.ndarray]:
    """``random_perspective(*mosaic4(images, labels, s, center), border=border, perspective=0, ...)`` without the
    2s x 2s canvas: the images are warped straight into the output (:func:`warp_mosaic4`). ``images`` may hold
    functions that load them, with their (h, w) in ``shapes``: only the images the output shows are loaded.

    The draws, the matrix and the box arithmetic are :func:`random_perspective`'s, so for the same ``rng`` the
    labels are identical; the pixels differ only along the seams (see :func:`warp_mosaic4`).

    Returns:
        The ``(2s + 2 * border[0], 2s + 2 * border[1])`` image and its (n, 5) [cls, x1, y1, x2, y2] labels.
    """
    if shapes is None:
        shapes = [im.shape[:2] for im in images]  # type: ignore[union-attr]
    layout = mosaic4_layout(shapes, s, center)
    lab4 = mosaic4_labels(labels, shapes, layout, s)
    M, sc = perspective_matrix((2 * s, 2 * s), border, degrees, translate, scale, shear, 0.0, rng)
    height, width = 2 * s + 2 * border[0], 2 * s + 2 * border[1]
    return warp_mosaic4(images, layout, M, (width, height), channels), warp_boxes(lab4, M, sc, width, height)


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
    if not (hgain or sgain or vgain):
        return
    r = _rng(rng).uniform(-1, 1, 3) * [hgain, sgain, vgain] + 1
    hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV)
    if 0 <= _HUE_MAX * r[0] < _U8_LEVELS:  # the scaled hue fits in 8 bits
        m = np.array([[r[0], 0, 0, -0.5], [0, r[1], 0, -0.5], [0, 0, r[2], -0.5]])
        cv2.transform(hsv, m, dst=hsv)
    else:
        x = np.arange(_U8_LEVELS, dtype=r.dtype)
        luts = ((x * r[0]) % (_HUE_MAX + 1), np.clip(x * r[1], 0, 255), np.clip(x * r[2], 0, 255))
        cv2.LUT(hsv, np.stack(luts, 1).astype(np.uint8).reshape(_U8_LEVELS, 1, 3), dst=hsv)
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

    def __call__(self, img: np.ndarray, rng: Rng | None = None) -> np.ndarray:
        """Apply the transforms to ``img``; with ``rng`` every draw of this call comes from it."""
        if rng is None:
            return self.transform(image=img)["image"]
        transforms = self.transform.transforms
        fire = rng.random(len(transforms)) < [t.p for t in transforms]
        if not fire.any():
            return img
        self.transform.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        for t, on in zip(transforms, fire, strict=True):
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
