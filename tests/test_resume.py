"""`resume=` as a user runs it: the checkpoint's own config, the same run folder, an extension to more epochs, and a
conflicting override refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yolo5l.io.old_targets import MOVED, current_target, current_targets
from yolo5l.resume import resume_in_place
from yolo5l.tracking.loggers import read_metrics_csv

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "yolo5l.train", "trainer.enable_progress_bar=false", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip


@pytest.mark.heavy  # five training commands in one scenario: CI runs it (make test-ci), `make test` stays light
def test_resume_true_uses_the_checkpoints_config_folder_and_extends_the_run(tmp_path):
    data = f"data.synthetic.root={tmp_path / 'synthetic'}"
    r = _train(
        tmp_path, "experiment=smoke", data, "trainer.limit_train_batches=2", "trainer.max_epochs=2",
        "hydra.run.dir=runs/train/a", "+callbacks.extra._target_=lightning.pytorch.callbacks.Callback",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "train" / "a"
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["yolo5l_config"]["model"]["width"] == 0.25

    # A change to what the run trains is refused before anything is built, in one line.
    r = _train(tmp_path, "resume=true", "model=yolov5s", "trainer.max_epochs=3")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "resume: model=yolov5s changes what the run" in r.stderr.strip().splitlines()[-1]

    # The finished 2-epoch run, extended to 3 epochs, without repeating experiment=smoke or the data root: the
    # checkpoint's config (yolov5n at 128 px, 2 batches an epoch) is used, in the same folder. `~callbacks.extra`
    # turns off a callback the run added (this command line's own config does not have it: Hydra alone refuses).
    r = _train(tmp_path, "resume=true", "trainer.max_epochs=3", "~callbacks.extra")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "extending the run to 3 epochs" in r.stdout + r.stderr
    assert "exists and is not empty" not in r.stdout + r.stderr  # the run's own checkpoint folder: no warning
    # The schedule had ended at lr0 x lrf: the extension stays there (no "from lr0 x 0.01 to lr0 x 0.01").
    assert "from epoch 2 the learning rate stays at lr0 x 0.01, where the schedule ended" in r.stdout + r.stderr
    assert "Training done in " in r.stdout
    assert ", 1 epoch (epoch 2), 3 in all. Outputs:" in r.stdout  # this command trained one epoch, not three
    assert "[the checkpoint]" in r.stdout  # the start-up block: the run's own settings
    assert sorted(p.name for p in (tmp_path / "runs" / "train").iterdir()) == ["a"]
    rows = read_metrics_csv(run / "metrics.csv")
    assert [row["epoch"] for row in rows] == ["0", "1", "2"]  # no earlier row lost
    for row in rows:  # every row carries the epoch's mean losses
        assert all(row[k] for k in ("train/loss_box", "train/loss_obj", "train/loss_cls")), row
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["yolo5l_config"]["callbacks"]["extra"] is None  # off, and off in a later resume
    assert ckpt["epoch"] == 2
    assert ckpt["global_step"] == 6
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # TensorBoard reads both files of the folder

    r = _train(tmp_path, "resume=true", "trainer.max_epochs=3")
    assert r.returncode == 2
    assert "already trained 3 of 3 epochs" in r.stderr

    # A last.ckpt of yolo5l 0.1, whose config names the modules before the package was put in rooms
    # (`yolo5l.module.YOLOv5Module`, `yolo5l.loss.YOLOv5Loss.from_model`, ...), resumes too.
    ckpt["yolo5l_config"], renamed = _as_in_0_1(ckpt["yolo5l_config"])
    assert {"yolo5l.module.YOLOv5Module", "yolo5l.loss.YOLOv5Loss.from_model"} <= renamed
    torch.save(ckpt, last)
    r = _train(tmp_path, "resume=true", "trainer.max_epochs=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["epoch"] for row in read_metrics_csv(run / "metrics.csv")] == ["0", "1", "2", "3"]


def _as_in_0_1(config, renamed=None):
    """`config` with each `_target_` in a moved module named as yolo5l 0.1 named it; and the renamed targets."""
    renamed = set() if renamed is None else renamed
    if isinstance(config, dict):
        out = {}
        for key, value in config.items():
            old = value
            if key == "_target_" and isinstance(value, str):
                old = next((o + value[len(n) :] for o, n in MOVED.items() if value.startswith(n + ".")), value)
                if old != value:
                    renamed.add(old)
            out[key] = old if key == "_target_" else _as_in_0_1(value, renamed)[0]
        return out, renamed
    if isinstance(config, list):
        return [_as_in_0_1(v, renamed)[0] for v in config], renamed
    return config, renamed


def test_old_targets_are_renamed_and_todays_kept():
    assert current_target("yolo5l.loss.YOLOv5Loss.from_model") == "yolo5l.training.loss.YOLOv5Loss.from_model"
    assert current_target("yolo5l.tracking.instantiate_entries") == "yolo5l.tracking.trackers.instantiate_entries"
    # `yolo5l.tracking` was a module and is now a package: its modules' names are today's
    assert current_target("yolo5l.tracking.loggers.EpochCSVLogger") == "yolo5l.tracking.loggers.EpochCSVLogger"
    for today in ("yolo5l.callbacks.ema.EMACallback", "torch.optim.SGD", "yolo5l.training.module.YOLOv5Module"):
        assert current_target(today) == today
    assert current_targets({"a": [{"_target_": "yolo5l.optim.LinearLR", "lrf": 0.01}], "_target_": 3}) == {
        "a": [{"_target_": "yolo5l.training.optim.LinearLR", "lrf": 0.01}],
        "_target_": 3,
    }


def test_an_import_of_a_0_1_module_names_its_place_now():
    import importlib

    with pytest.raises(
        ModuleNotFoundError, match=r"^No module named 'yolo5l.loss': since yolo5l 0.2 it is 'yolo5l.training.loss'$"
    ):
        importlib.import_module("yolo5l.loss")
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'yolo5l.no_such_module'$"):
        importlib.import_module("yolo5l.no_such_module")  # anything else: Python's own message
    assert importlib.import_module("yolo5l.tracking.loggers").EpochCSVLogger  # a 0.1 name that is a package now


def test_a_resume_turns_the_runs_entries_off_as_nulls(tmp_path):
    last = tmp_path / "last.ckpt"
    config = {"callbacks": {"crash": {"epoch": 1}}, "logger": {"tensorboard": {}}}
    torch.save({"epoch": 1, "state_dict": {}, "yolo5l_config": config}, last)
    argv = [f"resume={last}", "~callbacks.crash", "~logger.tensorboard", "~callbacks.nosuch", "~callbacks.crash.epoch",
            "~hyp.lr0", "hydra.run.dir=r"]  # fmt: skip
    assert resume_in_place(argv) == [
        f"resume={last}",
        "++callbacks.crash=null",
        "++logger.tensorboard=null",
        "~callbacks.nosuch",
        "~callbacks.crash.epoch",
        "~hyp.lr0",
        "hydra.run.dir=r",
    ]  # fmt: skip  (an entry the run does not have stays as typed, for the checks to name)
    assert resume_in_place(["~callbacks.crash"]) == ["~callbacks.crash"]  # not a resume: Hydra's own meaning
