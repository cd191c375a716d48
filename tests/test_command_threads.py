"""val, predict, export and benchmark on the CPU start at as many intra-op threads as cores are free
(`yolo5l.base.hardware.command_threads`), as a CPU training does.

The decision is tested with a fake measurement of the free cores (exact whatever this machine's load), in the
commands' own functions run in-process; one real `python -m yolo5l.val task=speed` runs beside a CPU-burning process
on the same two cores, where the measurement is real: other load only lowers the free cores, so it holds on a busy
machine too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import yolo5l.base.hardware as hw
from yolo5l.config import compose_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY_WEIGHTS = ROOT / "tests" / "data" / "deploy_yolov5n.pt"


@pytest.fixture
def two_threads(monkeypatch):
    """torch at 2 threads, as torch's own default count on a 2-core machine; 2 owned cores; no thread variables."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(hw, "IMPORT_THREADS", 2)
    monkeypatch.setattr(hw, "owned_cores", lambda: 2)
    for key in hw.THREAD_ENV:
        monkeypatch.delenv(key, raising=False)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def free_cores(monkeypatch, two_threads):
    """Set the cores the fake measurement finds free (`free_cores.free = 0.9`); `free_cores.calls` counts the
    measurements."""

    class Fake:
        free: float | None = 2.0
        calls = 0

        def __call__(self, seconds: float = hw.PROBE_SECONDS) -> float | None:
            self.calls += 1
            return self.free

    fake = Fake()
    monkeypatch.setattr(hw, "available_cores", fake)
    return fake


@pytest.mark.parametrize(("free", "threads"), [(0.9, 1), (0.2, 1), (1.6, 2), (2.0, 2), (None, 2)])
def test_the_cpu_work_runs_at_the_free_cores_and_gives_the_count_back(free_cores, capsys, free, threads):
    free_cores.free = free
    with hw.command_threads("cpu") as inside:
        assert inside == threads
        assert torch.get_num_threads() == threads
    assert torch.get_num_threads() == 2
    out = capsys.readouterr().out
    if threads < 2:
        assert f"intra-op threads: 2 -> 1 (about {free:.1f} of 2 cores free at the start)" in out
    else:
        assert "intra-op threads" not in out


def test_an_explicit_count_wins(free_cores, monkeypatch, capsys):
    free_cores.free = 0.9
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with hw.command_threads("cpu"):
        assert torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(3)  # torch.set_num_threads called in this process: differs from the count at import
    with hw.command_threads("cpu"):
        assert torch.get_num_threads() == 3
    assert free_cores.calls == 0
    assert "intra-op threads" not in capsys.readouterr().out


def test_accelerators_and_inner_commands_keep_the_count(free_cores):
    free_cores.free = 0.9
    for device in ("cuda", "cuda:1", torch.device("meta"), "gpu"):
        with hw.command_threads(device):
            assert torch.get_num_threads() == 2
    assert free_cores.calls == 0
    with hw.command_threads("cpu"):  # benchmark: its validations and exports keep what it picked
        with hw.command_threads("cpu"):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert free_cores.calls == 1
    assert torch.get_num_threads() == 2


def test_the_ceiling_is_the_cores_the_process_owns(free_cores, monkeypatch, capsys):
    monkeypatch.setattr(hw, "owned_cores", lambda: 1)  # a one-CPU container quota, or taskset -c 0
    with hw.command_threads("cpu"):
        assert torch.get_num_threads() == 1
    assert free_cores.calls == 0  # one core: nothing to measure
    assert "intra-op threads: 2 -> 1 (the cores this process owns)" in capsys.readouterr().out


def test_threads_for_rounds_the_free_cores_within_one_and_the_ceiling():
    assert [hw.threads_for(f, 4) for f in (0.0, 0.4, 1.4, 1.5, 2.6, 9.0, None)] == [1, 1, 1, 2, 3, 4, 4]


# ---- the commands, in-process, with the fake measurement -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Tiny yolov5 weights (width 0.125, 64 px) for the 4 synthetic classes and a 2-image synthetic data yaml."""
    from yolo5l.data.synthetic import ensure_synthetic
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    tmp = tmp_path_factory.mktemp("threads")
    data = ensure_synthetic(tmp / "syn", num_train=2, num_val=2, min_side=80, max_side=120)
    weights = tmp / "w.pt"
    torch.manual_seed(0)
    save_weights(YOLOv5(num_classes=4, depth=0.33, width=0.125), weights, imgsz=64)
    return {"weights": weights, "data": data, "images": data.parent / "images" / "val"}


