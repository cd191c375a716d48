"""Nearest-neighbour 2x upsampling with a fused forward and backward.

YOLOv5's neck upsamples twice per forward pass (``nn.Upsample(None, 2, "nearest")``). The generic
``F.interpolate`` computes a source index per output element; for an exact factor of 2 the forward is a
broadcast copy and the backward the sum of each 2x2 block, which is what this module does:

- ``"torch"`` (any device): forward as ``expand`` + ``reshape`` of a 6-d view, backward as
  ``view(..., 2, ..., 2).sum``; both work on an NHWC view for channels_last tensors, so the memory format is kept.
  On the CPU ``F.interpolate``'s own kernel is faster at YOLOv5's neck shapes (``scripts/bench_kernels.py --only
  upsample`` compares them; docs/benchmarks.md, "Nearest 2x upsample"), so ``"auto"`` uses ``F.interpolate`` there.
- CUDA: one Triton kernel each way (``_triton_upsample.py``), stride-generic, fp32 accumulation in the backward.

The output has the memory format of the input (channels_last in, channels_last out) and its dtype.

Reference: OneFlow PRs 9415/9424 (UpsampleNearest2D x2); ultralytics/yolov5 v7.0 ``models/yolo.py`` neck.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["BACKENDS", "UpsampleNearest2x", "upsample_nearest2x"]

BACKENDS = ("auto", "torch", "triton", "reference")


def _is_channels_last(x: Tensor) -> bool:
    # A (N, C, 1, 1) or C == 1 tensor is both; treat it as contiguous unless only channels_last matches.
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _memory_format(x: Tensor) -> torch.memory_format:
    return torch.channels_last if _is_channels_last(x) else torch.contiguous_format


def _up2x_torch(x: Tensor) -> Tensor:
    n, c, h, w = x.shape
    if _is_channels_last(x):
        nhwc = x.permute(0, 2, 3, 1)  # contiguous view
        out = nhwc[:, :, None, :, None, :].expand(n, h, 2, w, 2, c).reshape(n, 2 * h, 2 * w, c)
        return out.permute(0, 3, 1, 2)  # channels_last (N, C, 2H, 2W)
    return x[:, :, :, None, :, None].expand(n, c, h, 2, w, 2).reshape(n, c, 2 * h, 2 * w)


def _up2x_bwd_torch(g: Tensor, channels_last: bool) -> Tensor:
    n, c, h2, w2 = g.shape
    h, w = h2 // 2, w2 // 2
    if channels_last:
        gs = g.permute(0, 2, 3, 1).reshape(n, h, 2, w, 2, c).sum((2, 4))  # (N, H, W, C)
        return gs.permute(0, 3, 1, 2)
    return g.reshape(n, c, h, 2, w, 2).sum((3, 5))


class _Up2xTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.channels_last = _is_channels_last(x)
        return _up2x_torch(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return _up2x_bwd_torch(g, ctx.channels_last)


class _Up2xTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        from yolo5l_kernels import _triton_upsample

        ctx.memory_format = _memory_format(x)
        return _triton_upsample.up2x_fwd(x, ctx.memory_format)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        from yolo5l_kernels import _triton_upsample

        return _triton_upsample.up2x_bwd(g, ctx.memory_format)


def upsample_nearest2x(x: Tensor, backend: str = "auto") -> Tensor:
    """Nearest-neighbour 2x upsampling, equal to ``F.interpolate(x, scale_factor=2, mode="nearest")``.

    Args:
        x: (N, C, H, W) tensor of any float dtype, contiguous or channels_last.
        backend: ``"auto"`` (Triton on CUDA, ``F.interpolate`` elsewhere), ``"torch"``, ``"triton"`` or
            ``"reference"`` (``F.interpolate``).

    Returns:
        (N, C, 2H, 2W) tensor in the dtype and memory format of ``x``.

    Raises:
        ValueError: ``x`` is not 4-d, or the backend is unknown.
    """
    if backend not in BACKENDS:
        raise ValueError(f"yolo5l_kernels.upsample: unknown backend {backend!r}; use one of {BACKENDS}")
    if x.dim() != 4:
        raise ValueError(f"yolo5l_kernels.upsample: expected an (N, C, H, W) tensor, got shape {tuple(x.shape)}")
    if backend == "reference" or (backend == "auto" and not x.is_cuda):
        return nn.functional.interpolate(x, scale_factor=2, mode="nearest")
    if backend == "triton" or (backend == "auto" and x.is_cuda):
        return _Up2xTriton.apply(x)
    return _Up2xTorch.apply(x)


class UpsampleNearest2x(nn.Module):
    """Module form of :func:`upsample_nearest2x`, a drop-in for ``nn.Upsample(None, 2, "nearest")``.

    Args:
        backend: see :func:`upsample_nearest2x`.
    """

    def __init__(self, backend: str = "auto") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"yolo5l_kernels.upsample: unknown backend {backend!r}; use one of {BACKENDS}")
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:  # (N, C, H, W) -> (N, C, 2H, 2W)
        return upsample_nearest2x(x, self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"
