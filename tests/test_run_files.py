"""What a training run leaves in its folder as YOLOv5 v7.0's does: results.csv in YOLOv5's columns, labels.jpg and
labels_correlogram.jpg, train_batch0-2.jpg, and the closing validation of best.pt (`yolo5l.final_val`)."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from yolo5l.callbacks import BatchPlotter, EMACallback, LabelPlots, LastCheckpoint, ValidationPlots, ValidationSummary
from yolo5l.eval.label_plots import _saturation, write_label_plots
from yolo5l.final_val import validate_best
from yolo5l.run_info import report_outputs
from yolo5l.tracking.loggers import RESULTS_COLUMNS, EpochCSVLogger, write_results_csv

# ultralytics/yolov5 v7.0 utils/loggers/__init__.py: `keys`, after "epoch"
V7_RESULTS_HEADER = [
    "epoch", "train/box_loss", "train/obj_loss", "train/cls_loss", "metrics/precision", "metrics/recall",
    "metrics/mAP_0.5", "metrics/mAP_0.5:0.95", "val/box_loss", "val/obj_loss", "val/cls_loss", "x/lr0", "x/lr1",
    "x/lr2",
]  # fmt: skip


# ---- results.csv -----------------------------------------------------------------------------------------------------
def test_results_csv_has_yolov5s_columns_format_and_carries_the_last_validation(tmp_path):
    rows = {
        0: {"train/loss_box": 0.1, "train/loss_obj": 0.2, "train/loss_cls": 0.3, "train/lr0": 0.01,
            "train/lr1": 0.001, "train/lr2": 0.001},
        1: {"train/loss_box": 0.05, "val/precision": 0.5, "val/recall": 0.25, "val/map_50": 0.4, "val/map": 0.2,
            "val/loss_box": 0.07, "val/loss_obj": 0.08, "val/loss_cls": 0.09, "train/lr0": 0.009},
        2: {"train/loss_box": 0.04, "train/lr0": 0.008},  # no validation this epoch
    }  # fmt: skip
    path = write_results_csv(rows, tmp_path / "results.csv")
    lines = path.read_text().splitlines()
    assert all(len(cell) == 20 for line in lines for cell in line.split(","))  # YOLOv5's %20s / %20.5g cells
    table = [[c.strip() for c in line.split(",")] for line in lines]
    assert table[0] == V7_RESULTS_HEADER
    assert [name for name, _ in RESULTS_COLUMNS] == V7_RESULTS_HEADER[1:]
    by_epoch = {int(r[0]): dict(zip(table[0], map(float, r), strict=True)) for r in table[1:]}
    assert by_epoch[0]["train/box_loss"] == 0.1
    assert by_epoch[0]["x/lr1"] == 0.001
    assert by_epoch[0]["metrics/mAP_0.5"] == 0.0  # before the first validation
    assert by_epoch[1]["metrics/mAP_0.5:0.95"] == 0.2
    assert by_epoch[1]["val/cls_loss"] == 0.09
    assert by_epoch[2]["metrics/precision"] == 0.5  # repeated from the last validation, as YOLOv5 does
    assert by_epoch[2]["x/lr0"] == 0.008
    assert f"{0.0012345678:>20.5g}".strip() == "0.0012346"


def test_the_csv_logger_writes_results_csv_beside_metrics_csv(tmp_path):
    logger = EpochCSVLogger(tmp_path, results_filename="results.csv")
    logger.log_metrics({"epoch": 0, "train/loss_box": 0.3, "val/map": 0.1})
    logger.save()
    with open(tmp_path / "results.csv", newline="") as f:
        rows = [{k.strip(): v.strip() for k, v in r.items()} for r in csv.DictReader(f)]
    assert rows == [{**dict.fromkeys(V7_RESULTS_HEADER, "0"), "train/box_loss": "0.3", "metrics/mAP_0.5:0.95": "0.1"}]
    assert (tmp_path / "metrics.csv").is_file()
    assert not (tmp_path / "results.csv.tmp").exists()
    EpochCSVLogger(tmp_path / "plain").log_metrics({"epoch": 0, "val/map": 0.1})
    assert not (tmp_path / "plain" / "results.csv").exists()  # only when asked


# ---- labels.jpg, labels_correlogram.jpg ------------------------------------------------------------------------------
def test_label_plots_are_written_as_jpeg(tmp_path):
    g = np.random.default_rng(0)
    labels = np.c_[g.integers(0, 3, 400), g.random((400, 2)), g.uniform(0.01, 0.5, (400, 2))]
    files = write_label_plots(labels, ["a", "b", "c"], tmp_path)
    assert set(files) == {"labels.jpg", "labels_correlogram.jpg"}
    for path in files.values():
        img = cv2.imread(str(path))
        assert img is not None
        assert img.shape[0] > 500
        assert img.std() > 5  # something is drawn


def test_the_histogram_colour_scale_saturates_at_90_percent_of_the_boxes():
    counts = np.array([[0, 1, 1], [1, 1, 96]])  # 100 boxes; the cells up to 1 hold 4%, the 96-cell the rest
    assert _saturation(counts) == 96
    assert _saturation(np.array([10, 10, 10, 10, 60])) == 60  # 40% below 10, 100% at 60
    assert _saturation(np.array([50, 50])) == 50
    assert _saturation(np.zeros((2, 2))) == 1.0


def _labels_data(tiny_data):
    class WithLabels(tiny_data):
        train_dataset = type("Labels", (), {"labels": [np.array([[0, 0.5, 0.5, 0.2, 0.3]]), np.zeros((0, 5))]})()

    return WithLabels(n=4, batch_size=2)


def test_label_plots_before_training_not_on_resume_nor_with_plots_false(tmp_path, tiny_module, tiny_data, make_trainer):
    cb = LabelPlots()
    trainer = make_trainer(tmp_path, [cb], max_epochs=1, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(tiny_module(), datamodule=_labels_data(tiny_data))
    assert {p.name for p in tmp_path.glob("labels*.jpg")} == {"labels.jpg", "labels_correlogram.jpg"}
    off = LabelPlots(plots=False, out_dir=str(tmp_path / "off"))
    make_trainer(tmp_path, [off], max_epochs=1, limit_train_batches=1, limit_val_batches=0).fit(
        tiny_module(), datamodule=_labels_data(tiny_data)
    )
    assert not (tmp_path / "off").exists()
    resumed = LabelPlots(out_dir=str(tmp_path / "resumed"))  # a resumed run keeps the files its start wrote
    trainer = SimpleNamespace(ckpt_path="last.ckpt", datamodule=_labels_data(tiny_data), default_root_dir=tmp_path)
    resumed.on_fit_start(trainer, tiny_module())
    assert not (tmp_path / "resumed").exists()


# ---- train_batch0-2.jpg ----------------------------------------------------------------------------------------------
def test_the_first_three_batches_are_written_without_any_logger(
    tmp_path, tiny_module, tiny_data, make_trainer, one_thread
):
    trainer = make_trainer(tmp_path, [BatchPlotter()], max_epochs=1, limit_val_batches=0)
    trainer.fit(tiny_module(), datamodule=tiny_data(n=6, batch_size=2))
    assert sorted(p.name for p in tmp_path.glob("train_batch*.jpg")) == [f"train_batch{i}.jpg" for i in range(3)]
    img = cv2.imread(str(tmp_path / "train_batch0.jpg"))
    assert img.shape == (64, 128, 3)  # the batch's two 64 px images side by side
    off = tmp_path / "off"
    make_trainer(off, [BatchPlotter(plots=False)], max_epochs=1, limit_train_batches=1, limit_val_batches=0).fit(
        tiny_module(), datamodule=tiny_data(n=2, batch_size=2)
    )
    assert not list(off.glob("train_batch*.jpg"))


# ---- the closing validation of best.pt -------------------------------------------------------------------------------
class _WeightsAtValidation(Callback):
    """Records the model's weights when each validation starts (after EMACallback swapped what it validates)."""

    def __init__(self):
        self.seen = []

    def on_validation_epoch_start(self, trainer, pl_module):
        self.seen.append({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()})


