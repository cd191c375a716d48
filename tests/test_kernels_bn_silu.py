"""yolo5l_kernels.bn_silu: BatchNorm2d (training) + SiLU fused on the CPU, against F.silu(bn(x)).

The kernel's tests need a C compiler and skip without one; the fallback's take the compiler away themselves, so
they run everywhere.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yolo5l_kernels._bn_silu_build as B
import yolo5l_kernels.bn_silu as K
from torch import nn

from yolo5l.models.common import BN_EPS, BN_MOMENTUM, Conv
from yolo5l.models.yolo import YOLOv5

needs_kernel = pytest.mark.skipif(not K.fused_available(), reason="no C compiler: the fused kernel cannot be built")


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


@needs_kernel
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


@needs_kernel
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


@needs_kernel
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


@needs_kernel
def test_nan_propagates_like_pytorch():
    x = _input((2, 4, 6, 6), torch.float32).detach()
    x[1, 2, 3, 3] = float("nan")
    ref_bn, bn = _bn_pair(4)
    ref = F.silu(ref_bn(x))
    out = K.bn_silu(x, bn)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))  # the whole channel 2, as its statistics are NaN
    assert torch.isnan(out[:, 2]).all()
    assert not torch.isnan(out[:, [0, 1, 3]]).any()


@needs_kernel
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
    """Channels-first input, eval mode and fp16 take PyTorch's ops and give PyTorch's results, kernel or not."""
    x = torch.randn(2, 8, 6, 6)  # channels-first
    a, b = _bn_pair(8)
    assert not K.supports(x, b)
    torch.testing.assert_close(K.bn_silu(x, b), F.silu(a(x)), rtol=0, atol=0)
    xcl = x.contiguous(memory_format=torch.channels_last)
    a.eval(), b.eval()
    assert not K.supports(xcl, b)
    torch.testing.assert_close(K.bn_silu(xcl, b), F.silu(a(xcl)), rtol=0, atol=0)
    b.train()
    assert K.supports(xcl, b) == K.fused_available()
    assert not K.supports(xcl.to(torch.float16), b)
    assert not K.supports(xcl[:1, :, :1, :1], b)  # one value per channel: PyTorch's own error applies


@pytest.fixture
def fresh_build(monkeypatch, tmp_path) -> Path:
    """The loader as a new process finds it, with an empty cache (returned): nothing loaded, nothing tried."""
    monkeypatch.setattr(B, "_lib", None)
    monkeypatch.setattr(B, "_error", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "yolo5l" / "kernels"


@pytest.mark.parametrize("how", ["CC names no file", "no cc on PATH"])
def test_without_a_compiler_warns_once_and_gives_pytorchs_result(fresh_build, monkeypatch, tmp_path, caplog, how):
    if how == "CC names no file":
        cc = str(tmp_path / "no-such-cc")
        monkeypatch.setenv("CC", cc)
    else:
        cc = "cc"
        monkeypatch.delenv("CC", raising=False)
        (tmp_path / "bin").mkdir()
        monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    x = _input((2, 4, 5, 5), torch.float32)
    ref_bn, bn = _bn_pair(4)
    with caplog.at_level(logging.WARNING, logger=B.__name__):
        for _ in range(2):  # a warning for the process, not for every call
            assert not K.supports(x, bn)
            z, z_ref = K.bn_silu(x, bn), F.silu(ref_bn(x))
            torch.testing.assert_close(z, z_ref, rtol=0, atol=0)
            grads = torch.autograd.grad(z.square().sum(), (x, bn.weight, bn.bias))
            grads_ref = torch.autograd.grad(z_ref.square().sum(), (x, ref_bn.weight, ref_bn.bias))
            for g, g_ref in zip(grads, grads_ref):
                torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(bn, name), getattr(ref_bn, name), rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"fused BatchNorm+SiLU kernel unavailable, using PyTorch ops: no C compiler ({cc!r} not on PATH; set CC)"
    ]
    assert not fresh_build.exists()
    with pytest.raises(RuntimeError, match=r"unavailable \(no C compiler"):  # the op itself says why
        torch.ops.yolo5l.bn_silu_fwd(x.detach(), bn.weight.detach(), bn.bias.detach(), BN_EPS)


@needs_kernel
def test_compiles_once_into_the_cache(fresh_build, monkeypatch):
    assert B.load_library() is not None
    built = list(fresh_build.glob("bn_silu-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(B, "_lib", None)
    monkeypatch.setattr(B, "compile_library", lambda *a: pytest.fail("compiled again despite the cached library"))
    assert B.load_library() is not None
    assert built[0].stat().st_mtime_ns == mtime
    assert [p.name for p in fresh_build.iterdir()] == [built[0].name]  # no temporary file or folder left


@needs_kernel
def test_compiler_error_names_the_source(fresh_build, monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(B, "SOURCE", bad)
    assert B.load_library() is None
    assert str(bad) in B.error()
    assert "failed" in B.error()
    assert not list(fresh_build.rglob("*.so"))  # no half-written library left behind


# Prints the OpenMP runtimes mapped into a fresh process before and after the kernels' library is loaded.
_RUNTIMES = r"""
import json, os, re
import torch

