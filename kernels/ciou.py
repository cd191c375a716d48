"""Fused CIoU of element-wise box pairs with an analytic backward, dispatched per device.

Backends (``backend=``):

- ``"triton"``: one Triton kernel forward, one backward (CUDA; also runs under ``TRITON_INTERPRET=1``).
- ``"cpu"``: the same analytic forward/backward as a few vectorised torch passes on packed ``(2, 4, N)``
  coordinates (``_ciou_torch.py``); runs on any device.
- ``"compiled"``: the ``"cpu"`` math fused by ``torch.compile`` (one loop forward, one backward); falls back to
  ``"cpu"`` with a warning if compilation fails.
- ``"reference"``: the pure-torch composition of small ops in ``reference.py`` (autograd backward).
- ``"auto"``: ``"triton"`` on CUDA (fp16/bf16/fp32), otherwise ``"cpu"``.

Dtypes: fp16/bf16/fp32 inputs are computed in fp32 and fp64 in fp64; the CIoU is returned in the promoted
dtype of the two inputs and each gradient in its input's dtype. No path syncs the host (no ``.item()``, masks
or ``nonzero``) and N = 0 gives an empty result whose backward yields empty gradients.

Reference: ultralytics/yolov5 v7.0 ``utils/metrics.py::bbox_iou(xywh=True, CIoU=True)``; gradient of alpha
is not propagated (YOLOv5 computes it under ``no_grad``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import Tensor
from yolo5l_kernels import _ciou_torch, reference

__all__ = ["BACKENDS", "ciou_xywh"]

BACKENDS = ("auto", "reference", "triton", "cpu", "compiled")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _CIoUTorch(torch.autograd.Function):
    """Vectorised torch forward that saves its intermediates, analytic backward that reuses them."""

    @staticmethod
    def forward(ctx: Any, box1: Tensor, box2: Tensor, eps: float) -> Tensor:
        out_dtype = torch.promote_types(box1.dtype, box2.dtype)
        cdtype = _compute_dtype(out_dtype)
        t = torch.stack((box1.to(cdtype), box2.to(cdtype))).transpose(1, 2).contiguous()  # (2, 4, N)
        out, *saved = _ciou_torch.ciou_fwd(t, eps)
        ctx.save_for_backward(*saved)
        ctx.dtypes = (box1.dtype, box2.dtype)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        saved = ctx.saved_tensors
        gt = _ciou_torch.ciou_bwd(grad.to(saved[0].dtype), *saved).transpose(1, 2)  # (2, N, 4)
        return gt[0].to(ctx.dtypes[0]), gt[1].to(ctx.dtypes[1]), None


@functools.cache
def _compiled_fns() -> tuple[Any, Any]:
    fwd = torch.compile(lambda t, eps: _ciou_torch.ciou_fwd(t, eps)[0], dynamic=True)
    bwd = torch.compile(_ciou_torch.ciou_bwd_recompute, dynamic=True)
    return fwd, bwd


class _CIoUCompiled(torch.autograd.Function):
    """``torch.compile``-fused forward; the backward recomputes the forward inside its one fused loop."""

    @staticmethod
    def forward(ctx: Any, box1: Tensor, box2: Tensor, eps: float) -> Tensor:
        out_dtype = torch.promote_types(box1.dtype, box2.dtype)
        t = torch.stack((box1, box2)).to(_compute_dtype(out_dtype)).transpose(1, 2).contiguous()  # (2, 4, N)
        out = _compiled_fns()[0](t, eps)
        ctx.save_for_backward(t)
        ctx.eps = eps
        ctx.dtypes = (box1.dtype, box2.dtype)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (t,) = ctx.saved_tensors
        gt = _compiled_fns()[1](grad.to(t.dtype), t, ctx.eps).transpose(1, 2)  # (2, N, 4)
        return gt[0].to(ctx.dtypes[0]), gt[1].to(ctx.dtypes[1]), None


class _CIoUTriton(torch.autograd.Function):
    """One Triton kernel each way; the backward recomputes the forward from the saved inputs."""

    @staticmethod
    def forward(ctx: Any, box1: Tensor, box2: Tensor, eps: float) -> Tensor:
        from yolo5l_kernels import _triton_ciou

        dtype = torch.promote_types(box1.dtype, box2.dtype)
        b1, b2 = box1.to(dtype).contiguous(), box2.to(dtype).contiguous()
        ctx.save_for_backward(b1, b2)
        ctx.eps = eps
        ctx.dtypes = (box1.dtype, box2.dtype)
        return _triton_ciou.ciou_fwd(b1, b2, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        from yolo5l_kernels import _triton_ciou

        b1, b2 = ctx.saved_tensors
        g1, g2 = _triton_ciou.ciou_bwd(b1, b2, grad, ctx.eps)
        return g1.to(ctx.dtypes[0]), g2.to(ctx.dtypes[1]), None


_compile_failed = False


def _ciou_compiled(box1: Tensor, box2: Tensor, eps: float) -> Tensor:
    global _compile_failed
    if not _compile_failed:
        try:
            return _CIoUCompiled.apply(box1, box2, eps)
        except Exception as e:
            _compile_failed = True
            warnings.warn(
                f"yolo5l_kernels.ciou: torch.compile failed ({type(e).__name__}: {e}); using the eager 'cpu' backend",
                RuntimeWarning,
                stacklevel=3,
            )
    return _CIoUTorch.apply(box1, box2, eps)


def ciou_xywh(box1: Tensor, box2: Tensor, eps: float = reference.EPS, backend: str = "auto") -> Tensor:
    """Complete IoU of element-wise pairs of ``[cx, cy, w, h]`` boxes, fused forward and backward.

    Same semantics as :func:`yolo5l_kernels.reference.ciou_xywh` (formula in its docstring); the gradient flows
    to both boxes, with alpha treated as a constant.

    Args:
        box1: (N, 4) boxes ``[cx, cy, w, h]`` (predictions); leading dims ``(..., 4)`` are flattened.
        box2: (N, 4) boxes ``[cx, cy, w, h]`` (targets), broadcastable against ``box1``.
        eps: stabiliser added to union, enclosing diagonal and heights in the aspect term.
        backend: one of ``"auto"``, ``"reference"``, ``"triton"``, ``"cpu"``, ``"compiled"`` (module docstring).

    Returns:
        (N,) CIoU in the promoted dtype of the inputs.

    Raises:
        ValueError: unknown backend, or boxes whose last dimension is not 4.
    """
    if backend not in BACKENDS:
        raise ValueError(f"yolo5l_kernels.ciou: unknown backend {backend!r}; use one of {BACKENDS}")
    if box1.shape[-1] != 4 or box2.shape[-1] != 4:
        raise ValueError(
            f"yolo5l_kernels.ciou: boxes must be (N, 4) [cx, cy, w, h], got {tuple(box1.shape)} and {tuple(box2.shape)}"
        )
    if backend == "reference":
        return reference.ciou_xywh(box1, box2, eps)
    if box1.shape != box2.shape:
        box1, box2 = torch.broadcast_tensors(box1, box2)
    lead = box1.shape[:-1]
    box1, box2 = box1.reshape(-1, 4), box2.reshape(-1, 4)
    if backend == "auto":
        fast_triton = box1.is_cuda and torch.promote_types(box1.dtype, box2.dtype) != torch.float64
        backend = "triton" if fast_triton else "cpu"
    if backend == "triton":
        out = _CIoUTriton.apply(box1, box2, eps)
    elif backend == "compiled":
        out = _ciou_compiled(box1, box2, eps)
    else:
        out = _CIoUTorch.apply(box1, box2, eps)
    return out.reshape(lead)
