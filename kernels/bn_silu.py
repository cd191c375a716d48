"""BatchNorm2d (training mode) + SiLU fused into one CPU kernel each way, for channels_last bf16 / fp32 tensors.

Every YOLOv5 ``Conv`` block is conv -> BatchNorm2d -> SiLU. On the CPU the unfused composition passes over the
activations five times forward and six times backward and keeps the BN output for the SiLU backward; its SiLU is
bound by a vector division. ``_bn_silu.c`` makes two passes each way, recomputes y = BN(x) in the backward instead
of storing it, and uses a polynomial exp and a Newton reciprocal. Measured on yolov5s's 57 BN layers at 320 px,
batch 16, bf16 (``python scripts/bench_kernels.py --only bn_silu``), see the README's "Speed" section.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native
-fno-trapping-math -fopenmp``) into ``$XDG_CACHE_HOME/yolo5l/kernels`` (about a second), keyed by the source, the
flags, the compiler and the CPU; it links the OpenMP runtime torch already loaded. Without a compiler, or on any
other device, dtype, layout or in eval mode, :func:`bn_silu` computes the same thing with PyTorch ops.

Results: fp32 agrees with ``F.silu(F.batch_norm(...))`` to ~1e-6 relative; bf16 to one bf16 rounding (the
unfused path rounds y to bf16 before the SiLU, this does not). Running statistics follow ``nn.BatchNorm2d``
(momentum, unbiased running variance, ``num_batches_tracked``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["bn_silu", "fused_available", "load_library", "supports"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_bn_silu.c")
CFLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None  # why the library is unavailable, once tried


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "yolo5l" / "kernels"


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform's description."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _compile(cc: str, out: Path, flags: tuple[str, ...] = CFLAGS) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE}:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent ranks compile side by side, one file wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for sfx in _DTYPES.values():
        getattr(lib, f"bn_stats_{sfx}").argtypes = [p, i64, i64, p, p, i32]
        getattr(lib, f"bn_silu_fwd_{sfx}").argtypes = [p, p, i64, i64, p, p, p, p, i32]
        getattr(lib, f"bn_silu_bwd_{sfx}").argtypes = [p, p, p, i64, i64, p, p, p, p, p, p, i32]
        for name in ("bn_stats", "bn_silu_fwd", "bn_silu_bwd"):
            getattr(lib, f"{name}_{sfx}").restype = i32


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels (compiled and cached on first call), or None with the reason logged once."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        cc = os.environ.get("CC") or "cc"
        try:
            if shutil.which(cc) is None:
                raise RuntimeError(f"no C compiler ({cc!r} not on PATH; set CC)")
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
            key = hashlib.sha256(
                "\0".join([SOURCE.read_text(), " ".join(CFLAGS), version, _cpu_id()]).encode()
            ).hexdigest()[:16]
            path = _cache_dir() / f"bn_silu-{key}.so"
            if not path.exists():
                _compile(cc, path)
            lib = ctypes.CDLL(str(path))
            _bind(lib)
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _error = str(e)
            log.warning("fused BatchNorm+SiLU kernel unavailable, using PyTorch ops: %s", _error)
    return _lib


def fused_available() -> bool:
    """Whether the CPU kernel compiled and loaded (compiling it on the first call)."""
    return load_library() is not None


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
        and x.dtype in _DTYPES
        and x.dim() == 4
        and x.numel() > 0
        and x.shape[0] * x.shape[2] * x.shape[3] > 1
        and x.is_contiguous(memory_format=torch.channels_last)
        and not torch.compiler.is_compiling()
        and load_library() is not None
    )


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise MemoryError(f"fused BatchNorm+SiLU {what}: out of host memory for its per-thread buffers")


class _BNSiLU(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor,
        running_mean: Tensor,
        running_var: Tensor,
        momentum: float,
        eps: float,
    ) -> Tensor:
        lib = load_library()
        assert lib is not None
        n, c, h, w = x.shape
        m = n * h * w
        sfx = _DTYPES[x.dtype]
        nt = torch.get_num_threads()
        mean = torch.empty(c, dtype=torch.float32)
        var = torch.empty(c, dtype=torch.float32)
        _check(getattr(lib, f"bn_stats_{sfx}")(_ptr(x), m, c, _ptr(mean), _ptr(var), nt), "statistics")
        invstd = (var + eps).rsqrt_()
        wt, bs = weight.detach().contiguous(), bias.detach().contiguous()
        z = torch.empty_like(x, memory_format=torch.channels_last)
        fwd = getattr(lib, f"bn_silu_fwd_{sfx}")
        _check(fwd(_ptr(x), _ptr(z), m, c, _ptr(mean), _ptr(invstd), _ptr(wt), _ptr(bs), nt), "forward")
        with torch.no_grad():
            running_mean.lerp_(mean, momentum)
            running_var.lerp_(var * (m / (m - 1)), momentum)  # unbiased, as nn.BatchNorm2d
        ctx.save_for_backward(x, mean, invstd, wt, bs)
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, gz: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        lib = load_library()
        assert lib is not None
        x, mean, invstd, wt, bs = ctx.saved_tensors
        n, c, h, w = x.shape
        gz = gz.to(x.dtype).contiguous(memory_format=torch.channels_last)
        dx = torch.empty_like(x, memory_format=torch.channels_last)
        gw = torch.empty(c, dtype=torch.float32)
        gb = torch.empty(c, dtype=torch.float32)
        rc = getattr(lib, f"bn_silu_bwd_{_DTYPES[x.dtype]}")(
            _ptr(gz),
            _ptr(x),
            _ptr(dx),
            n * h * w,
            c,
            _ptr(mean),
            _ptr(invstd),
            _ptr(wt),
            _ptr(bs),
            _ptr(gw),
            _ptr(gb),
            torch.get_num_threads(),
        )
        _check(rc, "backward")
        need = ctx.needs_input_grad
        return (dx if need[0] else None, gw if need[1] else None, gb if need[2] else None, None, None, None, None)


def bn_silu(x: Tensor, bn: nn.BatchNorm2d) -> Tensor:
    """``F.silu(bn(x))``, in one fused CPU kernel each way where :func:`supports` says so.

    Args:
        x: (N, C, H, W) input, channels_last bf16 or fp32 for the fused path; anything for the fallback.
        bn: The BatchNorm2d; in training mode its running statistics and ``num_batches_tracked`` are updated.

    Returns:
        (N, C, H, W) tensor of x's dtype and memory format.
    """
    if not supports(x, bn):
        return F.silu(bn(x))
    bn.num_batches_tracked.add_(1)
    return _BNSiLU.apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.momentum, bn.eps)
