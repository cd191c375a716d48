"""What the entry points share: the lifecycle of a command (`run_entry_point`, the collector pause, `running` for
its work, `end_command_line`), Hydra's runner with the config composed once (`run_hydra_app`), one-line errors with
exit code 2 (`guarded`), a tidy console."""

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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from hydra._internal.hydra import Hydra
from omegaconf import DictConfig

from yolo5l.base.console import fail, is_rank_zero
from yolo5l.base.errors import UserError

__all__ = ["end_command_line", "guarded", "one_console_line_per_log", "quiet_lightning", "run_entry_point", "running"]

_F = TypeVar("_F", bound=Callable[..., Any])


#: True while `pause_gc` holds the cyclic garbage collector off (the command line's start-up).
_gc_paused = False
#: True while what start-up built sits in the collector's permanent generation (`resume_gc` put it there).
_start_up_frozen = False
#: True in a process started as one of yolo5l's commands (`run_entry_point` sets it): process-wide settings apply.
_command_line = False
#: `YOLO5L_FULL_SHUTDOWN=1`: a command ends through the interpreter's whole teardown, not `end_command_line`.
FULL_SHUTDOWN_ENV = "YOLO5L_FULL_SHUTDOWN"


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


@contextlib.contextmanager
def running(tune_malloc: bool = False) -> Iterator[None]:
    """The work of a command, between building its run and reporting it: every entry point runs it in this block.

    On entry, what start-up built moves to the collector's permanent generation and the collector is turned back on
    (`resume_gc`); with `tune_malloc` and only on the command line, glibc keeps freed host memory
    (`yolo5l.base.hostmem.tune_malloc`: process-wide, so a notebook or a test process keeps its allocator). On exit,
    however the block ends, the frozen objects go back to the collector (`unfreeze_start_up`): a sweep's next run
    needs the memory of this one's trainer and cache, and nothing is left frozen when the process ends. (The
    interpreter's shutdown never collects frozen objects, and nanobind bindings (onnx's, for one) report their
    objects still alive then as leaked, a page of lines after the run's last one.)
    """
    resume_gc()
    if tune_malloc and _command_line:
        from yolo5l.base.hostmem import tune_malloc as keep_freed_memory

        keep_freed_memory()
    try:
        yield
    finally:
        unfreeze_start_up()


