"""`python -m yolo5l.train` as a user runs it: the files it writes, where it says they are, and its error messages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yolo5l.loggers import CORE_COLUMNS, read_metrics_csv

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def run_train(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "yolo5l.train", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def smoke_args(tmp: Path, *extra: str) -> list[str]:
    return [
        "experiment=smoke",
        f"hydra.run.dir={tmp / 'run'}",
        f"data.synthetic.root={tmp.parent / 'synthetic'}",  # shared by the tests of this module
        *extra,
    ]


def test_smoke_run_writes_and_prints_outputs(tmp_path):
    r = run_train(*smoke_args(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    for name in ("checkpoints/last.ckpt", "checkpoints/weights.pt", "metrics.csv", ".hydra/config.yaml"):
        assert (run / name).is_file(), name
        assert str(run / name) in r.stdout  # the summary names every output
    assert list(run.glob("events.out.tfevents.*"))
    rows = read_metrics_csv(run / "metrics.csv")
    assert len(rows) == 1
    assert rows[0]["epoch"] == "0"
    assert list(rows[0])[: len(CORE_COLUMNS)] == list(CORE_COLUMNS)
    for col in ("train/loss_box", "train/loss_obj", "train/loss_cls", "val/map_50", "val/map"):
        assert rows[0][col] != "", col
    ckpt = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["epoch"] == 0
    assert ckpt["global_step"] > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["model=yolov9"], "unknown model 'yolov9': choose one of yolov5l, yolov5m, yolov5n, yolov5s, yolov5x"),
        (["data.file=/no/such/data.yaml"], "dataset file '/no/such/data.yaml' not found"),
        (["trainer.devices=2", "trainer.accelerator=cpu", "data.batch_size=15"], "does not divide by the 2 devices"),
    ],
)  # the other checks run in-process in test_config.py::test_validate_rejects_with_one_sentence
def test_bad_config_one_line_exit_2(tmp_path, args, needle):
    r = run_train(f"hydra.run.dir={tmp_path / 'run'}", "trainer.accelerator=cpu", *args, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ")
    assert needle in lines[-1]
    assert sum(ln.startswith("error:") for ln in lines) == 1


@pytest.mark.slow
@pytest.mark.xfail(
    reason="open: weights after resume differ from the straight run by up to 0.02 (model.0.conv.weight) even with "
    "augmentation off and the seeded per-epoch sampler; cause not yet found (module/data RNG state on restart)",
    strict=False,
)
def test_resume_matches_uninterrupted_run(tmp_path):
    """2 epochs straight == 1 epoch, then resume=<last.ckpt> with max_epochs=2 (weights, EMA, optimizer, LR)."""
    # Augmentation off: its random draws depend on the process's RNG history, which a restart does not replay.
    no_aug = [f"hyp.{k}=0.0" for k in ("mosaic", "fliplr", "hsv_h", "hsv_s", "hsv_v", "translate", "scale")]
    common = ["trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "data.num_workers=0", *no_aug]
    full = tmp_path / "full"
    part = tmp_path / "part"
    r = run_train(*smoke_args(full, "trainer.max_epochs=2", *common), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(*smoke_args(part, "trainer.max_epochs=1", *common), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    last = part / "run" / "checkpoints" / "last.ckpt"
    # A finished run refuses to resume, in one line.
    r = run_train(*smoke_args(tmp_path / "again", "trainer.max_epochs=1", f"resume={last}", *common))
    assert r.returncode == 2
    assert "nothing to resume" in r.stderr
    r = run_train(*smoke_args(part, "trainer.max_epochs=2", f"resume={last}", *common), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    a = torch.load(full / "run/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    b = torch.load(last, map_location="cpu", weights_only=False)
    assert a["epoch"] == b["epoch"] == 1
    assert a["global_step"] == b["global_step"]
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_learns_on_synthetic(tmp_path):
    """A short real CPU training on the synthetic shapes lifts mAP@0.5 well above chance (~0)."""
    r = run_train(
        "experiment=synthetic_learn",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"data.synthetic.root={tmp_path / 'synthetic'}",
        timeout=3000,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics_csv(tmp_path / "run" / "metrics.csv")
    best = max(float(row["val/map_50"]) for row in rows if row["val/map_50"])
    assert best > 0.3, rows
