"""Tests for yolo5l.training.loss.YOLOv5Loss: hand-derived values, a sync-full parity oracle, and the no-sync
guarantee."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from yolo5l.training.loss import YOLOv5Loss, loss_args

aten = torch.ops.aten

# --------------------------------------------------------------------------------------------------------------
# Hand-derivation helpers (plain Python floats)
# --------------------------------------------------------------------------------------------------------------


def _ciou_py(b1, b2, eps=1e-7):
    """CIoU of two (cx, cy, w, h) boxes, written out on floats (ultralytics/yolov5 v7.0 utils/metrics.py::bbox_iou)."""
    (x1, y1, w1, h1), (x2, y2, w2, h2) = b1, b2
    l1, r1, t1, d1 = x1 - w1 / 2, x1 + w1 / 2, y1 - h1 / 2, y1 + h1 / 2
    l2, r2, t2, d2 = x2 - w2 / 2, x2 + w2 / 2, y2 - h2 / 2, y2 + h2 / 2
    inter = max(min(r1, r2) - max(l1, l2), 0) * max(min(d1, d2) - max(t1, t2), 0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    c2 = (max(r1, r2) - min(l1, l2)) ** 2 + (max(d1, d2) - min(t1, t2)) ** 2 + eps
    rho2 = (x2 - x1) ** 2 + (y2 - y1) ** 2
    v = 4 / math.pi**2 * (math.atan(w2 / (h2 + eps)) - math.atan(w1 / (h1 + eps))) ** 2
    alpha = v / (v - iou + 1 + eps)
    return iou - (rho2 / c2 + alpha * v)


def _softplus(x):
    return math.log1p(math.exp(x))


def _bce(x, t, pw=1.0):
    """BCE-with-logits of one logit: -(pw t log s(x) + (1 - t) log(1 - s(x)))."""
    return pw * t * _softplus(-x) + (1 - t) * _softplus(x)


def _single_level_loss(nc=1, anchor=(2.0, 2.0), **kw):
    kw.setdefault("balance", (1.0,))
    return YOLOv5Loss(nc, torch.tensor([[anchor]]), [8.0], **kw)


def _heads(grid, nc=1, obj_logit=-2.0, cls_logits=None, batch=1, requires_grad=False):
    """One level: box logits 0 (pxy = 0.5, pwh = anchor), a constant objectness logit, optional class logits."""
    h = torch.zeros(batch, 1, grid, grid, 5 + nc)
    h[..., 4] = obj_logit
    if cls_logits is not None:
        h[..., 5:] = torch.tensor(cls_logits)
    return [h.requires_grad_(requires_grad)]


def _valid_cells(loss, targets, grid, level=0):
    cand = loss._candidates(level, targets.float(), grid, grid)
    v = cand.valid.tolist()
    return sorted({(gi, gj) for gi, gj, ok in zip(cand.gi.tolist(), cand.gj.tolist(), v) if ok})


# --------------------------------------------------------------------------------------------------------------
# Hand-derived cases: one level, 4x4 grid, one anchor of 2x2 cells, box logits 0 -> predicted box (0.5, 0.5, 2, 2)
# --------------------------------------------------------------------------------------------------------------

G = 4
X = -2.0  # objectness logit on every cell


def test_centre_only_at_frac_half():
    loss = _single_level_loss()
    t = torch.tensor([[0, 0, 1.5 / G, 2.5 / G, 2 / G, 2 / G]])  # exactly the anchor, centred in cell (1, 2)
    assert _valid_cells(loss, t, G) == [(1, 2)]
    total, items = loss(_heads(G), t)
    # Identical boxes: CIoU = 4 / (4 + eps); box target (0.5, 0.5, 2, 2).
    ciou = _ciou_py((0.5, 0.5, 2, 2), (0.5, 0.5, 2, 2))
    assert ciou == pytest.approx(1 - 2.5e-8, abs=1e-12)
    lbox = 1 - ciou
    lobj = (_bce(X, ciou) + 15 * _bce(X, 0.0)) / 16
    torch.testing.assert_close(items, torch.tensor([lbox * loss.box_gain, lobj * loss.obj_gain, 0.0]))
    torch.testing.assert_close(total, items.sum() * 1)


def test_frac_quarter_uses_left_and_top_neighbours():
    loss = _single_level_loss()
    t = torch.tensor([[0, 0, 1.25 / G, 2.25 / G, 2 / G, 2 / G]])
    assert _valid_cells(loss, t, G) == [(0, 2), (1, 1), (1, 2)]  # left, top, centre
    _, items = loss(_heads(G), t)
    pred = (0.5, 0.5, 2.0, 2.0)
    # Box targets relative to each cell: centre (0.25, 0.25), left cell gi=0 (1.25, 0.25), top cell gj=1 (0.25, 1.25).
    cious = [_ciou_py(pred, (0.25, 0.25, 2, 2)), _ciou_py(pred, (1.25, 0.25, 2, 2)), _ciou_py(pred, (0.25, 1.25, 2, 2))]
    # Worked by hand for the centre cell: inter 1.75^2, union 8 - 3.0625, rho^2 0.125, c^2 2 * 2.25^2.
    assert cious[0] == pytest.approx(3.0625 / 4.9375 - 0.125 / 10.125, abs=1e-7)
    assert cious[1] == pytest.approx(2.1875 / 5.8125 - 0.625 / 12.625, abs=1e-7)
    lbox = sum(1 - c for c in cious) / 3
    lobj = (sum(_bce(X, c) for c in cious) + 13 * _bce(X, 0.0)) / 16
    torch.testing.assert_close(items, torch.tensor([lbox * loss.box_gain, lobj * loss.obj_gain, 0.0]))


def test_frac_three_quarters_uses_right_and_bottom_neighbours():
    loss = _single_level_loss()
    t = torch.tensor([[0, 0, 1.75 / G, 1.75 / G, 2 / G, 2 / G]])
    assert _valid_cells(loss, t, G) == [(1, 1), (1, 2), (2, 1)]  # centre, bottom, right
    _, items = loss(_heads(G), t)
    pred = (0.5, 0.5, 2.0, 2.0)
    cious = [
        _ciou_py(pred, (0.75, 0.75, 2, 2)),
        _ciou_py(pred, (-0.25, 0.75, 2, 2)),
        _ciou_py(pred, (0.75, -0.25, 2, 2)),
    ]
    lbox = sum(1 - c for c in cious) / 3
    lobj = (sum(_bce(X, c) for c in cious) + 13 * _bce(X, 0.0)) / 16
    torch.testing.assert_close(items, torch.tensor([lbox * loss.box_gain, lobj * loss.obj_gain, 0.0]))


@pytest.mark.parametrize(
    ("cx", "cy", "cells"),
    [
        # frac < 0.5 but gx <= 1 (no left); W - gx with frac < 0.5 but <= 1 (no right); likewise vertically.
        (0.25, 0.25, [(0, 0)]),
        (3.75, 3.75, [(3, 3)]),
        (0.25, 3.75, [(0, 3)]),
        # gx = 0.9: frac 0.9 (no left) but W - gx = 3.1 (right); gy = 3.1: top, W - gy = 0.9 <= 1 (no bottom).
        (0.9, 3.1, [(0, 2), (0, 3), (1, 3)]),
    ],
)
def test_neighbours_near_the_image_border(cx, cy, cells):
    loss = _single_level_loss()
    t = torch.tensor([[0, 0, cx / G, cy / G, 2 / G, 2 / G]])
    assert _valid_cells(loss, t, G) == cells


def test_box_on_the_far_edge_clamps_into_the_grid():
    # cx = 1 -> gx = 4 = W: centre cell 4 is clamped to 3 and the left neighbour (frac 0 < 0.5, gx > 1) is also 3;
    # both box targets are gx - 3 = 1.
    loss = _single_level_loss()
    t = torch.tensor([[0, 0, 1.0, 1.5 / G, 2 / G, 2 / G]])
    cand = loss._candidates(0, t, G, G)
    v = cand.valid
    assert sorted(zip(cand.gi[v].tolist(), cand.gj[v].tolist())) == [(3, 1), (3, 1)]
    torch.testing.assert_close(cand.tbox[v][:, 0], torch.tensor([1.0, 1.0]))
    total, items = loss(_heads(G), t)
    assert torch.isfinite(total)
    c = _ciou_py((0.5, 0.5, 2, 2), (1.0, 0.5, 2, 2))
    torch.testing.assert_close(items[0], torch.tensor((1 - c) * loss.box_gain))


@pytest.mark.parametrize(("ratio", "matched"), [(5.0, False), (1 / 5.0, False), (3.9, True), (1 / 3.9, True)])
def test_anchor_t_rejection(ratio, matched):
    g = 16
    loss = _single_level_loss(anchor=(1.0, 1.0))
    t = torch.tensor([[0, 0, 8.5 / g, 8.5 / g, ratio / g, 1.0 / g]])  # w is `ratio` x the anchor, h matches
    assert bool(loss._candidates(0, t, g, g).valid.any()) is matched
    _, items = loss(_heads(g), t)
    if not matched:
        torch.testing.assert_close(items, torch.tensor([0.0, _bce(X, 0.0) * loss.obj_gain, 0.0]))
    else:
        assert items[0] > 0


def test_one_level_matches_another_does_not():
    # Two levels over the same 32 px image: 4x4 (anchor 1 cell = 8 px) and 2x2 (anchor 0.25 cells = 4 px).
    # A 16 px box is 2x the first anchor (matched) and 4x the second (rejected: not < 4).
    loss = YOLOv5Loss(1, torch.tensor([[[1.0, 1.0]], [[0.25, 0.25]]]), [8.0, 16.0], balance=(1.0, 1.0))
    t = torch.tensor([[0, 0, 0.5 + 1 / 16, 0.5 + 1 / 16, 0.5, 0.5]])
    assert loss._candidates(0, t, 4, 4).valid.any()
    assert not loss._candidates(1, t, 2, 2).valid.any()


def test_label_smoothing_and_class_pos_weight():
    eps, pw, z = 0.2, 2.0, (1.0, -1.0, 0.5)
    loss = _single_level_loss(nc=3, label_smoothing=eps, cls_pw=pw)
    assert (loss.cp, loss.cn) == pytest.approx((0.9, 0.1))
    t = torch.tensor([[0, 0, 1.5 / G, 2.5 / G, 2 / G, 2 / G]])  # class 0, centre cell only
    _, items = loss(_heads(G, nc=3, cls_logits=z), t)
    lcls = (_bce(z[0], 0.9, pw) + _bce(z[1], 0.1, pw) + _bce(z[2], 0.1, pw)) / 3
    torch.testing.assert_close(items[2], torch.tensor(lcls * loss.cls_gain))


def test_single_class_has_no_class_loss():
    loss = _single_level_loss(nc=1)
    _, items = loss(_heads(G, nc=1), torch.tensor([[0, 0, 0.4, 0.4, 0.5, 0.5]]))
    assert items[2] == 0


def test_obj_pos_weight():
    loss = _single_level_loss(obj_pw=3.0)
    t = torch.tensor([[0, 0, 1.5 / G, 2.5 / G, 2 / G, 2 / G]])
    _, items = loss(_heads(G), t)
    ciou = _ciou_py((0.5, 0.5, 2, 2), (0.5, 0.5, 2, 2))
    torch.testing.assert_close(items[1], torch.tensor((_bce(X, ciou, 3.0) + 15 * _bce(X, 0.0)) / 16 * loss.obj_gain))


def test_focal_objectness_by_hand():
    gamma, alpha = 1.5, 0.25
    loss = _single_level_loss(fl_gamma=gamma)
    _, items = loss(_heads(G), torch.zeros(0, 6))
    p = 1 / (1 + math.exp(-X))  # every target is 0: p_t = 1 - p, alpha factor 1 - alpha
    expected = _bce(X, 0.0) * (1 - alpha) * p**gamma
    torch.testing.assert_close(items[1], torch.tensor(expected * loss.obj_gain))


def test_later_write_wins_on_a_shared_cell():
    # Target A (first) at frac 0.25 also uses the left cell (0, 2); target B (second) is centred in that cell.
    # ultralytics' rows are offset-major: B's centre row comes before A's left-neighbour row, so A's CIoU wins
    # although A precedes B in the target list.
    loss = _single_level_loss()
    t = torch.tensor([[0, 0, 1.25 / G, 2.5 / G, 2 / G, 2 / G], [0, 0, 0.5 / G, 2.5 / G, 2 / G, 1.5 / G]])
    _, items = loss(_heads(G), t)
    pred = (0.5, 0.5, 2.0, 2.0)
    a_centre, a_left = _ciou_py(pred, (0.25, 0.5, 2, 2)), _ciou_py(pred, (1.25, 0.5, 2, 2))
    b_centre = _ciou_py(pred, (0.5, 0.5, 2, 1.5))
    assert abs(a_left - b_centre) > 0.1
    lobj = (_bce(X, a_centre) + _bce(X, a_left) + 14 * _bce(X, 0.0)) / 16
    torch.testing.assert_close(items[1], torch.tensor(lobj * loss.obj_gain))
    lbox = (3 - a_centre - a_left - b_centre) / 3  # duplicates still all count in the box loss
    torch.testing.assert_close(items[0], torch.tensor(lbox * loss.box_gain))


# --------------------------------------------------------------------------------------------------------------
# Gains, totals, edge cases
# --------------------------------------------------------------------------------------------------------------

ANCHORS_64 = torch.tensor(  # pixel anchors for a 64 px image, divided by the strides below -> grid units
    [[[4, 5], [6, 10], [12, 8]], [[10, 20], [20, 15], [18, 36]], [[36, 28], [48, 60], [60, 50]]], dtype=torch.float32
) / torch.tensor([8.0, 16.0, 32.0]).view(3, 1, 1)
STRIDES = [8.0, 16.0, 32.0]


def test_gain_rescaling():
    loss = YOLOv5Loss(20, ANCHORS_64, STRIDES, box=0.05, obj=1.0, cls=0.5, imgsz=320)
    assert loss.box_gain == pytest.approx(0.05)
    assert loss.cls_gain == pytest.approx(0.5 * 20 / 80)
    assert loss.obj_gain == pytest.approx(0.25)
    one = _single_level_loss(nc=80, box=0.05, obj=1.0, cls=0.5, imgsz=1280)
    assert (one.box_gain, one.obj_gain, one.cls_gain) == pytest.approx((0.15, 12.0, 1.5))


def test_items_scale_with_gains_and_total_is_sum_times_batch():
    heads, targets = _random_case(seed=3, nc=3)
    heads = [h.requires_grad_() for h in heads]
    base = YOLOv5Loss(3, ANCHORS_64, STRIDES, imgsz=64)
    doubled = YOLOv5Loss(3, ANCHORS_64, STRIDES, box=0.1, obj=2.0, cls=1.0, imgsz=64)
    total, items = base(heads, targets)
    _, items2 = doubled(heads, targets)
    torch.testing.assert_close(items2, items * 2)
    assert (items > 0).all()
    torch.testing.assert_close(total, items.sum() * heads[0].shape[0])
    assert total.ndim == 0
    assert total.requires_grad
    assert not items.requires_grad


def test_empty_targets_give_objectness_only():
    heads = [h.requires_grad_() for h in _random_heads(seed=1, nc=3)]
    loss = YOLOv5Loss(3, ANCHORS_64, STRIDES, imgsz=64)
    total, items = loss(heads, torch.zeros(0, 6))
    expected_obj = sum(b * F.softplus(h[..., 4].detach()).mean() for b, h in zip(loss.balance, heads))
    torch.testing.assert_close(items, torch.stack((torch.tensor(0.0), expected_obj * loss.obj_gain, torch.tensor(0.0))))
    assert torch.isfinite(total)
    total.backward()
    for h in heads:
        assert h.grad is not None
        assert torch.isfinite(h.grad).all()
        assert h.grad[..., 4].abs().sum() > 0
        assert h.grad[..., :4].abs().sum() == 0


def test_gradient_reaches_matched_cells_only_for_box_and_class():
    heads = _heads(G, nc=3, cls_logits=(0.3, -0.2, 0.1), requires_grad=True)
    loss = _single_level_loss(nc=3)
    t = torch.tensor([[0, 1, 1.25 / G, 2.25 / G, 1.5 / G, 2.5 / G]])
    total, _ = loss(heads, t)
    total.backward()
    g = heads[0].grad[0, 0]  # (H, W, 8)
    touched = {(gi, gj) for gj in range(G) for gi in range(G) if g[gj, gi, [0, 1, 2, 3, 5, 6, 7]].abs().sum() > 0}
    assert touched == {(1, 2), (0, 2), (1, 1)}
    assert (g[..., 4] != 0).all()


def test_bf16_and_noncontiguous_heads_compute_in_float32():
    heads, targets = _random_case(seed=5, nc=3)
    loss = YOLOv5Loss(3, ANCHORS_64, STRIDES, imgsz=64)
    bf16 = [h.bfloat16() for h in heads]
    # channels_last-derived layout: (B, H, W, na, no) storage viewed as (B, na, H, W, no).
    strided = [h.float().permute(0, 2, 3, 1, 4).contiguous().permute(0, 3, 1, 2, 4) for h in bf16]
    assert not strided[0].is_contiguous()
    ref_total, ref_items = loss([h.float() for h in bf16], targets)
    total, items = loss(bf16, targets)
    assert total.dtype == items.dtype == torch.float32
    torch.testing.assert_close(total, ref_total)
    torch.testing.assert_close(items, ref_items)
    torch.testing.assert_close(loss(strided, targets)[0], ref_total)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ac_total, _ = loss(bf16, targets)
    assert ac_total.dtype == torch.float32
    torch.testing.assert_close(ac_total, ref_total)
    leaf = [h.detach().requires_grad_() for h in bf16]
    loss(leaf, targets)[0].backward()
    assert all(h.grad.dtype == torch.bfloat16 and torch.isfinite(h.grad.float()).all() for h in leaf)


def test_degenerate_targets_stay_finite():
    heads = [h.requires_grad_() for h in _random_heads(seed=2, nc=3)]
    loss = YOLOv5Loss(3, ANCHORS_64, STRIDES, imgsz=64)
    t = torch.tensor([[0, 1, 0.5, 0.5, 0.0, 0.0], [1, 2, 0.0, 1.0, 0.0, 0.3], [2, 0, 1.0, 0.0, 0.2, 0.0]])
    total, items = loss(heads, t)
    total.backward()
    assert torch.isfinite(items).all()
    assert all(torch.isfinite(h.grad).all() for h in heads)


def test_constructor_validation():
    with pytest.raises(ValueError, match="anchors must be"):
        YOLOv5Loss(3, torch.ones(3, 2), STRIDES)
    with pytest.raises(ValueError, match="strides"):
        YOLOv5Loss(3, ANCHORS_64, [8.0, 16.0])
    with pytest.raises(ValueError, match="balance"):
        YOLOv5Loss(3, ANCHORS_64[:2], STRIDES[:2])
    assert YOLOv5Loss(3, ANCHORS_64[:2], STRIDES[:2], balance=None).balance == (4.0, 1.0)
    with pytest.raises(ValueError, match="ciou_backend must be one of"):
        YOLOv5Loss(3, ANCHORS_64, STRIDES, ciou_backend="fallback")
    loss = YOLOv5Loss(3, ANCHORS_64, STRIDES)
    with pytest.raises(ValueError, match="head 0"):
        loss([torch.zeros(1, 3, 8, 8, 7)] * 3, torch.zeros(0, 6))
    with pytest.raises(ValueError, match="targets must be"):
        loss(_random_heads(0, 3), torch.zeros(0, 5))


def test_from_model_reads_anchors_and_hyp():
    model = SimpleNamespace(anchors=ANCHORS_64.clone(), stride=torch.tensor(STRIDES), num_classes=20)
    hyp = {
        "box": 0.05,
        "obj": 1.0,
        "cls": 0.5,
        "anchor_t": 3.0,
        "label_smoothing": 0.1,
        "cls_pw": 2.0,
        "obj_pw": 1.5,
        "fl_gamma": 0.0,
        "lr0": 0.01,
    }
    assert loss_args(hyp) == {k: v for k, v in hyp.items() if k != "lr0"}  # the loss's keys only
    loss = YOLOv5Loss.from_model(model, 320, **loss_args(hyp))
    torch.testing.assert_close(loss.anchors, ANCHORS_64)
    assert loss.num_classes == 20
    assert loss.anchor_t == 3.0
    assert loss.balance == (4.0, 1.0, 0.4)
    assert (loss.cp, loss.cn) == pytest.approx((0.95, 0.05))
    assert (loss.box_gain, loss.obj_gain, loss.cls_gain) == pytest.approx((0.05, 0.25, 0.125))
    assert loss.cls_pos_weight.tolist() == [2.0]
    assert loss.obj_pos_weight.tolist() == [1.5]
    assert "anchors" not in loss.state_dict()  # derived from the model: kept out of checkpoints
    partial = YOLOv5Loss.from_model(model, 640, **loss_args({"box": 0.05, "obj": 1.0, "cls": 0.5}))
    assert partial.anchor_t == 4.0  # a key the mapping lacks: the constructor's default (v7.0 scratch-low)


def test_from_real_model():
    """`from_model` reads the model's classes, anchors and strides, and rescales the gains as v7.0's train.py does
    (box x 3/nl, cls x nc/80 x 3/nl, obj x (imgsz/640)^2 x 3/nl); the heads it scores are the model's own."""
    from yolo5l.models.yolo import YOLOv5

    model = YOLOv5(num_classes=3)
    hyp = {"box": 0.05, "obj": 1.0, "cls": 0.5, "anchor_t": 4.0}
    loss = YOLOv5Loss.from_model(model, 320, **hyp)
    assert (loss.num_classes, loss.nl, loss.na) == (3, 3, 3)
    torch.testing.assert_close(loss.anchors, model.anchors)
    torch.testing.assert_close(loss.strides, model.stride.float())
    assert loss.box_gain == pytest.approx(0.05)
    assert loss.cls_gain == pytest.approx(0.5 * 3 / 80)
    assert loss.obj_gain == pytest.approx(1.0 * (320 / 640) ** 2)
    assert loss.balance == (4.0, 1.0, 0.4)
    heads = model(torch.zeros(2, 3, 64, 64))
    total, items = loss(heads, torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.4], [1, 2, 0.2, 0.7, 0.1, 0.1]]))
    assert torch.isfinite(total)
    assert items.shape == (3,)
    assert (items > 0).all()  # labels matched: box and class terms, and objectness everywhere


