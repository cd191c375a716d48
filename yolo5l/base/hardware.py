"""What `auto` means on this machine: precision, cuDNN benchmark, determinism, loader workers.

One module answers these for train, val, predict and export, so an `auto` in `conf/` resolves the same everywhere:

- `trainer.precision`: `16-mixed` on CUDA; `bf16-mixed` on CPUs with AMX or AVX512-BF16; else `32-true`
  (`resolve_precision`; conf/trainer/default.yaml resolves it through `yolo5l.base.resolvers`, as `benchmark` and
  `deterministic`).
- `data.num_workers: auto`: the CPU cores this process owns per local device, less one for the device's own process
  (at least 1), on an accelerator; 0 on the CPU, where the compute threads own every core.
- `data.val_num_workers: null`: `num_workers` on an accelerator, 0 on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch

from yolo5l.base.errors import UserError

__all__ = [
    "cpu_has_bf16",
    "inference_device",
    "loader_workers",
    "num_devices",
    "owned_cores",
    "resolve_precision",
    "use_tensor_cores",
    "uses_cuda",
]


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
