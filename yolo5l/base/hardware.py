"""What `auto` means on this machine: precision, cuDNN benchmark, determinism, loader workers, CPU threads.

One module answers these for train, val, predict and export, so an `auto` in `conf/` resolves the same everywhere:

- `trainer.precision`: `16-mixed` on CUDA; `bf16-mixed` on CPUs with AMX or AVX512-BF16; else `32-true`
  (`resolve_precision`; conf/trainer/default.yaml resolves it through `yolo5l.base.resolvers`, as `benchmark` and
  `deterministic`).
- `data.num_workers: auto`: the CPU cores this process owns per local device, less one for the device's own process
  (at least 1), on an accelerator; 0 on the CPU, where the compute threads own every core.
- `data.val_num_workers: null`: `num_workers` on an accelerator, 0 on the CPU.
- torch's intra-op threads of a command on the CPU (val, predict, export, benchmark): the cores free when the
  command starts (`command_threads`), measured as training's `callbacks.cpu_threads` measures them
  (`available_cores`, from the scheduler's counters in `/proc`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from functools import cache, wraps
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from yolo5l.base.console import info
from yolo5l.base.errors import UserError

__all__ = [
    "available_cores",
    "command_threads",
    "cpu_has_bf16",
    "idle_cores",
    "inference_device",
    "loader_workers",
    "num_devices",
    "own_cpu_seconds",
    "owned_cores",
    "resolve_precision",
    "run_delay_seconds",
    "start_threads",
    "threads_for",
    "use_tensor_cores",
    "uses_cuda",
    "with_command_threads",
]

_F = TypeVar("_F", bound=Callable[..., Any])


@cache
def cpu_has_bf16() -> bool:
    """True on CPUs with AMX or AVX512-BF16, where bf16 autocast is fast (read from /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def uses_cuda(accelerator: str) -> bool:
    """Whether `trainer.accelerator` selects CUDA (`gpu`, `cuda`, or `auto` on a machine with a GPU)."""
    accelerator = str(accelerator)
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def use_tensor_cores(accelerator: str) -> bool:
    """On CUDA, let float32 matrix products use TensorFloat-32 (``torch.set_float32_matmul_precision("high")``), as
    Lightning advises on GPUs with Tensor Cores: fp32 training, and what autocast leaves in fp32 in a mixed-precision
    step, then runs its matrix products on them. Returns whether it did."""
    if not uses_cuda(accelerator):
        return False
    torch.set_float32_matmul_precision("high")
    return True


def resolve_precision(precision: Any, accelerator: str) -> Any:
    """`auto` -> 16-mixed on CUDA, bf16-mixed on CPUs with AMX/AVX512-BF16, else 32-true; other values unchanged."""
    if str(precision) != "auto":
        return precision
    if uses_cuda(accelerator):
        return "16-mixed"
    return "bf16-mixed" if cpu_has_bf16() else "32-true"


def precision_reason(accelerator: str) -> str:
    """Why `auto` chose what it chose, for the console line that reports it."""
    return "CUDA" if uses_cuda(accelerator) else "CPU with bf16" if cpu_has_bf16() else "CPU without bf16"


def inference_device(device: str) -> torch.device:
    """`device: auto` -> the first GPU when there is one, else the CPU; other values (`cpu`, `cuda:1`) as given.

    Raises:
        UserError: The device does not exist here.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise UserError(f"device={device!r} is not a device: use auto, cpu, cuda or cuda:N ({e})") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise UserError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s); use cpu")
    return dev


def num_devices(trainer_cfg: Mapping[str, Any]) -> int:
    """How many training processes `trainer_cfg` asks for: devices per node x nodes, parsed by Lightning's own
    accelerators (`devices=auto`, `-1`, `2`, `"0,1"`, `[0, 1]`).

    Raises:
        UserError: Lightning refuses the devices (e.g. GPUs asked for on a machine without them).
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    cls = CUDAAccelerator if uses_cuda(accelerator) else CPUAccelerator
    devices = trainer_cfg.get("devices", "auto")
    if hasattr(devices, "__iter__") and not isinstance(devices, str):
        devices = [int(d) for d in devices]
    try:
        parsed = cls.parse_devices(cls.auto_device_count() if devices == "auto" else devices)
        count = len(cls.get_parallel_devices(parsed))
    except (MisconfigurationException, ValueError, TypeError) as e:
        raise UserError(f"trainer.devices={devices!r} with trainer.accelerator={accelerator}: {e}") from None
    nodes = trainer_cfg.get("num_nodes", 1) or 1
    return max(1, count) * int(nodes)


# cgroup v2's "quota period" file, then v1's quota and period files: the first that exists is the process's.
CGROUP_CPU_FILES: tuple[tuple[str, str | None], ...] = (
    ("/sys/fs/cgroup/cpu.max", None),
    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
)


def owned_cores() -> int:
    """The cores this process may run on: its affinity mask (taskset, cpusets), capped by its cgroup's CPU quota
    (containers: cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for quota_file, period_file in CGROUP_CPU_FILES:
        try:
            fields = Path(quota_file).read_text().split()
            quota, period = fields[0], fields[1] if period_file is None else Path(period_file).read_text().strip()
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1") and int(period) > 0:
            cores = min(cores, max(1, -(-int(quota) // int(period))))
        break
    return max(1, cores)


def loader_workers(num_workers: int | str, on_accelerator: bool, local_devices: int = 1) -> int:
    """Worker processes per rank for `data.num_workers` (`auto` or a count).

    `auto` on an accelerator is the cores this process owns (:func:`owned_cores`) per local device, less the one the
    device's training process needs, at least 1. YOLOv5 caps it at 8, which left half of a 16-core GPU host idle
    while the GPU waited for data. On the CPU it is 0: there the compute threads own the cores, and worker processes
    would preempt them mid-operation.
    """
    if num_workers != "auto":
        return int(num_workers)
    if not on_accelerator:
        return 0
    return max(1, owned_cores() // max(1, local_devices) - 1)


# ---- intra-op threads on a shared CPU --------------------------------------------------------------------------------
# torch's CPU operators run as OpenMP parallel regions that end when their slowest thread is done. Beside another job
# that keeps a core busy, one of two threads is regularly descheduled while the other spins at the region's end
# (libgomp), so a forward pass at 2 threads on 2 cores can take 4 times or more as long as at 1 thread. Training
# adapts its thread count as it runs (`yolo5l.callbacks.cpu_threads`); a command sizes it once, at its start.

#: How long a command measures the free cores before its work (training's `callbacks.cpu_threads.probe_seconds`).
PROBE_SECONDS = 0.25
#: Environment variables that fix torch's thread count: where one is set, a command keeps that count.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: torch's intra-op thread count when this module was imported; a count that differs at a command's start was set
#: in this process (`torch.set_num_threads`), and the command keeps it.
IMPORT_THREADS = torch.get_num_threads()
_commands = 0  # commands inside `command_threads` now: an inner one (benchmark's validations) keeps the outer's count


def run_delay_seconds(pid: int | str = "self") -> float | None:
    """Seconds that the threads of process `pid` have spent runnable but waiting for a core, summed over its live
    threads (the second field of each `/proc/<pid>/task/<tid>/schedstat`); None where the kernel does not say."""
    total, seen = 0, False
    for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(task.read_text().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):  # a thread that ended between the glob and the read
            continue
    return total / 1e9 if seen else None


def idle_cores(cpus: set[int] | None = None) -> float | None:
    """Idle core-seconds since boot over `cpus` (default: this process's affinity), from `/proc/stat`'s idle and
    iowait columns; differences of two readings over a wall interval give the idle cores in it. None without
    `/proc/stat`."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu" and int(name[3:]) in cpus:
            ticks += int(fields[3]) + int(fields[4])
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process and its live children (DataLoader workers), from `/proc`; None
    without `/proc/self/stat`."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = ["self"]
    for task in Path("/proc/self/task").glob("*/children"):  # the kernel lists each thread's children
        try:
            pids += task.read_text().split()
        except OSError:
            continue
    total, seen = 0, False
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
            seen = True
        except (OSError, IndexError, ValueError):  # a worker that ended between the listing and the read
            continue
    return total / tick if seen else None


def available_cores(
    seconds: float = PROBE_SECONDS,
    idle: Callable[[], float | None] | None = None,
    own: Callable[[], float | None] | None = None,
) -> float | None:
    """Cores this process could have used over the next `seconds`: the idle ones of its affinity mask plus those
    its own threads and workers kept busy. Beside a job that keeps one core of two busy this is about 1; on a quiet
    machine, the mask's size. None where `/proc` does not say.

    Args:
        seconds: How long to measure (the caller sleeps that long).
        idle: The reader of idle core-seconds (default :func:`idle_cores`).
        own: The reader of this process's CPU seconds (default :func:`own_cpu_seconds`).
    """
    idle, own = idle or idle_cores, own or own_cpu_seconds
    idle0, own0, t0 = idle(), own(), time.perf_counter()
    time.sleep(seconds)
    idle1, own1, t1 = idle(), own(), time.perf_counter()
    if idle0 is None or idle1 is None or own0 is None or own1 is None:
        return None
    return ((idle1 - idle0) + (own1 - own0)) / max(t1 - t0, 1e-9)


def threads_for(free: float | None, ceiling: int) -> int:
    """Threads for `free` cores, rounded to the nearest, between 1 and `ceiling` (`ceiling` when not measured)."""
    ceiling = max(1, int(ceiling))
    return ceiling if free is None else max(1, min(ceiling, math.floor(free + 0.5)))


def start_threads(seconds: float = PROBE_SECONDS) -> tuple[int, str | None]:
    """The intra-op thread count a command on the CPU starts at, and the console line that says why it differs from
    torch's count (None when it does not).

    An explicit count wins: `OMP_NUM_THREADS` or `MKL_NUM_THREADS` set, or `torch.set_num_threads` called in this
    process since this module was imported (`IMPORT_THREADS`). Otherwise the ceiling is torch's count capped by
    :func:`owned_cores`, and below it the cores free over `seconds` (:func:`available_cores`).
    """
    threads = torch.get_num_threads()
    if any(os.environ.get(key, "").strip() for key in THREAD_ENV) or threads != IMPORT_THREADS:
        return threads, None
    ceiling = max(1, min(threads, owned_cores()))
    free = available_cores(seconds) if ceiling > 1 and seconds > 0 else None
    target = threads_for(free, ceiling)
    if free is not None and target < ceiling:
        why = f"about {free:.1f} of {ceiling} cores free at the start"
        return target, f"intra-op threads: {threads} -> {target} ({why})"
    if ceiling < threads:
        return ceiling, f"intra-op threads: {threads} -> {ceiling} (the cores this process owns)"
    return threads, None


def _on_cpu(device: torch.device | str) -> bool:
    """Whether `device` (a torch device, `cpu`, `cuda:N`, `gpu`, or `auto`: the GPU when there is one) is the CPU."""
    name = str(getattr(device, "type", device))
    return name.split(":")[0] == "cpu" or (name == "auto" and not torch.cuda.is_available())


@contextlib.contextmanager
def command_threads(device: torch.device | str, seconds: float = PROBE_SECONDS) -> Iterator[int]:
    """Run a command's work on the CPU at :func:`start_threads`'s count (printing its line), and give the process
    its count back after it. Elsewhere (`device` not the CPU, where the host threads mostly launch kernels), and
    inside another command's block (benchmark's validations and exports), the count stays as it is.

    Args:
        device: Where the work runs: a torch device, or a config's `cpu`, `cuda:N`, `gpu` or `auto`.
        seconds: How long the free cores are measured.

    Yields:
        The intra-op thread count the work runs at.
    """
    global _commands
    before = torch.get_num_threads()
    threads, why = start_threads(seconds) if _on_cpu(device) and _commands == 0 else (before, None)
    if why is not None:
        info(why)
    if threads != before:
        torch.set_num_threads(threads)
    _commands += 1
    try:
        yield threads
    finally:
        _commands -= 1
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def with_command_threads(device_of: Callable[[Any], torch.device | str]) -> Callable[[_F], _F]:
    """Decorate a command's function of its config: it runs inside `command_threads(device_of(cfg))`."""

    def decorate(fn: _F) -> _F:
        @wraps(fn)
        def run(cfg: Any, *args: Any, **kwargs: Any) -> Any:
            with command_threads(device_of(cfg)):
                return fn(cfg, *args, **kwargs)

        return cast(_F, run)

    return decorate
