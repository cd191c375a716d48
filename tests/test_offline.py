"""No network unless asked: a training run (with MLflow's local store, the plots, TensorBoard and its validations) and
a validation (heavy: CI), each in a subprocess whose sockets reach only this machine (tests/_netblock/sitecustomize.py
records every attempt to go further)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

NETBLOCK = Path(__file__).parent / "_netblock"
#: Variables under which libraries skip their telemetry by themselves (mlflow reads these): a user's shell has none.
CI_MARKERS = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "BUILDKITE", "TF_BUILD")


def _env(log: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CI_MARKERS}
    for key in ("NO_ALBUMENTATIONS_UPDATE", "MLFLOW_DISABLE_TELEMETRY", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)  # the defaults yolo5l sets are what is tested
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(NETBLOCK), YOLO5L_NETBLOCK_LOG=str(log), **extra)
    return env


def _attempts(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_blocker_sees_an_attempt(tmp_path):
    """The check below could fail: a lookup of a remote name is refused and recorded."""
    log = tmp_path / "net.log"
    code = "import urllib.request as u\ntry:\n    u.urlopen('http://example.com', timeout=2)\nexcept OSError:\n    pass"
    subprocess.run([sys.executable, "-c", code], env=_env(log), check=True, timeout=60)
    assert any("example.com" in line for line in _attempts(log))


def test_albumentations_would_look_for_updates_without_yolo5ls_switch(tmp_path):
    log = tmp_path / "net.log"
    env = _env(log, NO_ALBUMENTATIONS_UPDATE="0")
    subprocess.run([sys.executable, "-W", "ignore", "-c", "import albumentations"], env=env, check=True, timeout=120)
    assert _attempts(log), "albumentations no longer checks for updates: its switch in yolo5l/__init__.py may go"
    log.unlink()
    subprocess.run([sys.executable, "-c", "import yolo5l, albumentations"], env=_env(log), check=True, timeout=120)
    assert _attempts(log) == []


def test_training_makes_no_network_attempt(tmp_path):
    log = tmp_path / "net.log"
    run = tmp_path / "run"
    logger = ["logger=mlflow"] if importlib.util.find_spec("mlflow") else []  # TensorBoard + CSV + MLflow
    train = [
        sys.executable, "-m", "yolo5l.train", "experiment=smoke", f"hydra.run.dir={run}", *logger,
        f"data.synthetic.root={tmp_path / 'synthetic'}", "data.imgsz=64", "trainer.limit_train_batches=1",
        "trainer.limit_val_batches=1", f"paths.runs_dir={tmp_path / 'runs'}",
    ]  # fmt: skip
    r = subprocess.run(train, env=_env(log), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _attempts(log) == []
    # Nothing in the folder the command ran in but what it was told to write: no ./mlruns of MLflow's.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "runs", "synthetic"]
    if logger:
        assert (tmp_path / "runs" / "mlruns").is_dir()  # the MLflow run's artifacts, beside its store
    assert (run / "checkpoints" / "weights.pt").is_file()


@pytest.mark.heavy  # a second command: CI runs it; training's validations above run the same validation code
def test_val_makes_no_network_attempt(tmp_path):
    log = tmp_path / "net.log"
    val = [sys.executable, "-m", "yolo5l.val", f"weights={Path(__file__).parent / 'data' / 'deploy_yolov5n.pt'}",
           f"data.synthetic.root={tmp_path / 'synthetic'}", "data.synthetic.num_train=2", "data.synthetic.num_val=8",
           "data.imgsz=64", f"hydra.run.dir={tmp_path / 'val'}", "data.val_batch_size=8"]  # fmt: skip
    r = subprocess.run(val, env=_env(log), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "val" / "metrics.json").is_file()
    assert _attempts(log) == []


@pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's")
def test_unshared_network_namespace_smoke_import(tmp_path):
    """Where the kernel lets an unprivileged user have a network namespace with no interface but loopback, the
    package imports there with its defaults (nothing waits on a timeout)."""
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip("unshare -rn is not permitted here")
    code = "import yolo5l.train, yolo5l.val, yolo5l.predict, yolo5l.data.augment; print('ok')"
    r = subprocess.run(["unshare", "-rn", sys.executable, "-c", code], env=_env(tmp_path / "net.log"),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"
    assert "Error fetching version info" not in r.stderr
