"""`resume=` as a user runs it: the checkpoint's own config, the same run folder, an extension to more epochs, and a
conflicting override refused in one line."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
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


@contextlib.contextmanager
def held_by_another_process(folder: Path) -> Iterator[int]:
    """A process that holds `folder`'s training lock as a run does (`hold_run_folder`) until the block ends."""
    code = "import sys; from yolo5l.base.run_files import hold_run_folder as h; h(sys.argv[1]); print(1, flush=True)"
    child = subprocess.Popen(
        [sys.executable, "-c", f"{code}; sys.stdin.read()", str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout.readline() == b"1\n"
        yield child.pid
    finally:
        child.stdin.close()
        child.wait(timeout=60)


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

    # While another process trains the run (here: holds its lock), neither a resume nor a run into its folder starts,
    # and nothing in the folder changes.
    with held_by_another_process(run) as pid:
        before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != ".training.lock"}
        commands = {
            "error: resume=true: every run under runs/train with a last.ckpt": ("resume=true", "trainer.max_epochs=3"),
            "error: runs/train/a is": ("experiment=smoke", data, "hydra.run.dir=runs/train/a"),
        }
        for says, args in commands.items():
            r = _train(tmp_path, *args)
            assert r.returncode == 2, r.stderr[-3000:]
            line = r.stderr.strip().splitlines()[-1]
            assert line.startswith(says), line
            assert "being trained now (" in line
            assert f"process {pid} on " in line
        assert before == {p: p.stat().st_mtime_ns for p in before}
        assert not [p for p in run.rglob("*") if p.is_file() and p.name != ".training.lock" and p not in before]

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


def test_resume_true_passes_over_a_run_in_training_and_says_so(tmp_path, capsys):
    """resume=true takes the newest run that no process trains now, and one line names the runs it passed over: one
    training now, and a newer one that stopped before its first checkpoint. A run named by its path that trains now
    is refused in one line. The lock goes with its holder."""
    from yolo5l.base.errors import UserError, shown_path
    from yolo5l.base.run_files import training_now
    from yolo5l.resume import find_resume_checkpoint

    def run(name: str, mtime: int, checkpoint: bool = True) -> Path:
        folder = tmp_path / name
        (folder / ".hydra").mkdir(parents=True)
        os.utime(folder / ".hydra", (mtime, mtime))
        if checkpoint:
            (folder / "checkpoints").mkdir()
            (folder / "checkpoints" / "last.ckpt").write_bytes(b"")
            os.utime(folder / "checkpoints" / "last.ckpt", (mtime, mtime))
        return folder

    old, live, unfinished = run("old", 1_000), run("live", 2_000), run("unfinished", 3_000, checkpoint=False)
    with held_by_another_process(live) as pid:
        assert training_now(live).startswith(f"process {pid} on ")
        assert training_now(old) is None
        assert find_resume_checkpoint(True, tmp_path) == old / "checkpoints" / "last.ckpt"
        said = capsys.readouterr()
        line = (said.out + said.err).strip()
        old, live, unfinished = shown_path(old), shown_path(live), shown_path(unfinished)
        assert f"resume=true: resuming {old}, the newest run to resume; passed over: {live} (being trained now" in line
        assert f"; {unfinished} (no checkpoint: it stopped before its first epoch ended)" in line
        with pytest.raises(UserError, match=rf"^{live} is being trained now \(process {pid} on .*then resume it$"):
            find_resume_checkpoint(str(tmp_path / "live" / "checkpoints" / "last.ckpt"), tmp_path)
    live = tmp_path / "live"
    assert training_now(live) is None
    assert not (live / ".training.lock").exists()  # removed by its holder as it ended
    assert find_resume_checkpoint(True, tmp_path) == live / "checkpoints" / "last.ckpt"
