"""Judging per class: the per-class results of `DetectionMAP` / `COCOMap` (`per_class()`), YOLOv5's confusion matrix,
the table and per_class.csv, the plots, and `ValidationPlots` after training's last validation and in `yolo5l.val`."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_metrics import _problem

from yolo5l.callbacks.val_plots import ValidationPlots
from yolo5l.eval.coco_map import COCOMap
from yolo5l.eval.metrics import DetectionMAP, confusion_update
from yolo5l.eval.plots import (
    draw_val_batch,
    format_per_class_table,
    per_class_rows,
    render,
    results_figure,
    to_letterbox,
    validation_figures,
    write_per_class_csv,
)
from yolo5l.infer.boxes import scale_boxes

NAMES = ["cat", "dog", "bird"]
PLOTS = {"confusion_matrix.png", "PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png"}


def _boxes(rows: list[list[float]], width: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, width)


def _hand_problem() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Four images, classes cat 0, dog 1, bird 2; every box is exact except C's dog detection (IoU 70/77 = 0.909).

    A: labels cat, cat, dog; detections cat 0.9 on the first cat, dog 0.8 on the second cat (wrong class), dog 0.7
       on the dog.
    B: label bird; detections bird 0.95 on it, cat 0.6 on background (a false positive on background).
    C: label dog; one dog detection at 0.1 (below the confusion matrix's 0.25: the label counts as missed there).
    D: no labels; detection bird 0.5 on background.
    """
    dets = [
        _boxes([[10, 10, 50, 50, 0.9, 0], [100, 100, 150, 150, 0.8, 1], [200, 200, 260, 260, 0.7, 1]], 6),
        _boxes([[30, 30, 90, 90, 0.95, 2], [300, 300, 340, 340, 0.6, 0]], 6),
        _boxes([[50, 50, 120, 120, 0.1, 1]], 6),
        _boxes([[400, 400, 450, 450, 0.5, 2]], 6),
    ]
    labels = [
        _boxes([[10, 10, 50, 50, 0], [100, 100, 150, 150, 0], [200, 200, 260, 260, 1]], 5),
        _boxes([[30, 30, 90, 90, 2]], 5),
        _boxes([[50, 50, 120, 127, 1]], 5),
        _boxes([], 5),
    ]
    return dets, labels


# [predicted, true], background last: A's cat->cat, cat labelled but detected as dog, dog->dog; B's bird->bird and
# its cat on background; C's dog missed (its detection is below 0.25); D's bird on background.
HAND_CONFUSION = np.array([
    [1, 0, 0, 1],
    [1, 1, 0, 0],
    [0, 0, 1, 1],
    [0, 1, 0, 0],
])  # fmt: skip


def _computed(metric_cls: type, **kw) -> tuple[dict[str, torch.Tensor], object]:
    dets, labels = _hand_problem()
    metric = metric_cls(num_classes=3, **kw)
    metric.update(dets[:2], labels[:2])  # two updates: the states accumulate
    metric.update(dets[2:], labels[2:])
    return metric.compute(), metric


def test_hand_problem_yolov5_protocol():
    out, metric = _computed(DetectionMAP)
    pc = metric.per_class()
    assert pc.classes.tolist() == [0, 1, 2]
    assert pc.instances.tolist() == [2, 2, 1]
    assert pc.images.tolist() == [1, 2, 1]  # A holds both cats: one image
    assert pc.seen == 4  # D, without labels, counts as a validated image
    np.testing.assert_array_equal(pc.confusion, HAND_CONFUSION)
    # YOLOv5's AP: the precision envelope with sentinels (recall 1, precision 0) integrated at 101 recall points.
    # cat: by score TP (0.9), FP (0.6): precision 1 up to recall 0.5, then the envelope falls linearly from 0.5 to 0
    # at recall 1: 0.5 + 0.125, less the trapezoid's half step at the jump (0.01 x 0.5 / 2).
    # dog at IoU 0.5: FP, TP, TP: envelope 2/3 everywhere, less the half step at recall 1 (0.01 x 2/3 / 2).
    # dog at 0.95 (C's detection misses): FP, TP, FP: 1/2 up to recall 0.5 (less 0.01 x (1/2 - 1/3) / 2 at the
    # jump to 1/3), then 1/3 falling linearly to 0; its mAP@0.5:0.95 is (9 x AP@0.5 + AP@0.95) / 10.
    # bird: TP, FP: perfect, 0.995 (the last half step).
    dog50, dog95 = 2 / 3 - 0.01 / 3, 0.25 + 1 / 12 - 0.01 / 12
    np.testing.assert_allclose(pc.map_50, [0.6225, dog50, 0.995], atol=1e-9)
    np.testing.assert_allclose(pc.map, [0.6225, (9 * dog50 + dog95) / 10, 0.995], atol=1e-9)
    # the overall figures are the per-class means
    assert float(out["map_50"]) == pytest.approx(pc.map_50.mean(), abs=1e-6)
    assert float(out["map"]) == pytest.approx(pc.map.mean(), abs=1e-6)
    assert float(out["precision"]) == pytest.approx(pc.precision.mean(), abs=1e-6)
    assert float(out["recall"]) == pytest.approx(pc.recall.mean(), abs=1e-6)
    # P and R at the best mean-F1 confidence (below 0.1, where dog's last detection counts): cat 1 of 2 detections
    # right and 1 of 2 labels found, dog 2 of 3 and 2 of 2, bird 1 of 2 and 1 of 1.
    np.testing.assert_allclose(pc.precision, [0.5, 2 / 3, 0.5], atol=1e-6)
    np.testing.assert_allclose(pc.recall, [0.5, 1.0, 1.0], atol=1e-6)
    assert pc.p_curve.shape == pc.r_curve.shape == pc.f1_curve.shape == (3, pc.conf_grid.shape[0])
    assert pc.pr_curve.shape == (3, pc.pr_recall.shape[0])


