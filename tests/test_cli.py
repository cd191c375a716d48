"""`python -m yolo5l.train` as a user runs it: the files it writes, where it says they are, and its error messages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yolo5l.base.errors import shown_path
from yolo5l.tracking.loggers import CORE_COLUMNS, read_metrics_csv

TESTS = Path(__file__).parent
# tests/ on the path of the subprocesses: the fault-injection callback (_fault.CrashAtEpoch) lives there.
ENV = {
    **os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
    "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p),
}  # fmt: skip


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
        assert shown_path(run / name) in r.stdout  # the summary names every output (relative below the folder)
    # Everything written before exit is complete on disk.
    (events,) = run.glob("events.out.tfevents.*")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"train/loss", "val/map_50", "val/map"} <= set(tags), tags
    rows = read_metrics_csv(run / "metrics.csv")
    assert len(rows) == 1
    assert rows[0]["epoch"] == "0"
    assert list(rows[0])[: len(CORE_COLUMNS)] == list(CORE_COLUMNS)
    for col in ("train/loss_box", "train/loss_obj", "train/loss_cls", "val/map_50", "val/map"):
        assert rows[0][col] != "", col
    ckpt = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0
    assert ckpt["global_step"] > 0
    # What a user watches: a line per epoch and the best/last rows, none of Lightning's noise.
    console = r.stdout + r.stderr
    assert any(ln.startswith("epoch 0/0  box ") and "  P " in ln and "images/s" in ln for ln in r.stdout.splitlines())
    assert "best (epoch 0): P " in r.stdout
    # nanobind bindings list "leaked" objects at shutdown when objects are still frozen then: the work block
    # (yolo5l._cli.running) hands them back to the collector before the command ends (the whole teardown: below).
    for noise in ("Tip: For seamless cloud logging", "LeafSpec", "not supported by the model summary", "nanobind"):
        assert noise not in console, noise


def test_the_command_line_ends_after_a_joblib_pool():
    # Hydra's joblib launcher leaves loky's manager thread running; the interpreter stops it through the threading
    # module's exit hooks before joining threads: a command that ran one ends, without hanging or a leak report.
    pytest.importorskip("joblib")
    code = (
        "from joblib import Parallel, delayed\n"
        "from yolo5l._cli import run_entry_point, running\n"
        "from yolo5l.val import main  # as pip's console script (yolo5l-val): the command line\n"
        "def work():\n"
        "    with running():\n"
        "        print(Parallel(n_jobs=2, backend='loky')(delayed(abs)(-i) for i in range(4)), flush=True)\n"
        "run_entry_point(work, 'train')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0
    assert done.stdout.strip() == "[0, 1, 2, 3]"
    assert "leaked" not in done.stderr


def test_the_command_line_ends_after_threads_and_atexit_handlers_without_the_teardown():
    """`yolo5l._cli.end_command_line`: the threads joined and the `atexit` handlers run, in the interpreter's order,
    with the command's exit status; the module teardown after them is left out, unless `YOLO5L_FULL_SHUTDOWN=1`."""
    code = (
        "import atexit, threading, time\n"
        "from yolo5l._cli import run_entry_point, running\n"
        "from yolo5l.val import main  # as pip's console script (yolo5l-val): the command line\n"
        "class Torn:\n"
        "    def __del__(self):\n"
        "        print('torn down', flush=True)\n"
        "kept = Torn()  # a module global: freed when the interpreter tears the modules down\n"
        "def work():\n"
        "    with running():\n"
        "        atexit.register(print, 'atexit handler', flush=True)\n"
        "        threading.Thread(target=lambda: (time.sleep(0.3), print('thread finished', flush=True))).start()\n"
        "        print('work done', flush=True)\n"
        "    raise SystemExit(3)\n"
        "run_entry_point(work, 'train')\n"
    )
    lines = ["work done", "thread finished", "atexit handler"]
    for full, more in (("0", []), ("1", ["torn down"])):
        env = {**ENV, "YOLO5L_FULL_SHUTDOWN": full}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 3, done.stderr[-2000:]
        assert done.stdout.splitlines() == lines + more, full


