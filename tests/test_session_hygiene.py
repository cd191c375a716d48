"""The test session writes nothing outside the repository: tests/conftest.py switches onnxruntime's and MLflow's
telemetry off, and points $HOME, the XDG folders and the temp folder (pytest's tmp_path among its files) at
.test-scratch/, which git ignores."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import HOME, SESSION_CACHE, SOCKET_TMPDIR_MAX, TELEMETRY_OFF, TMP

#: Variables under which MLflow skips its telemetry by itself: a user's shell has none.
CI_MARKERS = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "BUILDKITE", "TF_BUILD")
#: A tiny onnxruntime session and an MLflow run with one metric, in the local store yolo5l uses (argv[1]).
PROBE = """
import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2]) for n in "xy")
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
assert session.run(None, {"x": np.ones((1, 2), np.float32)})[0].sum() == 2

import mlflow

mlflow.set_tracking_uri(sys.argv[1])
with mlflow.start_run():
    mlflow.log_metric("loss", 0.5)
"""


def _inside(path: str | Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def test_temp_files_home_and_caches_are_in_the_scratch_folder(tmp_path):
    assert _inside(tmp_path, TMP)
    if SESSION_CACHE is not None:  # else the variable came set, naming a cache of the user's choice
        assert _inside(os.environ["YOLO5L_CACHE_DIR"], TMP)
    for key in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        assert _inside(os.environ[key], HOME), key
    code = "import pathlib, tempfile; print(pathlib.Path.home()); print(tempfile.gettempdir())"
    for where in ("this process", "a subprocess"):
        if where == "this process":
            home, temp = Path.home(), tempfile.gettempdir()
        else:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
            home, temp = out.stdout.splitlines()
        assert _inside(home, HOME), where
        if len(str(TMP)) <= SOCKET_TMPDIR_MAX:
            assert _inside(temp, TMP), where


def _probe(tmp_path: Path, name: str, switches: bool) -> tuple[subprocess.Popen, Path]:
    """The probe under an empty $HOME, in the session's environment less the CI markers (with or without the
    telemetry switches): what it writes there is what a user's home would get."""
    home, work = tmp_path / name / "home", tmp_path / name / "work"
    home.mkdir(parents=True)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in CI_MARKERS and not k.startswith("XDG_")}
    if not switches:
        for key in TELEMETRY_OFF:
            env.pop(key)
    env["HOME"] = str(home)
    cmd = [sys.executable, "-c", PROBE, f"sqlite:///{work / 'mlflow.db'}"]
    return subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), home


def _files(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if not p.is_dir())


def test_onnxruntime_and_mlflow_write_nothing_under_home_with_the_switches(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("mlflow")
    runs = {switches: _probe(tmp_path, f"switches={switches}", switches) for switches in (True, False)}
    for proc, _ in runs.values():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    assert _files(runs[True][1]) == []
    without = _files(runs[False][1])
    # The check could fail: without the switches both libraries write there (else a switch may go from conftest.py).
    assert any("onnxruntime" in f for f in without), without
    assert any("mlflow" in f for f in without), without
