"""A sweep's values are checked before its first job (yolo5l.config_values.check_sweep_values): each value of a comma
sweep, `range(...)` or `choice(...)` gets the check its job's run would make, so that `data.batch_size=8,abc` is
refused at once, not after job 0 has trained."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from yolo5l.base.errors import UserError
from yolo5l.config_values import check_sweep_values

REFUSED = [
    ("train", "data.batch_size=8,abc", "data.batch_size=8,abc: data.batch_size='abc' must be a whole number"),
    ("train", "data.batch_size=8,0", "data.batch_size=8,0: data.batch_size=0 must be positive (or -1 to find"),
    ("train", "data.imgsz=range(64,-64,-64)",
     "data.imgsz=range(64,-64,-64): data.imgsz=0 must be a positive image size in pixels, e.g. data.imgsz=640"),
    ("train", "trainer.max_epochs=choice(1,x)", "trainer.max_epochs=choice(1,x): trainer.max_epochs='x' must be a"),
    ("train", "data.cache=ram,gpu", "data.cache=ram,gpu: data.cache='gpu' is not one of: none, ram, disk"),
    ("train", "data.rect=true,maybe", "data.rect=true,maybe: data.rect='maybe' must be true or false"),
    ("train", "freeze=10,abc", "freeze=10,abc: freeze='abc' must be an int N (first N layers)"),
    ("val", "data.imgsz=320,abc", "data.imgsz=320,abc: data.imgsz='abc' must be a whole number"),
    ("predict", "max_det=10,0", "max_det=10,0: max_det=0 must be at least 1"),
    ("export", "opset=17,9", "opset=17,9: opset=9 must be at least 11"),
]  # fmt: skip

ACCEPTED = [
    ("train", ["data.batch_size=8,16,-1", "data.imgsz=range(64,257,64)", "data.cache=none,ram", "freeze=0,10"]),
    ("train", ["data.imgsz=interval(64,256)", "hyp.lr0=0.01,abc", "data.batch_size=8,${oc.env:BATCH}"]),  # the job's
    ("train", ["trainer.max_epochs=null,3", "data.val_batch_size=null,4", "data.num_workers=auto,0"]),
    ("val", ["data.imgsz=null,320"]),
]


@pytest.mark.parametrize(("config_name", "override", "line"), REFUSED)
def test_a_bad_value_anywhere_in_a_sweep_is_one_line(config_name, override, line):
    parsed = OverridesParser.create().parse_overrides(["model=yolov5n,yolov5s", override])
    with pytest.raises(UserError) as e:
        check_sweep_values(parsed, config_name)
    assert str(e.value).startswith(line)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("config_name", "overrides"), ACCEPTED)
def test_good_sweeps_and_values_left_to_the_job_pass(config_name, overrides):
    check_sweep_values(OverridesParser.create().parse_overrides(overrides), config_name)


def test_the_command_refuses_the_sweep_before_its_first_job(tmp_path):
    """`-m experiment=smoke data.batch_size=8,abc`: one line and exit 2 before any job; no run folder, no dataset."""
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.train", "-m", "experiment=smoke", "data.batch_size=8,abc"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"},
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        "error: data.batch_size=8,abc: data.batch_size='abc' must be a whole number"
    ]
    assert "Launching" not in r.stdout + r.stderr  # Hydra's launcher never started
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no runs/sweep/<date>, no datasets/synthetic-smoke