@pytest.mark.heavy  # whole commands: CI runs it (make test-ci), `make test` stays light
def test_a_command_ends_alike_through_the_interpreters_whole_teardown(tmp_path):
    """The teardown the command line leaves out has nothing left to do or to report: with `YOLO5L_FULL_SHUTDOWN=1`
    a command prints the same and ends the same, with no "leaked" lines (export imports onnx, whose nanobind bindings
    count their objects at the end of a whole teardown: any still frozen would be listed) and, in Python's
    development mode, no unclosed file and no exception ignored at shutdown."""
    weights = Path(__file__).parent / "data" / "deploy_yolov5n.pt"
    out = {}
    for full in ("0", "1"):
        cwd = tmp_path / full
        cwd.mkdir()
        done = subprocess.run(
            [sys.executable, "-X", "dev", "-m", "yolo5l.export", f"weights={weights}", "imgsz=128", "output=w.onnx",
             "hydra.run.dir=run"],
            cwd=cwd, capture_output=True, text=True, timeout=300, env={**ENV, "YOLO5L_FULL_SHUTDOWN": full},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        for noise in ("leaked", "ResourceWarning", "Exception ignored", "Traceback"):
            assert noise not in done.stderr, (full, done.stderr[-2000:])
        assert (cwd / "w.onnx").stat().st_size > 1_000_000
        out[full] = done.stdout
    assert "max abs difference" in out["0"]
    assert out["0"] == out["1"]


def test_collector_is_paused_for_start_up_and_running_for_training(tmp_path, monkeypatch):
    """The command line holds the cyclic GC off while it imports and builds, then freezes what it built and turns the
    collector back on before `fit`: training's own cycles (autograd graphs, exceptions) are collected as usual. After
    the run it hands the frozen objects back (a sweep's next run needs the memory of this one's trainer and cache)."""
    import gc

    import yolo5l.train as tr

    seen = {}
    real_build, real_train = tr.build, tr.train

    def build(*args, **kwargs):
        seen["build"] = gc.isenabled()
        built = real_build(*args, **kwargs)

        def fit(*_a, **_k):  # the run itself is tested above
            seen["fit"] = gc.isenabled()
            seen["frozen"] = gc.get_freeze_count()

        built[2].fit = fit
        return built

    def train(cfg):
        out = real_train(cfg)
        seen["after"] = gc.get_freeze_count()
        return out

    monkeypatch.setattr(tr, "build", build)
    monkeypatch.setattr(tr, "train", train)
    monkeypatch.setattr(sys, "argv", ["yolo5l.train", *smoke_args(tmp_path)])
    frozen_before = gc.get_freeze_count()
    try:
        tr.main()
        seen["exit"] = gc.get_freeze_count()
    finally:
        gc.unfreeze()
        gc.enable()
    assert seen["build"] is False
    assert seen["fit"] is True
    assert seen["frozen"] > frozen_before + 10_000  # modules, config, model, trainer
    assert seen["after"] == frozen_before  # handed back when the run ends
    assert seen["exit"] == frozen_before  # called from code (not the command line), main() returns with none frozen
    # Outside the command line (a notebook), the collector is left as it is.
    from yolo5l._cli import running

    with running():
        assert gc.get_freeze_count() == 0


MISTAKES = [
    ("train", ["model=yolov9"], "unknown model 'yolov9': choose one of yolov5l, yolov5l6, yolov5m, yolov5m6, yolov5n,"),
    ("train", ["data.file=/no/such/data.yaml"], "data.file='/no/such/data.yaml': file not found"),
    ("train", ["trainer.devices=2", "trainer.accelerator=cpu", "data.batch_size=15"], "does not divide by the 2"),
    ("train", ["trainer.max_epochs=abc"], "trainer.max_epochs='abc' must be a whole number"),
    ("train", ["data.cache=gpu"], "data.cache='gpu' is not one of: none, ram, disk"),
    ("val", [], "weights= is required"),
    ("val", ["weights={w}", "data.imgsz=0"], "data.imgsz=0 must be a positive image size in pixels"),
    ("val", ["weights={w}", "module/metric=voc"], "unknown module/metric 'voc'"),
    ("predict", ["source=a.jpg"], "weights= is required"),
    ("predict", ["weights={w}", "source=/no/such/folder"], "source '/no/such/folder' not found"),
    ("predict", ["weights=/no/w.pt", "source=a.jpg"], "weights='/no/w.pt': file not found"),
]  # the same checks run in-process, one by one, in test_config.py


@pytest.mark.heavy
@pytest.mark.parametrize(("entry", "args", "needle"), MISTAKES)
def test_mistakes_are_one_line_exit_2_and_leave_no_run_folder(tmp_path, entry, args, needle):
    w = tmp_path / "w.pt"
    w.write_bytes(b"not read: the config check comes first")
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", f"yolo5l.{entry}", f"hydra.run.dir={run_dir}", *(a.format(w=w) for a in args)],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ")
    assert needle in lines[-1]
    assert sum(ln.startswith("error:") for ln in lines) == 1
    assert not run_dir.exists()


