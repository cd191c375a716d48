"""What a command prints, and the copy of it in the run folder's log.

- `run_log()`: while a command runs, everything it prints to stdout and stderr (its own lines, Lightning's, the
  tables, warnings, a traceback) also goes to `<run folder>/<command>.log` (`train.log`), as the console shows it
  once the progress bars are gone: carriage-return redraws keep their last state, escape codes and bar lines are
  left out. Hydra's job logging (`conf/hydra/job_logging/yolo5l.yaml`) prints log records as plain lines to stdout,
  so they reach the log the same way.
- `ConsoleFormatter`, `ConsoleHandler`: a log record as one line (`warning: ...` for warnings), written above any
  progress bar on screen, never on the bar's line; a record marked `console: False` is left out.
- Python warnings print as one `warning: <message>` line (no file name, line number or source line).
- `is_terminal()`: whether stdout is a terminal; when it is not (a file, a pipe, a batch system's log), the progress
  bar callback draws nothing and `EpochLine`'s one line per epoch is the record (yolo5l/callbacks/progress_bar.py).
- `info`, `warn`, `print_outputs`, `fail`: the command's own lines (`[yolo5l] ...` on rank 0, `warning: ...`, the
  outputs block, the one-line `error: ...` with exit code 2); `is_rank_zero` decides which process prints.
- `library_output()`: around a call into a third-party converter or runtime (LiteRT, OpenVINO, NNCF): what the library
  prints reaches the console in yolo5l's form, a `warning: ...` line where it tells the user something, nothing where
  it is the library's own chatter or progress display off a terminal.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn, TextIO

from yolo5l.base.errors import EXIT_USAGE

__all__ = [
    "ConsoleFormatter",
    "ConsoleHandler",
    "clean_lines",
    "fail",
    "info",
    "is_rank_zero",
    "is_terminal",
    "library_line",
    "library_output",
    "print_outputs",
    "run_log",
    "warn",
]

#: ANSI escape sequences: colours, cursor moves (tqdm's nested bars move the cursor up), OSC titles.
_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
#: A progress bar's line: tqdm's counter and clock (`| 12/40 [00:03<00:08, 3.2it/s`, also `0/?`, `1.2k/3.4k`), its
#: clock and rate without a total (`0 passes [00:00, ? passes/s]`, `[01:02, 1.5s/it]`), or rich's bar (`Validation
#: ━━━━━━━━ 4/4 0:00:01`: Lightning's RichProgressBar, NNCF's progress).
_BAR = re.compile(r"\|\s*[\d.]+[kMG]?/(?:\?|[\d.]+[kMG]?)\s*\[|\[\d+:\d\d(?::\d\d)?, [^\]\n]*/|[━╸╺]{3,}")


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default stdout) is an interactive terminal."""
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced by an object without isatty
        return False


