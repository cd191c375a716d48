"""`CPUThreads`: torch's intra-op threads follow the cores a CPU training actually gets.

PyTorch's CPU operators (and the fused BatchNorm + SiLU kernel) run as OpenMP parallel regions: every thread takes a
fixed share of the work, and the region ends when the slowest thread is done. On a machine shared with another job
that has more runnable threads than cores, one of the training's threads is regularly descheduled for a whole
scheduler slice while the others wait for it at the region's end, spinning; a training step is thousands of short
regions, so it slows down far more than its share of the cores (measured in docs/benchmarks.md, "Sharing the
machine": 2 threads on a 2-core host beside a one-core load lost 4x, 1 thread lost 2x).

This callback measures, every `window` training steps, how long the process's threads waited for a core (the
scheduler's run delay, from `/proc/self/task/*/schedstat`) and how much of the process's cores sat idle
(`/proc/stat`). When its threads waited more than `contended` thread-seconds per second, it tries fewer threads for
one window; when cores were idle and it runs below its ceiling, it tries more. The trial is kept only when the
median step time improves by `min_gain`; a trial that loses is retried later, at doubling intervals. The ceiling is
torch's thread count at the start of training (OMP_NUM_THREADS, Lightning's per-rank split under DDP) capped by the
cores the process owns (its affinity mask and cgroup CPU quota: `yolo5l.base.hardware.owned_cores`).

Before the first step it measures, for `probe_seconds`, how many cores are free (idle, or busy with this process and
its workers) and starts at that many threads when fewer than the ceiling are: beside a job in another session (the
kernel's autogroups share the cores between sessions, whatever their thread counts), a 2-thread step can take 20
times longer than a 1-thread step, so even the first step at the wrong count costs more than the whole probe. The
readings are `yolo5l.base.hardware`'s; val, predict, export and benchmark size their threads from the same probe
(`yolo5l.base.hardware.command_threads`).

On a quiet machine neither the probe nor a trial changes anything, so the thread count, and with it the results bit
for bit, stay as they are.
Under contention the thread count can change mid-run, and a reduction's rounding depends on the thread count: pass
`callbacks.cpu_threads.adaptive=false` (or set OMP_NUM_THREADS) for bit-identical reruns on a shared machine.
Only training on the CPU adapts: on an accelerator the host threads mostly launch kernels.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from yolo5l.base import hardware
from yolo5l.base.hardware import idle_cores, own_cpu_seconds, owned_cores, run_delay_seconds

__all__ = ["CPUThreads", "available_cores", "idle_cores", "own_cpu_seconds", "run_delay_seconds"]


def available_cores(seconds: float = 0.25) -> float | None:
    """:func:`yolo5l.base.hardware.available_cores` over the readers of this module's namespace (`idle_cores`,
    `own_cpu_seconds`), which a test may replace here."""
    return hardware.available_cores(seconds, idle=idle_cores, own=own_cpu_seconds)


class CPUThreads(Callback):
    """Adapt `torch.set_num_threads` to the cores a CPU training gets (see the module docstring).

    Args:
        adaptive: false keeps torch's thread count (capped by the owned cores) for the whole run.
        window: training steps per measurement, and per trial.
        start_after: training steps of a run (or a resumed run) before the first measurement: the first steps
            build the allocator's pools and oneDNN's primitives, and are slower than the rest.
        start_seconds: the warm-up ends sooner once its steps took this long (the first step alone may): under
            heavy contention a step can take many seconds, and every one at the wrong thread count is lost.
        max_seconds: a measurement ends sooner once its steps took this long (a single step may): slow steps
            under heavy contention are when a decision matters most.
        contended: run delay, in thread-seconds per second, above which fewer threads are tried.
        min_gain: relative improvement of the median step time that keeps a trial.
        probe_seconds: at the start of training, how long the free cores are measured (0: not measured); the run
            starts at that many threads when fewer than its ceiling are free.
        verbose: print a line each time the thread count changes.
    """

    def __init__(
        self, adaptive: bool = True, window: int = 6, start_after: int = 10, start_seconds: float = 5.0,
        max_seconds: float = 3.0, contended: float = 0.25, min_gain: float = 0.03, probe_seconds: float = 0.25,
        verbose: bool = True,
    ) -> None:  # fmt: skip
        if int(window) < 2:
            raise ValueError(f"CPUThreads: window must be at least 2 steps, got {window!r}")
        self.adaptive = bool(adaptive)
        self.window = int(window)
        self.max_seconds = float(max_seconds)
        self.start_after = int(start_after)
        self.start_seconds = float(start_seconds)
        self._seen = 0  # training steps of this fit
        self._warm_from: float | None = None  # when this fit's first training step started
        self.contended = float(contended)
        self.min_gain = float(min_gain)
        self.probe_seconds = float(probe_seconds)
        self.verbose = verbose
        self.ceiling = 1
        self._start_threads: int | None = None
        self.changes: list[tuple[int, int, int]] = []  # (global step, from, to): what the run did, for tests/logs
        self._active = False
        self._times: list[float] = []
        self._last: float | None = None
        self._trial: tuple[int, float, str] | None = None  # (threads before, their median step time, reason)
        self._hold = 0  # windows to wait before the next trial
        self._backoff = 2
        self._mark: tuple[float, float | None, float | None] | None = None  # (wall, run delay, idle) at window start

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        threads = self._start_threads = torch.get_num_threads()
        self.ceiling = max(1, min(threads, owned_cores()))
        if threads > self.ceiling:  # torch counts the machine's cores; a container or taskset may own fewer
            torch.set_num_threads(self.ceiling)
            rank_zero_info(f"intra-op threads: {threads} -> {self.ceiling} (the cores this process owns)")
        self._active = self.adaptive and trainer.strategy.root_device.type == "cpu" and self.ceiling > 1
        self._last = None
        self._seen = 0
        self._warm_from = None
        if self._active and self.probe_seconds > 0:
            # Beside a job in another session (the kernel's autogroups share the cores between sessions), a step at
            # too many threads can take 20x longer: start at the cores that are free now; trials go on from there.
            free = available_cores(self.probe_seconds)
            target = self.ceiling if free is None else max(1, min(self.ceiling, math.floor(free + 0.5)))
            if target < torch.get_num_threads():
                rank_zero_info(
                    f"intra-op threads: {torch.get_num_threads()} -> {target} (about {free:.1f} of "
                    f"{self.ceiling} cores free at the start)"
                )
                self.changes.append((trainer.global_step, torch.get_num_threads(), target))
                torch.set_num_threads(target)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None  # the step after validation or a new epoch's first fetch is not a training step's time
        self._mark = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None
        self._mark = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._active and self._last is None:  # the first step of a fit, an epoch, or after validation
            self._restart(time.perf_counter())
            if self._warm_from is None:
                self._warm_from = self._last

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._seen += 1
        now = time.perf_counter()  # CPU operators are synchronous: the host clock is the step's time
        if self._last is None:  # no batch start seen (a loop that skips the hook): this step starts the clock
            self._restart(now)
            return
        warm = now - self._warm_from if self._warm_from is not None else 0.0
        if self._seen <= self.start_after and warm < self.start_seconds:
            self._restart(now)  # a warm-up step: the measurement starts after it
            return
        self._times.append(now - self._last)  # fetch + step: what throughput is made of
        self._last = now
        if len(self._times) >= self.window or sum(self._times) >= self.max_seconds:
            self._decide(trainer.global_step, statistics.median(self._times), now)
            self._times.clear()

    def _restart(self, now: float) -> None:
        self._last = now
        self._mark = (now, run_delay_seconds(), idle_cores())
        self._times.clear()

    def _decide(self, step: int, median: float, now: float) -> None:
        wall0, delay0, idle0 = self._mark or (now, None, None)
        delay1, idle1 = run_delay_seconds(), idle_cores()
        self._mark = (now, delay1, idle1)
        elapsed = max(now - wall0, 1e-9)
        waiting = (delay1 - delay0) / elapsed if delay0 is not None and delay1 is not None else 0.0
        idle = (idle1 - idle0) / elapsed if idle0 is not None and idle1 is not None else 0.0
        threads = torch.get_num_threads()

        if self._trial is not None:
            before, before_median, reason = self._trial
            self._trial = None
            if median < before_median * (1.0 - self.min_gain):
                self._backoff = 2
                self._hold = 1
                self.changes.append((step, before, threads))
                if self.verbose:
                    rank_zero_info(
                        f"intra-op threads: {before} -> {threads} ({reason}; step {1e3 * before_median:.0f} -> "
                        f"{1e3 * median:.0f} ms)"
                    )
            else:
                torch.set_num_threads(before)
                self._hold = self._backoff
                self._backoff = min(64, 2 * self._backoff)
            return
        if self._hold > 0:
            self._hold -= 1
            return
        target, reason = threads, ""
        if waiting > self.contended and threads > 1:
            # Each waiting thread-second per second is about one core taken by someone else.
            target = max(1, min(threads - 1, math.floor(threads - waiting)))
            reason = f"threads waited {waiting:.2f} s/s for a core"
        elif threads < self.ceiling and idle >= 0.5:
            target = min(self.ceiling, threads + max(1, math.floor(idle + 0.5)))
            reason = f"{idle:.1f} cores idle"
        if target != threads:
            self._trial = (threads, median, reason)
            torch.set_num_threads(target)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The process goes on (a notebook, the next job of a sweep): it gets the thread count it came with.
        self._trial = None
        if self._start_threads is not None:
            torch.set_num_threads(self._start_threads)
            self._start_threads = None
