"""The canvas path of the mosaic, kept as the oracle of the direct warp in ``yolo5l.data.augment``.

Copies of ``mosaic4`` and ``random_perspective`` as they were before the mosaic's images were warped straight
into the output (and 3-channel warps went through RGBA), and of the flows of
``YOLODataset.load_mosaic`` and of a mosaic sample's ``YOLODataset._item`` (albumentations as one Compose call),
and ``augment_hsv`` as YOLOv5's three lookup tables:
the four images placed on a 2s x 2s canvas filled with 114, then a 3-channel ``cv2.warpAffine`` (or
``warpPerspective``) of the whole canvas into the s x s output. Helpers that did not change (``box_candidates``,
``copy_paste_boxes``, ``mixup``, the flips, the box formats) are imported.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import cv2
import numpy as np

from yolo5l.data.augment import box_candidates, flip_lr, flip_ud
from yolo5l.data.box_format import xywhn_to_xyxy, xyxy_to_xywhn
from yolo5l.data.letterbox import FILL
from yolo5l.data.mosaic import copy_paste_boxes, mixup


def reference_augment_hsv(
    img: np.ndarray, hgain: float = 0.5, sgain: float = 0.5, vgain: float = 0.5, rng: np.random.Generator | None = None
) -> None:
    """HSV jitter in place through three lookup tables, ``floor(x * r)``: the hue modulo 180, S and V clipped."""
    if not (hgain or sgain or vgain):
        return
    r = (np.random if rng is None else rng).uniform(-1, 1, 3) * [hgain, sgain, vgain] + 1
    hue, sat, val = cv2.split(cv2.cvtColor(img, cv2.COLOR_RGB2HSV))
    x = np.arange(0, 256, dtype=r.dtype)
    lut_hue = ((x * r[0]) % 180).astype(np.uint8)
    lut_sat = np.clip(x * r[1], 0, 255).astype(np.uint8)
    lut_val = np.clip(x * r[2], 0, 255).astype(np.uint8)
    hsv = cv2.merge((cv2.LUT(hue, lut_hue), cv2.LUT(sat, lut_sat), cv2.LUT(val, lut_val)))
    cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB, dst=img)


def reference_random_perspective(
    img: np.ndarray,
    labels: np.ndarray,
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float = 0.5,
    shear: float = 0.0,
    perspective: float = 0.0,
    border: tuple[int, int] = (0, 0),
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Random affine (or perspective) warp M = T·S·R·P·C of the whole image, boxes moved by their 4 corners."""
    r = np.random if rng is None else rng
    height = img.shape[0] + border[0] * 2
    width = img.shape[1] + border[1] * 2

    C = np.eye(3)
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
        xy[:, :2] = labels[:, [1, 2, 3, 4, 1, 4, 3, 2]].reshape(n * 4, 2)
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


def reference_mosaic4(
    images: Sequence[np.ndarray], labels: Sequence[np.ndarray], s: int, center: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """The 4 images placed around ``center`` on a 2s x 2s canvas of 114; labels in canvas pixels, clipped."""
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
        padw, padh = x1a - x1b, y1a - y1b
        if len(lab):
            box = xywhn_to_xyxy(lab[:, 1:5], w, h, padw, padh)
            out.append(np.concatenate([lab[:, :1], box], 1))
    lab4 = np.concatenate(out, 0).astype(np.float32) if out else np.zeros((0, 5), np.float32)
    np.clip(lab4[:, 1:], 0, 2 * s, out=lab4[:, 1:])
    return canvas, lab4


def reference_load_mosaic(
    ds, index: int, rng: np.random.Generator, partners: list[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``YOLODataset.load_mosaic`` through the canvas: the same draws in the same order (centre, partners unless
    given, permutation, copy-paste, perspective), from the dataset ``ds``'s images, labels, size and hyp."""
    s = ds.imgsz
    xc, yc = (int(rng.uniform(-b, 2 * s + b)) for b in ds.mosaic_border)
    others = rng.choice(ds.indices, size=3) if partners is None else partners
    idx = [index, *(int(i) for i in others)]
    idx = [idx[i] for i in rng.permutation(4)]
    images = [ds.load_image(i)[0] for i in idx]
    img, labels = reference_mosaic4(images, [ds.labels[i] for i in idx], s, (xc, yc))
    h = ds.hyp
    img, labels = copy_paste_boxes(img, labels, p=h["copy_paste"], rng=rng)
    return reference_random_perspective(
        img,
        labels,
        degrees=h["degrees"],
        translate=h["translate"],
        scale=h["scale"],
        shear=h["shear"],
        perspective=h["perspective"],
        border=ds.mosaic_border,
        rng=rng,
    )


def reference_item(ds, index: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A mosaic training sample as ``YOLODataset._item`` built it: :func:`reference_load_mosaic` (and mixup), the
    whole albumentations Compose run on generators seeded from ``rng`` (each transform's firing drawn inside
    it), HSV, flips. Needs ``ds.hyp["mosaic"] == 1``.

    Returns:
        The (s, s, 3) RGB image and its (n, 5) [cls, cx, cy, w, h] normalised labels.
    """
    h = ds.hyp
    if not rng.random() < h["mosaic"]:
        raise ValueError("reference_item covers mosaic samples only")
    img, labels = reference_load_mosaic(ds, index, rng)
    if rng.random() < h["mixup"]:
        img, labels = mixup(img, labels, *reference_load_mosaic(ds, int(rng.choice(ds.indices)), rng), rng=rng)
    if len(labels):
        labels[:, 1:5] = xyxy_to_xywhn(labels[:, 1:5], img.shape[1], img.shape[0], clip=True)
    compose = ds.albumentations.transform
    compose.set_random_state(rng, random.Random(int(rng.integers(2**63))))
    img = np.ascontiguousarray(compose(image=img)["image"])
    reference_augment_hsv(img, h["hsv_h"], h["hsv_s"], h["hsv_v"], rng=rng)
    if rng.random() < h["flipud"]:
        img = flip_ud(img, labels)
    if rng.random() < h["fliplr"]:
        img = flip_lr(img, labels)
    return img, labels
