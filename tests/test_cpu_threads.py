"""`CPUThreads`: the intra-op thread count follows the cores a CPU training gets.

The callback is driven with a fake clock whose step time depends on the thread count it sets, and fake scheduler
readings (run delay, idle cores), so each scenario (quiet machine, a neighbour that takes a core, a neighbour that
leaves, fewer threads that do not help) is exact and independent of this machine's load.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import yolo5l.base.hardware as hw
import yolo5l.callbacks.cpu_threads as ct
from yolo5l.callbacks.cpu_threads import CPUThreads


class Host:
    """A 2-core host: step time per thread count, and what the scheduler reports (per second of wall time)."""

    def __init__(self, step_s: dict[int, float], waiting: float = 0.0, idle: float = 0.0) -> None:
        self.step_s, self.waiting, self.idle = step_s, waiting, idle
        self.now = self.delay = self.idle_total = 0.0

    def advance(self) -> None:
        dt = self.step_s[torch.get_num_threads()]
        self.now += dt
        self.delay += self.waiting * dt
        self.idle_total += self.idle * dt


@pytest.fixture
def host(monkeypatch):
    h = Host({2: 1.0, 1: 1.0})
    monkeypatch.setattr(ct.time, "perf_counter", lambda: h.now)
    monkeypatch.setattr(ct, "run_delay_seconds", lambda pid="self": h.delay)
    monkeypatch.setattr(ct, "idle_cores", lambda cpus=None: h.idle_total)
    monkeypatch.setattr(ct, "owned_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield h
    torch.set_num_threads(threads)


def _trainer() -> types.SimpleNamespace:
    return types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")), global_step=0)


def _steps(cb: CPUThreads, trainer, host: Host, n: int) -> None:
    for _ in range(n):
        cb.on_train_batch_start(trainer, None, None, 0)
        host.advance()
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, None, None, None, 0)


def _start(**kwargs) -> tuple[CPUThreads, types.SimpleNamespace]:
    kwargs.setdefault("max_seconds", 1e9)  # windows of exactly `window` steps unless a test says otherwise
    kwargs.setdefault("start_after", 0)
    kwargs.setdefault("probe_seconds", 0.0)  # the start-up probe has tests of its own
    cb, trainer = CPUThreads(verbose=False, **kwargs), _trainer()
    cb.on_train_start(trainer, None)
    cb.on_train_epoch_start(trainer, None)
    return cb, trainer


def test_quiet_machine_never_changes_the_thread_count(host):
    cb, trainer = _start()
    _steps(cb, trainer, host, 200)
    assert torch.get_num_threads() == 2
    assert cb.changes == []


def test_a_neighbour_taking_a_core_moves_to_fewer_threads(host):
    # Two threads in lock-step beside a one-core load: each waits for a core 3/4 of the time; one thread is faster.
    host.step_s, host.waiting = {2: 4.0, 1: 1.5}, 1.5
    cb, trainer = _start()
    _steps(cb, trainer, host, 6)  # one window of 6 steps measured: the trial starts
    assert torch.get_num_threads() == 1
    assert cb.changes == []
    _steps(cb, trainer, host, 6)  # the trial's window: faster, kept
    assert torch.get_num_threads() == 1
    assert cb.changes == [(12, 2, 1)]
    _steps(cb, trainer, host, 60)  # still contended, but one thread is the floor
    assert torch.get_num_threads() == 1
    assert len(cb.changes) == 1


def test_a_trial_that_does_not_help_is_undone_and_retried_at_doubling_intervals(host):
    host.step_s, host.waiting = {2: 1.0, 1: 1.8}, 0.6  # contended, but the work scales: two threads still win
    cb, trainer = _start()
    trials = []
    for _ in range(200):
        _steps(cb, trainer, host, 1)
        if torch.get_num_threads() == 1:
            trials.append(trainer.global_step)
    assert torch.get_num_threads() == 2
    assert cb.changes == []
    starts = [s for s in trials if s - 1 not in trials]
    assert len(starts) >= 3
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps == sorted(gaps)
    assert gaps[-1] > gaps[0]


def test_threads_come_back_when_the_neighbour_leaves(host):
    host.step_s, host.waiting = {2: 4.0, 1: 1.5}, 1.5
    cb, trainer = _start()
    _steps(cb, trainer, host, 13)
    assert torch.get_num_threads() == 1
    host.step_s, host.waiting, host.idle = {2: 0.8, 1: 1.5}, 0.0, 1.0  # the other core is free again
    _steps(cb, trainer, host, 30)
    assert torch.get_num_threads() == 2
    assert [c[1:] for c in cb.changes] == [(2, 1), (1, 2)]


def test_slow_steps_end_a_measurement_early(host):
    host.step_s, host.waiting = {2: 30.0, 1: 3.0}, 1.5  # 30 s steps: a window of 6 would take 3 minutes
    cb, trainer = _start(max_seconds=10.0)
    _steps(cb, trainer, host, 1)  # one step of 30 s: decided, the trial starts
    assert torch.get_num_threads() == 1
    _steps(cb, trainer, host, 3)
    assert cb.changes == []
    _steps(cb, trainer, host, 1)  # 3 s steps: the trial's window ends after 4 of them (12 s), kept
    assert cb.changes == [(5, 2, 1)]


def test_slow_steps_end_the_warm_up_early(host):
    # Beside a neighbour the first steps are slow too: waiting out 10 of them at 30 s would lose 5 minutes.
    host.step_s, host.waiting = {2: 30.0, 1: 3.0}, 1.5
    cb, trainer = _start(start_after=10, start_seconds=5.0, max_seconds=10.0)
    _steps(cb, trainer, host, 1)  # the first step took 30 s > 5 s: it ends the warm-up and is measured
    assert torch.get_num_threads() == 1


def test_the_first_steps_are_not_measured(host):
    host.step_s, host.waiting = {2: 0.4, 1: 0.15}, 0.8  # 10 steps take 4 s: within start_seconds (5 s)
    cb, trainer = _start(start_after=10)
    _steps(cb, trainer, host, 10 + 5)
    assert torch.get_num_threads() == 2  # 10 warm-up steps, then 5 measured: no decision yet
    _steps(cb, trainer, host, 1)
    assert torch.get_num_threads() == 1  # the trial


def test_not_adaptive_or_one_thread_or_an_accelerator_leaves_it_alone(host):
    host.step_s, host.waiting = {2: 4.0, 1: 1.5}, 1.5
    for kwargs, device, threads in (({"adaptive": False}, "cpu", 2), ({}, "cpu", 1), ({}, "meta", 2)):
        torch.set_num_threads(threads)
        cb, trainer = CPUThreads(verbose=False, **kwargs), _trainer()
        trainer.strategy.root_device = torch.device(device)
        cb.on_train_start(trainer, None)
        _steps(cb, trainer, host, 40)
        assert torch.get_num_threads() == threads
        assert cb.changes == []


def test_teardown_gives_back_the_thread_count_and_the_ceiling_is_the_owned_cores(host, monkeypatch):
    monkeypatch.setattr(ct, "owned_cores", lambda: 1)  # e.g. `taskset -c 0` or a one-CPU container quota
    cb, trainer = _start()
    assert torch.get_num_threads() == 1
    assert cb.ceiling == 1
    cb.teardown(trainer, None, "fit")
    assert torch.get_num_threads() == 2


def test_owned_cores_reads_the_cgroup_quota(tmp_path, monkeypatch):
    cores = hw.owned_cores()
    assert 1 <= cores <= len(__import__("os").sched_getaffinity(0))
    v2 = tmp_path / "cpu.max"
    monkeypatch.setattr(hw, "CGROUP_CPU_FILES", ((str(v2), None),))
    v2.write_text("150000 100000\n")  # 1.5 CPUs of quota: 2 cores can run it
    assert hw.owned_cores() == min(2, cores)
    v2.write_text("50000 100000\n")
    assert hw.owned_cores() == 1
    v2.write_text("max 100000\n")
    assert hw.owned_cores() == cores
    quota, period = tmp_path / "q", tmp_path / "p"
    monkeypatch.setattr(hw, "CGROUP_CPU_FILES", ((str(tmp_path / "absent"), None), (str(quota), str(period))))
    quota.write_text("100000\n")
    period.write_text("100000\n")
    assert hw.owned_cores() == 1


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="the kernel keeps no scheduler statistics")
def test_scheduler_readings_on_this_machine():
    """This process and a spinning neighbour pinned to one core: each waits for the other, so this process's run
    delay grows by a good part of the wall time, and the core has (almost) no idle time in it."""
    core = min(os.sched_getaffinity(0))
    old = os.sched_getaffinity(0)
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nprint(flush=True)\nwhile True: pass"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        os.sched_setaffinity(0, {core})
        delay0, idle0, t0 = ct.run_delay_seconds(), ct.idle_cores({core}), time.perf_counter()
        while time.perf_counter() - t0 < 0.6:
            pass
        delay1, idle1, wall = ct.run_delay_seconds(), ct.idle_cores({core}), time.perf_counter() - t0
    finally:
        os.sched_setaffinity(0, old)
        child.kill()
        child.wait()
    assert delay0 is not None
    assert idle0 is not None
    assert 0.15 * wall < delay1 - delay0 < wall  # about half of it, shared with the neighbour
    assert 0.0 <= idle1 - idle0 < 0.1 * wall + 0.02  # /proc/stat counts in ticks of 10 ms


def test_the_run_starts_at_the_cores_free_at_its_start(host, monkeypatch):
    for free, threads in ((0.9, 1), (1.6, 2), (2.0, 2), (None, 2)):
        monkeypatch.setattr(ct, "available_cores", lambda seconds, free=free: free)
        torch.set_num_threads(2)
        cb, trainer = _start(probe_seconds=0.25)
        assert torch.get_num_threads() == threads
        assert cb.changes == ([(0, 2, 1)] if threads == 1 else [])
    # From one thread, idle cores later bring the second one back (a trial, kept when faster).
    host.step_s, host.idle = {2: 0.8, 1: 1.5}, 1.0
    monkeypatch.setattr(ct, "available_cores", lambda seconds: 1.0)
    cb, trainer = _start(probe_seconds=0.25)
    _steps(cb, trainer, host, 12)
    assert torch.get_num_threads() == 2


def test_available_cores_counts_idle_cores_and_the_process_own_work(monkeypatch):
    clock = {"now": 0.0}
    readings = iter([(10.0, 4.0), (10.3, 4.5)])  # (idle core-s, own CPU s) before and after a 0.5 s probe
    pair = {}

    def sleep(seconds):
        clock["now"] += seconds

    def idle(cpus=None):
        pair["r"] = next(readings)
        return pair["r"][0]

    monkeypatch.setattr(ct.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(ct.time, "sleep", sleep)
    monkeypatch.setattr(ct, "idle_cores", idle)
    monkeypatch.setattr(ct, "own_cpu_seconds", lambda: pair["r"][1])
    assert ct.available_cores(0.5) == pytest.approx((0.3 + 0.5) / 0.5)


def test_own_cpu_seconds_counts_a_live_worker():
    import subprocess
    import sys

    code = (
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
        "print('done', flush=True)\ntime.sleep(60)"
    )
    before = ct.own_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        assert ct.own_cpu_seconds() - before >= 0.45  # the worker's 0.5 CPU seconds, while it is alive
    finally:
        child.kill()
        child.wait()
