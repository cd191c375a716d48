"""Test-time augmentation (`augment=true` in `python -m yolo5l.val` and `python -m yolo5l.predict`).

The batch runs three times, at scales 1, 0.83 and 0.67 (the middle one flipped left-right); each pass's decoded boxes
are mapped back to the input's pixels and the passes are concatenated before NMS. The full-size pass drops its
coarsest level (large objects are better seen at the smaller scales) and the smallest pass drops its finest level
(small objects are better seen at full size).

The model's `forward` is not touched: `augmented_decode` takes any detector with `forward(images) -> heads`,
`decode(heads)` and a `stride` buffer (`yolo5l.models.yolo.YOLOv5`, its fused copy, a P6 model).

    >>> boxes = augmented_decode(model, images)  # (B, N', 5 + C), as model.decode(model(images)), more rows
    >>> dets = non_max_suppression(boxes, 0.001, 0.6, multi_label=True)

Reference: ultralytics/yolov5 v7.0 `models/yolo.py::DetectionModel._forward_augment`, `_descale_pred`,
`_clip_augmented`, and `utils/torch_utils.py::scale_img` (the pad value 0.447, the image size rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FLIPS", "PAD_VALUE", "SCALES", "TTADetector", "augmented_decode", "clip_tails", "descale", "scale_image"]

#: The passes' scales and flips (torch dims of a (B, 3, H, W) batch: 3 = left-right, 2 = up-down, None = none).
SCALES: tuple[float, ...] = (1.0, 0.83, 0.67)
FLIPS: tuple[int | None, ...] = (None, 3, None)
#: What a scaled-down batch is padded with up to the stride multiple (ImageNet's mean grey, as v7.0's `scale_img`).
PAD_VALUE = 0.447


def scale_image(images: Tensor, ratio: float, stride: int = 32) -> Tensor:
    """Resize a (B, 3, H, W) batch by `ratio` (bilinear) and pad it right and bottom to multiples of `stride`.

    The content is int(H x ratio) x int(W x ratio) pixels at the top left; the padded size is
    ceil(H x ratio / stride) x stride (and the same for W). A ratio of 1 returns `images` itself.
    """
    if ratio == 1.0:
        return images
    h, w = images.shape[2:]
    size = (int(h * ratio), int(w * ratio))
    out = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
    ph, pw = (math.ceil(x * ratio / stride) * stride for x in (h, w))
    return F.pad(out, [0, pw - size[1], 0, ph - size[0]], value=PAD_VALUE)


def descale(pred: Tensor, flip: int | None, ratio: float, img_hw: Sequence[int]) -> Tensor:
    """Map decoded boxes (B, N, 5 + C) of a scaled (and flipped) pass back to the input's pixels; a new tensor.

    cx, cy, w, h are divided by `ratio`; a left-right flip (3) mirrors cx about the input's width, an up-down flip (2)
    cy about its height. Scores are unchanged.
    """
    xy, wh, rest = pred[..., 0:2] / ratio, pred[..., 2:4] / ratio, pred[..., 4:]
    if flip == 2:
        xy = torch.stack((xy[..., 0], img_hw[0] - xy[..., 1]), -1)
    elif flip == 3:
        xy = torch.stack((img_hw[1] - xy[..., 0], xy[..., 1]), -1)
    return torch.cat((xy, wh, rest), -1)


def clip_tails(outputs: list[Tensor], level_rows: Sequence[Sequence[int]]) -> list[Tensor]:
    """Drop the coarsest level's rows of the first pass and the finest level's rows of the last pass.

    Args:
        outputs: Each pass's decoded (B, N_i, 5 + C) boxes, levels in stride order (finest first).
        level_rows: Each pass's rows per level (na x ny x nx of each head).

    Returns:
        `outputs` with its first and last entries clipped. v7.0 computes the counts from the total as if each level
        had 4x the cells of the next, which is what these are whenever the input is a multiple of the largest stride.
    """
    outputs = list(outputs)
    outputs[0] = outputs[0][:, : outputs[0].shape[1] - level_rows[0][-1]]
    outputs[-1] = outputs[-1][:, level_rows[-1][0] :]
    return outputs


def augmented_decode(
    model: nn.Module,
    images: Tensor,
    heads: Sequence[Tensor] | None = None,
    scales: Sequence[float] = SCALES,
    flips: Sequence[int | None] = FLIPS,
) -> Tensor:
    """Decoded boxes of the augmented passes, in the input's pixels, concatenated: (B, N', 5 + C) for NMS.

    Args:
        model: A detector: `model(images)` -> raw heads, `model.decode(heads)` -> (B, N, 5 + C), `model.stride`.
        images: (B, 3, H, W) in [0, 1], H and W multiples of the largest stride.
        heads: The model's heads for `images` when the caller already has them (validation computes its loss on
            them): the unscaled, unflipped pass then costs nothing. Only used when that pass is the first.
        scales: The passes' scales (v7.0's 1, 0.83, 0.67).
        flips: The passes' flips (None, 3: left-right, 2: up-down).

    Returns:
        (B, N', 5 + C): cx, cy, w, h in the input's pixels, objectness, class scores.
    """
    img_hw = images.shape[2:]
    stride = int(model.stride.max())
    outputs, level_rows = [], []
    for i, (ratio, flip) in enumerate(zip(scales, flips, strict=True)):
        if i == 0 and heads is not None and ratio == 1.0 and flip is None:
            pass_heads = list(heads)
        else:
            pass_heads = model(scale_image(images.flip(flip) if flip else images, ratio, stride))
        level_rows.append([h.shape[1] * h.shape[2] * h.shape[3] for h in pass_heads])  # (B, na, ny, nx, no)
        outputs.append(descale(model.decode(pass_heads), flip, ratio, img_hw))
    return torch.cat(clip_tails(outputs, level_rows), 1)


class TTADetector(nn.Module):
    """A detector with test-time augmentation: `TTADetector(model)(images)` -> (B, N', 5 + C) decoded boxes.

    Args:
        model: See `augmented_decode`.
        scales: The passes' scales.
        flips: The passes' flips.
    """

    def __init__(self, model: nn.Module, scales: Sequence[float] = SCALES, flips: Sequence[int | None] = FLIPS) -> None:
        super().__init__()
        if len(scales) != len(flips):
            raise ValueError(f"{len(scales)} scales but {len(flips)} flips")
        self.model = model
        self.scales, self.flips = tuple(scales), tuple(flips)

    def forward(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] -> (B, N', 5 + C) decoded boxes of every pass, in the input's pixels."""
        return augmented_decode(self.model, images, scales=self.scales, flips=self.flips)