# --------------------------------------------------------------------------------------------------------------
# Parity oracle: a straightforward sync-full ComputeLoss after ultralytics/yolov5 v7.0 utils/loss.py::ComputeLoss
# --------------------------------------------------------------------------------------------------------------

_OFFSETS = [(0.0, 0.0), (0.5, 0.0), (0.0, 0.5), (-0.5, 0.0), (0.0, -0.5)]  # centre, left, top, right, bottom


def _oracle_ciou(b1, b2, eps=1e-7):
    x1, y1, w1, h1 = b1.unbind(1)
    x2, y2, w2, h2 = b2.unbind(1)
    inter = (torch.min(x1 + w1 / 2, x2 + w2 / 2) - torch.max(x1 - w1 / 2, x2 - w2 / 2)).clamp(0) * (
        torch.min(y1 + h1 / 2, y2 + h2 / 2) - torch.max(y1 - h1 / 2, y2 - h2 / 2)
    ).clamp(0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    cw = torch.max(x1 + w1 / 2, x2 + w2 / 2) - torch.min(x1 - w1 / 2, x2 - w2 / 2)
    ch = torch.max(y1 + h1 / 2, y2 + h2 / 2) - torch.min(y1 - h1 / 2, y2 - h2 / 2)
    rho2 = (x2 - x1) ** 2 + (y2 - y1) ** 2
    v = 4 / math.pi**2 * (torch.atan(w2 / (h2 + eps)) - torch.atan(w1 / (h1 + eps))) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + 1 + eps)
    return iou - (rho2 / (cw**2 + ch**2 + eps) + alpha * v)