def _exit_status(code: object) -> int:
    """The status `SystemExit(code)` gives the process, as the interpreter maps it (None: 0; a code that is not an int
    is printed to stderr and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end_command_line(code: object = 0) -> NoReturn:
    """End a command-line process as the interpreter's shutdown does, but for its last phase: the threading module's
    exit hooks and the join of every thread that is not a daemon (`threading._shutdown`, what the interpreter calls
    first), the `atexit` handlers (loggers, DataLoader workers, temporary folders), stdout and stderr flushed; then
    `os._exit` with the status `SystemExit(code)` gives.

    The phase left out tears down every module and walks the heap with the collector until nothing is left: about
    900,000 objects after a run (the modules of torch, Lightning, SciPy and SymPy, and what the run made), 1.1-1.5 s,
    a fifth of a `python -m yolo5l.val` command, to free memory the OS takes back anyway. Nothing is frozen by then
    (`running` handed it back) and every file the run writes is closed after its write, so that phase has nothing
    left to do or to report: `YOLO5L_FULL_SHUTDOWN=1` runs it, and tests/test_cli.py checks that a command ends
    clean through it as well (the same output, no "leaked" lines, no exception ignored at shutdown).
    """
    status = _exit_status(code)
    if threading.current_thread() is not threading.main_thread():  # the interpreter's shutdown runs on the main one
        raise SystemExit(status)
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, detached or None: nothing to flush
            stream.flush()
    os._exit(status)


def _ends_fast() -> bool:
    """Whether this command ends through `end_command_line`: on the command line, unless `YOLO5L_FULL_SHUTDOWN`."""
    return _command_line and os.environ.get(FULL_SHUTDOWN_ENV, "") in ("", "0")


def _is_command_line() -> bool:
    """True in a process started as one of yolo5l's commands: `python -m yolo5l.<command>`, or a console script
    (`yolo5l-train`: pip's wrapper module imports `main` and calls it), where process-wide settings apply; not a
    `main()` called from other code (a test, a notebook)."""
    top = sys.modules.get("__main__")
    spec = getattr(top, "__spec__", None)
    if spec is not None and str(spec.name).startswith("yolo5l."):
        return True
    return str(getattr(getattr(top, "main", None), "__module__", "")).startswith("yolo5l.")


def run_entry_point(hydra_main: Callable[[], Any], config_name: str | None = None) -> None:
    """What `main()` of train, val, predict and export does: collector paused for start-up, the config composed once
    with its overrides checked (`run_hydra_app`), the command run (its work in `running`); then the collector as it
    was before, with nothing left frozen, however the command ended. On the command line a command that ended (0, a
    one-line error's 2, a preempted run's 128 + signal, Hydra's 1) then ends the process through `end_command_line`;
    an exception the command did not handle (a bug's traceback, Ctrl-C) takes the interpreter's own way out.

    Args:
        hydra_main: The `@hydra.main` function (a callable that is not a Hydra app is called as it is).
        config_name: Its config (`train`, `val`, ...); default: the last part of its module's name.
    """
    global _command_line, _gc_paused
    pause_gc()
    _command_line = _is_command_line()
    code: object = 0
    try:
        try:
            run_hydra_app(hydra_main, config_name or hydra_main.__module__.rsplit(".", 1)[-1], sys.argv[1:])
        except UserError as e:  # the command line's: the task's own are printed by `guarded`
            fail(str(e))
    except SystemExit as e:
        if not _ends_fast():
            raise
        code = e.code
    finally:
        unfreeze_start_up()  # a command that failed before its work: nothing was frozen; after it: handed back
        if _gc_paused:  # failed before its work began
            gc.enable()
            _gc_paused = False
    if _ends_fast():
        end_command_line(code)


def run_hydra_app(hydra_main: Callable[[], Any], config_name: str, argv: list[str]) -> None:
    """Run `@hydra.main` function `hydra_main` as Hydra would, but with its config composed once: the composition
    that checks the command line's overrides (`yolo5l.overrides.compose_checked`) is the one the run or the sweep
    gets, and with the same loader (Hydra itself composes a run's config twice, once to read `hydra.mode`). Hydra runs
    it from there: the run folder, `.hydra/`, the job log, callbacks, the sweeper and its launcher (each job of a
    sweep is composed by Hydra's sweeper and launcher, as with `@hydra.main`). What is not a run or a sweep
    (`--help`, `--cfg`, `--info`, shell completion) is Hydra's own, after the same check.

    A DDP rank Lightning re-launches (`LOCAL_RANK` > 0) composes the same command line without checking it again.

    Raises:
        UserError: An override or option of `argv` that is wrong (one line, before anything is written).
    """
    from hydra._internal.utils import detect_calling_file_or_module_from_task_function, run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from yolo5l.config import claim_run_folder
    from yolo5l.overrides import check_overrides, compose_checked, config_loader, parse_command_line

    task = getattr(hydra_main, "__wrapped__", None)  # what @hydra.main wraps: the task function
    args, overrides = parse_command_line(argv, config_name)
    if task is None or args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.run:
        if is_rank_zero():
            check_overrides(argv, config_name)
        hydra_main()  # not a run (or an explicit --run, which Hydra also checks against -m): Hydra's own
        return
    calling = detect_calling_file_or_module_from_task_function(task)
    loader = config_loader(args.config_dir, args.config_path, calling)
    hydra = _OnceComposed.create(calling, loader)
    try:
        config_name = args.config_name or config_name
        multirun = bool(args.multirun)
        if is_rank_zero():
            cfg = compose_checked(loader, config_name, overrides, multirun=multirun)
        else:
            mode = RunMode.MULTIRUN if multirun else RunMode.RUN
            cfg = loader.load_configuration(config_name, overrides, run_mode=mode, validate_sweep_overrides=False)
        if cfg.hydra.mode is None or (multirun and cfg.hydra.mode == RunMode.RUN):  # as Hydra's own `_run_app`
            cfg.hydra.mode = RunMode.MULTIRUN if multirun else RunMode.RUN
            cfg.hydra.overrides.hydra.append(f"hydra.mode={cfg.hydra.mode.name}")
        if is_rank_zero():
            claim_run_folder(cfg, overrides)
        hydra.composed = cfg
        if cfg.hydra.mode == RunMode.RUN:
            run_and_report(lambda: hydra.run(config_name=config_name, task_function=task, overrides=overrides))
        else:
            run_and_report(lambda: hydra.multirun(config_name=config_name, task_function=task, overrides=overrides))
    finally:
        GlobalHydra.instance().clear()


class _OnceComposed(Hydra):
    """Hydra's app object, handed the config `run_hydra_app` composed: its `run` and `multirun` take that one instead
    of composing their own (later compositions, a sweep's jobs, are Hydra's)."""

    composed: DictConfig | None = None

    @classmethod
    def create(cls, calling: tuple[str | None, str | None], loader: Any) -> _OnceComposed:
        """As Hydra's `create_main_hydra2` for a task function in `calling` (its file or module), with `loader`."""
        from hydra._internal.utils import detect_task_name
        from hydra.core.global_hydra import GlobalHydra

        task_name = detect_task_name(*calling)
        hydra = cls(task_name=task_name, config_loader=loader)
        GlobalHydra.instance().initialize(hydra)
        return hydra

    def compose_config(  # Hydra's signature
        self,
        config_name: str | None,
        overrides: list[str],
        run_mode: Any,
        with_log_configuration: bool = False,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
    ) -> DictConfig:
        cfg, self.composed = self.composed, None
        if cfg is None:
            return super().compose_config(
                config_name, overrides, run_mode, with_log_configuration, from_shell, validate_sweep_overrides
            )
        if with_log_configuration:  # Hydra's logging, as its own compose sets it up
            from hydra.core.utils import configure_log

            configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        return cfg


#: Lightning's console messages that say nothing about this run (a product tip, a size estimate it cannot make
#: under mixed precision, an interval note that the per-epoch CSV makes moot, a deprecation inside Lightning).
_NOISE = (
    "Tip: For seamless cloud logging",
    "is not supported by the model summary",
    "is smaller than the logging interval",
    "isinstance(treespec, LeafSpec)` is deprecated",
    # A mid-epoch checkpoint resumes exactly: YOLODataModule's state skips the batches already trained.
    "your dataloader is not resumable",
)
#: Lightning's lines a command's start-up block says better (the devices the run uses: yolo5l.run_info).
_IN_START_UP = ("GPU available: ", "TPU available: ", "HPU available: ")
#: Lightning's hint to log with sync_dist=True, for the epoch-level values yolo5l logs that are the same on every
#: rank already (the mAPs from the gathered metric states, the learning rates) or rank 0's own (throughput).
_SAME_ON_EVERY_RANK = re.compile(
    r"self\.log\('(?:val/(?:map|map_50|precision|recall|fitness)|train/(?:lr\d+|images_per_sec|data_wait))', "
    r"\.\.\., sync_dist=True\)"
)


def _not_noise(record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in _NOISE)


def _not_in_start_up(record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in _IN_START_UP)


def quiet_lightning(start_up_block: bool = False) -> None:
    """Leave out Lightning's messages and warnings in `_NOISE` (the commands, and `yolo5l.train.build` in a
    notebook), and with `start_up_block` (a command's) its device lines; again is harmless."""
    import warnings

    for text in _NOISE:
        warnings.filterwarnings("ignore", message=f".*{re.escape(text)}")
    warnings.filterwarnings("ignore", message=f".*{_SAME_ON_EVERY_RANK.pattern}")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_not_noise)  # a filter already there is not added again
        if start_up_block:
            logging.getLogger(name).addFilter(_not_in_start_up)


def one_console_line_per_log() -> None:
    """Tidy the console of a command: drop the `lightning` packages' own console handlers (stderr, not propagated)
    once the root logger has handlers (Hydra's console: the record then reaches it, and the run log, through the
    root, as every other line), and leave out Lightning's messages in `_NOISE`. Call it after `lightning` is
    imported (its import adds the handlers)."""
    import lightning  # noqa: F401 - the handler is added by this import

    quiet_lightning(start_up_block=True)
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # each import adds one to its package's
        lightning_logger = logging.getLogger(name)
        for handler in list(lightning_logger.handlers):
            if type(handler) is logging.StreamHandler:  # its console handler; file handlers are left alone
                lightning_logger.removeHandler(handler)
                lightning_logger.propagate = True  # to the root's console handler


def guarded(fn: _F) -> _F:
    """Run `fn` (a command's Hydra task) with its console copied into the run folder's log
    (`yolo5l.base.console.run_log`: `train.log`, and `train_ddp_process_<rank>.log` for each further DDP rank), and
    turn `UserError` (and a missing file) raised by it into a one-line message and exit code 2.

    A run folder that Hydra created for the failed command and that holds nothing but Hydra's own files (`.hydra/`,
    the job log) is removed, so mistakes leave no empty runs behind.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from yolo5l.base.console import run_log

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
        _remove_empty_sweep_folder()


def _remove_empty_sweep_folder() -> None:
    """A sweep whose first job failed: its folder holds Hydra's multirun.yaml alone."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    sweep = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    if sweep is not None and sweep.is_dir() and [p.name for p in sweep.iterdir()] == ["multirun.yaml"]:
        shutil.rmtree(sweep, ignore_errors=True)
