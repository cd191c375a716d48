"""The Detect head of YOLOv5 v7.0 and its anchors, shared by the built-in P5 table (`yolo5l.models.yolo`) and the
model yamls (`yolo5l.models.parse`).

Reference: ultralytics/yolov5 v7.0 ``models/yolo.py`` (``Detect``) and ``models/yolov5s.yaml`` (the anchors).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ANCHORS_P3_P5", "STRIDES", "Detect", "anchors_to_tensor", "make_upsample"]

log = logging.getLogger(__name__)

# Default anchors in pixels, (w, h) pairs, 3 per level: P3/8, P4/16, P5/32 (yolov5s.yaml).
ANCHORS_P3_P5: tuple[tuple[int, ...], ...] = (
    (10, 13, 16, 30, 33, 23),
    (30, 61, 62, 45, 59, 119),
    (116, 90, 156, 198, 373, 326),
)
STRIDES: tuple[float, ...] = (8.0, 16.0, 32.0)


def anchors_to_tensor(anchors: Any, nl: int | None = len(STRIDES)) -> Tensor:
    """Turn anchors given as ``nl`` lists of 2·na numbers (or an (nl, na, 2) nest / tensor) into a float tensor.

    Args:
        anchors: Pixel anchors, (w, h) pairs per level; lists, tuples, OmegaConf ListConfigs or a tensor.
        nl: Number of levels expected (3 for P3-P5); None accepts any.

    Returns:
        (nl, na, 2) float32 tensor in pixels.

    Raises:
        ValueError: If the anchors are not ``nl`` levels of the same number of (w, h) pairs.
    """
    if isinstance(anchors, Tensor):
        flat = [anchors[i].reshape(-1).tolist() for i in range(anchors.shape[0])]
    else:
        flat = []
        for level in anchors:
            values: list[float] = []
            for v in level:
                if isinstance(v, (int, float)):
                    values.append(float(v))
                else:  # a (w, h) pair
                    values.extend(float(u) for u in v)
            flat.append(values)
    if (nl is not None and len(flat) != nl) or len({len(v) for v in flat}) != 1 or len(flat[0]) % 2 or not flat[0]:
        levels = f"{nl} levels" if nl is not None else "levels"
        example = f", e.g. {[list(a) for a in ANCHORS_P3_P5]}" if nl == len(STRIDES) else ""
        raise ValueError(f"anchors must be {levels} of the same number of (w, h) pixel pairs{example}; got {flat}")
    return torch.tensor(flat, dtype=torch.float32, device="cpu").view(len(flat), -1, 2)


class Detect(nn.Module):
    """YOLOv5 detection head: one 1x1 conv (with bias) per level producing ``na * (5 + C)`` channels.

    Args:
        num_classes: Number of classes C.
        anchors: (nl, na, 2) anchors in pixels; stored as the buffer ``anchors`` in grid units of each level.
        ch: Input channels of each level.
        strides: Stride of each level in pixels.
    """

    def __init__(self, num_classes: int, anchors: Tensor, ch: Sequence[int], strides: Sequence[float] = STRIDES):
        super().__init__()
        self.nc = num_classes
        self.no = num_classes + 5  # outputs per anchor: x, y, w, h, obj, classes
        self.nl, self.na = anchors.shape[:2]
        if len(ch) != self.nl or len(strides) != self.nl:
            raise ValueError(f"Detect: {self.nl} anchor levels but {len(ch)} inputs and {len(strides)} strides")
        self.m = nn.ModuleList(nn.Conv2d(c, self.na * self.no, 1) for c in ch)
        stride = torch.tensor(strides, dtype=torch.float32, device=anchors.device)
        anchors = anchors.clone().float()
        # check_anchor_order: anchor area must grow with stride; flip the levels if the config lists them reversed.
        area = anchors.prod(-1).mean(-1)  # (nl,) mean anchor area per level
        da, ds = float(area[-1] - area[0]), float(stride[-1] - stride[0])
        if da and math.copysign(1.0, da) != math.copysign(1.0, ds):
            log.info("Reversing anchor order to match stride order")
            anchors = anchors.flip(0)
        self.register_buffer("anchors", anchors / stride.view(-1, 1, 1))  # (nl, na, 2) grid units
        self.register_buffer("stride", stride, persistent=False)  # (nl,)
        self._grids: dict[tuple[Any, ...], Tensor] = {}
        self._initialize_biases()

    @torch.no_grad()
    def _initialize_biases(self) -> None:
        # RetinaNet-style prior (focal loss paper §3.3): ~8 objects per 640 image, class prob ~0.6 / nc.
        for conv, s in zip(self.m, self.stride.tolist(), strict=True):
            b = conv.bias.view(self.na, self.no)
            b[:, 4] += math.log(8 / (640 / s) ** 2)
            b[:, 5:] += math.log(0.6 / (self.nc - 0.99999))

    def forward(self, xs: list[Tensor]) -> list[Tensor]:
        """Apply the per-level convs.

        Args:
            xs: ``nl`` feature maps (B, ch_i, H/s_i, W/s_i).

        Returns:
            ``nl`` raw heads (B, na, H/s_i, W/s_i, 5 + C): contiguous, or with a channels_last input a strided view
            whose last dim is dense.
        """
        out = []
        for conv, x in zip(self.m, xs, strict=True):
            x = conv(x)  # (B, na * no, ny, nx)
            b, _, ny, nx = x.shape
            h = x.view(b, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2)
            # channels_last: the view is (B, ny, nx, na, no) in memory, so its last dim is already dense and the
            # loss and decode read it as it is; .contiguous() would add a transposing copy of every head to the
            # forward and to the backward.
            out.append(h if h.stride(-1) == 1 else h.contiguous())
        return out

    def _grid(self, ny: int, nx: int, like: Tensor) -> Tensor:
        # Cell offsets minus 0.5 (folding the "- 0.5" of xy = 2σ - 0.5 + grid), (1, 1, ny, nx, 2) as (x, y).
        # Keyed by inference mode too: an inference tensor must not meet autograd outside inference_mode.
        key = (ny, nx, like.device, like.dtype, torch.is_inference_mode_enabled())
        grid = self._grids.get(key)
        if grid is None:
            if len(self._grids) >= 64:  # rectangular validation sees many sizes; keep the cache bounded
                self._grids.clear()
            y = torch.arange(ny, device=like.device, dtype=like.dtype)
            x = torch.arange(nx, device=like.device, dtype=like.dtype)
            yv, xv = torch.meshgrid(y, x, indexing="ij")
            grid = (torch.stack((xv, yv), -1) - 0.5).view(1, 1, ny, nx, 2)
            self._grids[key] = grid
        return grid

    def decode(self, heads: Sequence[Tensor]) -> Tensor:
        """Decode raw heads into boxes, as YOLOv5's Detect does in inference.

        ``xy = (2σ(t_xy) - 0.5 + grid) * stride``, ``wh = (2σ(t_wh))² * anchor_pixels``, objectness and class
        scores as sigmoids. No host syncs; grids cached per feature-map size.

        Args:
            heads: ``nl`` raw heads (B, na, ny, nx, 5 + C).

        Returns:
            (B, N, 5 + C) with N = Σ na·ny·nx: cx, cy, w, h in input pixels, objectness, class scores.
        """
        if len(heads) != self.nl:
            raise ValueError(f"decode expects {self.nl} heads, got {len(heads)}")
        out = []
        for i, h in enumerate(heads):
            b, na, ny, nx, no = h.shape
            y = h.sigmoid()
            xy, wh, conf = y.split((2, 2, no - 4), -1)
            stride = self.stride[i]
            xy = (xy * 2 + self._grid(ny, nx, y)) * stride  # (B, na, ny, nx, 2) pixels
            anchor_px = (self.anchors[i] * stride).view(1, na, 1, 1, 2)
            wh = (wh * 2) ** 2 * anchor_px  # (B, na, ny, nx, 2) pixels
            out.append(torch.cat((xy, wh.to(xy.dtype), conf.to(xy.dtype)), -1).reshape(b, na * ny * nx, no))
        return torch.cat(out, 1)


def make_upsample(fused: bool) -> nn.Module:
    if fused:
        try:
            from yolo5l_kernels.upsample import UpsampleNearest2x
        except ImportError:
            log.warning("fused_upsample=True but yolo5l_kernels.upsample is unavailable; using nn.Upsample")
        else:
            return UpsampleNearest2x()
    return nn.Upsample(scale_factor=2.0, mode="nearest")