def _fit_with_fitness(tmp_path, tiny_module, tiny_data, make_trainer, fitness):
    """A run whose validations report the given fitness values (the metric's own figures otherwise)."""
    module = tiny_module()
    compute = module.map_metric.compute
    values = iter(fitness)

    def fake_compute():
        out = compute()
        out["fitness"] = torch.tensor(next(values))
        return out

    module.map_metric.compute = fake_compute
    ck = tmp_path / "ck"
    probe, plots = _WeightsAtValidation(), ValidationPlots(plots=True)
    callbacks = [EMACallback(), ValidationSummary(), probe, plots, LastCheckpoint(dirpath=ck)]
    trainer = make_trainer(tmp_path, callbacks, max_epochs=len(fitness) - 1, limit_train_batches=2)
    datamodule = tiny_data(n=4, batch_size=2)
    trainer.fit(module, datamodule=datamodule)
    return trainer, module, datamodule, probe, plots, ck


def test_the_closing_validation_runs_on_best_pt_when_best_is_not_last(
    tmp_path, tiny_module, tiny_data, make_trainer, one_thread, capsys
):
    # three epochs, fitness falling: best.pt is epoch 0's; the fourth value is the closing validation's
    trainer, module, datamodule, probe, plots, ck = _fit_with_fitness(
        tmp_path, tiny_module, tiny_data, make_trainer, [0.9, 0.5, 0.1, 0.7]
    )
    last_results = plots.results
    assert capsys.readouterr().out.count("mAP@0.5:0.95") == 1
    metrics = validate_best(trainer, module, datamodule)
    assert metrics is not None
    assert metrics["val/fitness"] == pytest.approx(0.7)
    best = torch.load(ck / "best.pt", map_location="cpu", weights_only=True)["state_dict"]
    validated = probe.seen[-1]
    assert len(probe.seen) == 4
    for k, v in best.items():  # the weights validated are best.pt's (EMACallback swapped nothing in)
        torch.testing.assert_close(validated[k], v.to(validated[k].dtype), msg=k)
    assert not torch.equal(probe.seen[-1]["model.0.conv.weight"], probe.seen[-2]["model.0.conv.weight"])
    assert plots.results is not last_results  # the closing table and plots are the new validation's
    assert capsys.readouterr().out.count("mAP@0.5:0.95") == 1
    assert (tmp_path / "confusion_matrix.png").is_file()
    # The closing block's best row shows what best.pt scored there, as the table above it does, not its epoch's
    # figures (best.pt's half-precision weights may score a rounding apart).
    scored = {"val/precision": 0.123, "val/recall": 0.456, "val/map_50": 0.789, "val/map": 0.321, "val/fitness": 0.7}
    report_outputs(trainer, module, tmp_path, 1.0, None, scored)
    out = capsys.readouterr().out
    assert "best (epoch 0): P 0.123  R 0.456  mAP@0.5 0.789  mAP@0.5:0.95 0.321" in out
    assert "last (epoch 2): P " in out


def test_no_closing_validation_when_the_last_validation_was_the_best(
    tmp_path, tiny_module, tiny_data, make_trainer, one_thread
):
    trainer, module, datamodule, probe, _, _ = _fit_with_fitness(
        tmp_path, tiny_module, tiny_data, make_trainer, [0.1, 0.5, 0.9]
    )
    assert validate_best(trainer, module, datamodule) is None
    assert len(probe.seen) == 2