def _threads_at(monkeypatch, name: str, *modules: object) -> list[int]:
    """Record torch's thread count at each call of `name` in any of `modules`."""
    seen: list[int] = []
    for module in modules:
        fn = getattr(module, name)

        def recorded(*args, fn=fn, **kwargs):
            seen.append(torch.get_num_threads())
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)
    return seen


def _nms_threads(monkeypatch) -> list[int]:
    """torch's thread count at each NMS: the plain loops' (`yolo5l.infer.boxes`) and the LightningModule's."""
    import yolo5l.infer.boxes as boxes
    import yolo5l.training.module as module

    return _threads_at(monkeypatch, "non_max_suppression", boxes, module)


VAL = ["data.num_workers=0", "trainer.accelerator=cpu", "trainer.precision=32", "plots=false", "data.imgsz=64",
       "data.val_batch_size=2", "data.cache=none"]  # fmt: skip


@pytest.mark.parametrize("task", ["speed", "val"])
def test_val_beside_a_busy_process_runs_at_fewer_threads(free_cores, tiny, tmp_path, monkeypatch, capsys, task):
    from yolo5l.validation import validate_weights

    free_cores.free = 0.9
    seen = _nms_threads(monkeypatch)
    cfg = compose_config([f"weights={tiny['weights']}", f"data.file={tiny['data']}", f"task={task}", *VAL], "val",
                         tmp_path / "run")  # fmt: skip
    validate_weights(cfg)
    assert seen
    assert set(seen) == {1}
    assert "intra-op threads: 2 -> 1 (about 0.9 of 2 cores free at the start)" in capsys.readouterr().out
    assert torch.get_num_threads() == 2  # given back


def test_val_on_a_quiet_machine_keeps_every_owned_core(free_cores, tiny, tmp_path, monkeypatch, capsys):
    from yolo5l.validation import validate_weights

    seen = _nms_threads(monkeypatch)
    cfg = compose_config([f"weights={tiny['weights']}", f"data.file={tiny['data']}", "task=speed", *VAL], "val",
                         tmp_path / "run")  # fmt: skip
    validate_weights(cfg)
    assert seen
    assert set(seen) == {2}
    assert free_cores.calls == 1
    assert "intra-op threads" not in capsys.readouterr().out


def test_predict_beside_a_busy_process_runs_at_fewer_threads(free_cores, tiny, tmp_path, monkeypatch, capsys):
    from yolo5l.predict import predict

    free_cores.free = 0.9
    seen = _nms_threads(monkeypatch)
    cfg = compose_config([f"weights={tiny['weights']}", f"source={tiny['images']}", "device=cpu",
                          "save_images=false"], "predict", tmp_path / "run")  # fmt: skip
    predict(cfg)
    assert seen
    assert set(seen) == {1}
    assert "intra-op threads: 2 -> 1 (about 0.9 of 2 cores free at the start)" in capsys.readouterr().out
    assert torch.get_num_threads() == 2


def test_export_checks_its_file_at_the_free_cores(free_cores, tiny, tmp_path, monkeypatch, capsys):
    import yolo5l.export as export
    import yolo5l.exporter as exporter

    free_cores.free = 0.9
    seen = _threads_at(monkeypatch, "load_exported", exporter)  # the file's run against PyTorch follows its load
    out = tmp_path / "w.torchscript"
    cfg = compose_config([f"weights={tiny['weights']}", f"output={out}", "format=torchscript", "device=cpu"],
                         "export", tmp_path / "run")  # fmt: skip
    export.export_weights(cfg)
    assert seen == [1]
    assert "intra-op threads: 2 -> 1 (about 0.9 of 2 cores free at the start)" in capsys.readouterr().out
    assert torch.get_num_threads() == 2