def _oracle_bce(x, t, pw, gamma, alpha=0.25):
    loss = pw * t * F.softplus(-x) + (1 - t) * F.softplus(x)
    if gamma > 0:
        p = torch.sigmoid(x)
        p_t = t * p + (1 - t) * (1 - p)
        loss = loss * (t * alpha + (1 - t) * (1 - alpha)) * (1 - p_t) ** gamma
    return loss.mean()


def oracle_loss(
    heads,
    targets,
    anchors,
    nc,
    box=0.05,
    obj=1.0,
    cls=0.5,
    anchor_t=4.0,
    label_smoothing=0.0,
    balance=(4.0, 1.0, 0.4),
    imgsz=640,
    cls_pw=1.0,
    obj_pw=1.0,
    fl_gamma=0.0,
    last_write_wins=True,
):
    nl, batch = len(heads), heads[0].shape[0]
    cp, cn = 1 - 0.5 * label_smoothing, 0.5 * label_smoothing
    lbox, lobj, lcls = torch.zeros(()), torch.zeros(()), torch.zeros(())
    for i, p in enumerate(heads):
        p = p.float()
        _, na, H, W, _ = p.shape
        size = torch.tensor([W, H], dtype=torch.float32)
        gxy, gwh = targets[:, 2:4] * size, targets[:, 4:6] * size  # float32, as the loss sees them
        gxi = size - gxy
        rows = []  # selected (b, a, gi, gj, n) in ultralytics' order: offset, then anchor, then target
        for o, (ox, oy) in enumerate(_OFFSETS):
            for a in range(na):
                for n in range(targets.shape[0]):
                    r = gwh[n] / anchors[i, a]
                    if not torch.max(r, 1 / r).max() < anchor_t:  # the shape match
                        continue
                    (x, y), (xi, yi) = gxy[n].tolist(), gxi[n].tolist()
                    use = [
                        True,
                        x % 1 < 0.5 and x > 1,
                        y % 1 < 0.5 and y > 1,
                        xi % 1 < 0.5 and xi > 1,
                        yi % 1 < 0.5 and yi > 1,
                    ][o]
                    if use:
                        gi, gj = min(max(int(x - ox), 0), W - 1), min(max(int(y - oy), 0), H - 1)
                        rows.append((int(targets[n, 0]), a, gi, gj, n))
        tobj = torch.zeros(batch, na, H, W)
        if rows:
            b, a, gi, gj, n = (torch.tensor(c) for c in zip(*rows))
            ps = p[b, a, gj, gi]
            pbox = torch.cat((ps[:, :2].sigmoid() * 2 - 0.5, (ps[:, 2:4].sigmoid() * 2) ** 2 * anchors[i][a]), 1)
            tbox = torch.cat((gxy[n] - torch.stack((gi, gj), 1), gwh[n]), 1)
            iou = _oracle_ciou(pbox, tbox)
            lbox = lbox + (1 - iou).mean()
            order = range(len(rows)) if last_write_wins else reversed(range(len(rows)))
            for k in order:
                tobj[b[k], a[k], gj[k], gi[k]] = iou[k].detach().clamp(0)
            if nc > 1:
                t = torch.full((len(rows), nc), cn)
                t[torch.arange(len(rows)), targets[n, 1].long()] = cp
                lcls = lcls + _oracle_bce(ps[:, 5:], t, cls_pw, fl_gamma)
        lobj = lobj + _oracle_bce(p[..., 4], tobj, obj_pw, fl_gamma) * balance[i]
    lbox = lbox * box * 3 / nl
    lobj = lobj * obj * (imgsz / 640) ** 2 * 3 / nl
    lcls = lcls * cls * nc / 80 * 3 / nl
    return (lbox + lobj + lcls) * batch, torch.stack((lbox, lobj, lcls)).detach()


