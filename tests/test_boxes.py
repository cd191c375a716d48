from __future__ import annotations

import pytest
import torch
from torchvision.ops import batched_nms

from yolo5l.infer.boxes import clip_boxes, non_max_suppression, scale_boxes, xywh_to_xyxy


def test_xywh_to_xyxy_hand_values():
    x = torch.tensor([[10.0, 20.0, 4.0, 6.0], [0.0, 0.0, 2.0, 2.0]])
    expected = torch.tensor([[8.0, 17.0, 12.0, 23.0], [-1.0, -1.0, 1.0, 1.0]])
    torch.testing.assert_close(xywh_to_xyxy(x), expected)


def test_clip_boxes_in_place():
    b = torch.tensor([[-5.0, -1.0, 50.0, 30.0], [3.0, 4.0, 5.0, 6.0]])
    out = clip_boxes(b, (20, 40))  # h=20, w=40
    assert out is b
    torch.testing.assert_close(b, torch.tensor([[0.0, 0.0, 40.0, 20.0], [3.0, 4.0, 5.0, 6.0]]))


def test_scale_boxes_with_ratio_pad():
    # worked example: ratio 2, pad (w=4, h=10): a box at letterbox (14, 30, 54, 70) -> ((14-4)/2, (30-10)/2, ...)
    b = torch.tensor([[14.0, 30.0, 54.0, 70.0, 0.9, 1.0]])
    scale_boxes((120, 200), b, (50, 96), ((2.0, 2.0), (4.0, 10.0)))
    torch.testing.assert_close(b, torch.tensor([[5.0, 10.0, 25.0, 30.0, 0.9, 1.0]]))


def test_scale_boxes_recomputes_letterbox_and_clips():
    # 100 x 200 (h, w) -> 64 x 64: gain 0.32, resized 32 x 64, pad_h = 16, pad_w = 0
    b = torch.tensor([[0.0, 16.0, 32.0, 48.0], [-10.0, 0.0, 70.0, 64.0]])
    scale_boxes((64, 64), b, (100, 200))
    torch.testing.assert_close(b, torch.tensor([[0.0, 0.0, 100.0, 100.0], [0.0, 0.0, 200.0, 100.0]]))


def _iou(a, b):
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


def _naive_nms(pred, conf_thres, iou_thres, multi_label, max_det, agnostic=False):
    """A deliberately plain loop version of YOLOv5's NMS semantics, as the oracle."""
    out = []
    for x in pred.tolist():
        cands = []
        for row in x:
            cx, cy, w, h, obj, *cls = row
            if obj <= conf_thres:
                continue
            box = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
            sc = [c * obj for c in cls]
            if multi_label:
                cands += [(box, s, j) for j, s in enumerate(sc) if s > conf_thres]
            else:
                j = max(range(len(sc)), key=lambda k: sc[k])
                if sc[j] > conf_thres:
                    cands.append((box, sc[j], j))
        cands.sort(key=lambda c: -c[1])
        kept = []
        for c in cands:
            if all((k[2] != c[2] and not agnostic) or _iou(k[0], c[0]) <= iou_thres for k in kept):
                kept.append(c)
        kept = kept[:max_det]
        out.append(torch.tensor([[*b, s, j] for b, s, j in kept]).reshape(-1, 6))
    return out


def _random_pred(b=3, n=60, c=4, size=64.0):
    xy = torch.rand(b, n, 2) * size
    wh = torch.rand(b, n, 2) * size / 3 + 1
    obj = torch.rand(b, n, 1)
    cls = torch.rand(b, n, c)
    return torch.cat((xy, wh, obj, cls), -1)


@pytest.mark.parametrize("multi_label", [True, False])
@pytest.mark.parametrize("agnostic", [False, True])
def test_nms_matches_naive_loop(multi_label, agnostic):
    pred = _random_pred()
    got = non_max_suppression(
        pred, conf_thres=0.1, iou_thres=0.45, multi_label=multi_label, agnostic=agnostic, max_det=25
    )
    want = _naive_nms(pred, 0.1, 0.45, multi_label, 25, agnostic)
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def test_nms_matches_torchvision_batched_nms_per_image():
    pred = _random_pred(b=2, n=3000, c=5, size=640.0)
    got = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, multi_label=True, max_det=300)
    for x, g in zip(pred, got):
        scores = x[:, 5:] * x[:, 4:5]
        i, j = (scores > 0.001).nonzero(as_tuple=True)
        i, j = i[x[i, 4] > 0.001], j[x[i, 4] > 0.001]
        boxes, conf = xywh_to_xyxy(x[i, :4]), scores[i, j]
        top = conf.argsort(descending=True)[:30000]
        keep = batched_nms(boxes[top], conf[top], j[top], 0.6)[:300]
        torch.testing.assert_close(g[:, 4], conf[top][keep])
        torch.testing.assert_close(g[:, :4], boxes[top][keep])
        torch.testing.assert_close(g[:, 5], j[top][keep].float())


def test_nms_looks_past_the_best_candidates_until_max_det_survive():
    # 20 tight clusters of 10 boxes, scores falling cluster by cluster: the best 2 x max_det = 16 candidates hold
    # two clusters (2 survivors), the next round of 64 seven; only all 200 give max_det = 8 survivors.
    torch.manual_seed(0)
    centres = torch.rand(20, 2) * 600
    xy = centres.repeat_interleave(10, 0) + torch.randn(200, 2)
    obj = (1 - 0.04 * torch.arange(20).repeat_interleave(10) - 0.001 * torch.rand(200))[:, None]
    pred = torch.cat((xy, torch.full((200, 2), 30.0), obj, torch.ones(200, 1)), 1)[None]
    (got,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.5, max_det=8)
    boxes, scores = xywh_to_xyxy(pred[0, :, :4]), pred[0, :, 4]
    keep = batched_nms(boxes, scores, torch.zeros(200, dtype=torch.int64), 0.5)[:8]
    assert got.shape == (8, 6)
    torch.testing.assert_close(got[:, :4], boxes[keep])
    torch.testing.assert_close(got[:, 4], scores[keep])


def test_nms_hand_case_and_limits():
    # two heavily overlapping boxes of class 0 and one of class 1 at the same place; one low-objectness box
    pred = torch.tensor(
        [
            [
                [50.0, 50.0, 20.0, 20.0, 0.9, 1.0, 0.0],
                [51.0, 50.0, 20.0, 20.0, 0.8, 1.0, 0.0],
                [50.0, 50.0, 20.0, 20.0, 0.7, 0.0, 1.0],
                [10.0, 10.0, 4.0, 4.0, 0.0005, 1.0, 0.0],
            ]
        ]
    )
    (out,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6)
    want = torch.tensor([[40.0, 40.0, 60.0, 60.0, 0.9, 0.0], [40.0, 40.0, 60.0, 60.0, 0.7, 1.0]])
    torch.testing.assert_close(out, want)
    (out,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, agnostic=True)
    assert out.shape == (1, 6)
    (out,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, classes=[1])
    assert out[:, 5].tolist() == [1.0]
    (out,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, max_det=1)
    assert out.shape == (1, 6)
    # max_nms: only the single best candidate enters NMS
    (out,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, max_nms=1)
    assert out[:, 4].tolist() == pytest.approx([0.9])


def test_nms_empty_and_bad_input():
    pred = torch.zeros(2, 10, 7)
    out = non_max_suppression(pred, conf_thres=0.5)
    assert [o.shape for o in out] == [(0, 6), (0, 6)]
    with pytest.raises(ValueError, match="expects"):
        non_max_suppression(torch.zeros(10, 7))
