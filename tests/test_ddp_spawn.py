"""`trainer.strategy=ddp_spawn`: Lightning's launcher starts the ranks from a pickled trainer, and the command that
called fit only waits (yolo5l.callbacks.spawned). The runs go through the real entry point on the CPU (gloo)."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import warnings

import pytest
import torch

from yolo5l.callbacks.sweep import read_summary
from yolo5l.tracking.loggers import read_metrics_csv

_NUM_VAL = 16


def _train(tmp_path, *args: str, epochs: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable, "-m", "yolo5l.train", "experiment=smoke", "logger=csv",
            f"data.synthetic.root={tmp_path / 'synthetic'}", f"data.synthetic.num_val={_NUM_VAL}",
            "trainer.accelerator=cpu", "trainer.devices=2", f"trainer.max_epochs={epochs}", *args,
        ],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def _losses(run) -> list[float]:
    rows = read_metrics_csv(run / "metrics.csv")
    return [float(r[k]) for r in rows for k in ("train/loss_box", "train/loss_obj", "train/loss_cls")]


@pytest.mark.heavy
def test_a_ddp_spawn_run_trains_and_reports_as_a_ddp_run(tmp_path):
    """The ranks pickle (a callback held a thread lock), count their own validation images (the metric's states came
    in shared memory), write the run logs, and the closing block knows the epochs and the best and last rows; the
    closing validation of best.pt (ranks started again) prints its table alone, as under ddp; the losses are the ones
    `trainer.strategy=ddp` trains."""
    spawn_run, ddp_run = tmp_path / "spawn", tmp_path / "ddp"
    r = _train(tmp_path, f"hydra.run.dir={spawn_run}", "trainer.strategy=ddp_spawn", epochs=3)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Training done in" in out, out[-2000:]
    assert ", 3 epochs. Outputs:" in out, out[-2000:]
    assert re.search(r"best \(epoch [01]\): P ", out)  # this seed's best is not the last: best.pt is validated again
    assert "last (epoch 2): P " in out
    closing = r.stdout.split("for the closing table and plots\n", 1)[1]
    assert re.match(r"\n\s+Class\s+Images", closing), closing[:500]  # the table alone: no banner, no dataset line
    scored = re.search(r"^\s+all\s+\d+\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", closing, flags=re.M)
    best = re.search(r"best \(epoch [01]\): P ([\d.]+)  R ([\d.]+)  mAP@0.5 ([\d.]+)  mAP@0.5:0.95 ([\d.]+)", out)
    assert scored.groups() == best.groups()  # the best row is what best.pt scored in the table above it
    assert out.count("Initializing distributed: GLOBAL_RANK: 1") == 1
    tables = re.findall(r"^\s+all\s+(\d+)\s+\d+\s", out, flags=re.M)
    assert tables
    assert {int(n) for n in tables} == {_NUM_VAL}, tables  # not twice the images
    assert "sync_dist=True" not in out  # the values are the same on every rank already
    assert not re.search(r"^\S+\.py:\d+: \w*Warning", out, flags=re.M)  # warnings in the command's one-line form
    log = (spawn_run / "train.log").read_text()
    assert "epoch 2/2" in log
    assert "Training done in" in log
    assert (spawn_run / "train_ddp_process_1.log").is_file()
    assert len(read_metrics_csv(spawn_run / "metrics.csv")) == 3

    r = _train(tmp_path, f"hydra.run.dir={ddp_run}", "trainer.strategy=ddp", epochs=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(spawn_run) == pytest.approx(_losses(ddp_run), rel=1e-5)
    spawn_ckpt = torch.load(spawn_run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    ddp_ckpt = torch.load(ddp_run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert spawn_ckpt["global_step"] == ddp_ckpt["global_step"] > 0
    for key, value in ddp_ckpt["state_dict"].items():
        if value.is_floating_point():  # each rank stepped its own weights once (not twice into shared ones)
            torch.testing.assert_close(spawn_ckpt["state_dict"][key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.heavy
def test_a_ddp_fork_run_logs_each_line_once_and_watches_no_process_it_cannot(tmp_path):
    """A forked rank inherits the command's console (no second copy into train.log); the lost-rank watch leaves the
    multiprocessing launcher's processes to torch (its thread failed on ForkProcess.poll)."""
    run = tmp_path / "fork"
    r = _train(tmp_path, f"hydra.run.dir={run}", "trainer.strategy=ddp_fork")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert ", 2 epochs. Outputs:" in r.stdout
    log = (run / "train.log").read_text().splitlines()
    assert sum(line.startswith("epoch 1/1 ") for line in log) == 1


