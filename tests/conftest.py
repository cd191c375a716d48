from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

#: The test session's scratch area, inside the repository (.gitignore ignores it): the session's temporary files
#: (pytest's tmp_path folders among them, kept only for failed tests, for one session) and a home folder for what
#: libraries would otherwise write under the user's $HOME. `make clean` removes it.
SCRATCH = Path(__file__).resolve().parents[1] / ".test-scratch"
TMP = SCRATCH / "tmp"
HOME = SCRATCH / "home"
#: multiprocessing puts AF_UNIX sockets (DataLoader workers share tensors through them) in $TMPDIR/pymp-*/, and a
#: socket's path has at most 107 bytes: a longer checkout path keeps the system temp folder for everything else.
SOCKET_TMPDIR_MAX = 64

#: Telemetry switches, read when the library loads (onnxruntime at import): set before any test imports one, and
#: inherited by subprocesses. Without them onnxruntime writes a device id and an event database under
#: ~/.cache/Microsoft/DeveloperTools/.onnxruntime at import, and MLflow an installation id in
#: ~/.config/mlflow/telemetry.json (yolo5l switches MLflow's off too, but a test may import mlflow first).
TELEMETRY_OFF = {"ORT_DISABLE_TELEMETRY": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}


def _session_environment() -> dict[str, str]:
    """The variables this session sets: telemetry off, and $HOME, the XDG folders and the temp folder in SCRATCH, so
    that caches, settings and files of libraries not switched off here (OpenVINO's usage statistics in ~/intel,
    matplotlib's font cache, the compiled kernels) stay in the repository."""
    env = {**TELEMETRY_OFF, **{k: os.environ[k] for k in TELEMETRY_OFF if k in os.environ}}
    env.update(
        HOME=str(HOME), XDG_CACHE_HOME=str(HOME / ".cache"), XDG_CONFIG_HOME=str(HOME / ".config"),
        XDG_DATA_HOME=str(HOME / ".local" / "share"), XDG_STATE_HOME=str(HOME / ".local" / "state"),
        PYTEST_DEBUG_TEMPROOT=str(TMP),  # pytest's tmp_path root, whatever the length
    )  # fmt: skip
    if len(str(TMP)) <= SOCKET_TMPDIR_MAX:
        env["TMPDIR"] = str(TMP)
    return env


for _folder in (TMP, HOME):
    _folder.mkdir(parents=True, exist_ok=True)
os.environ.update(_session_environment())
tempfile.tempdir = None  # tempfile reads $TMPDIR again on its next call
# yolo5l's user cache (label-scan logs and locks, read-only fallbacks): one folder per session, removed at its end;
# subprocesses inherit it.
SESSION_CACHE: str | None = None  # None where the variable came set
if "YOLO5L_CACHE_DIR" not in os.environ:
    SESSION_CACHE = os.environ["YOLO5L_CACHE_DIR"] = tempfile.mkdtemp(prefix="yolo5l-test-cache-", dir=TMP)

import _module_helpers as helpers  # noqa: E402 (after the environment: yolo5l's imports load matplotlib)
import torch  # noqa: E402

# One intra-op thread for the session's in-process work: its models are tiny, and at 2 threads on 2 cores each of
# torch's OpenMP regions ends with one thread spinning until the other is scheduled again, which beside any other
# load (a DataLoader worker, a subprocess of the test, another job) made tiny trainings several times slower (a
# 118 s selection of tests took 22 s at one thread on a loaded 2-core machine). The tests of the thread logic set
# their own counts (tests/test_cpu_threads.py, tests/test_command_threads.py); subprocesses decide theirs.
torch.set_num_threads(1)


def pytest_unconfigure(config):
    if SESSION_CACHE is not None:
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


#: The signals whose handlers a test must give back: one left ignored or caught passes to every process the session
#: starts after it (SIG_IGN survives exec), and a child that ignores SIGTERM hangs whoever stops it with terminate()
#: (multiprocessing's Pool on leaving `with`, and at exit).
GUARDED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP") if hasattr(signal, name)
)


def _acts_as(handler, before, signum: int) -> bool:
    """Whether `handler` is `before`, or a PreemptionCheckpoint's handler after its fit, which passes the signal on to
    `before` (Lightning's teardown after a `Preempted` exit puts back the handlers it found: the callback's)."""
    if handler == before:
        return True
    owner = getattr(handler, "__self__", None)
    if type(owner).__name__ != "PreemptionCheckpoint" or owner._active:
        return False
    passed_to = owner._original.get(int(signum))
    return passed_to == before or (passed_to is None and before == signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _signal_handlers_given_back():
    """Fail the test that leaves a signal handler changed (and put the handler back, for the tests after it)."""
    before = {s: signal.getsignal(s) for s in GUARDED_SIGNALS}
    yield
    changed = {s: h for s, h in before.items() if not _acts_as(signal.getsignal(s), h, s)}
    for s, handler in changed.items():
        signal.signal(s, handler)
    if changed:
        names = ", ".join(signal.Signals(s).name for s in changed)
        pytest.fail(f"the test left the handler of {names} changed (put back now): restore it in the test")


@pytest.fixture(autouse=True)
def _absl_keeps_off_pytest_capture():
    """`import openvino` imports absl, whose log handler keeps the `sys.stderr` of that moment (pytest's capture) and
    closes it when Hydra's logging set-up closes every handler, unless it is the `sys.stderr` of that later moment:
    an in-process command under `capsys` would close pytest's capture for the rest of the session. After each test
    the handler writes to the process's own stderr, which it never closes."""
    yield
    absl_logging = sys.modules.get("absl.logging")
    if absl_logging is not None:
        absl_logging.get_absl_handler().python_handler.setStream(sys.__stderr__)


@pytest.fixture
def one_thread():
    """One intra-op thread, whatever a test set before (the session's own count is 1 too: see above)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_module():
    """Factory of a seeded 2-class yolov5 `YOLOv5Module` at width 0.125 (64 px images), built like
    conf/module/yolov5.yaml: `tiny_module(nbs=8, ciou_backend="auto", map_backend="yolov5", **module_kwargs)`."""
    return helpers.tiny_module


@pytest.fixture
def tiny_data():
    """The `TinyData` LightningDataModule class: `tiny_data(n=8, batch_size=4, delay=0.0)` gives deterministic
    64 px images with one box each, the same images for training and validation (subclass it to change a hook)."""
    return helpers.TinyData


@pytest.fixture
def tiny_collate():
    """`TinyData`'s collate function: (images, targets [image, class, cx, cy, w, h], paths, shapes)."""
    return helpers.collate


@pytest.fixture
def make_trainer():
    """Factory of a quiet CPU trainer: `make_trainer(tmp_path, callbacks=(), **trainer_kwargs)`, 2 epochs, no logger,
    no sanity check, checkpointing only when a callback has a `dirpath`."""
    return helpers.make_trainer


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: Set by `make test-ci` (CI builds .refvenv first): a `reference` test that skips, because the v7.0 environment is
#: missing or cannot run a format, fails instead, so that CI checks what the reference tests promise.
REQUIRE_REFERENCE = os.environ.get("YOLO5L_REQUIRE_REFERENCE", "") not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_REFERENCE and report.skipped and item.get_closest_marker("reference") is not None:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"a reference test skipped where YOLO5L_REQUIRE_REFERENCE is set: {reason}"