def _random_heads(seed, nc, batch=4, grids=(8, 4, 2)):
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randn(batch, 3, s, s, 5 + nc, generator=g) * 1.5 for s in grids]
    for h in heads:
        h[..., 4] -= 3.0  # objectness mostly negative, as after YOLOv5's bias init
    return heads


def _random_targets(seed, nc, batch=4, n=16):
    g = torch.Generator().manual_seed(seed + 1000)
    t = torch.zeros(n, 6)
    t[:, 0] = torch.randint(0, batch, (n,), generator=g)
    t[:, 1] = torch.randint(0, nc, (n,), generator=g)
    t[:, 2:4] = torch.rand(n, 2, generator=g)
    t[:, 4:6] = torch.rand(n, 2, generator=g) * 0.6 + 0.03
    # Borders (exactly 0 and 1, and just inside), exact half cells on the finest grid.
    t[:6, 2] = torch.tensor([0.0, 1.0, 0.001, 0.999, 0.5 / 8, 7.5 / 8])
    t[3:9, 3] = torch.tensor([1.0, 0.0, 0.999, 0.001, 3.5 / 8, 0.25])
    # Exact duplicates and jittered near-duplicates (same image, same cell, other size -> other CIoU).
    dup = t[6:10].clone()
    jit = t[10:14].clone()
    jit[:, 2:4] = (jit[:, 2:4] + 0.01).clamp(max=1.0)
    jit[:, 4:6] *= 1.3
    return torch.cat((t, dup, jit))[torch.randperm(n + 8, generator=g)]