def runtimes():
    with open("/proc/self/maps") as f:
        paths = {ln.split()[-1] for ln in f if len(ln.split()) >= 6}
    return sorted(os.path.realpath(p) for p in paths if re.search(r"/lib(gomp|iomp5|omp)[-.][^/]*$", p))

before = runtimes()
from yolo5l_kernels import _bn_silu_build as build
lib = build.load_library()
omp = build.openmp_runtime()
print(json.dumps({
    "before": before, "after": runtimes(), "linked": omp and os.path.realpath(omp),
    "openmp": lib is not None and bool(lib.bn_silu_openmp()),
}))
"""


def _gcc() -> bool:
    out = subprocess.run([B.find_compiler(), "--version"], capture_output=True, text=True).stdout
    return "Free Software Foundation" in out


@needs_kernel
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_loading_the_kernels_maps_no_second_openmp_runtime():
    """The library runs on torch's OpenMP runtime: one thread pool, however torch's copy is named."""
    r = subprocess.run([sys.executable, "-c", _RUNTIMES], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.splitlines()[-1])
    assert found["after"] == found["before"]
    if torch.backends.openmp.is_available():
        assert len(found["before"]) == 1, found
        assert found["linked"] == found["before"][0]
        if _gcc():  # GCC's OpenMP ABI is libgomp's: the threaded build links
            assert found["openmp"]


def test_the_link_step_names_torchs_runtime_and_not_the_compilers(tmp_path):
    omp = Path("/site-packages/torch/lib/libgomp-a34b3233.so.1")  # how older torch wheels name their copy
    compile_, link = B._commands("cc", B.SOURCE, tmp_path, tmp_path / "out.so", B.CFLAGS, omp)
    assert "-fopenmp" in compile_
    assert "-c" in compile_
    assert "-fopenmp" not in link  # it would add -lgomp: the compiler's runtime, a second one
    assert str(omp) in link
    assert "-Wl,-z,defs" in link


@needs_kernel
def test_a_runtime_that_cannot_be_linked_gives_a_one_thread_build(fresh_build, monkeypatch, tmp_path, caplog):
    """Where torch's OpenMP runtime lacks what the compiler calls, the kernels build without OpenMP and still work."""
    empty = tmp_path / "libempty.so"  # stands for a runtime of another ABI: it has none of the GOMP_* symbols
    (tmp_path / "empty.c").write_text("int yolo5l_empty;\n")
    subprocess.run([B.find_compiler(), "-shared", "-fPIC", str(tmp_path / "empty.c"), "-o", str(empty)], check=True)
    monkeypatch.setattr(B, "openmp_runtime", lambda: empty)
    monkeypatch.setattr(B, "_lib", None)
    with caplog.at_level(logging.WARNING, logger=B.__name__):
        lib = B.load_library()
    assert lib is not None
    assert lib.bn_silu_openmp() == 0
    assert any("runs on one thread" in r.getMessage() for r in caplog.records)
    x = _input((2, 13, 7, 5), torch.float32)
    (z_ref, gx_ref, _), (z, gx, _) = _both(x, 13)
    assert _rel(z, z_ref) < 1e-5
    assert _rel(gx, gx_ref) < 1e-4


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_pass_opcheck(dtype):
    """Schema, fake (meta) implementations, autograd registration and AOT dispatch of both operators."""
    x = _input((2, 6, 5, 4), dtype)
    g = torch.Generator().manual_seed(4)
    w = (torch.rand(6, generator=g) + 0.5).requires_grad_()
    b = (torch.rand(6, generator=g) - 0.5).requires_grad_()
    torch.library.opcheck(torch.ops.yolo5l.bn_silu_fwd.default, (x, w, b, BN_EPS))
    z, mean, var = torch.ops.yolo5l.bn_silu_fwd(x.detach(), w.detach(), b.detach(), BN_EPS)
    gz = torch.randn(z.shape, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    args = (gz, x.detach(), w.detach(), b.detach(), mean, var, BN_EPS)
    torch.library.opcheck(torch.ops.yolo5l.bn_silu_bwd.default, args)


def _conv_block() -> Conv:
    torch.manual_seed(0)
    m = Conv(16, 32, 3).to(memory_format=torch.channels_last).train()
    m.fused_bn_act = True
    return m


def _conv_input() -> torch.Tensor:
    x = torch.randn(2, 16, 12, 12, generator=torch.Generator().manual_seed(5))
    return x.contiguous(memory_format=torch.channels_last).requires_grad_()


@pytest.fixture
def dynamo():
    """A clean dynamo cache before and after: the tests compile the same Conv.forward with different backends."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recorder(graphs: list):
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return compiler


def _targets(graphs: list) -> list:
    return [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


@needs_kernel
def test_dynamo_traces_a_conv_block_with_the_fused_op_in_its_graph(dynamo):
    """Training mode, channels_last, fused_bn_act: one graph, no break, the op in it and no BatchNorm or SiLU."""
    graphs = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(_conv_block(), backend=record, fullgraph=True)(_conv_input())  # fullgraph: a break raises
    assert len(graphs) == 1
    targets = _targets(graphs)
    assert torch.ops.yolo5l.bn_silu_fwd.default in targets
    unfused = [t for t in targets if "yolo5l" not in str(t) and ("batch_norm" in str(t) or "silu" in str(t))]
    assert not unfused
    explained = torch._dynamo.explain(_conv_block())(_conv_input())
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1


@needs_kernel
@pytest.mark.parametrize("bf16", [False, True])
def test_aot_autograd_runs_both_ops_and_matches_eager_exactly(dynamo, bf16):
    """Forward graph: bn_silu_fwd; backward graph: bn_silu_bwd; outputs, gradients and running statistics (two
    steps, so that the updates compound) bit for bit those of the eager block."""
    from torch._dynamo.backends.common import aot_autograd

    fw, bw = [], []
    backend = aot_autograd(fw_compiler=_recorder(fw), bw_compiler=_recorder(bw))
    runs = []
    for compiled in (False, True):
        m, x = _conv_block(), _conv_input()
        f = torch.compile(m, backend=backend, fullgraph=True) if compiled else m
        for _ in range(2):
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                z = f(x)
            z.float().square().sum().backward()
        bn = m.bn
        runs.append([z, x.grad, m.conv.weight.grad, bn.weight.grad, bn.bias.grad, *bn.buffers()])
    assert runs[1][0].dtype == (torch.bfloat16 if bf16 else torch.float32)
    for got, want in zip(runs[1], runs[0], strict=True):
        assert torch.equal(got, want)
    assert runs[1][-1].item() == 2  # num_batches_tracked
    assert torch.ops.yolo5l.bn_silu_fwd.default in _targets(fw)
    assert torch.ops.yolo5l.bn_silu_bwd.default in _targets(bw)


@needs_kernel
@pytest.mark.slow  # inductor compiles C++ for the block: ~25 s on 2 cores
def test_inductor_keeps_the_ops_and_matches_eager(dynamo):
    from torch._inductor.utils import run_and_get_code

    runs = []
    for bf16 in (False, True):
        for compiled in (False, True):
            m, x = _conv_block(), _conv_input()
            f = torch.compile(m) if compiled else m

            def step(f=f, x=x):
                with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    z = f(x)
                z.float().square().sum().backward()
                return z

            if compiled:
                z, code = run_and_get_code(step)
                code = "\n".join(code)
                assert "torch.ops.yolo5l.bn_silu_fwd.default" in code
                assert "torch.ops.yolo5l.bn_silu_bwd.default" in code
            else:
                z = step()
            runs.append([z, x.grad, m.conv.weight.grad, m.bn.weight.grad, m.bn.bias.grad, *m.bn.buffers()])
        for got, want in zip(runs[-1], runs[-2], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


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


@needs_kernel
def test_yolov5_training_step_matches_unfused_fp32():
    """A whole yolov5n forward + backward in train mode: same outputs, gradients and running statistics."""
    _, out0, grad0, stats0 = _yolov5_step(fused=False, bf16=False)
    fused, out1, grad1, stats1 = _yolov5_step(fused=True, bf16=False)
    assert _err(out1, out0) < 1e-5
    assert _err(grad1, grad0) < 3e-4  # PyTorch's own fp32 step: 1.7e-4 between 1 and 2 threads
    assert _err(stats1, stats0) < 1e-5
    assert all(b.item() == 1 for n, b in fused.named_buffers() if n.endswith("num_batches_tracked"))
    assert sum(1 for m in fused.modules() if getattr(m, "fused_bn_act", False)) > 50


@needs_kernel
def test_yolov5_training_step_bf16_no_worse_than_autocast():
    """In bf16 both paths round; measured against fp32, the fused one must be no further off than PyTorch's."""
    _, out32, grad32, stats32 = _yolov5_step(fused=False, bf16=False)
    _, out_u, grad_u, stats_u = _yolov5_step(fused=False, bf16=True)
    _, out_f, grad_f, stats_f = _yolov5_step(fused=True, bf16=True)
    assert _err(out_f, out32) < 1.5 * _err(out_u, out32) + 1e-3
    assert _err(grad_f, grad32) < 1.5 * _err(grad_u, grad32) + 1e-3
    assert _err(stats_f, stats32) < 1.5 * _err(stats_u, stats32) + 1e-4


@needs_kernel
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",  # ATen's AVX512 is F + BW + VL + DQ, as the C file asks
    reason="no AVX-512 here: only the portable loops are compiled",
)
@pytest.mark.parametrize("c", [32, 13, 200])
def test_avx512_loops_match_the_portable_ones(tmp_path, c):
    """The hand-vectorised AVX-512 loops (full vectors and a masked tail) against the same file built without them."""
    portable = tmp_path / "portable.so"
    B.compile_library(B.find_compiler(), portable, (*B.CFLAGS, "-mno-avx512f"), B.openmp_runtime())
    libs = [B.load_library(), ctypes.CDLL(str(portable))]
    B._bind(libs[1])
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
