"""Fused CIoU: hand-derived values, parity with the reference and torchvision, gradcheck, Triton interpreter."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from torchvision.ops import complete_box_iou_loss
from yolo5l_kernels import _ciou_torch
from yolo5l_kernels import ciou as ciou_mod
from yolo5l_kernels.ciou import ciou_xywh
from yolo5l_kernels.reference import ciou_xywh as ref_ciou_xywh
from yolo5l_kernels.reference import ciou_xyxy, xywh_to_xyxy, xyxy_to_xywh

SIZES = [0, 1, 1023, 4099]
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def _boxes(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random overlapping, disjoint and nested (N, 4) xywh pairs; about 1/8 of the pairs identical (ties)."""
    g = torch.Generator().manual_seed(seed)
    b1 = torch.rand(n, 4, generator=g, dtype=torch.float64)
    b1[:, 2:] = b1[:, 2:] * 0.6 + 0.02
    b2 = b1 + torch.randn(n, 4, generator=g, dtype=torch.float64) * 0.2
    b2[:, 2:] = b2[:, 2:].abs() + 0.02
    b2[::8] = b1[::8]
    return b1.to(dtype), b2.to(dtype)


def _grads(fn, b1: torch.Tensor, b2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn(b1, b2)`` on leaf copies of the boxes and the gradients of its sum w.r.t. both."""
    b1, b2 = b1.detach().clone().requires_grad_(), b2.detach().clone().requires_grad_()
    out = fn(b1, b2)
    return (out, *torch.autograd.grad(out.sum(), (b1, b2)))


def _triton(b1: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return ciou_xywh(b1, b2, backend="triton")


def _check_triton_parity(device: str, dtype: torch.dtype, backend: str = "triton") -> None:
    """The Triton backend on the 4099 pairs of ``_boxes`` in ``dtype`` against the float64 reference.

    ``backend="auto"`` checks that CUDA inputs dispatch to it.

    The kernel computes in fp32 and rounds its results to ``dtype``, so each CIoU and gradient element may differ from
    the float64 value by one unit in the last place of ``dtype`` (Triton's interpreter truncates to bf16) plus its fp32
    evaluation error, which is bounded by 4x the fp32 reference's own error at that element (gradients of nearly
    identical thin boxes cancel terms of ~1/h) plus 1e-4. 16-bit inputs make some pairs touch exactly (overlap 0 on
    one axis), where the gradient has a kink: the float64 reference and the kernel take the same one-sided derivative.
    """
    b1, b2 = (b.to(device=device, dtype=dtype) for b in _boxes(4099))
    got = _grads(lambda x, y: ciou_xywh(x, y, backend=backend), b1, b2)
    ref32 = _grads(ref_ciou_xywh, b1.float(), b2.float())
    ref64 = _grads(ref_ciou_xywh, b1.double(), b2.double())
    for name, k, r32, r64 in zip(("ciou", "grad box1", "grad box2"), got, ref32, ref64):
        assert k.dtype == dtype
        assert k.shape == r64.shape
        err = (k.double() - r64).abs()
        bound = torch.finfo(dtype).eps * r64.abs() + 4 * (r32.double() - r64).abs() + 1e-4
        bad = (err > bound).nonzero().tolist()
        worst = [
            f"{tuple(i)}: kernel {k[tuple(i)].item():.6g}, float64 {r64[tuple(i)].item():.6g}, "
            f"fp32 reference {r32[tuple(i)].item():.6g}, pair {b1[i[0]].tolist()} {b2[i[0]].tolist()}"
            for i in bad[:4]
        ]
        assert not bad, f"{dtype} {name}: {len(bad)} of {err.numel()} elements off: " + "; ".join(worst)


# Pairs whose edges meet exactly on one axis (given) while the other axis overlaps, so the intersection is exactly 0:
# row 621 of ``_boxes(4099)`` rounded to fp16 (touching in x), row 3841 rounded to bf16 (in y), both exact in fp32, and
# a hand-made pair (in x).
_TOUCHING = (
    (
        [0.429931640625, 0.466552734375, 0.401123046875, 0.2327880859375],
        [0.113525390625, 0.334228515625, 0.231689453125, 0.464111328125],
        0,
    ),
    ([0.031494140625, 0.76953125, 0.08349609375, 0.365234375], [-0.08740234375, 1.0703125, 0.1796875, 0.236328125], 1),
    ([0.5, 0.5, 1.0, 1.0], [1.25, 0.75, 0.5, 1.0], 0),
)


def _check_touching(fn, device: str = "cpu") -> None:
    """At touching edges ``fn``'s gradients are the one-sided derivatives of the side where the boxes are apart.

    CIoU has a kink there and the backends choose no gradient through the zero overlap (relu, the minimum-norm
    subgradient). The oracle does not depend on any autograd convention at the kink: the float64 reference at box2
    moved 1e-9 away from box1 along the touching axis, where it is differentiable. The derivative of the overlapping
    side (box2 moved 1e-9 towards box1) must differ from it by > 0.05, so that the check decides between the two.
    """
    for a, b, axis in _TOUCHING:
        b1 = torch.tensor([a], dtype=torch.float64)
        b2 = torch.tensor([b], dtype=torch.float64)
        lo1, hi1 = b1[0, axis] - b1[0, axis + 2] / 2, b1[0, axis] + b1[0, axis + 2] / 2
        lo2, hi2 = b2[0, axis] - b2[0, axis + 2] / 2, b2[0, axis] + b2[0, axis + 2] / 2
        assert hi2 == lo1 or hi1 == lo2
        step = torch.zeros(1, 4, dtype=torch.float64)
        step[0, axis] = 1e-9 if hi1 == lo2 else -1e-9  # moves box2 away from box1
        apart = _grads(ref_ciou_xywh, b1, b2 + step)[1:]
        overlap = _grads(ref_ciou_xywh, b1, b2 - step)[1:]
        assert max((o - p).abs().max().item() for o, p in zip(overlap, apart)) > 0.05
        got = _grads(fn, b1.to(device, torch.float32), b2.to(device, torch.float32))[1:]
        for g, p in zip(got, apart):
            torch.testing.assert_close(g.cpu().double(), p, rtol=1e-4, atol=1e-4)


# torchvision's canonical boxes (test_ops.py): xyxy.
_TV = {
    "box1": [-1.0, -1.0, 1.0, 1.0],
    "box2": [0.0, 0.0, 1.0, 1.0],
    "box3": [0.0, 1.0, 1.0, 2.0],
    "box4": [1.0, 1.0, 2.0, 2.0],
}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(
    ("a", "b", "loss"),
    [
        # iou 1/4, enclosing diagonal^2 8, centre distance^2 1/2, same aspect: 1 - 1/4 + 1/16.
        ("box1", "box2", 0.8125),
        ("box2", "box2", 0.0),
        # touching edge: iou 0, c^2 = 1 + 4, rho^2 = 1 -> 1 + 1/5.
        ("box2", "box3", 1.2),
        # corner to corner: iou 0, c^2 = 8, rho^2 = 2 -> 1 + 1/4.
        ("box2", "box4", 1.25),
    ],
)
def test_torchvision_canonical_values(backend, a, b, loss):
    b1 = xyxy_to_xywh(torch.tensor([_TV[a]], dtype=torch.float64))
    b2 = xyxy_to_xywh(torch.tensor([_TV[b]], dtype=torch.float64))
    out = ciou_xywh(b1, b2, backend=backend)
    torch.testing.assert_close(1 - out, torch.tensor([loss], dtype=torch.float64), rtol=0, atol=1e-6)
    tv = complete_box_iou_loss(xywh_to_xyxy(b1), xywh_to_xyxy(b2))
    torch.testing.assert_close(1 - out, tv, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_hand_computed_aspect_term(backend):
    # Unit square vs a 2x1 box sharing its left half: iou 1/2, c^2 5, rho^2 1/4, v = 4/pi^2 (atan 2 - atan 1)^2.
    b1 = torch.tensor([[0.5, 0.5, 1.0, 1.0]], dtype=torch.float64)
    b2 = torch.tensor([[1.0, 0.5, 2.0, 1.0]], dtype=torch.float64)
    v = 4 / math.pi**2 * (math.atan(2.0) - math.atan(1.0)) ** 2
    expected = 0.5 - (0.25 / 5 + v * v / (v - 0.5 + 1))
    torch.testing.assert_close(ciou_xywh(b1, b2, backend=backend), torch.tensor([expected], dtype=torch.float64))
    # ciou_xyxy agrees on the same boxes.
    torch.testing.assert_close(ciou_xyxy(xywh_to_xyxy(b1), xywh_to_xyxy(b2)), torch.tensor([expected]).double())


def test_identical_boxes_give_one_and_conversions_round_trip():
    b, _ = _boxes(64, torch.float64)
    # rho = 0 and v = 0, so CIoU = IoU = area / (area + eps): 1 up to the eps in the union.
    area = b[:, 2] * b[:, 3]
    for backend in ("reference", "cpu"):
        torch.testing.assert_close(ciou_xywh(b, b, backend=backend), area / (area + 1e-7), rtol=0, atol=1e-12)
    torch.testing.assert_close(xyxy_to_xywh(xywh_to_xyxy(b)), b)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_matches_reference_forward_backward(n, dtype):
    b1, b2 = _boxes(n, dtype, seed=n)
    b1.requires_grad_()
    b2.requires_grad_()
    out = ciou_xywh(b1, b2, backend="cpu")
    assert out.shape == (n,)
    assert out.dtype == dtype
    g = torch.randn(n, dtype=torch.float64).to(dtype)
    g1, g2 = torch.autograd.grad(out, (b1, b2), g)
    assert g1.shape == g2.shape == (n, 4)
    assert g1.dtype == g2.dtype == dtype
    # Oracle: the reference evaluated in the fused path's compute precision (fp32 for bf16).
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    r1, r2 = b1.detach().to(cdt).requires_grad_(), b2.detach().to(cdt).requires_grad_()
    ref = ref_ciou_xywh(r1, r2)
    q1, q2 = torch.autograd.grad(ref, (r1, r2), g.to(cdt))
    torch.testing.assert_close(out.to(cdt), ref, **TOL[dtype])
    torch.testing.assert_close(g1.to(cdt), q1, **TOL[dtype])
    torch.testing.assert_close(g2.to(cdt), q2, **TOL[dtype])


@pytest.mark.parametrize("n", [1, 1023, 4099])
def test_matches_torchvision_loss_and_grads(n):
    b1, b2 = _boxes(n, torch.float64, seed=7)
    b1.requires_grad_()
    b2.requires_grad_()
    loss = (1 - ciou_xywh(b1, b2, backend="cpu")).sum()
    g1, g2 = torch.autograd.grad(loss, (b1, b2))
    # torchvision takes xyxy and has no eps on h in the aspect term: differences are O(eps / h) ~ 1e-6.
    t1, t2 = b1.detach().requires_grad_(), b2.detach().requires_grad_()
    tv = complete_box_iou_loss(xywh_to_xyxy(t1), xywh_to_xyxy(t2), reduction="sum")
    q1, q2 = torch.autograd.grad(tv, (t1, t2))
    torch.testing.assert_close(loss, tv, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(g1, q1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g2, q2, rtol=1e-4, atol=1e-4)


class _FixedAlphaCIoU(torch.autograd.Function):
    """The fused math with alpha frozen at given values: its exact Jacobian is what the analytic backward claims."""

    @staticmethod
    def forward(ctx, t, alpha):
        out, *saved = _ciou_torch.ciou_fwd(t, 1e-7, alpha=alpha)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, g):
        return _ciou_torch.ciou_bwd(g, *ctx.saved_tensors), None


def test_gradcheck_float64():
    b1, b2 = _boxes(23, torch.float64, seed=3)
    # Keep gradcheck's finite differences away from the kinks of min/max/clamp (ties are tested elsewhere).
    b2 = b2 + 0.013
    t = torch.stack((b1, b2)).transpose(1, 2).contiguous().requires_grad_()
    # gradcheck's finite differences would move alpha too, which YOLOv5 (and the backward) treat as a constant.
    alpha = _ciou_torch.ciou_fwd(t.detach(), 1e-7)[-1]
    assert alpha.abs().min() > 0  # the aspect term is exercised
    assert torch.autograd.gradcheck(lambda x: _FixedAlphaCIoU.apply(x, alpha), (t,))
    # The public Function's backward is the same analytic backward: it matches autograd through the reference.
    b1.requires_grad_()
    b2.requires_grad_()
    g = torch.randn(23, dtype=torch.float64)
    fused = torch.autograd.grad(ciou_mod._CIoUTorch.apply(b1, b2, 1e-7), (b1, b2), g)
    ref = torch.autograd.grad(ref_ciou_xywh(b1, b2), (b1, b2), g)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_degenerate_boxes_are_finite(backend):
    b1 = torch.tensor(
        [[0.5, 0.5, 0.0, 1.0], [0.5, 0.5, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0]]
    )
    b2 = torch.tensor(
        [[0.5, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 1.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    )
    b1.requires_grad_()
    b2.requires_grad_()
    out = ciou_xywh(b1, b2, backend=backend)
    g1, g2 = torch.autograd.grad(out.sum(), (b1, b2))
    assert torch.isfinite(out).all()
    assert torch.isfinite(g1).all()
    assert torch.isfinite(g2).all()
    assert (out <= 1).all()
    assert (out >= -1.5).all()
    if backend == "cpu":
        r1, r2 = b1.detach().requires_grad_(), b2.detach().requires_grad_()
        ref = ref_ciou_xywh(r1, r2)
        torch.testing.assert_close(out, ref)
        for a, b in zip((g1, g2), torch.autograd.grad(ref.sum(), (r1, r2))):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_touching_edges_take_the_separated_side(backend):
    _check_touching(lambda b1, b2: ciou_xywh(b1, b2, backend=backend))


def test_empty_input_gives_empty_output_and_grads():
    b1 = torch.zeros(0, 4, requires_grad=True)
    b2 = torch.zeros(0, 4, requires_grad=True)
    out = ciou_xywh(b1, b2)
    assert out.shape == (0,)
    loss = (1 - out).sum()
    loss.backward()
    assert loss.item() == 0.0
    assert b1.grad is not None
    assert b1.grad.shape == (0, 4)
    assert b2.grad.shape == (0, 4)


def test_broadcast_leading_dims_and_errors():
    b1, b2 = _boxes(12)
    out = ciou_xywh(b1.view(3, 4, 4), b2.view(3, 4, 4))
    torch.testing.assert_close(out, ref_ciou_xywh(b1, b2).view(3, 4))
    torch.testing.assert_close(ciou_xywh(b1, b2[:1]), ref_ciou_xywh(b1, b2[:1]))
    with pytest.raises(ValueError, match="backend"):
        ciou_xywh(b1, b2, backend="cuda")
    with pytest.raises(ValueError, match=r"\(N, 4\)"):
        ciou_xywh(b1[:, :3], b2[:, :3])


def test_compiled_falls_back_when_compile_fails(monkeypatch):
    def _broken():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(ciou_mod, "_compiled_fns", _broken)
    monkeypatch.setattr(ciou_mod, "_compile_failed", False)
    b1, b2 = _boxes(9)
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        out = ciou_xywh(b1, b2, backend="compiled")
    torch.testing.assert_close(out, ref_ciou_xywh(b1, b2))


@pytest.mark.slow
@pytest.mark.parametrize("n", [0, 1, 1023, 4099])
def test_compiled_matches_reference(n):
    b1, b2 = _boxes(n, seed=n)
    b1.requires_grad_()
    b2.requires_grad_()
    out = ciou_xywh(b1, b2, backend="compiled")
    g = torch.randn(n)
    grads = torch.autograd.grad(out, (b1, b2), g)
    ref = ref_ciou_xywh(b1, b2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    # Inductor fuses the backward in another order: gradients of O(1) agree to ~1e-5 absolute, and an element
    # that cancels to ~1e-4 can differ by a few percent relative, so compare gradients absolutely.
    for a, b in zip(grads, torch.autograd.grad(ref, (b1, b2), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


_TRITON_CHECK = """
import sys
import torch
from yolo5l_kernels.ciou import ciou_xywh
from yolo5l_kernels.reference import ciou_xywh as ref
torch.manual_seed(0)
for n in (0, 1, 37, 1100):
    b1 = torch.rand(n, 4); b1[:, 2:] = b1[:, 2:] * 0.6 + 0.02
    b2 = b1 + torch.randn(n, 4) * 0.2; b2[:, 2:] = b2[:, 2:].abs() + 0.02
    b2[::8] = b1[::8]
    if n >= 37:
        b1[1, 2] = 0.0; b2[2, 3] = 0.0; b1[3, 2:] = 0.0  # degenerate widths/heights
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):  # fp32: rounding order differs
        x1, x2 = b1.to(dtype).requires_grad_(), b2.to(dtype).requires_grad_()
        out = ciou_xywh(x1, x2, backend="triton")
        assert out.dtype == dtype and out.shape == (n,)
        g = torch.randn(n).to(dtype)
        g1, g2 = torch.autograd.grad(out, (x1, x2), g)
        r1, r2 = x1.detach().float().requires_grad_(), x2.detach().float().requires_grad_()
        r = ref(r1, r2)
        q1, q2 = torch.autograd.grad(r, (r1, r2), g.float())
        torch.testing.assert_close(out.float(), r, rtol=tol, atol=tol)
        torch.testing.assert_close(g1.float(), q1, rtol=tol, atol=tol)
        torch.testing.assert_close(g2.float(), q2, rtol=tol, atol=tol)
# The checks of the CUDA tests below, on the CPU: same inputs and dtypes, same oracle and bounds.
sys.path.insert(0, sys.argv[1])
import test_kernels_ciou as t
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    t._check_triton_parity("cpu", dtype)
t._check_touching(t._triton)
print("TRITON_CIOU_OK")
"""


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    # A subprocess: TRITON_INTERPRET must be set before triton is imported and must not leak into other tests.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-c", _TRITON_CHECK, os.path.dirname(__file__)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TRITON_CIOU_OK" in res.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_on_cuda(dtype):
    _check_triton_parity("cuda", dtype, backend="auto")


@pytest.mark.gpu
def test_triton_touching_edges_on_cuda():
    _check_touching(_triton, "cuda")
