"""YOLOv5 v7.0's augmentations that combine images: the 4-image mosaic (with its perspective warp done tile by
tile), mixup and copy-paste. Labels are ``(n, 5)`` float32 ``[cls, x1, y1, x2, y2]`` in pixels; every random op
takes ``rng`` as in `yolo5l.data.augment`.

Reference: ultralytics/yolov5 v7.0 utils/dataloaders.py (`load_mosaic`) and utils/augmentations.py (`mixup`,
`copy_paste`) (behaviour, not code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import cv2
import numpy as np

from yolo5l.data.augment import (
    Rng,
    affine_bounds,
    perspective_matrix,
    pick_rng,
    warp_boxes,
)
from yolo5l.data.box_format import xywhn_to_xyxy
from yolo5l.data.letterbox import FILL

__all__ = [
    "Placement",
    "copy_paste_boxes",
    "mixup",
    "mosaic4",
    "mosaic4_labels",
    "mosaic4_layout",
    "mosaic4_perspective",
    "warp_mosaic4",
]

MIXUP_BETA = 32.0  # mixup ratio r ~ Beta(MIXUP_BETA, MIXUP_BETA), as YOLOv5
_PASTE_MAX_IOA = 0.30  # copy-paste skips a box whose mirror covers this much of an existing box
# Where a mosaic image lands: (canvas rectangle x1a, y1a, x2a, y2a), (image rectangle x1b, y1b, x2b, y2b)
Placement = tuple[tuple[int, int, int, int], tuple[int, int, int, int]]


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
    counts = [len(lab) for lab in labels]
    if not sum(counts):
        return np.zeros((0, 5), np.float32)
    lab = np.concatenate(labels, 0)
    # per box its image's (w, h) and where the image's origin lands on the canvas: (x1a - x1b, y1a - y1b)
    geometry = [
        (w, h, x1a - x1b, y1a - y1b)
        for (h, w), ((x1a, y1a, _, _), (x1b, y1b, _, _)) in zip(shapes_hw, layout, strict=True)
    ]
    w, h, padw, padh = np.repeat(np.asarray(geometry, dtype=np.float32), counts, axis=0).T  # exact, as float32 math
    lab4 = np.empty((len(lab), 5), np.float32)
    lab4[:, 0] = lab[:, 0]
    lab4[:, 1:] = xywhn_to_xyxy(lab[:, 1:5], w, h, padw, padh)
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
    vx1, vy1, vx2, vy2 = affine_bounds(inv, 0, 0, width, height)
    vx1, vy1, vx2, vy2 = vx1 - 2, vy1 - 2, vx2 + 2, vy2 + 2
    for img, ((x1a, y1a, x2a, y2a), (x1b, y1b, _, _)) in zip(images, layout, strict=True):
        ax1, ay1, ax2, ay2 = max(x1a, vx1), max(y1a, vy1), min(x2a, vx2), min(y2a, vy2)  # the part that is read
        if ax2 <= ax1 or ay2 <= ay1:
            continue
        # the output pixels with a bilinear neighbour in it: its box grown by a pixel, mapped by M
        ox1, oy1, ox2, oy2 = affine_bounds(M[:2].tolist(), ax1 - 1, ay1 - 1, ax2, ay2)
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
    """Blend two images with r ~ Beta(``MIXUP_BETA``, ``MIXUP_BETA``) and keep both label sets (Zhang et al., 2017).

    ``rng``: source of the draw (None: the global ``np.random``).
    """
    r = pick_rng(rng).beta(MIXUP_BETA, MIXUP_BETA)
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
    for j in pick_rng(rng).choice(n, size=round(p * n), replace=False):
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
