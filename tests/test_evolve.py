"""The search's YOLOv5 evolve files: evolve.csv in v7.0's layout (read as v7.0's scripts read it), a row per finished
trial with that trial's metrics and hyp, trials ending together all kept; evolve.png a panel per searched
hyperparameter; a real 2-trial Optuna search writes both (heavy)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf
from PIL import Image

from yolo5l.callbacks.sweep import read_summary
from yolo5l.eval.plots import PLOT_DPI
from yolo5l.tracking.evolve import append_generation, evolve_fitness, plot_evolve, read_evolve_csv

ROOT = Path(__file__).resolve().parents[1]
#: ultralytics/yolov5 v7.0 train.py's `keys` before `print_mutation`: evolve.csv's first seven columns.
V7_METRICS = (
    "metrics/precision", "metrics/recall", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95", "val/box_loss", "val/obj_loss",
    "val/cls_loss",
)  # fmt: skip
HYP = yaml.safe_load((ROOT / "conf" / "hyp" / "scratch-low.yaml").read_text())


def _metrics(i: int) -> dict[str, float]:
    keys = ("val/precision", "val/recall", "val/map_50", "val/map", "val/loss_box", "val/loss_obj", "val/loss_cls")
    return {k: (i + 1) / (j + 10) + 1e-9 * i for j, k in enumerate(keys)}


def _append(args: tuple[str, int]) -> None:
    sweep_dir, i = args
    append_generation(sweep_dir, _metrics(i), {**HYP, "lr0": 0.001 * (i + 1) + 1e-13})


def test_evolve_csv_has_v7_columns_and_full_values_read_as_v7_reads_it(tmp_path):
    pool = mp.get_context("fork").Pool(4)  # trials ending together: every row lands
    try:
        pool.map(_append, [(str(tmp_path), i) for i in range(8)])
    finally:  # close and join, not `with` (terminate): the workers end when the tasks are done
        pool.close()
        pool.join()
    path = tmp_path / "evolve.csv"
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    assert [h.strip() for h in header] == [*V7_METRICS, *HYP]
    assert all(len(h) >= 20 for h in header), header  # right-aligned in 20 characters, as v7.0's `%20s`
    # numpy as v7.0's train.py reads it to pick parents: every value a number, a row per trial.
    x = np.loadtxt(path, ndmin=2, delimiter=",", skiprows=1)
    assert x.shape == (8, 7 + len(HYP))
    by_lr0 = {round(r["lr0"] * 1000) - 1: r for r in read_evolve_csv(path)}
    assert sorted(by_lr0) == list(range(8))
    for i, row in by_lr0.items():
        expected = dict(zip(V7_METRICS, _metrics(i).values(), strict=True))
        assert {k: row[k] for k in V7_METRICS} == expected  # exactly: written in full, not to 5 digits
        assert row["lr0"] == 0.001 * (i + 1) + 1e-13
        assert {k: row[k] for k in HYP if k != "lr0"} == {k: float(v) for k, v in HYP.items() if k != "lr0"}
    # v7.0's fitness of the first four columns (utils/metrics.py::fitness) is the one this module computes
    fitness = (x[:, :4] * [0.0, 0.0, 0.1, 0.9]).sum(1)
    assert np.allclose(fitness, [evolve_fitness(r) for r in read_evolve_csv(path)], rtol=0, atol=1e-15)
    assert not list(tmp_path.glob(".*lock"))


def test_a_trial_with_more_hyp_keys_widens_the_table(tmp_path):
    append_generation(tmp_path, _metrics(0), {"lr0": 0.01, "name": "not a number"})
    append_generation(tmp_path, _metrics(1), {"lr0": 0.02, "anchors": 3})
    rows = read_evolve_csv(tmp_path / "evolve.csv")
    assert list(rows[0]) == [*V7_METRICS, "lr0", "anchors"]  # only numbers: np.loadtxt reads every cell
    assert [r["lr0"] for r in rows] == [0.01, 0.02]
    assert math.isnan(rows[0]["anchors"])
    assert rows[1]["anchors"] == 3
    assert math.isnan(append_generation(tmp_path, {}, {"lr0": 0.03})[1]["metrics/precision"])  # not measured


def test_evolve_png_has_a_panel_per_searched_hyperparameter(tmp_path):
    for i in range(5):
        append_generation(tmp_path, _metrics(i), {**HYP, "lr0": 0.01 * (i + 1)})
    searched = ["lr0", "momentum", "mosaic", "scale", "hsv_h", "degrees", "mixup"]
    png, drawn = plot_evolve(tmp_path / "evolve.csv", searched[::-1])
    assert png == tmp_path / "evolve.png"
    assert drawn == [k for k in HYP if k in searched]  # in the table's order
    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert im.format == "PNG"
        # 5 panels a row, 2 inches each: 7 panels make 2 rows of 5 columns
        assert im.size == (round((2.0 * 5 + 0.5) * PLOT_DPI), round(2.0 * 2 * PLOT_DPI))
    _, every = plot_evolve(tmp_path / "evolve.csv")
    assert every == list(HYP)
    (tmp_path / "empty.csv").write_text(",".join(V7_METRICS) + "\n")
    assert plot_evolve(tmp_path / "empty.csv") is None


#: Two trials of a few seconds: the smoke experiment, 2 training batches and 1 validation batch, 2 epochs.
TINY_SEARCH = [
    "hparams_search=evolve", "experiment=smoke", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "callbacks.batch_plotter.num_batches=1",
    "trainer.max_epochs=2", "hydra.sweeper.n_trials=2", "plots=false",
]  # fmt: skip


@pytest.mark.heavy
def test_search_writes_a_row_per_trial_and_the_figure(tmp_path, one_thread):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.train", *TINY_SEARCH, f"hydra.sweep.dir={sweep}",
         f"data.synthetic.root={tmp_path / 'syn'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    trials = {row["output_dir"]: row for row in read_summary(sweep / "summary.csv")}
    rows = read_evolve_csv(sweep / "evolve.csv")
    assert len(rows) == len(trials) == 2
    assert list(rows[0])[:7] == list(V7_METRICS)
    for row in rows:
        # the trial whose hyp this row holds: its job folder's config, exactly
        (out,) = [o for o in trials if OmegaConf.load(Path(o, ".hydra", "config.yaml")).hyp.lr0 == row["lr0"]]
        hyp = OmegaConf.to_container(OmegaConf.load(Path(out, ".hydra", "config.yaml")).hyp)
        assert {k: row[k] for k in hyp} == hyp
        # its metrics: the job's best validation (metrics.csv's row of the epoch with the best fitness)
        epochs = [e for e in read_summary(Path(out, "metrics.csv")) if e.get("val/fitness")]
        best = max(epochs, key=lambda e: float(e["val/fitness"]))
        for name, key in zip(V7_METRICS, ("precision", "recall", "map_50", "map", "loss_box", "loss_obj",
                                          "loss_cls"), strict=True):  # fmt: skip
            assert math.isclose(row[name], float(best[f"val/{key}"]), rel_tol=1e-5), (name, row[name], best)
        assert math.isclose(evolve_fitness(row), float(trials[out]["fitness"]), rel_tol=1e-4)
    study = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert math.isclose(max(map(evolve_fitness, rows)), study["best_value"], rel_tol=1e-4)

    searched = [k.removeprefix("hyp.") for k in study["best_params"]]
    with Image.open(sweep / "evolve.png") as im:
        im.verify()
    with Image.open(sweep / "evolve.png") as im:  # 26 panels: 6 rows of 5
        assert im.size == (round((2.0 * 5 + 0.5) * PLOT_DPI), round(2.0 * math.ceil(len(searched) / 5) * PLOT_DPI))
    assert plot_evolve(sweep / "evolve.csv", searched)[1] == [k for k in rows[0] if k in searched]
    assert len(searched) == 26
    assert "evolve.png" in r.stdout
