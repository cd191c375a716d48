"""BatchNorm2d (training mode) + SiLU fused into one CPU kernel each way, for channels_last bf16 / fp32 tensors.

Every YOLOv5 ``Conv`` block is conv -> BatchNorm2d -> SiLU. On the CPU the unfused composition passes over the
activations five times forward and six times backward and keeps the BN output for the SiLU backward; its SiLU is
bound by a vector division. ``_bn_silu.c`` makes two passes each way, recomputes y = BN(x) in the backward instead
of storing it, and uses a polynomial exp and a Newton reciprocal. Measured on yolov5s's 57 BN layers at 320 px,
batch 16, bf16 (``python scripts/bench_kernels.py --only bn_silu``): docs/benchmarks.md, "BatchNorm + SiLU".

The kernels are the PyTorch operators ``torch.ops.yolo5l.bn_silu_fwd`` and ``torch.ops.yolo5l.bn_silu_bwd``
(``torch.library.custom_op``, CPU only, with fake implementations and an autograd formula), so the dispatcher,
autograd and ``torch.compile`` treat each as one op: under ``torch.compile`` they stay in the graph, forward and
backward. They are functional; :func:`bn_silu` updates the BatchNorm's running statistics and
``num_batches_tracked`` from the batch statistics the forward returns, with ordinary in-place ops on the buffers
that dynamo records like ``nn.BatchNorm2d``'s own.

The C file is compiled on first use (see ``_bn_silu_build``). Without a compiler, or on any other device, dtype,
layout or in eval mode, :func:`bn_silu` computes the same thing with PyTorch ops.

Results: fp32 agrees with ``F.silu(F.batch_norm(...))`` to ~1e-6 relative; bf16 to one bf16 rounding (the
unfused path rounds y to bf16 before the SiLU, this does not). Running statistics follow ``nn.BatchNorm2d``
(momentum, unbiased running variance, ``num_batches_tracked``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from yolo5l_kernels import _bn_silu_build as build

__all__ = ["bn_silu", "bn_silu_bwd", "bn_silu_fwd", "fused_available", "supports"]


# Under torch.compile dynamo calls this once while tracing and keeps the answer as a constant; traced, the loader
# (a lock, a compiler subprocess) would break the graph. The decorator imports torch._dynamo, which any call of a
# torch.library custom op in eager mode imports anyway.
@torch.compiler.assume_constant_result
def fused_available() -> bool:
    """Whether the CPU kernel compiled and loaded (compiling it on the first call)."""
    return build.load_library() is not None


def supports(x: Tensor, bn: nn.Module) -> bool:
    """Whether :func:`bn_silu` runs the fused kernel for this input and BatchNorm (else PyTorch ops)."""
    return (
        type(bn) is nn.BatchNorm2d  # not SyncBatchNorm: its statistics are global
        and bn.training
        and bn.affine
        and bn.track_running_stats
        and bn.momentum is not None
        and bn.weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dtype in build.DTYPES
        and x.dim() == 4
        and x.numel() > 0
        and x.shape[0] * x.shape[2] * x.shape[3] > 1
        and x.is_contiguous(memory_format=torch.channels_last)
        and fused_available()
    )


def _library() -> ctypes.CDLL:
    lib = build.load_library()
    if lib is None:
        raise RuntimeError(f"yolo5l::bn_silu: the CPU kernel is unavailable ({build.error()})")
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise MemoryError(f"fused BatchNorm+SiLU {what}: out of host memory for its per-thread buffers")


@torch.library.custom_op("yolo5l::bn_silu_fwd", mutates_args=(), device_types="cpu")
def bn_silu_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``silu(batch_norm(x))`` with batch statistics, and those statistics.

    Args:
        x: (N, C, H, W) bf16 or fp32 input; the kernel reads it channels_last (copied there if it is not).
        weight: (C,) fp32 BatchNorm weight.
        bias: (C,) fp32 BatchNorm bias.
        eps: BatchNorm epsilon.

    Returns:
        z: (N, C, H, W) channels_last, x's dtype.
        mean: (C,) fp32 batch mean.
        var: (C,) fp32 biased batch variance.
    """
    lib = _library()
    x = x.contiguous(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    m = n * h * w
    sfx = build.DTYPES[x.dtype]
    nt = torch.get_num_threads()
    mean = torch.empty(c, dtype=torch.float32)
    var = torch.empty(c, dtype=torch.float32)
    _check(getattr(lib, f"bn_stats_{sfx}")(x.data_ptr(), m, c, mean.data_ptr(), var.data_ptr(), nt), "statistics")
    invstd = (var + eps).rsqrt_()
    wt, bs = weight.contiguous(), bias.contiguous()
    z = torch.empty_like(x, memory_format=torch.channels_last)
    p = [t.data_ptr() for t in (mean, invstd, wt, bs)]
    _check(getattr(lib, f"bn_silu_fwd_{sfx}")(x.data_ptr(), z.data_ptr(), m, c, *p, nt), "forward")
    return z, mean, var


@bn_silu_fwd.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    c = x.shape[1]
    stat = x.new_empty(c, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.channels_last), stat, torch.empty_like(stat)


@torch.library.custom_op("yolo5l::bn_silu_bwd", mutates_args=(), device_types="cpu")
def bn_silu_bwd(
    gz: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, var: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`bn_silu_fwd`'s ``z`` with respect to x, weight and bias (through the batch statistics).

    Args:
        gz: (N, C, H, W) gradient of z (cast to x's dtype).
        x: The forward's input.
        weight: The forward's weight.
        bias: The forward's bias.
        mean: The forward's batch mean.
        var: The forward's biased batch variance.
        eps: The forward's epsilon.

    Returns:
        dx: (N, C, H, W) channels_last, x's dtype.
        gw: (C,) fp32 gradient of weight.
        gb: (C,) fp32 gradient of bias.
    """
    lib = _library()
    x = x.contiguous(memory_format=torch.channels_last)
    gz = gz.to(x.dtype).contiguous(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    invstd = (var + eps).rsqrt_()  # bit for bit the forward's
    wt, bs = weight.contiguous(), bias.contiguous()
    dx = torch.empty_like(x, memory_format=torch.channels_last)
    gw = torch.empty(c, dtype=torch.float32)
    gb = torch.empty(c, dtype=torch.float32)
    p = [t.data_ptr() for t in (mean, invstd, wt, bs, gw, gb)]
    rc = getattr(lib, f"bn_silu_bwd_{build.DTYPES[x.dtype]}")(
        gz.data_ptr(), x.data_ptr(), dx.data_ptr(), n * h * w, c, *p, torch.get_num_threads()
    )
    _check(rc, "backward")
    return dx, gw, gb


@bn_silu_bwd.register_fake
def _(
    gz: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, var: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    stat = x.new_empty(x.shape[1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.channels_last), stat, torch.empty_like(stat)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, weight, bias, eps = inputs
    _, mean, var = output
    ctx.save_for_backward(x, weight, bias, mean, var)
    ctx.eps = eps
    # The batch statistics only feed the running statistics (without grad); their effect on z is in dx already.
    ctx.mark_non_differentiable(mean, var)


def _backward(ctx: Any, gz: Tensor, _gmean: Tensor | None, _gvar: Tensor | None) -> tuple[Tensor | None, ...]:
    x, weight, bias, mean, var = ctx.saved_tensors
    dx, gw, gb = torch.ops.yolo5l.bn_silu_bwd.default(gz, x, weight, bias, mean, var, ctx.eps)
    need = ctx.needs_input_grad
    return dx if need[0] else None, gw if need[1] else None, gb if need[2] else None, None


bn_silu_fwd.register_autograd(_backward, setup_context=_setup_context)


def bn_silu(x: Tensor, bn: nn.BatchNorm2d) -> Tensor:
    """``F.silu(bn(x))``, in one fused CPU op each way where :func:`supports` says so.

    Args:
        x: (N, C, H, W) input, channels_last bf16 or fp32 for the fused path; anything for the fallback.
        bn: The BatchNorm2d; in training mode its running statistics and ``num_batches_tracked`` are updated.

    Returns:
        (N, C, H, W) tensor of x's dtype and memory format.
    """
    if not supports(x, bn):
        return F.silu(bn(x))
    z, mean, var = torch.ops.yolo5l.bn_silu_fwd.default(x, bn.weight, bn.bias, bn.eps)
    m = x.shape[0] * x.shape[2] * x.shape[3]
    with torch.no_grad():  # as nn.BatchNorm2d: momentum, unbiased running variance, a step count
        bn.num_batches_tracked.add_(1)
        bn.running_mean.lerp_(mean, bn.momentum)
        bn.running_var.lerp_(var * (m / (m - 1)), bn.momentum)
    return z
