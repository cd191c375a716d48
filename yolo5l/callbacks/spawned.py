"""Training in processes that Lightning's launcher starts: `trainer.strategy=ddp_spawn` (and ddp_fork, ddp_notebook).

There `trainer.fit` runs in new processes, one a rank, each with an unpickled copy of the trainer, the module and the
datamodule, and the process that called fit only waits: Lightning hands back rank 0's weights, trainer state and
logged metrics, nothing else. Two things make such a run read as a `trainer.strategy=ddp` one:

- `SpawnedConsole` (a callback of the command line, for the `spawn` start method: a forked rank inherits the
  command's console): in each started process, the command's console rules (the command hands them in:
  `yolo5l._cli.one_console_line_per_log`), Python warnings as one line, and its run log: rank 0 appends to the
  command's `<job>.log`, rank k writes `<job>_ddp_process_<k>.log`, as the ranks `ddp` launches do.
- `adopt_fit_state`: afterwards, in the calling process, the callbacks' state and the epochs trained are taken from
  the run's last checkpoint, which rank 0 wrote as the fit ended; the closing validation of best.pt and the
  closing block then see the run as it was trained.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["SpawnedConsole", "adopt_fit_state", "fit_ran_elsewhere", "quiet_distributed_start"]

#: Lightning's lines as a process group starts (`lightning.fabric.utilities.distributed::_init_dist_connection`).
_START_BANNER = re.compile(r"^Initializing distributed: |All distributed processes registered")


def _not_start_banner(record: logging.LogRecord) -> bool:
    return not _START_BANNER.search(record.getMessage())


def quiet_distributed_start() -> None:
    """Leave out Lightning's process-group start-up lines (`Initializing distributed: ...`, the `----` banner) in this
    process and the ones it forks: those of a second start, after the fit's own."""
    for name in ("lightning.fabric.utilities.distributed", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.utilities.rank_zero"):  # fmt: skip
        logger = logging.getLogger(name)
        if _not_start_banner not in logger.filters:
            logger.addFilter(_not_start_banner)


def fit_ran_elsewhere(trainer: Any) -> str | None:
    """How `trainer`'s fit starts the processes it runs in (`spawn`, `fork`, `forkserver`: its callbacks and loops in
    this process then never see the run), None when it runs here (one process, or `ddp`'s rank 0)."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    return getattr(launcher, "_start_method", "spawn") if isinstance(launcher, _MultiProcessingLauncher) else None


class SpawnedConsole(Callback):
    """In a process that Lightning's launcher started, the command's console and run log (see the module docstring);
    in the process that made it, nothing.

    Args:
        log_dir: The run folder.
        job_name: The command's job name (`train`): rank 0 appends to `<job_name>.log`, rank k writes
            `<job_name>_ddp_process_<k>.log`.
        tidy: Called first in a started process: the command's console rules (a module-level function: it is
            pickled by name).
    """

    def __init__(self, log_dir: str | os.PathLike, job_name: str, tidy: Callable[[], None] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.job_name = job_name
        self.tidy = tidy
        self._pid = os.getpid()
        self._log: contextlib.ExitStack | None = None
        self.after_fit = False  # set by adopt_fit_state: the processes started next leave out the start-up banner

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_log": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if state.get("after_fit") and os.getpid() != self._pid:  # unpickled in a started process, before its
            quiet_distributed_start()  # process group starts: the closing validation's ranks

    def log_path(self, rank: int) -> Path:
        """The run log that rank `rank` writes."""
        name = self.job_name if rank == 0 else f"{self.job_name}_ddp_process_{rank}"
        return self.log_dir / f"{name}.log"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if os.getpid() == self._pid or self._log is not None:
            return
        from yolo5l.base.console import run_log

        if self.tidy is not None:
            self.tidy()
        self._log = contextlib.ExitStack()
        self._log.enter_context(run_log(self.log_path(trainer.global_rank)))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def adopt_fit_state(trainer: Any, datamodule: Any = None) -> bool:
    """After a fit that ran in launched processes: load the callbacks' state and the epoch count into this process's
    trainer from the run's last checkpoint (`last.ckpt`, written by rank 0 as the fit ended), and mark `datamodule`'s
    summary lines printed. Returns False when the run has none (`callbacks=none`, or it stopped before its first
    checkpoint): the closing block then has no validation rows."""
    import torch
    from lightning.pytorch.trainer import call

    from yolo5l.base.run_files import checkpoint_dir
    from yolo5l.callbacks.epoch_line import EpochLine
    from yolo5l.eval.best_fitness import ReadsBestFitness, best_of, checkpoint_best

    # The closing validation starts the ranks again: as under `ddp`, its console is the table alone, without Lightning's
    # process-group banner or the datasets' summary lines the fit's ranks printed (a forked rank inherits the filter).
    quiet_distributed_start()
    for console in (cb for cb in trainer.callbacks if isinstance(cb, SpawnedConsole)):
        console.after_fit = True
    printed = getattr(datamodule, "printed", None)  # the trainer's is None again after a launched fit
    if isinstance(printed, set):
        printed.add("*")  # every summary line, whichever the datamodule has
    folder = checkpoint_dir(trainer)
    path = folder / "last.ckpt" if folder is not None else None
    if path is None or not path.is_file():
        return False
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    call._call_callbacks_load_state_dict(trainer, checkpoint)
    module = trainer.lightning_module
    if (record := best_of(module)) is not None:  # the run's best validation: best.pt's epoch, the summary's row
        record.load_state_dict(checkpoint_best(checkpoint))
    for callback in trainer.callbacks:
        if isinstance(callback, ReadsBestFitness):
            callback.read_record(module)
    trainer.fit_loop.epoch_progress.load_state_dict(checkpoint["loops"]["fit_loop"]["epoch_progress"])
    for line in (cb for cb in trainer.callbacks if isinstance(cb, EpochLine)):
        if line.first_epoch is not None:  # the checkpoint was written during its last epoch, after training it
            line.epochs_run = int(checkpoint["epoch"]) - line.first_epoch + 1
    return True
