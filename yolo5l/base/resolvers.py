"""The OmegaConf resolvers `conf/` uses, registered on import (`yolo5l.conf` and `yolo5l.config` import this module,
so every composed or reloaded config resolves them).

- `${if_file:${.file},640,320}`: a value by whether a dataset file is given.
- `${auto_precision:${.accelerator}}`, `${auto_deterministic:${.accelerator}}`,
  `${auto_benchmark:${.accelerator},${.deterministic}}`: what conf/trainer/default.yaml's defaults of
  `trainer.precision`, `trainer.deterministic` and `trainer.benchmark` are on this machine (`yolo5l.base.hardware`'s
  rules). A value given on the command line replaces the interpolation.
- `${val_precision:${half},${task},${.accelerator}}`: conf/val.yaml's `trainer.precision`, v7.0 val.py's rule with
  yolo5l's bf16 for `half` on the CPU.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

__all__ = ["auto_benchmark", "auto_deterministic", "auto_precision", "if_file", "register", "val_precision"]


def if_file(file: Any, with_file: Any, without_file: Any) -> Any:
    """``${if_file:${.file},640,320}``: ``with_file`` when a dataset file is given, else ``without_file``."""
    return with_file if file not in (None, "") else without_file


def auto_precision(accelerator: Any) -> str:
    """16-mixed on CUDA; bf16-mixed on CPUs with AMX or AVX512-BF16; else 32-true (`hardware.resolve_precision`)."""
    from yolo5l.base.hardware import resolve_precision

    return str(resolve_precision("auto", str(accelerator)))


def val_precision(half: Any, task: Any, accelerator: Any) -> str:
    """The precision of `python -m yolo5l.val`: 32-true, as v7.0's val.py without `--half`; with `half`, 16-mixed on
    CUDA and bf16-mixed on CPUs with AMX or AVX512-BF16 (32-true on other CPUs). `task=speed|study` use 16-mixed on
    CUDA whatever `half` says, as v7.0 times them in fp16 on a GPU.

    Reference: ultralytics/yolov5 v7.0 `val.py::run` (`half`, fp16 on CUDA only) and `val.py::main` (`opt.half` for
    speed and study).
    """
    from yolo5l.base.hardware import cpu_has_bf16, uses_cuda

    if uses_cuda(str(accelerator)):
        return "16-mixed" if bool(half) or str(task) in ("speed", "study") else "32-true"
    return "bf16-mixed" if bool(half) and str(accelerator) in ("cpu", "auto") and cpu_has_bf16() else "32-true"


def auto_deterministic(accelerator: Any) -> bool:
    """Deterministic algorithms on the CPU (reproducible runs); off on CUDA, where they cost speed."""
    from yolo5l.base.hardware import uses_cuda

    return not uses_cuda(str(accelerator))


def auto_benchmark(accelerator: Any, deterministic: Any) -> bool:
    """cuDNN's autotuner on CUDA unless deterministic: it chooses kernels by timing, which varies from run to run."""
    from yolo5l.base.hardware import uses_cuda

    return uses_cuda(str(accelerator)) and not bool(deterministic)


_RESOLVERS = {
    "if_file": if_file,
    "auto_precision": auto_precision,
    "auto_deterministic": auto_deterministic,
    "auto_benchmark": auto_benchmark,
    "val_precision": val_precision,
}


def register() -> None:
    """Register the resolvers once per process."""
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register()
