"""Training-batch transforms that run on the device, after the batch is moved there: ``data.quad`` and
``data.multi_scale`` (ultralytics/yolov5 v7.0 ``train.py --quad`` / ``--multi-scale``).

``YOLODataModule`` calls :meth:`TrainBatchTransform.before_transfer` on the host batch (the targets are rewritten
there, where filtering them costs no device sync) and :meth:`TrainBatchTransform.after_transfer` on the device images,
for training batches only. Every draw comes from a generator keyed by (seed, epoch, batch index): the same batches after
a resume, and for multi-scale the same size on every DDP rank.

- Quad (v7.0 ``LoadImagesAndLabels.collate_fn4``): a batch of B images becomes B // 4 images of twice the size. Each
  group of 4 is, with probability 0.5, its first image upscaled 2x (bilinear, ``align_corners=False``, then back to
  uint8 by truncation as v7.0's ``.type()``) with that image's labels, else the 2 x 2 tiling
  ``[[im0, im2], [im1, im3]]`` with the labels shifted into their quarter and halved. Images past the last whole group
  are dropped, as in v7.0; a batch of fewer than 4 images (v7.0 fails on it) becomes its first image upscaled. The
  loss of a quad batch counts x4 (``YOLOv5Module(quad=True)``), as v7.0's ``loss *= 4.``.
- Multi-scale (v7.0's training loop): per batch a size ``sz`` uniform over ``range(imgsz // 2, imgsz * 3 // 2 + gs)``
  floored to a multiple of the grid ``gs = max(max stride, 32)``; the batch is resized bilinearly
  (``align_corners=False``) so its long side is ``sz`` and each side is ``ceil(side * sz / long side / gs) * gs``.
  It runs on the float images, after a quad collation (whose 2x images it scales back towards ``imgsz``, as v7.0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TrainBatchTransform", "multi_scale_shape", "quad_images", "quad_targets"]

_QUAD_STREAM = 0x9A4D  # leading words of the generators' keys: each transform has a stream of its own
_SCALE_STREAM = 0x5CA1E


def multi_scale_shape(rng: np.random.Generator, imgsz: int, hw: Sequence[int], gs: int) -> tuple[int, int] | None:
    """The (h, w) a batch of shape ``hw`` is resized to by v7.0's ``--multi-scale``, or None when it keeps its size.

    Reference: ultralytics/yolov5 v7.0 ``train.py`` (``sz = random.randrange(imgsz * 0.5, imgsz * 1.5 + gs) // gs *
    gs``, ``sf = sz / max(shape)``, ``ns = [math.ceil(x * sf / gs) * gs for x in shape]``).
    """
    sz = int(rng.integers(imgsz // 2, imgsz * 3 // 2 + gs)) // gs * gs
    sf = sz / max(hw)
    if sf == 1:
        return None
    h, w = (math.ceil(x * sf / gs) * gs for x in hw)
    return h, w


def quad_targets(targets: Tensor, batch: int, upscaled: Sequence[bool]) -> Tensor:
    """The (N, 6) [image, class, x, y, w, h] targets of a quad batch, from those of the ``batch`` images it groups.

    Args:
        targets: the batch's targets, normalised xywh, sorted by image (as ``collate_fn`` gives them).
        batch: images in the batch.
        upscaled: per group, whether it is its first image upscaled (True) or the 2 x 2 tiling (False).
    """
    img = targets[:, 0].long()
    group, pos = img // 4, img % 4
    n = len(upscaled)
    up = torch.tensor(list(upscaled), dtype=torch.bool)
    if batch < 4:  # one group: the first image upscaled
        keep = pos == 0 if n else torch.zeros_like(img, dtype=torch.bool)
        group = torch.zeros_like(group)
    else:
        keep = (group < n) & ~(up[group.clamp(max=max(n - 1, 0))] & (pos > 0))
    out = targets[keep].clone()
    group, pos = group[keep], pos[keep]
    tiled = ~up[group] if batch >= 4 else torch.zeros_like(group, dtype=torch.bool)
    shift = torch.stack(((pos >= 2), (pos % 2 == 1)), 1).to(out.dtype)  # right column: im2, im3; bottom row: im1, im3
    out[:, 2:4] = torch.where(tiled[:, None], (out[:, 2:4] + shift) * 0.5, out[:, 2:4])
    out[:, 4:6] = torch.where(tiled[:, None], out[:, 4:6] * 0.5, out[:, 4:6])
    out[:, 0] = group.to(out.dtype)
    return out


def quad_images(images: Tensor, upscaled: Sequence[bool]) -> Tensor:
    """(B, C, H, W) uint8 -> (len(upscaled), C, 2H, 2W) uint8 (see the module docstring)."""
    n = len(upscaled)
    b, c, h, w = images.shape
    out = images.new_empty((n, c, 2 * h, 2 * w)).contiguous(memory_format=_memory_format(images))
    tiles = [g for g in range(n) if not upscaled[g]] if b >= 4 else []
    singles = [g for g in range(n) if g not in tiles]
    if tiles:
        x = images[: 4 * n].reshape(n, 4, c, h, w)[tiles]
        out[tiles] = torch.cat((torch.cat((x[:, 0], x[:, 1]), 2), torch.cat((x[:, 2], x[:, 3]), 2)), 3)
    if singles:
        first = images[[4 * g for g in singles]].float()
        up = F.interpolate(first, scale_factor=2.0, mode="bilinear", align_corners=False)
        out[singles] = up.to(torch.uint8)  # truncates, as v7.0's `.type(im.type())`
    return out


def _memory_format(x: Tensor) -> torch.memory_format:
    return torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format


class TrainBatchTransform:
    """Quad collation and multi-scale resizing of training batches (see the module docstring).

    Args:
        imgsz: training image size.
        quad: group the images by four (``data.quad``).
        multi_scale: resize each batch to a size drawn in [0.5, 1.5] x imgsz (``data.multi_scale``).
        seed: the run's seed.
    """

    def __init__(self, imgsz: int, quad: bool = False, multi_scale: bool = False, seed: int = 0) -> None:
        self.imgsz, self.quad, self.multi_scale, self.seed = int(imgsz), bool(quad), bool(multi_scale), int(seed)
        self._upscaled: list[bool] | None = None  # the quad draws of the batch between its two hooks

    @property
    def active(self) -> bool:
        """Whether any transform is on."""
        return self.quad or self.multi_scale

    def before_transfer(self, batch: Any, epoch: int, batch_idx: int, rank: int) -> Any:
        """Host side: draw the quad groups and rewrite targets, paths and shapes for them."""
        if not self.quad:
            return batch
        images, targets, paths, shapes = batch
        b = images.shape[0]
        n = max(1, b // 4)
        rng = np.random.default_rng((_QUAD_STREAM, self.seed, epoch, batch_idx, rank))
        self._upscaled = [bool(u) for u in rng.random(n) < 0.5]
        return images, quad_targets(targets, b, self._upscaled), tuple(paths)[:n], tuple(shapes)[:n]

    def after_transfer(self, images: Tensor, epoch: int, batch_idx: int, gs: int) -> Tensor:
        """Device side: uint8 (B, 3, H, W) in, float in [0, 1] out, grouped and resized as drawn."""
        if self.quad and self._upscaled is not None:
            images = quad_images(images, self._upscaled)
            self._upscaled = None
        images = images.float().div_(255)
        if self.multi_scale:
            rng = np.random.default_rng((_SCALE_STREAM, self.seed, epoch, batch_idx))  # no rank: the same on all
            shape = multi_scale_shape(rng, self.imgsz, images.shape[2:], gs)
            if shape is not None:
                images = F.interpolate(images, size=shape, mode="bilinear", align_corners=False)
        return images
