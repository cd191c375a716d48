"""Sweep summary: rows from concurrent jobs all land, the table sorts by throughput; a real 2-job multirun (slow)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from yolo5l.base.errors import shown_path
from yolo5l.callbacks.sweep import append_row, read_summary, render_markdown


def _write(args: tuple[str, int]) -> None:
    sweep_dir, job = args
    append_row(
        sweep_dir,
        {
            "job": job,
            "overrides": f"common=1 data.batch_size={job}",
            "images_per_sec": 10.0 * job,
            "data_wait": 0.1,
            "map_50": 0.5,
            "map": 0.3,
            "wall_s": 1.0,
            "status": "finished",
        },
    )


def test_concurrent_jobs_all_recorded(tmp_path):
    pool = mp.get_context("fork").Pool(4)  # jobs ending together: every row lands
    try:
        pool.map(_write, [(str(tmp_path), j) for j in range(1, 9)])
    finally:  # close and join, not `with` (terminate): the workers end when the tasks are done
        pool.close()
        pool.join()
    rows = read_summary(tmp_path / "summary.csv")
    assert sorted(int(r["job"]) for r in rows) == list(range(1, 9))
    md = (tmp_path / "summary.md").read_text()
    jobs_in_order = [int(line.split("|")[1]) for line in md.splitlines() if line.startswith("| ") and "job" not in line]
    assert jobs_in_order == list(range(8, 0, -1))  # fastest first
    assert "Common overrides: `common=1`" in md
    assert "`data.batch_size=8` | 80.0 | 10.0% | 0.5000 | 0.3000 | 1.0 | finished |" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.csv", "summary.md"]  # no lock left behind


def test_rerun_replaces_row_and_nan_sorts_last(tmp_path):
    append_row(tmp_path, {"job": 0, "overrides": "a=1", "images_per_sec": float("nan"), "status": "failed: X"})
    append_row(tmp_path, {"job": 1, "overrides": "a=2", "images_per_sec": 5.0, "status": "finished"})
    append_row(tmp_path, {"job": 1, "overrides": "a=2", "images_per_sec": 7.0, "status": "finished"})
    rows = read_summary(tmp_path / "summary.csv")
    assert [(r["job"], r["images_per_sec"]) for r in rows] == [("0", "nan"), ("1", "7")]
    lines = render_markdown(rows).splitlines()
    assert lines[-2].startswith("| 1 |")
    assert lines[-1].startswith("| 0 |")


@pytest.mark.heavy  # a 2-job sweep: make test-ci (CI)
def test_multirun_two_jobs_write_summary(tmp_path):
    sweep = tmp_path / "sweep"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "yolo5l.train",
            "-m",
            "experiment=smoke",
            f"hydra.sweep.dir={sweep}",
            f"data.synthetic.root={tmp_path / 'synthetic'}",
            "data.batch_size=4,8",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_summary(sweep / "summary.csv")
    assert sorted(r["overrides"].split()[-1] for r in rows) == ["data.batch_size=4", "data.batch_size=8"]
    for row in rows:
        assert row["status"] == "finished"
        assert float(row["wall_s"]) > 0
        assert float(row["map_50"]) >= 0  # a number, not nan: val/map_50 reached the table
        assert float(row["images_per_sec"]) > 0  # the ThroughputMonitor's numbers reached it too
        assert 0 <= float(row["data_wait"]) <= 1
        assert Path(row["output_dir"], "metrics.csv").is_file()
    assert f"table: {shown_path(sweep / 'summary.md')}" in r.stdout  # relative to the folder the command ran in
