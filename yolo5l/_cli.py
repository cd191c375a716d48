"""What the entry points share: one-line errors with exit code 2, the collector pause, printing where outputs are."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from yolo5l.config import check_group_choices
from yolo5l.errors import EXIT_USAGE, UserError
from yolo5l.errors import shown_path as relpath  # the entry points' name for it

__all__ = ["EXIT_USAGE", "UserError", "fail", "guarded", "info", "print_outputs", "relpath", "run_entry_point"]

_F = TypeVar("_F", bound=Callable[..., Any])


#: True while `pause_gc` holds the cyclic garbage collector off (the command line's start-up).
_gc_paused = False
#: True while what start-up built sits in the collector's permanent generation (`resume_gc` put it there).
_start_up_frozen = False


def pause_gc() -> None:
    """Command line only: hold the cyclic garbage collector off while Python imports torch, Lightning and Hydra and
    builds the run; `resume_gc` turns it back on before the first step.

    The imports create hundreds of thousands of objects, and the collector would walk all of them several times while
    they are being created (docs/benchmarks.md, "Where the one-epoch run's time goes", has the cost). Imports make
    next to no cyclic garbage, so nothing is lost by not collecting it. `python -m yolo5l.train` calls
    `gc.disable()` itself before its first import; this marks it.
    """
    global _gc_paused
    gc.disable()
    _gc_paused = True


def resume_gc() -> None:
    """Move everything start-up built (modules, config, model, trainer) to the collector's permanent generation and
    turn it back on: a no-op unless `pause_gc` turned it off, so a notebook's collector is left as it is.

    Frozen objects are never scanned again, so later full collections only walk what training creates. A reference
    cycle among them is not freed until `unfreeze_start_up` hands them back at the end of the run.
    """
    global _gc_paused, _start_up_frozen
    if _gc_paused:
        gc.freeze()
        gc.enable()
        _gc_paused, _start_up_frozen = False, True


def unfreeze_start_up() -> None:
    """Hand what `resume_gc` froze back to the collector at the end of a run. In a multirun sweep the finished run's
    trainer, model and RAM image cache hang together in reference cycles: frozen, they would stay in memory for the
    whole sweep. A no-op unless `resume_gc` froze something."""
    global _start_up_frozen
    if _start_up_frozen:
        gc.unfreeze()
        _start_up_frozen = False


def _exit_status(code: object) -> int:
    """The status `SystemExit(code)` gives the process, as the interpreter maps it (None: 0; other non-int codes are
    printed to stderr and give 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_without_heap_walk(code: object = 0) -> NoReturn:
    """End the command line the way interpreter shutdown would, less its last walk of the heap and its teardown of
    every module: run the threading module's exit hooks and join the threads that are not daemons, run the `atexit`
    handlers (loggers, DataLoader workers,
    temporary folders, Hydra's job log), flush stdout and stderr, then `os._exit`.

    What is skipped frees memory the OS takes back anyway: the run's objects (the collector would walk all ~770,000
    of them once more: 0.4-0.6 s) and the frozen start-up objects. Skipping it also keeps the console clean: the
    extension modules that count their objects at shutdown (nanobind's, in triton, which torch imports) would
    otherwise print a page of "leaked" lines after the run's last line, because what `resume_gc` froze is never
    collected. Every file the run writes is closed by then (checkpoints, logs and the metrics CSV are closed after
    each write; the loggers flush in their `finalize`).
    """
    status = _exit_status(code)
    # What the interpreter's own shutdown does first: the threading module's exit hooks (executors such as
    # joblib's loky stop their manager threads there), then a join of the threads that are not daemons.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    else:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon and thread.is_alive():
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # closed, detached or replaced by None: nothing to flush
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(status)


def _is_command_line() -> bool:
    """True in a process started as one of yolo5l's commands: `python -m yolo5l.<command>`, or a console script
    (`yolo5l-train`: pip's wrapper module imports `main` and calls it). Such a process may end with `os._exit`; a
    `main()` called from other code (a test, a notebook) returns or raises `SystemExit` as any function would."""
    top = sys.modules.get("__main__")
    spec = getattr(top, "__spec__", None)
    if spec is not None and str(spec.name).startswith("yolo5l."):
        return True
    return str(getattr(getattr(top, "main", None), "__module__", "")).startswith("yolo5l.")


def run_entry_point(hydra_main: Callable[[], Any], config_name: str | None = None) -> None:
    """What `main()` of train, val, predict and export does: collector paused for start-up, config groups and
    overrides checked before Hydra composes (`yolo5l.overrides`), the Hydra app run; then, on the command line,
    `exit_without_heap_walk` with the status the command ended with (0, a one-line error's 2, a preempted run's
    128 + signal, Hydra's 1 for an error it reported).

    Args:
        hydra_main: The `@hydra.main` function.
        config_name: Its config (`train`, `val`, ...); default: the last part of its module's name.
    """
    pause_gc()
    command_line = _is_command_line()
    try:
        try:
            check_group_choices(sys.argv[1:])
            if is_rank_zero():  # DDP re-launches the command per rank with what rank 0 checked
                from yolo5l.overrides import check_overrides

                check_overrides(sys.argv[1:], config_name or hydra_main.__module__.rsplit(".", 1)[-1])
        except UserError as e:
            fail(str(e))
        hydra_main()
    except SystemExit as e:
        if not command_line:
            raise
        exit_without_heap_walk(e.code)
    if command_line:
        exit_without_heap_walk(0)


def fail(message: str) -> NoReturn:
    """Print `error: <message>` to stderr and exit with code 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


#: Lightning's console messages that say nothing about this run (a product tip, a size estimate it cannot make
#: under mixed precision, an interval note that the per-epoch CSV makes moot, a deprecation inside Lightning).
_NOISE = (
    "Tip: For seamless cloud logging",
    "is not supported by the model summary",
    "is smaller than the logging interval",
    "isinstance(treespec, LeafSpec)` is deprecated",
    "GPU available: ",  # the start-up block names the devices the run uses (yolo5l.run_info)
    "TPU available: ",
    "HPU available: ",
)


def _not_noise(record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in _NOISE)


def one_console_line_per_log() -> None:
    """Tidy the console of a command: drop the `lightning` packages' own console handlers (stderr, not propagated)
    once the root logger has handlers (Hydra's console: the record then reaches it, and the run log, through the
    root, as every other line), and leave out Lightning's messages in `_NOISE`. Call it after `lightning` is
    imported (its import adds the handlers)."""
    import warnings

    import lightning  # noqa: F401 - the handler is added by this import

    for text in _NOISE:
        warnings.filterwarnings("ignore", message=f".*{re.escape(text)}")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_not_noise)
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # each import adds one to its package's
        lightning_logger = logging.getLogger(name)
        for handler in list(lightning_logger.handlers):
            if type(handler) is logging.StreamHandler:  # its console handler; file handlers are left alone
                lightning_logger.removeHandler(handler)
                lightning_logger.propagate = True  # to the root's console handler


def guarded(fn: _F) -> _F:
    """Run `fn` (a command's Hydra task) with its console copied into the run folder's log (`yolo5l.console.run_log`:
    `train.log`, and `train_ddp_process_<rank>.log` for each further DDP rank), and turn `UserError` (and a missing
    file) raised by it into a one-line message and exit code 2.

    A run folder that Hydra created for the failed command and that holds nothing but Hydra's own files (`.hydra/`,
    the job log) is removed, so mistakes leave no empty runs behind.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from yolo5l.console import run_log

        try:
            with run_log():  # a DDP rank re-launched by Lightning writes its own <job name>.log
                try:
                    return fn(*args, **kwargs)
                except UserError as e:
                    fail(str(e))
                except FileNotFoundError as e:
                    name = f" {e.filename!r}" if e.filename else ""
                    fail(f"file not found{name}: {e.strerror or e}" if e.filename else str(e))
        except SystemExit:
            _remove_empty_run_folder()
            raise

    return wrapper  # type: ignore[return-value]


def _remove_empty_run_folder() -> None:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or not is_rank_zero():
        return
    out = Path(HydraConfig.get().runtime.output_dir)
    if not out.is_dir():
        return
    hydra_own = {".hydra", f"{HydraConfig.get().job.name}.log"}
    if all(p.name in hydra_own for p in out.iterdir()):
        logging.shutdown()  # the job log's handler holds the file open
        shutil.rmtree(out, ignore_errors=True)


def info(message: str) -> None:
    """Print one `[yolo5l] ...` console line (rank 0 only)."""
    if is_rank_zero():
        print(f"[yolo5l] {message}", flush=True)


def is_rank_zero() -> bool:
    """True in the launching process (before and after DDP starts) and on global rank 0."""
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    return rank == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


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
