"""Fused nearest-2x upsample: parity with F.interpolate, memory formats, gradcheck, Triton under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from yolo5l_kernels.upsample import UpsampleNearest2x, upsample_nearest2x

SHAPES = [(2, 3, 5, 7), (1, 1, 1, 1), (3, 8, 4, 9), (2, 16, 13, 13)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_parity_with_interpolate(shape, dtype, channels_last):
    x = torch.randn(shape).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    y = upsample_nearest2x(x, backend="torch")
    ref = F.interpolate(x, scale_factor=2, mode="nearest")
    assert y.shape == (shape[0], shape[1], 2 * shape[2], 2 * shape[3])
    assert y.dtype == dtype
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    g = torch.randn(ref.shape).to(dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    (gr,) = torch.autograd.grad(ref, x, g)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype in (torch.bfloat16, torch.float16) else {}
    torch.testing.assert_close(gx, gr, **tol)
    if shape[1] > 1 and shape[2] * shape[3] > 1:  # memory format is ambiguous for C == 1 or H == W == 1
        assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert gx.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_backward_sums_each_block_by_hand():
    x = torch.zeros(1, 1, 1, 2, requires_grad=True)
    y = upsample_nearest2x(x, backend="torch")
    g = torch.tensor([[[[1.0, 2.0, 10.0, 20.0], [3.0, 4.0, 30.0, 40.0]]]])
    y.backward(g)
    assert x.grad.tolist() == [[[[10.0, 100.0]]]]


def test_gradcheck_float64():
    x = torch.randn(2, 3, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: upsample_nearest2x(t, backend="torch"), (x,))
    xc = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: upsample_nearest2x(t, backend="torch"), (xc,))


def test_module_and_errors():
    m = UpsampleNearest2x()
    x = torch.randn(1, 2, 3, 3)
    torch.testing.assert_close(m(x), F.interpolate(x, scale_factor=2.0, mode="nearest"))
    assert "auto" in repr(m)
    with pytest.raises(ValueError, match="N, C, H, W"):
        upsample_nearest2x(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="backend"):
        UpsampleNearest2x(backend="cuda")


_TRITON_CHECK = """
import torch, torch.nn.functional as F
from yolo5l_kernels.upsample import upsample_nearest2x
for shape in [(2, 3, 5, 7), (1, 16, 9, 4), (0, 3, 4, 4)]:
    for cl in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape).to(dtype)
            if cl:
                x = x.to(memory_format=torch.channels_last)
            x.requires_grad_()
            y = upsample_nearest2x(x, backend="triton")
            r = F.interpolate(x, scale_factor=2, mode="nearest")
            torch.testing.assert_close(y, r, rtol=0, atol=0)
            assert y.stride() == r.stride() or shape[0] == 0, (y.stride(), r.stride())
            g = torch.randn(r.shape).to(dtype)
            (gx,) = torch.autograd.grad(y, x, g)
            (gr,) = torch.autograd.grad(r, x, g)
            torch.testing.assert_close(gx, gr, rtol=1e-2, atol=1e-2)
            assert gx.stride() == x.stride() or shape[0] == 0
print("TRITON_UPSAMPLE_OK")
"""


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    # A subprocess: TRITON_INTERPRET must be set before triton is imported and must not leak into other tests.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TRITON_UPSAMPLE_OK" in res.stdout


@pytest.mark.gpu
def test_triton_on_cuda():
    x = torch.randn(2, 32, 20, 20, device="cuda").to(memory_format=torch.channels_last).requires_grad_()
    y = upsample_nearest2x(x)
    r = F.interpolate(x, scale_factor=2, mode="nearest")
    torch.testing.assert_close(y, r, rtol=0, atol=0)
    g = torch.randn_like(r)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(r, x, g)[0])
