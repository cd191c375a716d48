"""Output that is yolo5l's: what third-party libraries print during an export reaches the console as yolo5l's
`warning: ...` lines or not at all (`yolo5l.base.console.library_output`), a weights load prints nothing itself
(training says what it transferred, once), and no progress bar is drawn where stdout is not a terminal, nor left
behind unused on one."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel
from tqdm import tqdm

from yolo5l.base.console import ConsoleFormatter, ConsoleHandler, clean_lines, library_line, library_output
from yolo5l.callbacks.progress_bar import NoBar, YOLOProgressBar, with_console_progress
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.models.weights import load_weights, save_weights
from yolo5l.models.yolo import YOLOv5

NAMES = ["rectangle", "ellipse", "triangle", "cross"]  # the synthetic dataset's classes
IMGSZ = 64
#: A line that a yolo5l command prints: its own `[yolo5l] ...`, a warning or error in its one-line form, the outputs
#: block (`Outputs:` and its indented rows), a blank line.
YOLO5L_LINE = re.compile(r"^(?:\[yolo5l\] |warning: |error: |Outputs:$|  \S[^:]*: |$)")
BAR_TRACES = ("\r", "━", "it/s", "\x1b[")

# ---- library_output and the run log -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        ("I0000 00:00:1795720273.613855   27525 flatbuffer_export.cc:4410] Estimated count of arithmetic ops", None),
        ("W1126 19:13:44.373000 29124 converter.cc:12] a real concern", "warning: a real concern"),
        ("E0000 00:00:1.5   7 lower.cc:3] op  'foo'\tis not supported", "warning: op 'foo' is not supported"),
        ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", None),
        ("INFO: Created TensorFlow Lite XNNPACK delegate for CPU.", None),
        ("ERROR: Didn't find op for builtin opcode 'X'", "warning: Didn't find op for builtin opcode 'X'"),
        ("\rRunning Calibration::  10%|█         | 190/1992 [00:00<00:00, 1897.62it/s]", None),
        ("Running MIL frontend_milinternal pipeline: 0 passes [00:00, ? passes/s]", None),
        ("Statistics collection ━━━━━━━━━━━━━━━━━━━━ 100% 1/1 • 0:00:00 • 0:00:00", None),
        ("[11/26/2026-19:13:44] [TRT] [W] onnx2trt: INT64 cast down", "warning: onnx2trt: INT64 cast down"),
        ("[11/26/2026-19:13:44] [TRT] [I] [MemUsageChange] Init CUDA: CPU +2, GPU +0", None),
        ("warning: already one line", "warning: already one line"),
        ("   ", None),
        ("something a C library printed", "warning: something a C library printed"),
    ],
)
def test_library_line(line, shown):
    assert library_line(line) == shown


def test_library_line_drops_what_the_caller_ignores():
    assert library_line("note: for debugging only", (re.compile("debugging"),)) is None


def test_c_level_stderr_is_folded_and_its_chatter_dropped(capfd):
    with library_output():
        os.write(
            2,
            b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
            b"I0000 00:00:1795720273.613855   27525 flatbuffer_export.cc:4410] Estimated count of arithmetic ops\n"
            b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n"
            b"W0000 00:00:1795720273.613855   27525 converter.cc:12] a real concern\n",
        )
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == ["warning: a real concern"]


def test_a_failure_keeps_what_the_library_said(capfd):
    def convert() -> None:
        os.write(2, b"E0000 00:00:1.5   7 lower.cc:3] op 'foo' is not supported\n")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"), library_output():
        convert()
    assert capfd.readouterr().err.splitlines() == ["warning: op 'foo' is not supported"]


@pytest.fixture
def command_logging():
    """Set the root logger as a command's job logging sets it (conf/hydra/job_logging/yolo5l.yaml): INFO, one console
    line per record on the current stdout (call it in the test, where pytest's capture is in place)."""
    root = logging.getLogger()
    level = root.level
    handlers = []

    def install() -> None:
        handler = ConsoleHandler(sys.stdout)
        handler.setFormatter(ConsoleFormatter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        handlers.append(handler)

    yield install
    for handler in handlers:
        root.removeHandler(handler)
    root.setLevel(level)


def test_library_logging_and_warnings(capfd, command_logging):
    command_logging()
    torch_loggers = [logging.getLogger(name) for name in ("torch", "torch.export")]
    torch_state = [(logger.propagate, list(logger.handlers)) for logger in torch_loggers]
    with library_output(ignore=(r"for debugging purposes",)):
        logging.getLogger().info("Use JAX lowering: aten.permute")  # litert-torch logs on the root logger
        logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu': no libtpu.so")
        logging.getLogger("ai_edge_quantizer").info("Serializing model...")
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='/cuda'")
        logging.getLogger("torch.utils._pytree").warning("register_constant() on Enum subclasses is deprecated")
        logging.getLogger("torch.export").warning("a torch warning")  # torch's own glog-style handler otherwise
        logging.getLogger("somelib").warning("Enabled for debugging purposes only")
        warnings.warn("x is deprecated", DeprecationWarning, stacklevel=1)
        warnings.warn("careful:\n  over two lines", UserWarning, stacklevel=1)
        warnings.warn("intended for debugging purposes only", UserWarning, stacklevel=1)
        print("a library's progress tree on stdout")
    out, err = capfd.readouterr()
    assert out.splitlines() == ["warning: a torch warning"]
    assert err.splitlines() == ["warning: careful: over two lines"]
    # Everything is as it was after the block.
    assert [(logger.propagate, list(logger.handlers)) for logger in torch_loggers] == torch_state
    assert logging.root.manager.disable == logging.NOTSET
    assert logging.getLogger("torch.utils.cpp_extension").level == logging.NOTSET
    logging.getLogger().info("a command's own record")
    assert capfd.readouterr().out == "a command's own record\n"


class _Terminal(io.TextIOWrapper):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_library_bar_is_drawn(capfd, monkeypatch):
    terminal = _Terminal(open(os.dup(2), "wb"), encoding="utf-8", line_buffering=True, write_through=True)
    monkeypatch.setattr(sys, "stderr", terminal)
    try:
        with library_output():
            for _ in tqdm(range(3), desc="Running Calibration:", mininterval=0):
                os.write(2, b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n")
    finally:
        terminal.close()
    err = capfd.readouterr().err
    assert "Running Calibration:" in err
    assert "3/3" in err
    assert "XNNPACK" not in err


def test_off_a_terminal_a_library_bar_is_not_drawn(tmp_path):
    """stderr a file (a subprocess: pytest's own capture would take Python's writes before the file does)."""
    script = (
        "import sys\n"
        "from tqdm import tqdm\n"
        "from yolo5l.base.console import library_output\n"
        "with library_output():\n"
        "    for _ in tqdm(range(200), desc='Running Calibration:', disable=False, mininterval=0): pass\n"
        "    print('a library on stdout')\n"
        "print('[yolo5l] done')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout == "[yolo5l] done\n"
    assert r.stderr == ""


def test_the_run_log_drops_a_rich_bar():
    lines, _ = clean_lines("val: 8 images\nValidation ━━━━━━━━━━━━━━━━━━━━ 1/1 0:00:00 • 0:00:00 0.00it/s \n\n")
    assert lines == ["val: 8 images", ""]


# ---- commands -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quiet")


@pytest.fixture(scope="module")
def weights(tmp) -> Path:
    """An untrained yolov5n for the synthetic classes."""
    torch.manual_seed(0)
    return save_weights(YOLOv5.from_name("yolov5n", num_classes=len(NAMES)), tmp / "w.pt", names=NAMES, half=False)


@pytest.fixture(scope="module")
def dataset(tmp) -> Path:
    root = tmp / "synthetic"
    ensure_synthetic(root, num_train=8, num_val=8, seed=0)
    return root


def _command(module: str, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m yolo5l.<module> ...` with stdout and stderr pipes (not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", f"yolo5l.{module}", *args], capture_output=True, text=True, timeout=600, cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )  # fmt: skip


def _not_yolo5ls(text: str) -> list[str]:
    return [line for line in text.split("\n") if not YOLO5L_LINE.match(line)]


# ---- weights ------------------------------------------------------------------------------------------------------


def test_a_weights_load_prints_nothing_on_a_commands_console(weights, caplog, capfd, command_logging):
    """The loader's `Transferred 349/349 items` record is for an API user's logging, not the console."""
    caplog.set_level(logging.INFO)
    command_logging()
    _, info = load_weights(weights)
    assert (info.transferred, info.total) == (349, 349)
    (record,) = [r for r in caplog.records if "ransferred" in r.getMessage()]
    assert record.getMessage() == f"Transferred 349/349 items from {weights}"
    assert capfd.readouterr() == ("", "")


def test_training_says_what_it_transferred_once_in_yolo5l_form(weights, dataset, tmp):
    r = _command(
        "train",
        ["experiment=smoke", f"hydra.run.dir={tmp / 'run_train'}", f"data.file={dataset}/data.yaml",
         f"data.imgsz={IMGSZ}", f"weights={weights}", "trainer.max_epochs=1", "trainer.limit_train_batches=1",
         "trainer.limit_val_batches=1", "plots=false"],
        tmp,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in (r.stdout + r.stderr).splitlines() if "ransferred" in line]
    assert said == [f"[yolo5l] transferred 349/349 items from {weights} (yolov5n)"]
    for trace in BAR_TRACES:
        assert trace not in r.stdout + r.stderr, trace


def test_a_load_that_then_fails_prints_the_error_only(dataset, tmp):
    three = save_weights(YOLOv5.from_name("yolov5n", num_classes=3), tmp / "three.pt", half=False)
    r = _command(
        "val",
        [f"weights={three}", f"data.file={dataset}/data.yaml", f"data.imgsz={IMGSZ}", "trainer=cpu",
         "data.num_workers=0", f"hydra.run.dir={tmp / 'run_val_fail'}"],
        tmp,
    )  # fmt: skip
    assert r.returncode == 2
    assert "ransferred" not in r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"error: {three} predicts 3 classes but the dataset has 4: pass the data= or data.file= the weights were "
        "trained on"
    ]


# ---- exports ------------------------------------------------------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("fmt", "module"),
    [("tflite", "litert_torch"), ("openvino", "nncf")],
)
def test_an_int8_export_prints_only_yolo5l_lines(weights, dataset, tmp, fmt, module):
    """LiteRT: JAX's lowering notes, its TPU probe, absl's C++ lines, the quantizer's bars and its interpreter's
    debugging note; OpenVINO: NNCF's rich bars, torch's note on a CUDA_HOME without CUDA (NNCF imports torch's
    extension builder); torchao's deprecation notice when litert-torch loads it."""
    pytest.importorskip(module)
    run = tmp / f"run_{fmt}"
    cuda_home = tmp / "cuda"  # torch notes a CUDA_HOME it finds without a CUDA runtime
    cuda_home.mkdir(exist_ok=True)
    r = _command(
        "export",
        [f"weights={weights}", f"imgsz={IMGSZ}", f"format={fmt}", "int8=true", f"calib_data={dataset}/data.yaml",
         f"output={tmp / ('w-int8.tflite' if fmt == 'tflite' else 'w_int8_openvino_model')}", f"hydra.run.dir={run}"],
        tmp, CUDA_HOME=str(cuda_home),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert any(line.startswith("[yolo5l] ") and "max abs difference" in line for line in r.stdout.splitlines())
    assert _not_yolo5ls(r.stdout) == []
    assert _not_yolo5ls(r.stderr) == []
    for trace in BAR_TRACES:
        assert trace not in r.stdout + r.stderr, trace
    log = (run / "export.log").read_text()
    assert _not_yolo5ls(log) == []


# ---- progress bars ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def val_run(weights, dataset, tmp) -> tuple[subprocess.CompletedProcess, Path]:
    """`python -m yolo5l.val` with stdout and stderr pipes."""
    run = tmp / "run_val"
    r = _command(
        "val",
        [f"weights={weights}", f"data.file={dataset}/data.yaml", f"data.imgsz={IMGSZ}", "trainer=cpu",
         "data.num_workers=0", "plots=false", f"hydra.run.dir={run}"],
        tmp,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r, run


def test_val_log_has_no_bar(val_run):
    r, run = val_run
    log = (run / "val.log").read_text()
    assert "precision" in log  # the table
    for trace in BAR_TRACES:
        assert trace not in log, trace
    assert "ransferred" not in r.stdout + r.stderr  # val loads the whole file and says nothing of it, as v7.0's


def test_val_with_stdout_redirected_draws_no_bar(val_run):
    r, _ = val_run
    for trace in BAR_TRACES:
        assert trace not in r.stdout + r.stderr, trace


def test_with_console_progress(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # not a terminal
    plain = [BoringModel]  # any callback list entry that is not a progress bar
    (added,) = with_console_progress([])
    assert isinstance(added, NoBar)
    assert with_console_progress(plain)[:1] == plain
    bar = YOLOProgressBar()
    assert with_console_progress([bar]) == [bar]
    assert with_console_progress([bar, *plain], enabled=False) == plain


class _Screen(io.StringIO):
    """stdout as a terminal: what is left on it once every carriage return has done its work."""

    def isatty(self) -> bool:
        return True

    def lines(self) -> list[str]:
        text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", self.getvalue())
        return [line.rsplit("\r", 1)[-1].strip() for line in text.split("\n")]


@pytest.mark.parametrize("bar", [YOLOProgressBar, TQDMProgressBar])
def test_no_dead_training_bar_is_left_on_a_terminal(tmp_path, monkeypatch, bar):
    """Lightning's TQDMProgressBar with `leave=True` opens a `Training: | 0/?` bar at the start of fitting and a
    new bar every epoch, so the first one is left on screen unused; YOLOProgressBar does not open it."""
    screen = _Screen()
    monkeypatch.setattr(sys, "stdout", screen)
    trainer = Trainer(
        max_epochs=2, limit_train_batches=2, limit_val_batches=1, logger=False, enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu",
        callbacks=[bar(refresh_rate=1, leave=True)],
    )  # fmt: skip
    trainer.fit(BoringModel())
    shown = screen.lines()
    assert any(line.startswith("Epoch 1: 100%") for line in shown), shown  # the bars were drawn
    dead = [line for line in shown if line.startswith("Training")]
    assert (dead == []) == (bar is YOLOProgressBar), shown
