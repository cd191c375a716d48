"""Sweep summary: rows from concurrent jobs all land, the table sorts by throughput, a row's time is its job's
`Training done in` figure, the table is printed when the sweep ends; a real 2-job multirun (heavy)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from yolo5l.base.errors import shown_path
from yolo5l.callbacks.sweep import (
    SweepEnd,
    SweepSummary,
    append_row,
    read_summary,
    record_training_time,
    render_markdown,
    update_row,
)


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


def test_a_jobs_time_becomes_its_training_done_figure(tmp_path):
    """The row written as fit ends holds the time of fit's hooks; the job's `Training done in` figure (from the call of
    `trainer.fit`, with the set-up of the data and the ranks, to its return) replaces it, in the CSV and the table."""
    for job in (0, 1):
        _write((str(tmp_path), job))  # wall_s 1.0
    summary = SweepSummary(tmp_path, 1, ["common=1", "data.batch_size=1"], rank_by="throughput")
    record_training_time(SimpleNamespace(callbacks=[object(), summary]), 9.123)
    rows = {r["job"]: r for r in read_summary(tmp_path / "summary.csv")}
    assert (rows["0"]["wall_s"], rows["1"]["wall_s"]) == ("1", "9.123")
    assert rows["1"]["images_per_sec"] == "10"  # the rest of the row as it was
    md = (tmp_path / "summary.md").read_text()
    assert "`data.batch_size=1` | 10.0 | 10.0% | 0.5000 | 0.3000 | 9.1 | finished |" in md
    assert not update_row(tmp_path, 7, {"wall_s": 2.0})  # no row for that job: nothing written
    assert len(read_summary(tmp_path / "summary.csv")) == 2
    assert not update_row(tmp_path / "none", 0, {"wall_s": 2.0})
    assert not (tmp_path / "none").exists()


BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def _sweep_config(sweep_dir: Path, sweeper: str) -> object:
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "sweeper": {"_target_": sweeper}}})


def test_the_end_of_a_sweep_prints_its_table(tmp_path, capsys):
    for job in (1, 2, 3):
        _write((str(tmp_path), job))
    update_row(tmp_path, 2, {"status": "failed: TrainingDiverged"})
    SweepEnd().on_multirun_end(_sweep_config(tmp_path, BASIC))
    out = capsys.readouterr().out
    assert "\nSweep done: 3 jobs, 1 failed, the fastest first. Outputs:\n" in out
    assert f"table: {shown_path(tmp_path / 'summary.md')}" in out
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["job", "overrides"])
    assert lines[header - 1].strip() == "common overrides: common=1"
    assert "training time (s)" in lines[header]
    rows = [ln.split() for ln in lines[header + 1 :]]
    assert [r[:3] for r in rows] == [["3", "data.batch_size=3", "30.0"], ["2", "data.batch_size=2", "20.0"],
                                     ["1", "data.batch_size=1", "10.0"]]  # fmt: skip
    assert rows[0][3:] == ["10.0%", "0.5000", "0.3000", "1.0", "finished"]
    assert rows[1][-2:] == ["failed:", "TrainingDiverged"]
    end = lines[header].index("training time (s)") + len("training time (s)")
    assert all(ln[:end].endswith(" 1.0") for ln in lines[header + 1 : header + 4])  # numbers aligned right
    # A search ranks its trials by fitness and reports itself (yolo5l.search: "Search done: ..."); no table here.
    SweepEnd().on_multirun_end(_sweep_config(tmp_path, OPTUNA))
    SweepEnd().on_multirun_end(_sweep_config(tmp_path / "empty", BASIC))  # no job wrote a row
    assert capsys.readouterr().out == ""


def test_the_train_command_registers_the_end_of_sweep_callback(tmp_path):
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    from yolo5l.config import compose_config

    compose_config(output_dir=tmp_path)  # installs its hydra node as the current HydraConfig
    assert isinstance(instantiate(HydraConfig.get().callbacks.sweep_summary), SweepEnd)


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
    # Each row's time is its job's `Training done in` figure (not fit's hooks' alone, which miss the data's set-up).
    done = re.findall(r"^Training done in ([\d.]+) s, .*?^  run folder:\s+([^\n]+)$", r.stdout, flags=re.M | re.S)
    assert len(done) == 2, r.stdout[-3000:]
    seconds = {Path(folder).resolve(): figure for figure, folder in done}
    for row in rows:
        assert f"{float(row['wall_s']):.1f}" == seconds[Path(row["output_dir"]).resolve()], (row, done)
    # The table once, when the sweep has ended: after the last job's closing block.
    assert r.stdout.count("Sweep done: 2 jobs, the fastest first.") == 1
    assert "Launching 2 jobs locally" in r.stdout.splitlines()  # Hydra's lines plain, as the run's (no [<time>][HYDRA])
    assert "[HYDRA]" not in r.stdout
    end = r.stdout.split("Sweep done: 2 jobs, the fastest first.", 1)[1]
    assert "Training done" not in end
    printed = [ln.split() for ln in end.splitlines() if re.match(r"\s+\d+\s+data\.batch_size=", ln)]
    assert sorted((t[0], t[1], t[-2]) for t in printed) == sorted(
        (row["job"], row["overrides"].split()[-1], f"{float(row['wall_s']):.1f}") for row in rows
    )