def convert(argv: list[str], capsys) -> tuple[int, list[str]]:
    """`python -m yolo5l.convert *argv` in this process (the module runs `sys.exit(main())`): its exit status and
    the lines of its stderr. The command line itself, import to exit, is run once below."""
    from yolo5l.convert import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's mistakes end in the parser
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["/no/such.pt", "{out}"], "/no/such.pt"),
        (["{w}", "{w}"], "would overwrite the source"),
        (["{w}", "{out}", "--num-classes", "0"], "--num-classes must be >= 1"),
        (
            ["best.onnx", "{out}"],
            "error: best.onnx: an exported model (format=onnx), which cannot be converted: give "
            "the .pt it was exported from (best.pt, weights.pt or last.ckpt)",
        ),
        (["best_openvino_model", "{out}"], "best_openvino_model: an exported model (format=openvino)"),
    ],
)
def test_convert_mistakes_are_one_line(tmp_path, capsys, args, needle):
    w = tmp_path / "w.pt"
    w.write_bytes(b"x")
    code, lines = convert([a.format(w=w, out=tmp_path / "out.pt") for a in args], capsys)
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert needle in lines[0]
    assert not (tmp_path / "out.pt").exists()


def test_a_convert_mistake_on_the_command_line_is_one_line_and_status_2(tmp_path):
    """The process around `main`: nothing else on stderr (no traceback, no library's noise at import or exit)."""
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.convert", str(tmp_path / "missing.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"error: {tmp_path / 'missing.pt'}: no such file")
    assert r.stdout == ""
    assert not (tmp_path / "out.pt").exists()


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k, v in a.items():
        assert torch.equal(b[k], v), f"{what}: {k} differs by {(b[k].float() - v.float()).abs().max()}"