def _random_case(seed, nc):
    return _random_heads(seed, nc), _random_targets(seed, nc)


PARITY_CASES = [
    pytest.param(0, 1, {}, id="nc1"),
    pytest.param(1, 3, {}, id="nc3"),
    pytest.param(2, 3, {"label_smoothing": 0.1, "cls_pw": 1.5, "obj_pw": 0.7}, id="nc3-smooth-pw"),
    pytest.param(3, 5, {"anchor_t": 2.9, "imgsz": 320, "box": 0.1}, id="nc5-anchor_t"),
    pytest.param(4, 3, {"fl_gamma": 1.5}, id="nc3-focal"),
    pytest.param(5, 1, {}, id="nc1-seed5"),
]


@pytest.mark.parametrize(("seed", "nc", "hyp"), PARITY_CASES)
def test_parity_with_sync_full_oracle(seed, nc, hyp):
    heads, targets = _random_case(seed, nc)
    kw = {"imgsz": 64, **hyp}
    loss = YOLOv5Loss(nc, ANCHORS_64, STRIDES, **kw)
    h1 = [h.clone().requires_grad_() for h in heads]
    h2 = [h.clone().requires_grad_() for h in heads]
    total, items = loss(h1, targets)
    ref_total, ref_items = oracle_loss(h2, targets, ANCHORS_64, nc, **kw)
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(items, ref_items, rtol=1e-5, atol=1e-6)
    for g1, g2 in zip(torch.autograd.grad(total, h1), torch.autograd.grad(ref_total, h2)):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