# ---- for real: a CPU-burning neighbour on the same cores -------------------------------------------------------------
@pytest.fixture
def busy_neighbour():
    """A `while True` loop in a session of its own (another job, as the scheduler's autogroups see it), on the
    first two cores of this process, where the test's commands run too; yields those cores. The loop is started
    through a launcher that exits at once, so it is no child of this process: a command counts its own children's
    CPU time (DataLoader workers) as its own, and would count the neighbour's too."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2 or hw.owned_cores() < 2:
        pytest.skip("needs two cores")
    loop = f"import os\nos.sched_setaffinity(0, {set(cores)})\nprint(os.getpid(), flush=True)\nwhile True: pass"
    launch = (
        f"import subprocess, sys\nchild = subprocess.Popen([sys.executable, '-c', {loop!r}], "
        "stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)\n"
        "print(child.stdout.readline().decode().strip())"
    )
    pid = int(subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, check=True).stdout)
    try:
        time.sleep(0.3)  # pinned, and spinning from here
        yield cores
    finally:
        os.kill(pid, signal.SIGKILL)


def test_start_threads_measures_a_busy_neighbour(two_threads, busy_neighbour, monkeypatch):
    monkeypatch.setattr(hw, "owned_cores", lambda: 2)
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, busy_neighbour)
    try:
        threads, why = hw.start_threads()
    finally:
        os.sched_setaffinity(0, old)
    assert threads == 1, why
    assert why is not None
    assert why.startswith("intra-op threads: 2 -> 1 (about ")


def _val_speed(tmp_path: Path, cores: list[int], **env: str) -> subprocess.CompletedProcess:
    args = [f"weights={DEPLOY_WEIGHTS}", "task=speed", "data.imgsz=64", "data.val_batch_size=2",
            f"data.synthetic.root={tmp_path / 'syn'}", "data.synthetic.num_train=2", "data.synthetic.num_val=2",
            "data.num_workers=0", "trainer.accelerator=cpu", "trainer.precision=32", "plots=false",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return subprocess.run(
        ["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-m", "yolo5l.val", *args],
        capture_output=True, text=True, timeout=300, env={**base, "HYDRA_FULL_ERROR": "1", **env}, cwd=ROOT,
    )  # fmt: skip


def test_val_command_beside_a_busy_process_picks_one_thread(busy_neighbour, tmp_path):
    done = _val_speed(tmp_path, busy_neighbour)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "intra-op threads: 2 -> 1 (about " in done.stdout, done.stdout[-3000:]
    assert sum(ln.startswith("Speed: ") for ln in done.stdout.splitlines()) == 2


@pytest.mark.heavy  # a second command beside the neighbour: CI runs it; test_an_explicit_count_wins is the rule
def test_val_command_beside_a_busy_process_keeps_an_explicit_count(busy_neighbour, tmp_path):
    pinned = _val_speed(tmp_path, busy_neighbour, OMP_NUM_THREADS="2")
    assert pinned.returncode == 0, pinned.stderr[-3000:]
    assert "intra-op threads" not in pinned.stdout
    assert sum(ln.startswith("Speed: ") for ln in pinned.stdout.splitlines()) == 2


def test_benchmark_measures_once_for_all_its_formats(free_cores, tiny, tmp_path, monkeypatch, capsys):
    from yolo5l.benchmark import benchmark

    free_cores.free = 0.9
    seen = _nms_threads(monkeypatch)
    cfg = compose_config([f"weights={tiny['weights']}", f"data.file={tiny['data']}", "formats=[pytorch,torchscript]",
                          "timing_runs=1", "data.num_workers=0", "data.cache=none", "data.imgsz=64"], "benchmark",
                         tmp_path / "run")  # fmt: skip
    rows = benchmark(cfg)
    assert [r.status for r in rows] == ["ok", "ok"]
    assert free_cores.calls == 1  # the validations and the export inside keep the benchmark's count
    assert seen
    assert set(seen) == {1}
    assert capsys.readouterr().out.count("intra-op threads: 2 -> 1") == 1
    assert torch.get_num_threads() == 2


def test_onnxruntime_and_openvino_sessions_take_the_commands_thread_count(tmp_path, monkeypatch):
    """An exported file runs at the command's count (the cores free at its start), not its runtime's own pool of one
    thread per physical core: onnxruntime's intra-op threads, OpenVINO's INFERENCE_NUM_THREADS."""
    ort = pytest.importorskip("onnxruntime")
    from yolo5l.base.errors import UserError
    from yolo5l.deploy.exported import ExportedModel

    seen = {}

    def session(path, options, providers):
        seen["ort"] = options.intra_op_num_threads
        raise RuntimeError("stop here")

    monkeypatch.setattr(ort, "InferenceSession", session)
    (tmp_path / "m.onnx").write_bytes(b"x")
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with pytest.raises(UserError):
            ExportedModel(tmp_path / "m.onnx")
    finally:
        torch.set_num_threads(n)
    assert seen["ort"] == 1
    ov = pytest.importorskip("openvino")
    from yolo5l.deploy import openvino as ov_format

    class Core:
        def read_model(self, path):
            return "model"

        def compile_model(self, model, device, config):
            seen["ov"] = config["INFERENCE_NUM_THREADS"]
            raise RuntimeError("stop here")

    monkeypatch.setattr(ov, "Core", Core)
    folder = tmp_path / "m_openvino_model"
    folder.mkdir()
    (folder / "m.xml").write_text("<net/>")
    try:
        torch.set_num_threads(1)
        with pytest.raises(UserError):
            ov_format.load_openvino(folder, torch.device("cpu"))
    finally:
        torch.set_num_threads(n)
    assert seen["ov"] == 1