def test_hand_problem_coco_protocol():
    out, metric = _computed(COCOMap)
    pc = metric.per_class()
    assert pc.classes.tolist() == [0, 1, 2]
    assert pc.instances.tolist() == [2, 2, 1]
    assert pc.images.tolist() == [1, 2, 1]
    assert pc.seen == 4
    np.testing.assert_array_equal(pc.confusion, HAND_CONFUSION)
    # COCO samples the envelope at 101 recall thresholds: cat has precision 1 at the 51 thresholds up to 0.5 and 0
    # after; dog 2/3 at every threshold at IoU 0.5; bird 1.
    np.testing.assert_allclose(pc.map_50, [51 / 101, 2 / 3, 1.0], atol=1e-6)
    assert float(out["map_50"]) == pytest.approx(pc.map_50.mean(), abs=1e-6)
    assert float(out["map"]) == pytest.approx(pc.map.mean(), abs=1e-6)
    assert float(out["precision"]) == pytest.approx(pc.precision.mean(), abs=1e-6)
    assert float(out["recall"]) == pytest.approx(pc.recall.mean(), abs=1e-6)


@pytest.mark.parametrize("metric_cls", [DetectionMAP, COCOMap])
@pytest.mark.parametrize("seed", [0, 3])
def test_mean_of_per_class_equals_overall(metric_cls, seed):
    problem = _problem(seed)
    metric = metric_cls()
    metric.update([d for d, _ in problem], [g for _, g in problem])
    out = metric.compute()
    pc = metric.per_class()
    assert pc.confusion is None  # no class count given
    assert pc.instances.sum() == sum(g.shape[0] for _, g in problem)
    assert pc.seen == len(problem)
    for key in ("map", "map_50", "precision", "recall"):
        assert float(out[key]) == pytest.approx(getattr(pc, key).mean(), abs=1e-6), key
    assert pc.overall()["map"] == pytest.approx(float(out["map"]), abs=1e-6)


@pytest.mark.parametrize("metric_cls", [DetectionMAP, COCOMap])
def test_states_merge_as_ranks_do(metric_cls):
    """Two halves merged (torchmetrics reduces DDP ranks' states the same way) equal the whole: counts and confusion
    matrix are states, not host-side tallies."""
    problem = _problem(1, images=30)
    halves = [metric_cls(num_classes=3), metric_cls(num_classes=3)]
    whole = metric_cls(num_classes=3)
    for metric, part in ((halves[0], problem[:13]), (halves[1], problem[13:]), (whole, problem)):
        metric.update([d for d, _ in part], [g for _, g in part])
    assert halves[0]._reductions["confusion"] is not None
    # Each state combined by its declared reduction, as merge_state does (which MeanAveragePrecision refuses: it
    # keeps full_state_update unset) and as a DDP gather ends up.
    halves[0]._reduce_states({name: getattr(halves[1], name) for name in halves[1]._defaults})
    a, b = halves[0].compute(), whole.compute()
    assert all(float(a[k]) == pytest.approx(float(b[k]), abs=1e-6) for k in a)
    pa, pb = halves[0].per_class(), whole.per_class()
    np.testing.assert_array_equal(pa.confusion, pb.confusion)
    np.testing.assert_array_equal(pa.images, pb.images)
    assert pa.seen == pb.seen == 30