def test_parity_cases_exercise_duplicates_and_write_order():
    # The random targets must really create shared cells with different CIoUs: the first-write-wins variant of the
    # oracle must differ from the loss, while last-write-wins matches it (checked above).
    heads, targets = _random_case(1, 3)
    loss = YOLOv5Loss(3, ANCHORS_64, STRIDES, imgsz=64)
    _, items = loss(heads, targets)
    _, first_wins = oracle_loss(heads, targets, ANCHORS_64, 3, imgsz=64, last_write_wins=False)
    assert (items[1] - first_wins[1]).abs() > 1e-5
    torch.testing.assert_close(items[[0, 2]], first_wins[[0, 2]], rtol=1e-5, atol=1e-6)


def test_parity_empty_targets():
    heads = _random_heads(7, 3)
    kw = {"imgsz": 64}
    total, items = YOLOv5Loss(3, ANCHORS_64, STRIDES, **kw)(heads, torch.zeros(0, 6))
    ref_total, ref_items = oracle_loss(heads, torch.zeros(0, 6), ANCHORS_64, 3, **kw)
    torch.testing.assert_close(total, ref_total)
    torch.testing.assert_close(items, ref_items)


# --------------------------------------------------------------------------------------------------------------
# No host syncs
# --------------------------------------------------------------------------------------------------------------

_SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), float(t), bool(t)
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class _OpRecorder(TorchDispatchMode):
    """Records every aten op with its output shapes, and flags host-syncing ops and boolean-mask indexing."""

    def __init__(self):
        super().__init__()
        self.trace, self.bad = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _SYNC_OPS or (
            func in _INDEX_OPS
            and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in pytree.tree_leaves(args[1]))
        ):
            self.bad.append(str(func))
        shapes = tuple(tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        self.trace.append((str(func), shapes))
        return out


def _record(loss, heads, targets):
    heads = [h.clone().requires_grad_() for h in heads]
    with _OpRecorder() as rec:
        total, _ = loss(heads, targets)
        total.backward()
    return rec


def test_no_sync_ops_and_shapes_depend_only_on_n():
    loss = YOLOv5Loss(3, ANCHORS_64, STRIDES, imgsz=64)
    heads, targets = _random_case(0, 3)
    rec = _record(loss, heads, targets)
    assert rec.bad == []
    assert any("scatter_reduce" in op for op, _ in rec.trace)  # the recorder does see the loss' ops
    # Same N, completely different data: nothing matches (tiny boxes), or everything sits on one border cell.
    none_match = targets.clone()
    none_match[:, 4:6] = 1e-4
    all_border = targets.clone()
    all_border[:, 0] = 0
    all_border[:, 2:4] = 1.0
    for other in (none_match, all_border):
        assert _record(loss, heads, other).trace == rec.trace


@pytest.mark.gpu
def test_no_sync_on_cuda():
    loss = YOLOv5Loss(3, ANCHORS_64, STRIDES, imgsz=64).cuda()
    heads, targets = _random_case(0, 3)
    heads = [h.cuda().requires_grad_() for h in heads]
    targets = targets.cuda()
    loss(heads, targets)  # warm-up (lazy init, kernel compilation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total, _items = loss(heads, targets)
        total.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_total, _ = oracle_loss([h.detach().cpu() for h in heads], targets.cpu(), ANCHORS_64, 3, imgsz=64)
    torch.testing.assert_close(total.cpu(), ref_total, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiles_as_one_graph_with_dynamic_target_count():
    # fullgraph=True fails on any graph break, and every data-dependent op (.item(), masks, nonzero) is one.
    # The pure-torch CIoU keeps this about the loss itself (about 70 s on one CPU core).
    loss = YOLOv5Loss(3, ANCHORS_64, STRIDES, imgsz=64, ciou_backend="reference")
    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    heads, targets = _random_case(0, 3)
    for t in (targets, targets[:9]):
        h1 = [h.clone().requires_grad_() for h in heads]
        h2 = [h.clone().requires_grad_() for h in heads]
        total, items = compiled(h1, t)
        ref_total, ref_items = loss(h2, t)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(items, ref_items, rtol=1e-5, atol=1e-6)
        for g1, g2 in zip(torch.autograd.grad(total, h1), torch.autograd.grad(ref_total, h2)):
            torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
