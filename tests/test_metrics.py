"""YOLOv5's validation protocol (`DetectionMAP`): matching, AP, precision/recall, and agreement with the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.ops import box_iou

from yolo5l.eval.coco_map import COCOMap
from yolo5l.eval.metrics import DetectionMAP, match_detections
from yolo5l.eval.per_class import ap_per_class

IOUV = torch.linspace(0.5, 0.95, 10)


def _loop_match(det: torch.Tensor, gt: torch.Tensor, iouv: torch.Tensor) -> torch.Tensor:
    """The rule written out pair by pair: per threshold, eligible (label, detection) pairs sorted by IoU, the first
    pair of every detection kept, then (in detection order) the first detection of every label."""
    correct = torch.zeros(det.shape[0], iouv.numel(), dtype=torch.bool)
    if det.shape[0] == 0 or gt.shape[0] == 0:
        return correct
    iou = box_iou(gt[:, :4], det[:, :4])
    for ti, t in enumerate(iouv.tolist()):
        pairs = [
            (float(iou[g, d]), g, d)
            for g in range(gt.shape[0])
            for d in range(det.shape[0])
            if iou[g, d] >= t and gt[g, 4] == det[d, 5]
        ]
        pairs.sort(key=lambda p: -p[0])
        per_det: dict[int, int] = {}
        for _, g, d in pairs:
            per_det.setdefault(d, g)
        per_label: dict[int, int] = {}
        for d in sorted(per_det):
            per_label.setdefault(per_det[d], d)
        for d in per_label.values():
            correct[d, ti] = True
    return correct


def _problem(seed: int, images: int = 60) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random validation sets: labels of 3 classes, detections jittered from them (some with a wrong class) plus
    random boxes, scores uniform, detections sorted by score as NMS returns them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(images):
        m = int(torch.randint(0, 8, (), generator=g))
        gcls = torch.randint(0, 3, (m,), generator=g).float()
        gxy = torch.rand(m, 2, generator=g) * 200
        gwh = torch.rand(m, 2, generator=g) * 60 + 5
        gt = torch.cat([gxy, gxy + gwh, gcls[:, None]], 1)
        n = int(torch.randint(0, 30, (), generator=g))
        src = torch.randint(0, max(m, 1), (n,), generator=g)
        if m:
            base = gt[src, :4] + torch.randn(n, 4, generator=g) * torch.rand(n, 1, generator=g) * 15
            wrong = torch.randint(0, 3, (n,), generator=g).float()
            cls = torch.where(torch.rand(n, generator=g) < 0.8, gt[src, 4], wrong)
        else:
            base = torch.rand(n, 4, generator=g) * 200
            base[:, 2:] += base[:, :2]
            cls = torch.randint(0, 3, (n,), generator=g).float()
        rnd = torch.rand(n, generator=g) < 0.3
        xy = torch.rand(n, 2, generator=g) * 200
        base[rnd] = torch.cat([xy, xy + torch.rand(n, 2, generator=g) * 50 + 2], 1)[rnd]
        x1y1 = torch.minimum(base[:, :2], base[:, 2:])
        x2y2 = torch.maximum(base[:, :2], base[:, 2:]) + 1
        det = torch.cat([x1y1, x2y2, torch.rand(n, 1, generator=g), cls[:, None]], 1)
        out.append((det[det[:, 4].argsort(descending=True)], gt))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matching_equals_the_pairwise_rule(seed):
    checked = 0
    for det, gt in _problem(seed):
        got = match_detections(det, gt, IOUV)
        assert got.shape == (det.shape[0], 10)
        assert got.dtype == torch.bool
        assert torch.equal(got, _loop_match(det, gt, IOUV))
        checked += int(got.any())
    assert checked > 10  # true positives exist: the comparison is not all-False against all-False


def test_matching_hand_case():
    gt = torch.tensor([[0.0, 0.0, 10.0, 10.0, 0.0], [20.0, 20.0, 30.0, 30.0, 1.0]])
    det = torch.tensor([
        [0.0, 0.0, 10.0, 9.0, 0.9, 0.0],   # IoU 0.9 with label 0
        [0.0, 0.0, 10.0, 10.0, 0.8, 0.0],  # IoU 1.0 with label 0, but the better-scoring detection took it
        [20.0, 20.0, 30.0, 30.0, 0.7, 0.0],  # right place, wrong class
        [20.0, 20.0, 30.0, 26.0, 0.6, 1.0],  # IoU 0.6 with label 1
    ])  # fmt: skip
    tp = match_detections(det, gt, IOUV)
    assert tp[0].tolist() == [True] * 9 + [False]  # 0.9 passes up to threshold 0.9
    assert tp[1].tolist() == [False] * 9 + [True]  # only at 0.95, where detection 0 no longer qualifies
    assert not tp[2].any()
    assert tp[3].tolist() == [True, True, True] + [False] * 7  # 0.6 >= 0.5, 0.55, 0.6


# ultralytics/yolov5 v7.0 (PyPI yolov5==7.0.14, `val.py::process_batch` + `utils/metrics.py::ap_per_class`) on
# `_problem(seed)`, run once in its own environment: (mp, mr, map50, map).
REFERENCE = {
    0: (0.20488547826557676, 0.29814638135477717, 0.15622795775277545, 0.07120007272085636),
    1: (0.19705134161195023, 0.3179496233521657, 0.16192979485637413, 0.08153848994376206),
}
PROBLEM0_DETS, PROBLEM0_LABELS, PROBLEM0_SUM = 769, 193, 468647.21875


@pytest.mark.parametrize("seed", sorted(REFERENCE))
def test_detection_map_equals_yolov5(seed):
    problem = _problem(seed)
    metric = DetectionMAP()
    half = len(problem) // 2  # two updates: the state accumulates
    metric.update([d for d, _ in problem[:half]], [g for _, g in problem[:half]])
    metric.update([d for d, _ in problem[half:]], [g for _, g in problem[half:]])
    out = metric.compute()
    mp, mr, map50, map_all = REFERENCE[seed]
    assert float(out["precision"]) == pytest.approx(mp, abs=1e-6)
    assert float(out["recall"]) == pytest.approx(mr, abs=1e-6)
    assert float(out["map_50"]) == pytest.approx(map50, abs=1e-6)
    assert float(out["map"]) == pytest.approx(map_all, abs=1e-6)
    assert float(out["fitness"]) == pytest.approx(0.1 * map50 + 0.9 * map_all, abs=1e-6)


def test_problem_generator_is_stable():
    # REFERENCE was computed on these exact boxes: a change of torch's generator would make it meaningless.
    problem = _problem(0)
    assert sum(d.shape[0] for d, _ in problem) == PROBLEM0_DETS
    assert sum(g.shape[0] for _, g in problem) == PROBLEM0_LABELS
    assert float(sum(d.sum() + g.sum() for d, g in problem)) == pytest.approx(PROBLEM0_SUM, rel=1e-5)


def test_perfect_and_empty():
    gt = torch.tensor([[0.0, 0.0, 10.0, 10.0, 0.0], [20.0, 20.0, 40.0, 40.0, 2.0]])
    det = torch.cat((gt[:, :4], torch.tensor([[0.9], [0.8]]), gt[:, 4:]), 1)
    metric = DetectionMAP()
    metric.update([det], [gt])
    out = metric.compute()
    for k in ("precision", "recall"):
        assert float(out[k]) == pytest.approx(1.0, abs=1e-6), k
    # YOLOv5's integral tops out at 0.995 (the envelope falls to its sentinel 0 between recall 0.99 and 1)
    for k in ("map", "map_50", "fitness"):
        assert float(out[k]) == pytest.approx(0.995, abs=1e-6), k
    # labels but no detections: everything 0; nothing at all: 0, no error
    metric.reset()
    metric.update([torch.zeros(0, 6)], [gt])
    assert all(float(v) == 0 for v in metric.compute().values())
    metric.reset()
    metric.update([torch.zeros(0, 6)], [torch.zeros(0, 5)])
    assert all(float(v) == 0 for v in metric.compute().values())
    with pytest.raises(ValueError, match="prediction lists"):
        metric.update([det], [])


def test_classes_without_labels_are_ignored_and_missing_ones_count_zero():
    gt = torch.tensor([[0.0, 0.0, 10.0, 10.0, 0.0], [20.0, 20.0, 40.0, 40.0, 1.0]])
    det = torch.tensor([[0.0, 0.0, 10.0, 10.0, 0.9, 0.0], [50.0, 50.0, 60.0, 60.0, 0.95, 2.0]])
    metric = DetectionMAP()
    metric.update([det], [gt])
    out = metric.compute()
    # class 0 perfect, class 1 (labelled, never detected) 0, class 2 (no labels) ignored
    assert float(out["map_50"]) == pytest.approx(0.995 / 2, abs=1e-6)
    assert float(out["map"]) == pytest.approx(0.995 / 2, abs=1e-6)


def test_ap_integrates_the_precision_envelope():
    # one class, 2 labels; detections TP, FP, TP by score: recall 0.5 @ P 1, then 1.0 @ P 2/3
    tp = np.array([[1], [0], [1]], dtype=float)
    stats = ap_per_class(tp, np.array([0.9, 0.8, 0.7]), np.zeros(3), np.zeros(2))
    # envelope: P = 1 on [0, 0.5], 2/3 on (0.5, 1]; 101-point trapezoid: ~0.5 + 0.5 * 2/3 minus one half-step
    x = np.linspace(0, 1, 101)
    want = np.trapezoid(np.interp(x, [0, 0.5, 0.5, 1.0, 1.0], [1, 1, 2 / 3, 2 / 3, 0]), x)
    assert stats["ap"][0, 0] == pytest.approx(want, abs=1e-9)
    assert 0.82 < stats["ap"][0, 0] < 0.84


def test_close_to_the_coco_protocol_on_realistic_detections():
    # The two protocols differ in matching order and AP sampling, by a few points at most on such data.
    problem = _problem(3, images=80)
    ours, coco = DetectionMAP(), COCOMap()
    for metric in (ours, coco):
        metric.update([d for d, _ in problem], [g for _, g in problem])
    a, b = ours.compute(), coco.compute()
    assert set(a) == set(b) == {"map", "map_50", "precision", "recall", "fitness"}
    assert float(a["map_50"]) == pytest.approx(float(b["map_50"]), abs=0.03)
    assert float(a["map"]) == pytest.approx(float(b["map"]), abs=0.03)
