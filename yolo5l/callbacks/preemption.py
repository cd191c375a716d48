"""`PreemptionCheckpoint`: when the scheduler says it is about to kill the job (SIGTERM from SLURM, Kubernetes or a
spot instance's shutdown; SIGUSR1 from SLURM's `--signal=USR1@90`), finish the current step, write `last.ckpt` with
the position inside the epoch, and exit with one line that says how to resume.

The signal handler only sets a flag; the callback acts on it at the next point where a checkpoint resumes exactly:

- mid-epoch, at the end of a batch that stepped the optimizer (after an accumulation-only micro-batch the summed
  gradients would be in no checkpoint), that is neither the epoch's last batch nor followed by validation. Saved in
  `on_train_batch_end`, Lightning 2.6 restores it as "restarted on train batch end": the loop continues at the next
  `batch_idx`, and `YOLODataModule.load_state_dict` makes the sampler skip the batches already trained;
- otherwise at the end of the epoch, after its validation and `LastCheckpoint`'s save: Lightning 2.6 restores a
  checkpoint written at the last batch's end as "epoch done" and would skip the epoch's validation and
  `on_train_epoch_end` (where the learning-rate schedule steps), so the epoch is finished first and the process
  exits at the start of the next one.

The exit status is 128 + the signal number (143 for SIGTERM, 138 for SIGUSR1): what a shell or a scheduler reports
for a process the signal ended, and non-zero, so that a Kubernetes Job, systemd or torchrun's restart policy treats
the run as unfinished (exit 0 would mark it "Succeeded" and nothing would resume it). Under SLURM with Lightning's
`SLURMEnvironment(auto_requeue=True)` (its default when it detects SLURM), the requeue signal also requeues the job
(`scontrol requeue`) once the checkpoint is written.

Lightning's own handling is kept where it fits and replaced where it does not. Its signal connector installs its
handlers when fit starts (after `setup`) and puts the earlier ones back at teardown. This callback installs its own in
`setup`, before Lightning's: Lightning then leaves SIGUSR1 alone (its SLURM handler would write `hpc_ckpt_<n>.ckpt`
from inside the signal handler, in the middle of whatever step is running) and puts its SIGTERM handler in front of
this one; at `on_train_start` this callback takes SIGTERM back, since Lightning's makes the loops raise
`SIGTERMException` at the next batch end or even inside validation (no checkpoint at all when the signal lands in the
epoch's last batch or its validation, and exit status 0). What is reused: `SIGTERMException` (`Preempted` subclasses
it, so `on_exception` consumers see the usual type), the launcher's forwarding of the signal to the ranks it started,
the SLURM environment's `auto_requeue`/`requeue_signal`, and `Strategy.reduce` for the ranks' agreement.

DataLoader workers: SLURM signals every process of the job step, the workers too. Those forked while this handler is
installed keep it, and it does nothing outside the process that installed it; SIGUSR1's default action would kill
them (and the run with them: "DataLoader worker ... is killed by signal"). Persistent workers are forked between
Lightning's registration and `on_train_start`, so they hold Lightning's SIGTERM handler in front of this one.

DDP: the signal may reach one rank only (Kubernetes signals the container's first process). The ranks agree with
one all-reduce (MAX) of the received signal every `check_every_n_steps` optimizer steps, at the end of the batch
that made the step (the same batch on every rank), and once at every epoch end; a single process reads its own flag
at every step, which costs nothing. A signal therefore stops a DDP run within `check_every_n_steps` optimizer steps
(10 by default: a few seconds at usual batch sizes) plus the step and the checkpoint write. A rank that received the
signal waits at most `agree_timeout_s` for the others there: the signal may be a scheduler's answer to a rank that
died (torchrun's agent sends SIGTERM to the surviving workers), and waiting for that rank would outlast the grace
period; it then stops with `LostRankWatch`'s line and status (`RankLost`) instead.

A checkpoint that cannot be written (full disk) stops the run with `CheckpointWriteError`'s line instead, which
names the previous `last.ckpt` (whole: every write is atomic) to resume from.

Not covered: a SIGTERM between the start of fit and `on_train_start` also reaches Lightning's handler, which stops
the run at the end of the first batch if this callback has not stopped it there (when that batch only accumulates,
the previous `last.ckpt` stays the latest); a second signal is handled like the first; SIGKILL, which follows when
the grace period ends, cannot be caught: the previous `last.ckpt` is whole, as every write is atomic.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from yolo5l.base.errors import shown_path
from yolo5l.base.run_files import last_checkpoint
from yolo5l.callbacks.checkpoint import LastCheckpoint, stop_on_write_error
from yolo5l.callbacks.lost_rank import RankLost, collective_failure, lost_rank_message

__all__ = ["Preempted", "PreemptionCheckpoint"]

_CTRL_C = (
    "\nCtrl-C: stopping at the next step a checkpoint resumes exactly (at the latest after this epoch and its "
    "validation); Ctrl-C again stops now, and the run then resumes from its last epoch end\n"
)


class Preempted(SIGTERMException):
    """The run stopped for a signal after writing a resumable `last.ckpt`; exits with status 128 + `signum`.

    Attributes:
        signum: the signal.
        path: the checkpoint written (resume from it).
    """

    def __init__(self, signum: int, path: str) -> None:
        super().__init__(128 + int(signum))
        self.signum = int(signum)
        self.path = path


class PreemptionCheckpoint(Checkpoint):
    """On one of `signals`, write a resumable `last.ckpt` at the next safe step and exit (see the module docstring).

    A `Checkpoint` so that Lightning runs its hooks after the other callbacks' (the EMA update of the step is in the
    checkpoint) and its `on_train_epoch_end` after the LightningModule's and `LastCheckpoint`'s.

    Args:
        signals: signal names to handle (SIGTERM: SLURM, Kubernetes and spot instances before they kill; SIGUSR1:
            SLURM's `--signal=USR1@<seconds>` notice; SIGINT: Ctrl-C, whose second press stops at once).
        check_every_n_steps: under DDP, optimizer steps between the ranks' agreements (one all-reduce and one host
            sync each); unused on one process.
        folder: where `last.ckpt` goes; None: `LastCheckpoint`'s folder, else `<default_root_dir>/checkpoints`.
        agree_timeout_s: under DDP, how long a rank that received the signal waits for the others to agree before it
            takes one of them as lost (`RankLost`).
    """

    def __init__(
        self,
        signals: Sequence[str] = ("SIGTERM", "SIGUSR1", "SIGINT"),
        check_every_n_steps: int = 10,
        folder: str | os.PathLike | None = None,
        agree_timeout_s: float = 10.0,
    ) -> None:
        names = [str(s).upper() for s in signals]
        unknown = [n for n in names if not isinstance(getattr(signal, n, None), signal.Signals)]
        if unknown:
            raise ValueError(f"PreemptionCheckpoint: unknown signal(s) {unknown}; use names such as SIGTERM, SIGUSR1")
        if int(check_every_n_steps) < 1:
            raise ValueError(f"PreemptionCheckpoint: check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.signals = [getattr(signal, n) for n in names]
        self.check_every_n_steps = int(check_every_n_steps)
        if not agree_timeout_s > 0:
            raise ValueError(f"PreemptionCheckpoint: agree_timeout_s must be > 0, got {agree_timeout_s}")
        self.agree_timeout_s = float(agree_timeout_s)
        self.folder = None if folder is None else str(folder)
        self._received = 0  # signal number seen by this process (0: none); written by the handler only
        self._agreed = 0  # signal number all ranks agreed to stop for (0: not yet)
        self._stop_at_epoch_start = False
        self._step_before = -1
        self._original: dict[int, Any] = {}  # the handlers this callback replaced, put back after fit
        self._active = False
        self._pid = -1
        self._trainer: pl.Trainer | None = None

    # ---- signals -------------------------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a process forked while this handler was installed
            from torch.utils.data import get_worker_info

            if get_worker_info() is not None:
                return  # a DataLoader worker (before its init made it ignore the signal): the main process decides
            # Anything else (a multiprocessing pool's worker) ends as the signal's default action ends it: the
            # handler this one replaced may itself defer the signal (Lightning's), and Pool.terminate() would wait.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not self._active:
            self._pass_on(signum, frame)
            return
        # As little as possible: no buffered I/O (a print here can re-enter a write the main thread was doing), no
        # collective.
        first = not self._received
        if signum == signal.SIGINT and self._leads():
            if self._received == signal.SIGINT:  # Ctrl-C again: stop now, as Python's own handler would
                signal.default_int_handler(signum, frame)
            os.write(2, _CTRL_C.encode())
        self._received = int(signum)
        launcher = getattr(getattr(self._trainer, "strategy", None), "launcher", None)
        if first and launcher is not None and hasattr(launcher, "kill"):
            launcher.kill(signum)  # the ranks this process started (Lightning's script launcher) hear it too

    def _leads(self) -> bool:
        # The process a user's Ctrl-C is for: rank 0 (the ranks it started hear the signal from the terminal and from
        # their launcher, and leave the second press to it: it kills them).
        return getattr(self._trainer, "global_rank", 0) == 0

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        # Installed after fit (Lightning's teardown after an exception puts back the handlers it found, this one
        # among them): behave as the handler this one replaced.
        original = self._original.get(int(signum), signal.SIG_DFL)
        if callable(original):
            original(signum, frame)
        elif original in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _install(self, trainer: pl.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python takes signals on the main thread only (a notebook's worker thread): nothing to do
        if not self._active:  # the first install of this fit: remember what to put back
            found = {int(sig): signal.getsignal(sig) for sig in self.signals}
            # one left installed by an earlier fit (see _pass_on) stands for what it replaced
            self._original = {sig: self._original.get(sig) if h == self._handle else h for sig, h in found.items()}
        self._trainer, self._pid, self._active = trainer, os.getpid(), True
        for sig in self.signals:
            signal.signal(sig, self._handle)

    def _uninstall(self) -> None:
        if not self._active or threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._original.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._active = False
        self._trainer = None

    # ---- hooks ---------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before Lightning's _SignalConnector registers its handlers: it then leaves SIGUSR1 alone (no SLURM
        # checkpoint written from inside its handler), and the training loader's persistent workers, forked before
        # on_train_start, inherit this handler (a no-op there) rather than SIGUSR1's default action, which kills
        # them when a scheduler signals the whole process group.
        if stage == "fit":
            self._received = self._agreed = 0
            self._stop_at_epoch_start = False
            self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning has since put its own SIGTERM handler in front of this one (it would make the loops raise
        # SIGTERMException where no checkpoint resumes exactly): take SIGTERM back for the rest of fit.
        if getattr(trainer, "received_sigterm", False):  # the signal came while Lightning's handler ran
            self._received = self._received or int(signal.SIGTERM)
        self._install(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stop_at_epoch_start:  # the previous epoch ended (validated, logged, saved) after the signal
            self._exit(trainer, f"after epoch {trainer.current_epoch - 1}", self._last_path(trainer))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_before:
            return  # an accumulation micro-batch: its gradients would be in no checkpoint
        if not self._agreed and (trainer.world_size == 1 or trainer.global_step % self.check_every_n_steps == 0):
            self._agreed = self._agree(trainer)
        if not self._agreed or self._ends_epoch(trainer, batch_idx) or self._validates_after(trainer, batch_idx):
            return
        path = self._last_path(trainer)
        with stop_on_write_error(trainer):  # a full disk stops the run here too, naming the previous last.ckpt
            trainer.save_checkpoint(path, weights_only=False)  # on every rank: a collective under DDP
        self._exit(trainer, f"at epoch {trainer.current_epoch}, batch {batch_idx + 1} of "
                   f"{trainer.num_training_batches}", path)  # fmt: skip

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._agreed:
            self._agreed = self._agree(trainer)  # once per epoch on every rank
        if not self._agreed:
            return
        last = self._last_checkpoint(trainer)
        if last is None or not last.saved_at_step(trainer.global_step):  # every_n_epochs skipped this epoch
            with stop_on_write_error(trainer):
                trainer.save_checkpoint(self._last_path(trainer), weights_only=False)
        # Exit once the epoch's metrics are logged (after this hook), at the next epoch's start; when this was the
        # last epoch, fit simply ends and the run is complete.
        self._stop_at_epoch_start = True

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._uninstall()
        if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero:  # Ctrl-C twice, or where not caught
            path = last_checkpoint(trainer)
            resume = f"resume with python -m yolo5l.train resume={shown_path(path)} (its last save: the epoch it was in"
            print(
                f"\nstopped (Ctrl-C) in epoch {trainer.current_epoch}: "
                + (f"{resume} starts again)" if path else "no checkpoint was written yet, nothing to resume"),
                file=sys.stderr,
                flush=True,
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _agree(self, trainer: pl.Trainer) -> int:
        """The signal to stop for, the same on every rank (the largest received; 0: none). One all-reduce and host
        sync, every n steps only; a rank that received the signal waits `agree_timeout_s` at most."""
        if trainer.world_size == 1:
            return self._received
        flag = torch.tensor(self._received, dtype=torch.int32, device=trainer.strategy.root_device)
        if not self._received:  # bounded by the process group's timeout (LostRankWatch sets it)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            return int(flag)
        work = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.agree_timeout_s))
        except RuntimeError as e:  # a rank is gone: its connection closed, or it did not come in time
            self._uninstall()
            name = signal.Signals(self._received).name
            if collective_failure(e) == "closed":
                why = "lost its connection to another rank: that rank died"
            else:
                wait = f"{self.agree_timeout_s:g} s (callbacks.preemption.agree_timeout_s)"
                why = f"the other ranks did not agree within {wait}: one of them died or hangs"
            message = lost_rank_message(trainer, f"rank {trainer.global_rank} received {name} and {why}")
            print(f"\n{message}", file=sys.stderr, flush=True)
            raise RankLost(message) from e
        return int(flag)

    @staticmethod
    def _ends_epoch(trainer: pl.Trainer, batch_idx: int) -> bool:
        return batch_idx + 1 >= trainer.num_training_batches

    @staticmethod
    def _validates_after(trainer: pl.Trainer, batch_idx: int) -> bool:
        # A checkpoint saved before a mid-epoch validation resumes past it (Lightning fast-forwards the validation
        # of a batch restored as "ended"): stop after the next stepping batch instead.
        every = getattr(trainer, "val_check_batch", None)
        return isinstance(every, int) and every > 0 and (batch_idx + 1) % every == 0

    @staticmethod
    def _last_checkpoint(trainer: pl.Trainer) -> LastCheckpoint | None:
        return next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, LastCheckpoint)), None)

    def _last_path(self, trainer: pl.Trainer) -> str:
        if self.folder is not None:
            return os.path.join(self.folder, "last.ckpt")
        return last_checkpoint(trainer, must_exist=False) or os.path.join(
            trainer.default_root_dir, "checkpoints", "last.ckpt"
        )

    def _exit(self, trainer: pl.Trainer, where: str, path: str) -> None:
        signum = self._agreed or int(signal.SIGTERM)
        self._uninstall()
        if trainer.is_global_zero:
            requeued = _requeue(trainer, signum)
            what = "stopped (Ctrl-C)" if signum == signal.SIGINT else f"preempted ({signal.Signals(signum).name})"
            print(
                f"\n{what} {where}: resume with python -m yolo5l.train resume={shown_path(path)}"
                f"{'; ' + requeued if requeued else ''}",
                file=sys.stderr,
                flush=True,
            )
        raise Preempted(signum, path)


def _requeue(trainer: pl.Trainer, signum: int) -> str:
    """Requeue the SLURM job when `signum` is the requeue signal of Lightning's SLURM environment with auto-requeue
    on (what Lightning's own handler does, after the checkpoint instead of in the middle of a step); returns what
    happened, or "" when nothing was to be done."""
    # The single-device strategy keeps no cluster environment; Lightning's signal connector reads it from the
    # accelerator connector too.
    env = getattr(trainer.strategy, "cluster_environment", None)
    env = env or getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
    if not (isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal == signum):
        return ""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array else os.environ.get("SLURM_JOB_ID", "")
    if not job.replace("_", "").isdigit():
        return f"no SLURM job id to requeue ({job!r})"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"requeueing SLURM job {job} failed ({e}): resubmit it"
    if result.returncode != 0:
        return f"requeueing SLURM job {job} failed ({(result.stderr or result.stdout).strip()}): resubmit it"
    return f"requeued SLURM job {job}"