def test_per_class_outlives_reset_and_follows_updates():
    _, metric = _computed(DetectionMAP)
    metric.reset()  # what the module does at the end of its validation epoch, before callbacks read the results
    assert metric.per_class().seen == 4
    dets, labels = _hand_problem()
    metric.update(dets[:1], labels[:1])  # new states: per_class() computes them
    assert metric.per_class().seen == 1


def test_confusion_matching_rules():
    m = torch.zeros(3, 3, dtype=torch.long)  # 2 classes + background
    gt = _boxes([[0, 0, 10, 10, 0], [20, 0, 30, 10, 1]], 5)
    # Two class-0 detections on label 0 (IoU 1 and 0.8): the better one matches, the other is a false positive on
    # background; a detection at exactly conf 0.25 is ignored and one at exactly IoU 0.45 does not match (both
    # thresholds strict, as YOLOv5's): label 1 is missed and that detection is on background.
    det = _boxes(
        [[0, 0, 10, 10, 0.9, 0], [0, 0, 10, 8, 0.8, 0], [20, 0, 30, 10, 0.25, 1], [20, 0, 24.5, 10, 0.7, 1]], 6
    )
    confusion_update(m, det, gt)
    assert m.tolist() == [
        [1, 0, 1],  # det cat: matched to cat; the second cat detection on background
        [0, 0, 1],  # det dog (IoU 0.45): background
        [0, 1, 0],  # the dog label: missed
    ]
    # A detection overlapping two labels (IoU 0.54 and 0.67) takes the one it overlaps most, whatever the classes.
    m.zero_()
    gt = _boxes([[0, 0, 10, 10, 0], [5, 0, 15, 10, 1]], 5)
    confusion_update(m, _boxes([[3, 0, 13, 10, 0.9, 0]], 6), gt)
    assert m.tolist() == [[0, 1, 0], [0, 0, 0], [1, 0, 0]]  # predicted cat on the dog; the cat label missed


def test_table_and_csv(tmp_path):
    _, metric = _computed(DetectionMAP)
    pc = metric.per_class()
    rows = per_class_rows(pc, NAMES)
    assert [r[0] for r in rows] == ["all", "cat", "dog", "bird"]
    assert rows[0][1:3] == (4, 5)  # all images, all labels
    lines = format_per_class_table(pc, NAMES).splitlines()
    assert lines[0].split() == ["Class", "Images", "Instances", "P", "R", "mAP@0.5", "mAP@0.5:0.95"]
    assert lines[2].split()[:3] == ["cat", "1", "2"]
    path = write_per_class_csv(pc, NAMES, tmp_path / "per_class.csv")
    with open(path, newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["Class"] for r in table] == ["all", "cat", "dog", "bird"]
    assert [r["class_id"] for r in table] == ["", "0", "1", "2"]
    per_class_map = [float(r["mAP@0.5:0.95"]) for r in table[1:]]
    assert float(table[0]["mAP@0.5:0.95"]) == pytest.approx(np.mean(per_class_map), abs=1e-5)
    assert table[3]["Images"] == "1"
    assert float(table[3]["mAP@0.5"]) == pytest.approx(0.995)


def test_figures_render():
    _, metric = _computed(DetectionMAP)
    figures = validation_figures(metric.per_class(), NAMES)
    assert set(figures) == {p.removesuffix(".png") for p in PLOTS}
    for fig in figures.values():
        rgb = render(fig)
        assert rgb.dtype == np.uint8
        assert rgb.ndim == 3
        assert rgb.shape[2] == 3
        assert rgb.min() < 128  # something is drawn
    rows = [{"epoch": str(e), "train/loss_box": str(0.1 / (e + 1)), "val/map": str(0.1 * e)} for e in range(6)]
    assert render(results_figure(rows)).shape[2] == 3
    assert results_figure([{"epoch": "0"}]) is None  # nothing to draw


def test_val_batch_drawing():
    images = torch.zeros(2, 3, 64, 96, dtype=torch.uint8)
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.5, 0.5]])
    shape = ((32, 48), ((2.0, 2.0), (0.0, 0.0)))  # original 32 x 48, scaled by 2 into the batch
    det = torch.tensor([[12.0, 8.0, 36.0, 24.0, 0.9, 1.0], [0.0, 0.0, 5.0, 5.0, 0.2, 0.0]])
    lb = to_letterbox(det, (64, 96), shape)
    assert lb[0, :4].tolist() == [24.0, 16.0, 72.0, 48.0]
    assert torch.allclose(scale_boxes((64, 96), lb.clone(), shape[0], shape[1]), det)  # the inverse
    labels, preds = draw_val_batch(images, targets, [lb, torch.zeros(0, 6)], ["a", "b"])
    assert labels.shape == preds.shape
    # the label and the 0.9 detection are the same box: the same pixels drawn; the 0.2 one is not drawn
    assert (labels > 0).any()
    np.testing.assert_array_equal(labels, preds)


