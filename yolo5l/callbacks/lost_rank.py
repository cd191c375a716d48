"""`LostRankWatch`: when a DDP rank dies (the kernel's OOM killer, a lost node, a crashed worker), the job ends with
one line naming the rank, its signal or exit code, the last complete checkpoint and the `resume=` command, and with
exit status 75 (`RankLost`, `yolo5l.base.errors.EXIT_RANK_LOST`).

How a lost rank is noticed depends on who started the ranks:

- **Lightning's launcher** (`trainer.devices=N` on one machine, strategy ddp): rank 0's process is the parent of the
  others. Lightning's own observer polls them every 5 s and, when one is gone, SIGKILLs the rest and rank 0 itself:
  the job ends with status 137 (which reads as if the whole job was OOM-killed) and the last console line is a
  progress bar. This callback stops that observer (its thread is found by its class, and its next poll ends its loop)
  and runs its own in its place, polling every `poll_s`: a rank killed by a signal, or ended with a status that is
  not one of an orderly stop that all ranks make together (0, 2, 65, 75, 128 + a signal: those print their own line
  and rank 0 stops with them), is reported; the other ranks are SIGKILLed as Lightning does (a rank waiting in a
  collective does not answer SIGTERM), a half-written checkpoint's temporary file is removed, and rank 0 ends with
  status 75 (`os._exit` from the observer thread: the main thread may be blocked in a collective).
- **No observer** (`torchrun`, SLURM's `srun`, several nodes): nothing on this node can watch a rank on another. The
  ranks still alive notice in their next collective: at once when the lost rank's sockets close (gloo: "Connection
  closed by peer"), or when the process group's timeout runs out when its node is gone or hung. `collective_timeout_s`
  sets that timeout (`torch.distributed.set_timeout` at `on_fit_start`) instead of torch's 30 minutes, which would
  keep every other GPU of the job idle for half an hour; the set-up before it (dataset download, label scan and
  image cache, which one rank may take much longer over than another) keeps the long default. The collective's
  error reaches `on_exception`, which prints the line on each surviving rank; `python -m yolo5l.train` then exits
  with `RankLost`'s status (`raise_if_rank_lost`). Under NCCL, torch's watchdog ends the process when the timeout
  runs out (with its own message naming the collective) before Python sees an error.
- **A scheduler that signals the survivors** (torchrun's agent sends SIGTERM to the other workers when one fails):
  `PreemptionCheckpoint` waits a bounded time for the other ranks to agree on the stop, then stops with this line
  rather than waiting for a rank that is gone.

Nothing is lost that a resume does not bring back: every checkpoint write is atomic, so `last.ckpt` is the last
complete one, and `resume=` continues from it exactly.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from yolo5l.base.errors import EXIT_DIVERGED, EXIT_RANK_LOST, EXIT_USAGE, shown_path
from yolo5l.base.run_files import last_checkpoint

__all__ = ["LostRankWatch", "RankLost", "collective_failure", "lost_rank_message", "raise_if_rank_lost"]

# Exit statuses of a rank that stopped in an orderly way, which all ranks reach together (each prints its own line).
_ORDERLY = {0, EXIT_USAGE, EXIT_DIVERGED, EXIT_RANK_LOST} | {128 + int(s) for s in signal.Signals}

# What a failed collective says when its peer is gone (gloo's and NCCL's words), and how the line puts it.
_CLOSED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
_TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")
_OOM_HINT = " (the kernel's out-of-memory killer sends SIGKILL: see dmesg)"


class RankLost(SystemExit):
    """A DDP rank was lost and the job stopped: exit status `EXIT_RANK_LOST` (75); `str()` is the one-line message.

    Attributes:
        message: the line printed.
    """

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_RANK_LOST)
        self.message = message

    def __str__(self) -> str:
        return self.message


def lost_rank_message(trainer: Any, what: str, epoch: bool = True) -> str:
    """The line: at the current epoch (when `epoch`: this process trains) `what` happened; the job stops; the last
    complete checkpoint and the `resume=` command, or that there is none yet."""
    last = last_checkpoint(trainer)
    if last is not None:
        advice = f"resume from the last complete checkpoint: python -m yolo5l.train resume={shown_path(last)}"
    else:
        advice = "no checkpoint was written yet: start the run again"
    when = f" at epoch {getattr(trainer, 'current_epoch', 0)}" if epoch else ""
    return f"DDP rank lost{when}: {what}; the job stops; {advice}"


def collective_failure(error: BaseException) -> str | None:
    """Whether `error` (or an exception it was raised from) is a collective that failed because a rank is gone:
    "closed" (its connection closed: the process died), "timeout" (it did not come in time: its node is gone or
    hung), "failed: <the backend's first line>" (another failure of the backend), or None (not a collective's)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        from_backend = isinstance(error, dist_error) or any(w in text for w in ("gloo", "NCCL", "c10d", *_CLOSED))
        if isinstance(error, RuntimeError) and from_backend:
            if any(w in text for w in _CLOSED):
                return "closed"
            if any(w in text for w in _TIMED_OUT):
                return "timeout"
            return f"failed: {text.strip().splitlines()[0][:160]}"
        error = error.__cause__ or error.__context__
    return None


def raise_if_rank_lost(trainer: Any, error: BaseException) -> None:
    """Raise `RankLost` from `error` when a rank was lost: `LostRankWatch.on_exception` found so, or `error` is
    torch's word that a process of `trainer.strategy=ddp_spawn` ended (its launcher waits in the parent process,
    outside any hook). The command line calls this for an exception out of `trainer.fit`."""
    for cb in getattr(trainer, "callbacks", []):
        if isinstance(cb, LostRankWatch) and cb.lost is not None:
            raise cb.lost from error
    if isinstance(error, torch.multiprocessing.ProcessExitedException):
        if error.signal_name:
            how = f"was killed by {error.signal_name}"
            how += _OOM_HINT if error.signal_name == "SIGKILL" else ""
        else:
            how = f"exited with status {error.exit_code}"
        message = lost_rank_message(trainer, f"rank {error.error_index} (pid {error.error_pid}) {how}", epoch=False)
        print(f"\n{message}", file=sys.stderr, flush=True)
        raise RankLost(message) from error


class LostRankWatch(Callback):
    """Explain a DDP rank that died, and bound how long the others wait for it (see the module docstring).

    Args:
        collective_timeout_s: how long a collective (gradient all-reduce, barrier, metric gather) waits for every
            rank once fit is set up, before the job is taken as having lost a rank; None keeps the backend's
            (torch: 30 minutes). Runs alone on one process are unaffected.
        poll_s: how often rank 0 looks at the ranks it started (Lightning's launcher only).
    """

    def __init__(self, collective_timeout_s: float | None = 600.0, poll_s: float = 1.0) -> None:
        if collective_timeout_s is not None and not collective_timeout_s > 0:
            raise ValueError(f"LostRankWatch: collective_timeout_s must be > 0 or null, got {collective_timeout_s}")
        if not poll_s > 0:
            raise ValueError(f"LostRankWatch: poll_s must be > 0, got {poll_s}")
        self.collective_timeout_s = None if collective_timeout_s is None else float(collective_timeout_s)
        self.poll_s = float(poll_s)
        self.lost: RankLost | None = None  # set by on_exception when a rank was lost
        self._stop = threading.Event()
        self._observer: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        # trainer.strategy=ddp_spawn pickles the trainer and its callbacks for each process it starts: the
        # observer thread and its event stay with the process that made them, each copy gets its own.
        state = self.__dict__.copy()
        state["_stop"], state["_observer"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stop = threading.Event()

    # ---- hooks ---------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.lost = None
        if trainer.world_size < 2 or not _distributed():
            return
        # The ranks Lightning's script launcher started (`ddp`: subprocess.Popen); the multiprocessing launchers'
        # (ddp_spawn, ddp_fork) are processes torch joins, which raise_if_rank_lost reads.
        procs = [
            p for p in getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or [] if hasattr(p, "poll")
        ]
        if procs and self._observer is None:
            _stop_lightning_observer(procs)
            self._stop.clear()
            self._observer = threading.Thread(
                target=self._watch, args=(trainer, procs), name="yolo5l-lost-rank", daemon=True
            )
            self._observer.start()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After set-up, whose waits may be long on purpose (the barrier while rank 0 scans labels or caches images,
        # DDP's first broadcast): from here on every rank takes part in every step.
        if trainer.world_size > 1 and _distributed() and self.collective_timeout_s is not None:
            c10d = torch.distributed.distributed_c10d
            set_timeout = getattr(torch.distributed, "set_timeout", None) or getattr(c10d, "_set_pg_timeout", None)
            if set_timeout is None:  # a torch that can change it neither way: the backend's stays
                rank_zero_warn("this torch cannot change the process group's timeout: collective_timeout_s unused")
                return
            set_timeout(datetime.timedelta(seconds=self.collective_timeout_s))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.world_size < 2 or isinstance(exception, SystemExit):  # stopped on purpose, with its own line
            return
        kind = collective_failure(exception)
        if kind is None:
            return
        if self._observer is not None and self._observer.is_alive():
            # Rank 0 under Lightning's launcher: the collective may have failed before the observer saw the rank
            # go; give it two polls to name it (it then ends the process).
            self._observer.join(timeout=2 * self.poll_s + 1)
        rank = f"rank {trainer.global_rank}"
        if kind == "closed":
            what = f"{rank} lost its connection to another rank in a collective: that rank died"
        elif kind == "timeout":
            wait = "the process group's timeout"
            if self.collective_timeout_s is not None:
                wait = f"{self.collective_timeout_s:g} s (callbacks.lost_rank.collective_timeout_s)"
            what = f"{rank} waited {wait} for another rank in a collective: that rank died, hangs or lost its node"
        else:
            what = f"{rank}: a collective {kind}"
        message = lost_rank_message(trainer, what)
        print(f"\n{message}", file=sys.stderr, flush=True)
        self.lost = RankLost(message)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop.set()  # fit is over on rank 0: the ranks finish on their own
        self._observer = None

    # ---- the observer (rank 0 under Lightning's launcher) ---------------------------------------------------------
    def _watch(self, trainer: pl.Trainer, procs: list[Any]) -> None:
        first_rank = getattr(trainer, "node_rank", 0) * getattr(trainer, "num_devices", len(procs) + 1) + 1
        while not self._stop.wait(self.poll_s):
            for i, proc in enumerate(procs):
                code = proc.poll()
                if code is None or code in _ORDERLY:
                    continue
                if self._stop.is_set():
                    return
                self._report(trainer, procs, first_rank + i, proc.pid, code)

    def _report(self, trainer: pl.Trainer, procs: list[Any], rank: int, pid: int, code: int) -> None:
        """Say which rank went and how, end the other ranks and this process (status 75)."""
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            how = f"was killed by {name}" + (_OOM_HINT if -code == signal.SIGKILL else "")
        else:
            how = f"exited with status {code}"
        message = lost_rank_message(trainer, f"rank {rank} (pid {pid}) {how}")
        print(f"\n{message}", file=sys.stderr, flush=True)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL, as Lightning's observer: a rank blocked in a collective ignores SIGTERM
        _remove_partial_writes(trainer)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(EXIT_RANK_LOST)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _stop_lightning_observer(procs: list[Any]) -> None:
    """End the loop of Lightning's `_ChildProcessObserver` that watches `procs`: its next poll returns "finished"
    instead of SIGKILLing the job (Lightning 2.6 `fabric/strategies/launchers/subprocess_script.py`)."""
    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:  # a Lightning without it starts none
        return
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and list(getattr(thread, "_child_processes", [])) == procs:
            thread._run = lambda: True  # type: ignore[method-assign]


def _remove_partial_writes(trainer: pl.Trainer) -> None:
    """Remove the temporary files of checkpoint writes cut short (`yolo5l.models.weights.atomic_save` names them
    `.<name>.<random>.tmp` beside the target); the files they would have replaced are whole."""
    for cb in getattr(trainer, "checkpoint_callbacks", []):
        folder = getattr(cb, "dirpath", None)
        if not folder or not os.path.isdir(folder):
            continue
        for name in ("last.ckpt", "best.ckpt", "best.pt", "weights.pt"):
            for tmp in Path(folder).glob(f".{name}.*.tmp"):
                tmp.unlink(missing_ok=True)