@pytest.mark.heavy
def test_a_sweep_with_ddp_spawn_runs_as_the_refusal_of_ddp_advises(tmp_path):
    r = _train(
        tmp_path,
        "-m",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "trainer.strategy=ddp_spawn",
        "trainer.max_epochs=1",
        "seed=1",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert re.search(r"trainer\.strategy=ddp_spawn seed=1` \|.*\| finished \|", summary), summary
    # The epoch line shows what metrics.csv holds: the ranks' mean losses (each rank's differ: other images) and the
    # job's images/s, which the sweep's table has too.
    (row,) = read_metrics_csv(tmp_path / "sweep" / "0" / "metrics.csv")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("epoch 0/0  "))
    shown = dict(re.findall(r"(box|obj|cls) ([\d.]+)", line))
    assert shown == {k: f"{float(row[f'train/loss_{k}']):.5f}" for k in ("box", "obj", "cls")}, (line, row)
    rate = float(row["train/images_per_sec"])
    assert f"  {rate:.1f} images/s  " in line, (line, rate)
    (job,) = read_summary(tmp_path / "sweep" / "summary.csv")
    assert float(job["images_per_sec"]) == pytest.approx(rate, rel=1e-5)
    # Its time is the command's `Training done in` figure: with the start of the ranks, which the ranks cannot time.
    assert f"Training done in {float(job['wall_s']):.1f} s" in r.stdout, (job, r.stdout[-3000:])
    assert r.stdout.count("Sweep done: 1 job, the fastest first.") == 1


def test_the_lost_rank_watch_pickles_without_its_thread():
    from yolo5l.callbacks.lost_rank import LostRankWatch

    watch = LostRankWatch(collective_timeout_s=30.0)
    copy = pickle.loads(pickle.dumps(watch))
    assert copy.collective_timeout_s == 30.0
    assert copy._observer is None
    assert copy._stop is not watch._stop
    assert not copy._stop.is_set()


def test_the_spawned_console_acts_only_in_a_started_process(tmp_path, monkeypatch):
    from yolo5l.callbacks.spawned import SpawnedConsole

    class Trainer:
        global_rank = 1

    console = SpawnedConsole(tmp_path, "train")
    assert console.log_path(0) == tmp_path / "train.log"
    assert console.log_path(1) == tmp_path / "train_ddp_process_1.log"
    console.setup(Trainer(), None, "fit")  # the process that made it: its own console stays as it is
    assert console._log is None
    assert not console.log_path(1).exists()
    started = pickle.loads(pickle.dumps(console))
    tidied = []
    started.tidy = lambda: tidied.append(True)  # the command's: yolo5l._cli.one_console_line_per_log
    monkeypatch.setattr(os, "getpid", lambda: console._pid + 1)  # as in a rank the launcher started
    started.setup(Trainer(), None, "fit")
    try:
        print("a line of rank 1")
        warnings.warn("a warning of rank 1", UserWarning, stacklevel=1)
    finally:
        started.teardown(Trainer(), None, "fit")
    assert tidied == [True]
    assert console.log_path(1).read_text().splitlines() == ["a line of rank 1", "warning: a warning of rank 1"]


def test_after_a_launched_fit_the_datasets_summary_lines_are_not_printed_again(tmp_path, monkeypatch, capsys):
    """adopt_fit_state silences every summary line of the datamodule (the fit's ranks printed them), whichever keys
    it has: the closing validation's re-started ranks print the table alone."""
    from types import SimpleNamespace

    from yolo5l import YOLODataModule
    from yolo5l.callbacks import spawned

    dm = YOLODataModule(synthetic={"root": str(tmp_path / "synthetic")}, imgsz=64, batch_size=2)
    dm._print("train", "train: 2 images")
    dm._print("train", "train: 2 images")  # once per key
    monkeypatch.setattr(spawned, "quiet_distributed_start", lambda: None)  # the process-wide log filter: not here
    assert spawned.adopt_fit_state(SimpleNamespace(callbacks=[]), dm) is False  # no checkpoint callback: no state
    dm._print("val", "val: 1 image")
    dm._print("a line added later", "more")
    assert capsys.readouterr().out == "train: 2 images\n"


def test_lightnings_sync_hint_is_left_out_for_values_the_same_on_every_rank():
    from yolo5l._cli import _SAME_ON_EVERY_RANK

    def hint(key: str) -> str:  # Lightning's words (logger_connector/result.py)
        return (
            f"It is recommended to use `self.log({key!r}, ..., sync_dist=True)` when logging on epoch level in "
            "distributed setting to accumulate the metric across devices."
        )

    for key in ("val/map", "val/map_50", "val/fitness", "train/lr0", "train/lr2", "train/images_per_sec"):
        assert re.match(f".*{_SAME_ON_EVERY_RANK.pattern}", hint(key)), key
    for key in ("val/my_metric", "train/loss_box", "val/mapping"):  # a user's own value keeps Lightning's hint
        assert not re.match(f".*{_SAME_ON_EVERY_RANK.pattern}", hint(key)), key


def test_the_modules_set_up_gives_it_metric_states_of_its_own(tiny_module):
    """What ddp_spawn on the CPU hands each rank: metric states in shared memory (the ranks added into one)."""
    module = tiny_module()
    metric = module.map_metric
    metric.num_images += 3
    metric.num_images.share_memory_()
    shared = metric.num_images
    module.setup("fit")
    assert metric.num_images is not shared
    assert not metric.num_images.is_shared()
    assert int(metric.num_images) == 0


def test_the_epoch_line_keeps_the_first_epoch_of_the_command_in_checkpoints():
    from yolo5l.callbacks.epoch_line import EpochLine

    line = EpochLine()
    line.first_epoch = 3
    restored = EpochLine()
    restored.load_state_dict(line.state_dict())
    assert restored.first_epoch == 3