class ConsoleFormatter(logging.Formatter):
    """A log record as one console line: the message for INFO and below, `warning: <message>` above."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            level = "warning" if record.levelno < logging.ERROR else record.levelname.lower()
            text = f"{level}: {text}"
        return text


class ConsoleHandler(logging.StreamHandler):
    """A console handler that writes each record above any progress bar on screen (tqdm's `write`), so that a line
    logged during an epoch never lands on the bar's own line.

    A record logged with `extra={"console": False}` is for an API user's own logging and stays off the console: the
    command says what matters of it in its own line (a weights load's `Transferred 349/349 items`: training's
    start-up line).
    """

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "console", True) is False:
            return
        try:
            _write_above_bars(self.format(record), self.stream)
        except Exception:
            self.handleError(record)


def _write_above_bars(line: str, stream: TextIO) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=stream)
    stream.flush()


def _show_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
    line: str | None = None,
) -> None:  # fmt: skip
    """`warnings.showwarning` for a command: `warning: <message>` on stderr, one line."""
    text = " ".join(str(message).split())
    kind = "" if category is UserWarning else f"{category.__name__}: "
    stream = file if file is not None else sys.stderr
    with contextlib.suppress(OSError, ValueError, AttributeError):
        _write_above_bars(f"warning: {kind}{text}", stream)


def clean_lines(text: str, partial: str = "") -> tuple[list[str], str]:
    """Turn console output into log lines: `partial` (the unfinished line so far) + `text` split at newlines, each
    line as a terminal would leave it after carriage returns, without escape codes, and without progress-bar lines.

    Returns:
        (finished lines to write, the unfinished rest).
    """
    lines: list[str] = []
    buffer = partial + _ESCAPE.sub("", text)
    *done, rest = buffer.split("\n")
    for raw in done:
        line = raw.rsplit("\r", 1)[-1] if "\r" in raw.rstrip("\r") else raw.rstrip("\r")
        if _BAR.search(line):
            continue
        lines.append(line.rstrip())
    if "\r" in rest:
        rest = rest.rsplit("\r", 1)[-1]  # what the next write overwrites or finishes
    return lines, rest


class _LogFile:
    """The run log: complete, cleaned lines from any number of streams, one pending line per stream."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by close()
        self._partial: dict[str, str] = {}
        self._lock = threading.Lock()

    def feed(self, stream: str, text: str) -> None:
        with self._lock:
            if self._file.closed:
                return
            lines, self._partial[stream] = clean_lines(text, self._partial.get(stream, ""))
            if lines:
                self._file.write("".join(f"{line}\n" for line in lines))
                self._file.flush()

    def write_raw(self, text: str) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(text)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            for rest in self._partial.values():
                if rest.strip() and not _BAR.search(rest):
                    self._file.write(rest.rstrip() + "\n")
            self._file.close()


class _Tee:
    """A text stream that writes to the console stream and feeds the run log; the rest is the console's."""

    def __init__(self, console: TextIO, log: _LogFile, name: str) -> None:
        self._console, self._log, self._name = console, log, name

    def write(self, text: str) -> int:
        n = self._console.write(text)
        self._log.feed(self._name, text)
        return n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._console.flush()

    def isatty(self) -> bool:
        return is_terminal(self._console)

    def fileno(self) -> int:
        return self._console.fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer, ... as the console has them
        return getattr(self._console, name)


def _log_path() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    return Path(hc.runtime.output_dir) / f"{hc.job.name}.log"


@contextlib.contextmanager
def run_log(path: str | os.PathLike | None = None) -> Iterator[Path | None]:
    """Copy the console into the run log (default `<Hydra run folder>/<job name>.log`) while the block runs, with
    Python warnings as one line each. Yields the log's path (None outside a Hydra run: nothing is copied).

    A traceback that leaves the block is written to the log too (Hydra prints it to the console afterwards).
    """
    path = Path(path) if path is not None else _log_path()
    if path is None:
        yield None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    log = _LogFile(path)
    streams = {"stdout": sys.stdout, "stderr": sys.stderr}
    tees = {name: _Tee(stream, log, name) for name, stream in streams.items()}
    handlers = [
        (h, h.stream)
        for logger in map(logging.getLogger, ("", "lightning", "lightning.pytorch", "lightning.fabric"))
        for h in logger.handlers
        if type(h) in (logging.StreamHandler, ConsoleHandler) and h.stream in streams.values()
    ]
    show_warning = warnings.showwarning
    sys.stdout, sys.stderr = tees["stdout"], tees["stderr"]  # type: ignore[assignment]
    for handler, stream in handlers:
        handler.setStream(tees["stdout"] if stream is streams["stdout"] else tees["stderr"])  # type: ignore[arg-type]
    warnings.showwarning = _show_warning
    try:
        yield path
    except BaseException as e:
        if not isinstance(e, (SystemExit, KeyboardInterrupt)):
            log.write_raw("".join(traceback.format_exception(type(e), e, e.__traceback__)))
        raise
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        warnings.showwarning = show_warning
        for handler, stream in handlers:
            handler.setStream(stream)
        sys.stdout, sys.stderr = streams["stdout"], streams["stderr"]
        log.close()


# ---- what third-party libraries print -----------------------------------------------------------------------------
#: Loggers whose warnings are about the library's own setup, not the user's model: torch's notice that registering an
#: Enum as a pytree constant is deprecated (torchao, imported by litert-torch) and its note on a `CUDA_HOME` without
#: a CUDA runtime (printed when NNCF imports torch's C++-extension builder, which an export never uses).
_NOISY_LOGGERS = ("torch.utils._pytree", "torch.utils.cpp_extension")
#: Packages whose loggers print through console handlers of their own (torch's `torch`, `torch.export`,
#: `torch._dynamo`, ..., in glog's `W1126 19:13:44 ... file.py:183] ...` form); inside `library_output` their records
#: go to the root logger's handlers instead (yolo5l's line form).
_OWN_HANDLER_PACKAGES = ("torch",)
#: glog / absl C++ log lines: `I0000 00:00:1795720273.613855   27525 flatbuffer_export.cc:4410] message`.
_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ [^\]\s]+\] ?(.*)$")
#: TFLite's (and other C libraries') levelled lines: `INFO: Created TensorFlow Lite XNNPACK delegate for CPU.`.
_LEVELLED = re.compile(r"^(INFO|VERBOSE|DEBUG|WARNING|ERROR|FATAL): (.*)$")
#: TensorRT's logger: `[11/26/2026-19:13:44] [TRT] [W] message` (V verbose, I info, W warning, E error, F fatal).
_TRT = re.compile(r"^\[[\d/:-]+\] \[TRT\] \[([VIWEF])\] (.*)$")
#: Lines already in yolo5l's form (a Python warning printed by `_show_warning`, a log record's line).
_OWN_FORM = re.compile(r"^(?:warning|error): |^\[yolo5l\] ")
#: Lines that say nothing about the model: absl's note that it writes to stderr until it is initialised.
_NOISE = (re.compile(r"All log messages before absl::InitializeLog\(\) is called are written to STDERR"),)
#: Python warnings that concern a library's authors (its own or its dependencies' deprecations), not its user.
_DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def library_line(line: str, ignore: tuple[re.Pattern[str], ...] = ()) -> str | None:
    """One line a library wrote to stderr, in yolo5l's form: `warning: <message>`, or None where it is noise.

    Dropped: blank lines, progress bars, informational log lines (glog's `I...`, `INFO: ...`, TensorRT's `[I]`),
    absl's start-up note, and lines matching `ignore`. A warning or error line of those forms keeps its message; any
    other line is a warning as written (a library writes diagnostics to stderr).
    """
    line = _ESCAPE.sub("", line).rsplit("\r", 1)[-1].strip()
    if not line or _BAR.search(line):
        return None
    if _OWN_FORM.match(line):
        return line
    text = line
    if m := _GLOG.match(line) or _TRT.match(line):
        level, text = m.groups()
        if level in ("I", "V"):
            return None
    elif m := _LEVELLED.match(line):
        level, text = m.groups()
        if level in ("INFO", "VERBOSE", "DEBUG"):
            return None
    if not text.strip() or any(p.search(text) for p in (*_NOISE, *ignore)):
        return None
    return f"warning: {' '.join(text.split())}"


