"""DDP on the CPU (gloo, 2 processes) through the real entry point: Lightning re-launches `python -m yolo5l.train`
under Hydra with hydra.run.dir pointing at our run folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from yolo5l.loggers import read_metrics_csv


@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path):
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "yolo5l.train",
            "experiment=smoke",
            f"hydra.run.dir={run}",
            f"data.synthetic.root={tmp_path / 'synthetic'}",
            "trainer.devices=2",
            "trainer.strategy=ddp",
            "data.batch_size=8",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("Training done") == 1  # rank 0 reports, rank 1 stays quiet
    assert (run / "train_ddp_process_1.log").is_file()  # the re-launched rank used our run folder
    ckpt = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] > 0
    assert len(read_metrics_csv(run / "metrics.csv")) == 1


def test_multirun_with_ddp_is_refused(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "yolo5l.train",
            "-m",
            f"hydra.sweep.dir={tmp_path}",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.strategy=ddp",
            "seed=1,2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "trainer.strategy=ddp_spawn" in r.stderr.strip().splitlines()[-1]