# ---- the callback in a training run ---------------------------------------------------------------------------------
def _fit(tmp_path, tiny_module, tiny_data, make_trainer, plots: bool):
    from lightning.pytorch.loggers import TensorBoardLogger

    from yolo5l.tracking.loggers import EpochCSVLogger

    callback = ValidationPlots(plots=plots)
    loggers = [TensorBoardLogger(tmp_path, name="", version=""), EpochCSVLogger(tmp_path)]
    trainer = make_trainer(tmp_path, callbacks=[callback], logger=loggers, max_epochs=2, limit_train_batches=1)
    trainer.fit(tiny_module(), datamodule=tiny_data(n=8, batch_size=4))
    return callback


def test_training_writes_table_plots_and_tensorboard_images(tmp_path, tiny_module, tiny_data, make_trainer, capsys):
    callback = _fit(tmp_path, tiny_module, tiny_data, make_trainer, plots=True)
    stdout = capsys.readouterr().out
    assert stdout.count("mAP@0.5:0.95") == 1  # printed once, after the last validation
    assert "all" in stdout
    files = {p.name for p in tmp_path.iterdir()}
    batches = {f"val_batch{i}_{k}.jpg" for i in (0, 1) for k in ("labels", "pred")}
    assert {"per_class.csv", "results.png", *PLOTS, *batches} <= files
    assert set(callback.files) == {"per_class.csv", "results.png", *PLOTS, *batches}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0}).Reload()
    tags = set(events.Tags()["images"])
    assert {"val/confusion_matrix", "val/PR_curve", "val/results", "val/batch0_pred", "val/batch1_labels"} <= tags


def test_plots_false_writes_the_table_only(tmp_path, tiny_module, tiny_data, make_trainer, capsys):
    callback = _fit(tmp_path, tiny_module, tiny_data, make_trainer, plots=False)
    assert "mAP@0.5:0.95" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir() if p.suffix in (".png", ".jpg", ".csv")} == {
        "per_class.csv",
        "metrics.csv",
    }
    assert set(callback.files) == {"per_class.csv"}


# ---- yolo5l.val ------------------------------------------------------------------------------------------------------
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


@pytest.fixture(scope="module")
def untrained_weights(tmp_path_factory):
    """A yolov5n-width weights file for the 4 synthetic classes: validation needs weights, not a good model."""
    from yolo5l.data.synthetic import NAMES as SYNTHETIC
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    tmp = tmp_path_factory.mktemp("val_plots")
    torch.manual_seed(0)
    model = YOLOv5(num_classes=len(SYNTHETIC), depth=0.33, width=0.25)
    return {"tmp": tmp, "weights": save_weights(model, tmp / "weights.pt", list(SYNTHETIC), imgsz=128)}


@pytest.mark.parametrize("plots", ["true", "false"])
def test_val_entry_point_writes_per_class_and_plots(untrained_weights, plots):
    tmp = untrained_weights["tmp"]
    out = tmp / f"val_{plots}"
    r = subprocess.run(
        [
            sys.executable, "-m", "yolo5l.val", f"weights={untrained_weights['weights']}",
            f"data.synthetic.root={tmp / 'synthetic'}", "data.synthetic.num_train=8", "data.synthetic.num_val=16",
            "data.imgsz=128", "data.num_workers=0", "data.cache=none", "trainer=cpu", "data.val_batch_size=8",
            "module.conf_thres=0.2", f"plots={plots}", f"hydra.run.dir={out}",
        ],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    summary = next(i for i, ln in enumerate(lines) if "mAP@0.5:0.95" in ln)  # the summary table comes first
    assert lines[summary].split()[0] == "precision"
    table = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["Class"])
    assert table > summary
    assert lines[table + 1].split()[0] == "all"
    written = {p.name for p in out.iterdir() if p.suffix in (".png", ".jpg", ".csv", ".json")}
    if plots == "true":
        assert {"per_class.csv", "metrics.json", *PLOTS, "val_batch0_labels.jpg", "val_batch0_pred.jpg"} <= written
        assert "results.png" not in written  # a training run's
    else:
        assert written == {"per_class.csv", "metrics.json"}
    assert "per_class.csv" in r.stdout
