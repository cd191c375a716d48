"""The benchmark scripts the README's speed figures come from run end to end (tiny settings) and fail clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _script(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True, timeout=timeout
    )


def test_bench_reference_names_what_to_install_when_the_reference_is_missing(tmp_path):
    r = _script("bench_reference.py", "--ref-python", str(tmp_path / "no-venv" / "python"))
    assert r.returncode != 0
    assert "not found" in r.stderr
    assert "pip install" in r.stderr
    assert "yolov5==7.0.14" in r.stderr


def test_bench_data_reference_names_what_to_install_when_the_reference_is_missing(tmp_path):
    r = _script("bench_data.py", "--reference", "--ref-python", str(tmp_path / "no-venv" / "python"))
    assert r.returncode != 0
    assert "not found" in r.stderr
    assert "yolov5==7.0.14" in r.stderr


@pytest.mark.bench
def test_bench_data_per_core_child_and_ddp_memory(tmp_path):
    """The per-core run of --reference (yolo5l's side) and --ddp-memory, at tiny settings."""
    from yolo5l.data.synthetic import ensure_synthetic

    data = ensure_synthetic(tmp_path / "syn", num_train=16, num_val=4)
    cfg = tmp_path / "child.json"
    cfg.write_text(json.dumps({
        "core": 0, "imgsz": 64, "batch": 4, "warmup": 1, "batches": 2, "cache": "disk",
        "cache_dir": str(tmp_path / "npy"), "yaml": str(data),
    }))  # fmt: skip
    r = _script("bench_data.py", "--child", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["ips"] > 0
    assert list((tmp_path / "npy").rglob("*.npy"))  # the disk cache was filled and read
    r = _script(
        "bench_data.py", "--ddp-memory", "--root", str(tmp_path / "syn2"), "--num-train", "16", "--imgsz", "64",
        "--batch", "4", "--batches", "2", "--warmup", "1", "--caches", "disk",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("| disk |"))
    peak_mib = float(row.split("|")[2])
    assert peak_mib > 100  # two ranks and their workers, each with torch loaded


@pytest.mark.bench
def test_bench_train_measures_a_config_and_survives_a_missing_reference(tmp_path):
    out = tmp_path / "bench.json"
    r = _script(
        "bench_train.py", "--configs", "default", "--steps", "2", "--warmup", "0", "--epochs", "1",
        "--val-images", "8", "--model", "yolov5n", "--imgsz", "64", "--batch", "4", "--no-micro",
        "--data-root", str(tmp_path / "synthetic"), "--json", str(out), "--profile", "4",
        "--reference", "--ref-python", str(tmp_path / "no-venv" / "python"), "--e2e-args", "model=yolov5n",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[reference] failed" in r.stderr  # the comparison is skipped, the rest still runs
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["name"] == "default"
    assert run["train_img_s"] > 0
    assert run["val_img_s"] > 0
    assert run["extra"]["faults_per_step"] >= 0
    assert report["reference"] == {}
    assert report["e2e"]["one_epoch_run_s"] > 0  # --reference implies the one-epoch command
    assert "| default" in r.stdout
    # --profile over more steps than the epoch has: the table comes at the epoch's end (a profiler left running
    # past fit crashed the process)
    assert "[profile] the epoch ended first: 2 steps profiled" in r.stdout
    assert "Self CPU time total" in r.stdout


@pytest.mark.bench
def test_bench_val_times_the_validation_stages_per_backend(tmp_path):
    out = tmp_path / "val.json"
    r = _script(
        "bench_val.py", "--model", "yolov5n", "--imgsz", "64", "--images", "16", "--batch", "8", "--repeat", "1",
        "--data-root", str(tmp_path / "synthetic"), "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [x["backend"] for x in results] == ["yolov5", "coco"]
    for x in results:
        assert x["images"] == 16
        assert x["img_s"] > 0
        stages = x["passes"][-1]["stages_s"]
        assert {"forward", "val loss", "decode + NMS", "mAP update", "mAP compute"} <= set(stages)
        assert all(v > 0 for v in stages.values())
    assert "| yolov5 |" in r.stdout


@pytest.mark.bench
def test_bench_kernels_times_fused_bn_silu_against_pytorch():
    from yolo5l_kernels.bn_silu import fused_available

    r = _script("bench_kernels.py", "--only", "bn_silu", "--imgsz", "64", "--batch", "2", "--repeats", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    if not fused_available():
        assert "unavailable" in r.stdout
        return
    assert "57 Conv blocks at 64 px," in r.stdout
    assert "batch 2 (" in r.stdout
    lines = [ln.split() for ln in r.stdout.splitlines()]
    rows = {ln[0]: ln[1:] for ln in lines if ln[:1] in (["bfloat16"], ["float32"])}
    assert set(rows) == {"bfloat16", "float32"}
    for unfused, fused, _ in rows.values():
        assert float(unfused) > 0
        assert float(fused) > 0


def _load_script(name: str, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_reference_trains_validates_and_times_on_the_device_yolo5l_runs_on(monkeypatch, tmp_path):
    """On a GPU the comparison is GPU against GPU: bench_train passes its --device, and YOLOv5 gets it its way."""
    ref = _load_script("bench_reference", monkeypatch)
    assert [ref.yolov5_device(d) for d in ("cpu", "cuda", "cuda:1")] == ["cpu", "0", "1"]
    for device, expected in (("cpu", "cpu"), ("cuda", "0")):
        args = ref.build_parser().parse_args(["--device", device])
        argv = ref.train_argv(args, tmp_path / "data.yaml", tmp_path)
        assert argv[argv.index("--device") + 1] == expected
        assert argv[argv.index("--img") + 1] == "320"
    bench = _load_script("bench_train", monkeypatch)
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = bench.build_parser().parse_args(["--device", "cuda", "--reference"])
    assert bench.reference_timings(args) == {}
    assert seen["cmd"][seen["cmd"].index("--device") + 1] == "cuda"


def test_the_gemm_ceiling_times_the_same_product_in_onednn_as_a_1x1_convolution(monkeypatch):
    import torch

    bench = _load_script("bench_train", monkeypatch)
    a, b = torch.randn(64, 48, dtype=torch.float64), torch.randn(48, 40, dtype=torch.float64)
    x, w = bench.gemm_as_conv(a, b)
    y = torch.nn.functional.conv2d(x, w)  # [1, 40, 32, 2]
    torch.testing.assert_close(y[0].flatten(1).t(), a @ b)
    assert bench.gemm_gflops(torch.float32, "cpu", n=256, repeat=2) > 0


def test_bench_predict_names_what_to_install_when_the_reference_is_missing(tmp_path):
    r = _script("bench_predict.py", "--ref-python", str(tmp_path / "no-venv" / "python"), "--images", "2")
    assert r.returncode != 0
    assert "not found" in r.stderr
    assert "yolov5==7.0.14" in r.stderr


@pytest.mark.bench
@pytest.mark.skipif(not (REPO / ".refvenv" / "bin" / "python").exists(), reason="needs .refvenv (yolov5==7.0.14)")
def test_bench_predict_measures_both_sides_at_tiny_settings(tmp_path):
    out = tmp_path / "bench.json"
    r = _script(
        "bench_predict.py", "--images", "3", "--imgsz", "64", "--batch", "2", "--data-root", str(tmp_path / "syn"),
        "--work-dir", str(tmp_path / "work"), "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["images"] == 3
    assert report["reference_img_s"] > 0
    assert report["yolo5l_img_s"] > 0
    assert report["ratio"] == pytest.approx(report["yolo5l_img_s"] / report["reference_img_s"])
    assert len(list((tmp_path / "work" / "yolo5l" / "run").glob("*.jpg"))) == 3  # both drew every image
    assert len(list((tmp_path / "work" / "ref" / "run").glob("*.jpg"))) == 3


def test_bench_autoanchor_checks_both_label_sets_and_names_a_broken_reference(tmp_path):
    r = _script("bench_autoanchor.py", "--images", "200")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("thin boxes (")
    assert "-> 1.000" in lines[0]  # the thin bars get anchors that fit them
    assert lines[1].startswith("log-normal boxes (")
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    r = _script("bench_autoanchor.py", "--images", "50", "--reference", str(broken))
    assert r.returncode != 0
    assert "yolov5==7.0.14" in r.stderr


def test_bench_contention_names_what_to_install_when_the_reference_is_missing(tmp_path):
    r = _script("bench_contention.py", "--ref-python", str(tmp_path / "no-venv" / "python"))
    assert r.returncode != 0
    assert "yolov5==7.0.14" in r.stderr


def test_bench_contention_refuses_an_unknown_neighbour_before_any_run():
    r = _script("bench_contention.py", "--no-reference", "--neighbours", "spin,spinn")
    assert r.returncode == 2
    assert "unknown neighbour(s) spinn: use spin, torch or yolo5l" in r.stderr.strip().splitlines()[-1]
    assert "round 0" not in r.stdout


@pytest.mark.bench
def test_bench_contention_times_yolo5l_alone_and_beside_a_neighbour(tmp_path):
    """yolo5l alone and beside a one-core load at tiny settings: the table has both rows and their slowdown."""
    r = _script(
        "bench_contention.py", "--no-reference", "--rounds", "1", "--neighbours", "spin",
        "--data-root", str(tmp_path / "syn"), "--yolo5l-args", "experiment=smoke", timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| yolo5l |")]
    assert [ln.split("|")[2].strip() for ln in rows] == ["alone", "spin"]
    assert float(rows[0].split("|")[4]) == 1.0  # alone against itself
    assert float(rows[1].split("|")[3]) > 0


@pytest.mark.slow
def test_loss_growth_probe_reports_the_largest_rise(tmp_path):
    """The figure docs/benchmarks.md gives for module.max_loss_growth: the rule's reads of a run, largest rise first.
    With hyp.lr0=10000 (the rule switched off) the rise it reports is far over the default 10."""
    common = ("experiment=smoke", "data.imgsz=64", "logger=csv", "trainer.limit_val_batches=0",
              f"data.synthetic.root={tmp_path / 'syn'}")  # fmt: skip
    r = _script("loss_growth_probe.py", *common, "trainer.max_epochs=2", f"hydra.run.dir={tmp_path / 'a'}")
    assert r.returncode == 0, r.stderr[-3000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("largest rise over the lowest running mean loss: ")
    assert line.endswith(", mean of 4 batches (2 epochs)")
    lr0 = ("hyp.lr0=10000", "hyp.warmup_epochs=0", "module.max_loss_growth=null", "trainer.max_epochs=2")
    r = _script("loss_growth_probe.py", *common, *lr0, f"hydra.run.dir={tmp_path / 'b'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.strip().splitlines()[-1].split(": ")[1].split(" x")[0]) > 10


def _bench_input(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """bench_input.py at tiny settings: 8 small JPEGs, 64 px, batch 4, one timed batch, no workers, on the CPU."""
    return _script(
        "bench_input.py", "--root", str(tmp_path / "syn"), "--num-train", "8", "--min-side", "64", "--max-side", "96",
        "--imgsz", "64", "--batch", "4", "--batches", "1", "--warmup", "0", "--workers", "0", "--rounds", "1",
        "--device", "cpu", "--json", str(tmp_path / "input.json"), *args,
    )  # fmt: skip


@pytest.mark.bench
def test_bench_input_times_each_input_path_and_skips_a_missing_reference(tmp_path):
    """Every yolo5l row is measured and printed, with the workers' CPU ratio; a missing reference venv skips its row
    with one line that says how to make it."""
    r = _bench_input(tmp_path, "--ref-python", str(tmp_path / "no-venv" / "python"))
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "input.json").read_text())
    rows = report["rows"]
    assert list(rows) == ["v7.0 loader", "host", "device: workers", "device: pixels on cpu", "device: end to end"]
    assert rows["v7.0 loader"]["best"] is None
    for name in ("host", "device: workers", "device: pixels on cpu", "device: end to end"):
        best = rows[name]["best"]
        assert best["img_s"] > 0
        assert best["images"] == 4
    assert rows["device: pixels on cpu"]["best"]["worker_cpu_s_per_img"] is None  # no workers in that row
    assert "the CPU stands in for a GPU" in r.stdout
    table = [ln.split("|")[1].strip() for ln in r.stdout.splitlines() if ln.startswith("| ")][1:]
    assert table == ["host", "device: workers", "device: pixels on cpu", "device: end to end"]
    assert "device workers' CPU s/img / host workers' CPU s/img = " in r.stdout
    (skip,) = [ln for ln in r.stdout.splitlines() if ln.startswith("v7.0 loader: skipped")]
    assert "not found" in skip
    assert "yolov5==7.0.14" in skip


@pytest.mark.bench
@pytest.mark.skipif(not (REPO / ".refvenv" / "bin" / "python").exists(), reason="needs .refvenv (yolov5==7.0.14)")
def test_bench_input_runs_the_v7_loader_beside_yolo5l(tmp_path):
    r = _bench_input(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads((tmp_path / "input.json").read_text())["rows"]["v7.0 loader"]["best"]
    assert ref["img_s"] > 0
    assert ref["images"] == 4
    assert any(ln.startswith("| v7.0 loader |") for ln in r.stdout.splitlines())


@pytest.mark.bench
def test_bench_compose_counts_and_times_both_runners():
    """The old path composes three times (the check's, then `@hydra.main`'s two), yolo5l's runner once."""
    r = _script("bench_compose.py", "--rounds", "2", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(ln.startswith("check + @hydra.main") and " 3 compositions " in ln for ln in lines), r.stdout
    assert any(ln.startswith("run_hydra_app") and " 1 compositions " in ln for ln in lines), r.stdout
