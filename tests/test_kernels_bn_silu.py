"""yolo5l_kernels.bn_silu: BatchNorm2d (training) + SiLU fused on the CPU, against F.silu(bn(x))."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
import yolo5l_kernels.bn_silu as K
from torch import nn

from yolo5l.models.common import BN_EPS, BN_MOMENTUM
from yolo5l.models.yolo import YOLOv5

pytestmark = pytest.mark.skipif(not K.fused_available(), reason="no C compiler: the fused kernel cannot be built")


def _bn_pair(c: int, seed: int = 0) -> tuple[nn.BatchNorm2d, nn.BatchNorm2d]:
    g = torch.Generator().manual_seed(seed)
    a = nn.BatchNorm2d(c, eps=BN_EPS, momentum=BN_MOMENTUM)
    with torch.no_grad():
        a.weight.copy_(torch.rand(c, generator=g) + 0.5)
        a.bias.copy_(torch.rand(c, generator=g) - 0.5)
        a.running_mean.copy_(torch.randn(c, generator=g))
        a.running_var.copy_(torch.rand(c, generator=g) + 0.5)
    b = nn.BatchNorm2d(c, eps=BN_EPS, momentum=BN_MOMENTUM)
    b.load_state_dict(a.state_dict())
    return a, b


def _input(shape: tuple[int, ...], dtype: torch.dtype, scale: float = 3.0, offset: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * scale + offset
    return x.to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_()


def _both(x: torch.Tensor, c: int, autocast: bool = False):
    """(reference, fused) outputs and gradients of x, weight, bias, and the two BatchNorms after one step."""
    ref_bn, fused_bn = _bn_pair(c)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x.dtype)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        z_ref = F.silu(ref_bn(x))
    z_ref.backward(g)
    gx_ref, x.grad = x.grad, None
    assert K.supports(x, fused_bn)
    z = K.bn_silu(x, fused_bn)
    z.backward(g)
    gx, x.grad = x.grad, None
    return (z_ref, gx_ref, ref_bn), (z, gx, fused_bn)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize("shape", [(4, 64, 20, 24), (2, 13, 7, 5), (3, 3, 1, 1), (1, 200, 9, 11)])
def test_fp32_matches_pytorch(shape):
    x = _input(shape, torch.float32)
    (z_ref, gx_ref, ref_bn), (z, gx, bn) = _both(x, shape[1])
    assert z.dtype == torch.float32
    assert z.is_contiguous(memory_format=torch.channels_last)
    assert _rel(z, z_ref) < 1e-5
    assert _rel(gx, gx_ref) < 1e-4
    assert _rel(bn.weight.grad, ref_bn.weight.grad) < 1e-4
    assert _rel(bn.bias.grad, ref_bn.bias.grad) < 1e-4
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-5, atol=1e-6)
    assert bn.num_batches_tracked.item() == ref_bn.num_batches_tracked.item() == 1


def test_bf16_within_one_rounding_of_autocast_composition():
    """Under autocast the unfused path rounds y = BN(x) to bf16 before the SiLU; the fused one does not."""
    x = _input((4, 64, 20, 24), torch.bfloat16)
    (z_ref, gx_ref, ref_bn), (z, gx, bn) = _both(x, 64, autocast=True)
    assert z.dtype == torch.bfloat16
    assert gx.dtype == torch.bfloat16
    assert _rel(z, z_ref) < 2**-7
    assert _rel(gx, gx_ref) < 2**-7
    assert _rel(bn.weight.grad, ref_bn.weight.grad) < 1e-2
    assert _rel(bn.bias.grad, ref_bn.bias.grad) < 1e-2
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-4, atol=1e-5)


def test_large_offset_and_extreme_values():
    """A mean far from zero (the variance is computed shifted) and |y| large enough to saturate the sigmoid."""
    x = _input((2, 8, 16, 16), torch.float32, scale=0.01, offset=1000.0)
    (z_ref, _, _), (z, _, bn) = _both(x, 8)
    exact_bn = _bn_pair(8)[0].double()
    z_exact = F.silu(exact_bn(x.detach().double()))
    # fp32 resolution at 1000 is 6e-5, against a spread of 0.01: PyTorch's fp32 statistics are off by ~3e-4 here
    # (0.8% of z); these accumulate shifted values in double.
    assert (z.double() - z_exact).abs().max() < 2e-3
    assert (z.double() - z_exact).abs().max() < (z_ref.double() - z_exact).abs().max()
    torch.testing.assert_close(bn.running_var.double(), exact_bn.running_var, rtol=1e-3, atol=1e-8)
    with torch.no_grad():
        bn.weight.fill_(100.0)  # y up to about +-400: silu(y) = y or 0
    x2 = _input((2, 8, 16, 16), torch.float32)
    ref = F.silu(F.batch_norm(x2, None, None, bn.weight, bn.bias, True, 0.0, BN_EPS))
    out = K.bn_silu(x2, bn)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-3)  # |y| ~ 400: fp32 rounding of y is ~3e-5


def test_nan_propagates_like_pytorch():
    x = _input((2, 4, 6, 6), torch.float32).detach()
    x[1, 2, 3, 3] = float("nan")
    ref_bn, bn = _bn_pair(4)
    ref = F.silu(ref_bn(x))
    out = K.bn_silu(x, bn)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))  # the whole channel 2, as its statistics are NaN
    assert torch.isnan(out[:, 2]).all()
    assert not torch.isnan(out[:, [0, 1, 3]]).any()


def test_thread_count_does_not_change_the_result_beyond_rounding():
    x = _input((4, 32, 20, 20), torch.float32)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            _, bn = _bn_pair(32)
            z = K.bn_silu(x, bn)
            z.sum().backward()
            outs.append((z.detach(), x.grad.clone(), bn.weight.grad.clone()))
            x.grad = None
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_falls_back_to_pytorch_where_unsupported():
    """Channels-first input, eval mode and frozen weights in bf16 take PyTorch's ops and give PyTorch's results."""
    x = torch.randn(2, 8, 6, 6)  # channels-first
    a, b = _bn_pair(8)
    assert not K.supports(x, b)
    torch.testing.assert_close(K.bn_silu(x, b), F.silu(a(x)), rtol=0, atol=0)
    xcl = x.contiguous(memory_format=torch.channels_last)
    a.eval(), b.eval()
    assert not K.supports(xcl, b)
    torch.testing.assert_close(K.bn_silu(xcl, b), F.silu(a(xcl)), rtol=0, atol=0)
    b.train()
    assert K.supports(xcl, b)
    assert not K.supports(xcl.to(torch.float16), b)
    assert not K.supports(xcl[:1, :, :1, :1], b)  # one value per channel: PyTorch's own error applies


def test_no_compiler_warns_once_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(K, "_lib", None)
    monkeypatch.setattr(K, "_error", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=K.__name__):
        assert K.load_library() is None
        assert K.load_library() is None
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
        f"fused BatchNorm+SiLU kernel unavailable, using PyTorch ops: no C compiler ('{tmp_path / 'no-such-cc'}' "
        "not on PATH; set CC)"
    ]
    x = _input((2, 4, 5, 5), torch.float32)
    a, b = _bn_pair(4)
    assert not K.supports(x, b)
    torch.testing.assert_close(K.bn_silu(x, b), F.silu(a(x)), rtol=0, atol=0)


def test_compiles_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(K, "_lib", None)
    monkeypatch.setattr(K, "_error", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert K.load_library() is not None
    built = list((tmp_path / "yolo5l" / "kernels").glob("bn_silu-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(K, "_lib", None)
    monkeypatch.setattr(K, "_compile", lambda *a: pytest.fail("compiled again despite the cached library"))
    assert K.load_library() is not None
    assert built[0].stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "yolo5l" / "kernels").iterdir()] == [built[0].name]  # no temp file left


def test_compiler_error_names_the_source(monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(K, "_lib", None)
    monkeypatch.setattr(K, "_error", None)
    monkeypatch.setattr(K, "SOURCE", bad)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert K.load_library() is None
    assert str(bad) in K._error
    assert "failed" in K._error
    assert not list((tmp_path / "cache").rglob("*.so"))  # no half-written library left behind


def _yolov5_step(fused: bool, bf16: bool, state: dict | None = None):
    torch.manual_seed(0)
    m = YOLOv5.from_name("yolov5n", num_classes=3, fused_bn_act=fused).to(memory_format=torch.channels_last).train()
    if state is not None:
        m.load_state_dict(state)
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(3)).contiguous(
        memory_format=torch.channels_last
    )
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        heads = m(x)
    sum(h.float().square().mean() for h in heads).backward()
    out = torch.cat([h.detach().float().flatten() for h in heads])
    grad = torch.cat([p.grad.flatten() for p in m.parameters()])
    stats = torch.cat([b.flatten().float() for n, b in m.named_buffers() if "running" in n])
    return m, out, grad, stats


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_yolov5_training_step_matches_unfused_fp32():
    """A whole yolov5n forward + backward in train mode: same outputs, gradients and running statistics."""
    _, out0, grad0, stats0 = _yolov5_step(fused=False, bf16=False)
    fused, out1, grad1, stats1 = _yolov5_step(fused=True, bf16=False)
    assert _err(out1, out0) < 1e-5
    assert _err(grad1, grad0) < 3e-4  # PyTorch's own fp32 step: 1.7e-4 between 1 and 2 threads
    assert _err(stats1, stats0) < 1e-5
    assert all(b.item() == 1 for n, b in fused.named_buffers() if n.endswith("num_batches_tracked"))
    assert sum(1 for m in fused.modules() if getattr(m, "fused_bn_act", False)) > 50


def test_yolov5_training_step_bf16_no_worse_than_autocast():
    """In bf16 both paths round; measured against fp32, the fused one must be no further off than PyTorch's."""
    _, out32, grad32, stats32 = _yolov5_step(fused=False, bf16=False)
    _, out_u, grad_u, stats_u = _yolov5_step(fused=False, bf16=True)
    _, out_f, grad_f, stats_f = _yolov5_step(fused=True, bf16=True)
    assert _err(out_f, out32) < 1.5 * _err(out_u, out32) + 1e-3
    assert _err(grad_f, grad32) < 1.5 * _err(grad_u, grad32) + 1e-3
    assert _err(stats_f, stats32) < 1.5 * _err(stats_u, stats32) + 1e-4


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",  # ATen's AVX512 is F + BW + VL + DQ, as the C file asks
    reason="no AVX-512 here: only the portable loops are compiled",
)
@pytest.mark.parametrize("c", [32, 13, 200])
def test_avx512_loops_match_the_portable_ones(tmp_path, c):
    """The hand-vectorised AVX-512 loops (full vectors and a masked tail) against the same file built without them."""
    import ctypes

    portable = tmp_path / "portable.so"  # the module's skip already says a compiler is there
    K._compile(os.environ.get("CC") or "cc", portable, (*K.CFLAGS, "-mno-avx512f"))
    libs = [K.load_library(), ctypes.CDLL(str(portable))]
    K._bind(libs[1])
    g = torch.Generator().manual_seed(3)
    m = 1000
    for dtype, sfx, tol in ((torch.float32, "f32", 2e-6), (torch.bfloat16, "bf16", 2**-7)):
        x = (torch.randn(m, c, generator=g) * 3 + 1.5).to(dtype)
        gz = torch.randn(m, c, generator=g).to(dtype)
        w, b = torch.rand(c, generator=g) + 0.5, torch.rand(c, generator=g) - 0.5
        outs = []
        for lib in libs:
            mean, var = torch.empty(c), torch.empty(c)
            assert getattr(lib, f"bn_stats_{sfx}")(x.data_ptr(), m, c, mean.data_ptr(), var.data_ptr(), 2) == 0
            invstd = (var + 1e-3).rsqrt()
            z, dx, gw, gb = torch.empty_like(x), torch.empty_like(x), torch.empty(c), torch.empty(c)
            p = [t.data_ptr() for t in (mean, invstd, w, b)]
            assert getattr(lib, f"bn_silu_fwd_{sfx}")(x.data_ptr(), z.data_ptr(), m, c, *p, 2) == 0
            args = (gz.data_ptr(), x.data_ptr(), dx.data_ptr(), m, c, *p, gw.data_ptr(), gb.data_ptr(), 2)
            assert getattr(lib, f"bn_silu_bwd_{sfx}")(*args) == 0
            outs.append((mean, var, z, dx, gw, gb))
        for a, ref in zip(*outs):
            assert _rel(a, ref) < tol, (dtype, c)
