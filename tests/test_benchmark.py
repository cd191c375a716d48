"""`python -m yolo5l.benchmark`: `formats=` takes one name or a list, and the command's console is plain lines as the
other commands' (yolo5l's job logging), copied once into `benchmark.log`. (Every format end to end: test_deploy.py.)"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from yolo5l.base.errors import UserError
from yolo5l.benchmark import benchmark, benchmark_formats
from yolo5l.config import compose_config
from yolo5l.deploy.formats import FORMATS

WEIGHTS = Path(__file__).parent / "data" / "deploy_yolov5n.pt"
CHOICES = f"pytorch, {', '.join(FORMATS)}"


def test_one_name_is_a_list_of_one():
    assert benchmark_formats("onnx") == ["onnx"]
    assert benchmark_formats("onnx") == benchmark_formats(["onnx"])
    assert benchmark_formats(OmegaConf.create({"f": ["pytorch", "ONNX", "pytorch"]}).f) == ["pytorch", "onnx"]


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("onxx", f"formats: onxx not one of {CHOICES}"),
        (["pytorch", "onxx"], f"formats: onxx not one of {CHOICES}"),
        ("onnx,openvino", "formats='onnx,openvino': several formats are written as a list: formats=[onnx,openvino]"),
        ([], "formats=[] names no format: pass formats=onnx, or several as formats=[pytorch,onnx]"),
    ],
)
def test_a_bad_formats_value_is_one_line_naming_it(value, line):
    with pytest.raises(UserError) as e:
        benchmark_formats(value)
    assert str(e.value) == line


def test_a_misspelt_format_is_refused_before_the_weights_load(tmp_path):
    cfg = compose_config([f"weights={tmp_path / 'never_read.pt'}", "formats=onxx"], "benchmark", tmp_path / "run")
    with pytest.raises(UserError, match=rf"^formats: onxx not one of {re.escape(CHOICES)}$"):
        benchmark(cfg)


def test_the_command_takes_one_format_and_prints_plain_lines(tmp_path):
    """`formats=pytorch` (a name, not a list) benchmarks that one format; every console line is yolo5l's (no Hydra
    `[date][logger][INFO] - ...` line such as the weights load's `Transferred 349/349 items`, which the command does
    not print, as val does not), and `benchmark.log` is the console once."""
    run = tmp_path / "run"
    args = [f"weights={WEIGHTS}", "formats=pytorch", f"data.synthetic.root={tmp_path / 'synthetic'}",
            "data.synthetic.num_train=8", "data.synthetic.num_val=8", "data.imgsz=64", "data.num_workers=0",
            "data.cache=none", "timing_runs=1", f"hydra.run.dir={run}"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "yolo5l.benchmark", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(run / "benchmark.csv", newline="") as f:
        assert [(r["format"], r["status"]) for r in csv.DictReader(f)] == [("pytorch", "ok")]
    console = done.stdout + done.stderr
    assert "[yolo5l] benchmark: pytorch" in done.stdout
    assert not re.search(r"^\[\d{4}-\d\d-\d\d|\]\[INFO\]|^INFO: |Transferred", console, re.M), console
    assert (run / "benchmark.log").read_text() == done.stdout + done.stderr