def _rerouted_loggers() -> list[tuple[logging.Logger, list[logging.Handler], list[logging.Handler]]]:
    """The loggers of `_OWN_HANDLER_PACKAGES` that print through a console handler of their own (torch's
    `_StderrHandler`, a stream handler on stderr) and do not propagate: each with those handlers and all its handlers
    in order, to restore after `library_output`. Other handlers (torch's structured trace) stay where they are."""
    found = []
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or logger.propagate:
            continue
        if not any(name == p or name.startswith(f"{p}.") for p in _OWN_HANDLER_PACKAGES):
            continue
        console = [
            h for h in logger.handlers
            if type(h).__name__ == "_StderrHandler"
            or (type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.__stderr__))
        ]  # fmt: skip
        if console:
            found.append((logger, console, logger.handlers[:]))
    return found


class _DropMatching(logging.Filter):
    """A handler filter that drops the records whose message matches one of `patterns`."""

    def __init__(self, patterns: tuple[re.Pattern[str], ...]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


class _Swallow(io.StringIO):
    """A library's stdout off a terminal: its progress display, dropped (`library_output`)."""

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def _captured_stderr_fd(ignore: tuple[re.Pattern[str], ...]) -> Iterator[None]:
    """Send file descriptor 2 to a temporary file while the block runs (C and C++ code writes there directly), then
    print what was written as `library_line`s on `sys.stderr`, also when the block raises.

    On a terminal, Python's `sys.stderr` keeps writing to the terminal meanwhile, so that a library's progress bar
    (tqdm) is drawn there; elsewhere its writes go to the file too, and its bars are dropped with the rest.
    """
    python_stderr = sys.stderr
    console = python_stderr._console if isinstance(python_stderr, _Tee) else python_stderr
    on_terminal = is_terminal(console)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        python_stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (a process started without one): nothing to capture
        yield
        return
    terminal: TextIO | None = None
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            if on_terminal:
                encoding = getattr(console, "encoding", None) or "utf-8"
                terminal = open(os.dup(saved), "w", buffering=1, encoding=encoding, errors="replace")  # noqa: SIM115
                if isinstance(python_stderr, _Tee):  # the run log still gets the library's Python-level lines
                    sys.stderr = _Tee(terminal, python_stderr._log, python_stderr._name)  # type: ignore[assignment]
                else:
                    sys.stderr = terminal
            else:
                sys.stderr = console  # the run log is fed the translated lines below, once
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            sys.stderr = python_stderr
            if terminal is not None:
                terminal.close()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", errors="replace")
            for raw in text.split("\n"):
                line = library_line(raw, ignore)
                if line is not None:
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        _write_above_bars(line, sys.stderr)


@contextlib.contextmanager
def library_output(ignore: tuple[str, ...] = ()) -> Iterator[None]:
    """Around a call into a third-party converter or runtime: what the library prints, in yolo5l's form.

    - Python logging: records at INFO and below are dropped (`Use JAX lowering: aten.permute`, `Serializing
      model...`, `Unable to initialize backend 'tpu'`), and the warnings of `_NOISY_LOGGERS`; other warnings and
      errors reach the root logger's handlers (one `warning: ...` line in a command), torch's included.
    - Python warnings: one `warning: ...` line each; deprecation notices are dropped.
    - What C and C++ code writes to stderr (absl, LiteRT, OpenVINO): captured, then printed as `library_line`s, the
      informational ones dropped. Nothing is hidden from a failure: the lines are printed before the exception
      leaves the block.
    - Progress bars: drawn on a terminal; elsewhere the library's stdout (its bars, pass trees) is dropped, and
      its bars on stderr with it.

    Args:
        ignore: Regular expressions (searched) for further messages to drop, as Python warnings, log records or
            lines: ones about the library's own set-up or its own use of itself (LiteRT's note on
            `experimental_preserve_all_tensors` during calibration, coremltools' missing macOS runtime on Linux).
    """
    patterns = tuple(re.compile(p) for p in ignore)
    disabled = logging.root.manager.disable
    noisy = [(logger, logger.level) for logger in map(logging.getLogger, _NOISY_LOGGERS)]
    rerouted = _rerouted_loggers()
    stdout = sys.stdout
    drop = _DropMatching(patterns)
    handlers = [*logging.getLogger().handlers, logging.lastResort] if patterns else []
    logging.disable(max(disabled, logging.INFO))
    for logger, _ in noisy:
        logger.setLevel(logging.ERROR)
    for logger, console, _ in rerouted:
        logger.propagate = True
        for handler in console:
            logger.removeHandler(handler)
    for handler in handlers:
        if handler is not None:
            handler.addFilter(drop)
    try:
        with warnings.catch_warnings(), _captured_stderr_fd(patterns):
            warnings.showwarning = _show_warning
            for category in _DEPRECATIONS:
                warnings.simplefilter("ignore", category)
            for p in patterns:
                warnings.filterwarnings("ignore", message=f".*(?:{p.pattern})")
            if not is_terminal(stdout):
                sys.stdout = _Swallow()
            yield
    finally:
        sys.stdout = stdout
        logging.disable(disabled)
        for logger, level in noisy:
            logger.setLevel(level)
        for logger, console, order in rerouted:
            logger.propagate = False
            now = logger.handlers[:]  # with any added meanwhile, after those it had
            logger.handlers = [h for h in order if h in console or h in now] + [h for h in now if h not in order]
        for handler in handlers:
            if handler is not None:
                handler.removeFilter(drop)


# ---- the command's own lines ---------------------------------------------------------------------------------------
#: The variables Lightning reads a process's rank from, first set first (`lightning.fabric.utilities.rank_zero`).
RANK_ENV = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def is_rank_zero() -> bool:
    """True in the launching process (before and after DDP starts) and on global rank 0.

    The rank is Lightning's: the one its strategy set (`rank_zero_only.rank`), else the first of `RANK`,
    `LOCAL_RANK`, `SLURM_PROCID` and `JSM_NAMESPACE_RANK` that is set (`srun` starts every task with its
    `SLURM_PROCID`); `NODE_RANK` > 0 (a further node's `LOCAL_RANK=0`) is not rank 0 either. Before Lightning is
    imported no strategy has set a rank, and the variables are read here: a command's mistake or `--help` is
    answered without importing Lightning (2-3 s on a small CPU).
    """
    lightning_rank = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if lightning_rank is None:
        rank = next((int(os.environ[key]) for key in RANK_ENV if os.environ.get(key) is not None), 0)
        strategy_rank = 0
    else:
        rank = lightning_rank._get_rank() or 0
        strategy_rank = getattr(lightning_rank.rank_zero_only, "rank", 0)
    return rank == 0 and strategy_rank == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def info(message: str, stream: TextIO | None = None) -> None:
    """Print one `[yolo5l] ...` console line on rank 0 (to stdout, or `stream`)."""
    if is_rank_zero():
        print(f"[yolo5l] {message}", file=stream or sys.stdout, flush=True)


def warn(message: str) -> None:
    """Print one `warning: ...` line on rank 0 (stdout), the form of every warning a command shows: the run goes on."""
    if is_rank_zero():
        print(f"warning: {message}", flush=True)


def fail(message: str) -> NoReturn:
    """Print `error: <message>` to stderr and exit with code 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


def print_outputs(title: str, items: Mapping[str, str | os.PathLike | None]) -> None:
    """Print an aligned 'where things are' block (rank 0 only); entries that are None are skipped."""
    if not is_rank_zero():
        return
    rows = [(k, str(v)) for k, v in items.items() if v is not None]
    width = max((len(k) for k, _ in rows), default=0) + 1
    print(f"\n{title}", flush=False)
    for k, v in rows:
        print(f"  {k + ':':<{width}} {v}")
    sys.stdout.flush()