@pytest.mark.slow
@pytest.mark.parametrize(("num_workers", "crash_epoch"), [(0, 1), (2, 2)])
def test_resume_after_crash_matches_uninterrupted_run(tmp_path, num_workers, crash_epoch):
    """A run killed at the start of an epoch and resumed from its last.ckpt with the same config ends bit-identical to
    the run that was never interrupted: EMA and raw weights, optimizer and scheduler state, counters. With the full
    default augmentation (mosaic, perspective, HSV, flips, albumentations), in-process and in 2 persistent workers."""
    common = [
        "trainer.max_epochs=3",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=1",
        f"data.num_workers={num_workers}",
        f"data.persistent_workers={num_workers > 0}",
        "~callbacks.batch_plotter",
        "logger=csv",
    ]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    r = run_train(*smoke_args(straight, *common), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    crash = ["+callbacks.crash._target_=_fault.CrashAtEpoch", f"+callbacks.crash.epoch={crash_epoch}"]
    r = run_train(*smoke_args(crashed, *common, *crash), timeout=600)
    assert r.returncode != 0
    assert f"killing the process at the start of epoch {crash_epoch}" in r.stdout
    last = crashed / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["epoch"] == crash_epoch - 1
    assert not (crashed / "run" / "checkpoints" / "weights.pt").exists()  # nothing written after the crash
    # The checkpoint keeps the run's config, the fault callback with it: the resume turns it off (a crash has none).
    r = run_train(*smoke_args(crashed, *common, f"resume={last}", "~callbacks.crash"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    a = torch.load(straight / "run/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    b = torch.load(last, map_location="cpu", weights_only=False)
    assert a["epoch"] == b["epoch"] == 2
    assert a["global_step"] == b["global_step"] > 0
    _assert_same_tensors(a["state_dict"], b["state_dict"], "EMA weights")
    _assert_same_tensors(a["current_model_state"], b["current_model_state"], "raw weights")
    (oa,), (ob,) = a["optimizer_states"], b["optimizer_states"]
    assert oa["param_groups"] == ob["param_groups"]  # lr, momentum, initial_lr: plain floats
    assert oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        _assert_same_tensors(oa["state"][k], ob["state"][k], f"optimizer state {k}")
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["yolo5l_last_opt_step"] == b["yolo5l_last_opt_step"]
    ema_a = next(v for k, v in a["callbacks"].items() if k.startswith("EMACallback"))
    ema_b = next(v for k, v in b["callbacks"].items() if k.startswith("EMACallback"))
    assert ema_a == ema_b

    # A finished run refuses to resume, in one line.
    r = run_train(*smoke_args(tmp_path / "again", *common, f"resume={last}"), timeout=120)
    assert r.returncode == 2
    assert "nothing to resume: extend it with trainer.max_epochs=N, any N above" in r.stderr


@pytest.mark.slow
def test_learns_on_synthetic(tmp_path):
    """A short real CPU training on the synthetic shapes lifts mAP@0.5 well above chance (~0): above 0.5."""
    r = run_train(
        "experiment=synthetic_learn",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"data.synthetic.root={tmp_path / 'synthetic'}",
        timeout=3000,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics_csv(tmp_path / "run" / "metrics.csv")
    best = max(float(row["val/map_50"]) for row in rows if row["val/map_50"])
    assert best > 0.5, rows  # measured: 0.87 mAP@0.5 (0.51 mAP@0.5:0.95) after 25 epochs


@pytest.mark.slow
def test_device_pipeline_learns_as_the_host_pipeline(tmp_path):
    """The same training with the pixels made by the device path (here the CPU stands in for the GPU): the same
    draws and labels, pixels within rounding, so mAP@0.5 lands within the seed-to-seed noise of the host path's."""
    best = {}
    for pipeline in ("host", "device"):
        r = run_train(
            "experiment=synthetic_learn",
            f"data.pipeline={pipeline}",
            f"hydra.run.dir={tmp_path / pipeline}",
            f"data.synthetic.root={tmp_path / 'synthetic'}",
            timeout=3000,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"pipeline:   {pipeline}" in r.stdout
        rows = read_metrics_csv(tmp_path / pipeline / "metrics.csv")
        best[pipeline] = max(float(row["val/map_50"]) for row in rows if row["val/map_50"])
    print(f"best mAP@0.5: {best}")
    assert best["device"] > 0.5, best
    assert abs(best["device"] - best["host"]) < 0.15, best  # seeds alone spread mAP@0.5 over 0.64-0.88


def _hydra_cfg(tmp_path, mode: str, run_dir: str):
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"hydra": {"run": {"dir": run_dir}, "sweep": {"dir": f"{tmp_path}/sweep/${{now:%Y}}"}}})
    cfg.hydra.mode = RunMode[mode]
    return cfg


def test_a_command_started_in_the_same_second_gets_a_run_folder_of_its_own(tmp_path):
    """Two commands whose time stamp is the same (two GPUs, a script's parallel runs) shared one folder and wrote
    over each other's checkpoints; now the second takes `<stamp>_2`, as v7.0 numbers exp, exp2."""
    from hydra.core.utils import setup_globals

    from yolo5l.config import claim_run_folder

    setup_globals()  # Hydra's ${now:...} resolver, as a command has it

    stamped = f"{tmp_path}/train/${{now:%Y}}"
    first, second = _hydra_cfg(tmp_path, "RUN", stamped), _hydra_cfg(tmp_path, "RUN", stamped)
    one, two = claim_run_folder(first, ["seed=1"]), claim_run_folder(second, ["seed=2"])
    assert two == one.with_name(f"{one.name}_2")
    assert one.is_dir()
    assert two.is_dir()
    assert (first.hydra.run.dir, second.hydra.run.dir) == (str(one), str(two))  # fixed: no second ${now:...}
    sweep = claim_run_folder(_hydra_cfg(tmp_path, "MULTIRUN", stamped), [])
    assert sweep.parent == tmp_path / "sweep"

    typed = _hydra_cfg(tmp_path, "RUN", stamped)
    assert claim_run_folder(typed, [f"hydra.run.dir={one}"]) is None  # a folder the user names is written into
    assert claim_run_folder(_hydra_cfg(tmp_path, "RUN", f"{tmp_path}/mine"), []) is None
    assert not (tmp_path / "mine").exists()
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [one.name, two.name]
