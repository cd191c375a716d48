"""What a command line may say before anything is composed: the options of each config group, and the values each
key takes.

- `check_group_choices`: a `group=option` naming an option that does not exist (each option of a sweep too);
- `check_key_values`: each key's own check (a whole number, an image size, true or false, one of a list) on a
  config; `yolo5l.config`'s checks of a run start with it, and `compose_config` runs it on what it composed;
- `check_sweep_values`: the same check on every value of a sweep (`data.batch_size=8,16`, `range(...)`), so that a
  bad value is refused before the sweep's first job, not when its own job comes.

Each mistake raises a `UserError` whose one line names the key, the value and the fix.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from yolo5l.base.errors import UserError

__all__ = [
    "CONFIG_MODULE",
    "check_group_choices",
    "check_key_values",
    "check_sweep_values",
    "config_choices",
    "image_size",
    "key_checks",
    "override_key",
    "unknown_option",
    "whole_number",
]

CONFIG_MODULE = "yolo5l.conf"
TRAIN_OPTIONS = ("single_cls", "rect", "image_weights", "multi_scale", "quad")  # v7.0 train.py's data switches
#: The data switches (`data.rect=true`), v7.0's and the loader's.
DATA_SWITCHES = ("reduced_decode", "val_reduced_decode", "persistent_workers", "pin_memory", *TRAIN_OPTIONS)
#: export's switches.
EXPORT_SWITCHES = ("dynamic", "half", "simplify", "int8", "nms", "optimize")

#: A key's check: called with the value and the key, raises `UserError`.
Check = Callable[[Any, str], object]


# ---- config groups --------------------------------------------------------------------------------------------------
def config_choices(group: str) -> list[str]:
    """Options of a config group (`model` -> ['yolov5l', 'yolov5m', ...]), from the shipped `yolo5l.conf`.

    Files starting with `_` are shared bases (`data/_base.yaml`), not options.
    """
    from importlib.resources import files

    folder = files(CONFIG_MODULE).joinpath(group)
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml") and p.name[0] != "_")


def _group_folders(folder: Any, prefix: str = "") -> Iterator[str]:
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.is_dir() or entry.name.startswith(("_", ".")) or (not prefix and entry.name == "hydra"):
            continue  # Hydra's own groups (hydra/job_logging) are checked by Hydra
        name = f"{prefix}{entry.name}"
        if any(e.name.endswith(".yaml") for e in entry.iterdir()):
            yield name
        yield from _group_folders(entry, f"{name}/")


@functools.cache
def config_groups() -> tuple[str, ...]:
    """The config groups: every folder of the shipped `yolo5l.conf` that holds option files (`model`,
    `module/optimizer`, ...)."""
    from importlib.resources import files

    return tuple(_group_folders(files(CONFIG_MODULE)))


@functools.cache
def nullable_groups() -> tuple[str, ...]:
    """The groups a command may leave out (`experiment=null`): those whose entry in a command's defaults list is
    null (conf/train.yaml: `- experiment: null`)."""
    from importlib.resources import files

    found: set[str] = set()
    for entry in files(CONFIG_MODULE).iterdir():
        if entry.name.endswith(".yaml"):
            defaults = OmegaConf.create(entry.read_text()).get("defaults") or []
            found |= {str(k) for d in defaults if OmegaConf.is_dict(d) for k, v in d.items() if v is None}
    return tuple(sorted(found))


def check_group_choices(argv: Sequence[str], groups: Sequence[str] | None = None) -> None:
    """Refuse `group=option` arguments naming an option that does not exist, listing the ones that do.

    Hydra would also refuse them, but with a multi-line report; this runs before Hydra composes anything.
    Sweeps (`model=yolov5n,yolov5s`) are checked option by option.

    Raises:
        UserError: An unknown option.
    """
    groups = config_groups() if groups is None else groups
    for arg in argv:
        if "=" not in arg or arg.startswith(("-", "hydra.", "hydra/")):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key.startswith("override "):
            key = key[len("override ") :].strip()
        if key not in groups:
            continue
        choices = config_choices(key)
        if not choices:
            continue
        for option in _sweep_values(value):
            if option in ("null", "") and key in nullable_groups():
                continue
            if option not in choices:
                raise UserError(unknown_option(key, option, choices))


#: Groups whose option a file may replace, with the key that takes the file (`data=my.yaml` -> `data.file=my.yaml`).
FILE_KEYS = {"data": ("data.file", "a dataset yaml"), "model": ("model.cfg", "a model yaml")}


def unknown_option(group: str, option: str, choices: Sequence[str]) -> str:
    """`unknown data 'x': choose one of ...`; for a file given as the option (v7.0's `--data data.yaml`), what to
    write instead: the preset it names (`data=coco128`), or the key that takes a file (`data.file=...`)."""
    message = f"unknown {group} {option!r}: choose one of {', '.join(choices)}"
    path = Path(option)
    if not (option.endswith((".yaml", ".yml")) or "/" in option or os.sep in option or path.is_file()):
        return message
    key, what = FILE_KEYS.get(group, (None, None))
    preset = path.stem if path.stem in choices and path.parent == Path(".") else None
    if preset is not None and key is not None and path.is_file():
        return f"{message}; write {group}={preset} for the preset, or {key}={option} for this file"
    if preset is not None:
        return f"{message}; write {group}={preset}"
    return f"{message}; for {what} write {key}={option}" if key is not None else message


def _sweep_values(value: str) -> list[str]:
    value = value.strip()
    if value.startswith(("range(", "choice(", "glob(", "interval(", "tag(", "sort(", "shuffle(")):
        return []  # extended sweep syntax: leave it to Hydra
    value = value.removeprefix("[").removesuffix("]")  # a list of options (`callbacks=[ema,checkpoint]`)
    return [v.strip().strip("'\"") for v in value.split(",")]


def override_key(override: str) -> str:
    """The dotted key an override sets: `+a.b=1`, `~a.b`, `override a/b=c` -> `a.b`."""
    key = override.split("=", 1)[0].lstrip("+~")
    return key.removeprefix("override ").strip().replace("/", ".")


# ---- one value ------------------------------------------------------------------------------------------------------
def whole_number(value: Any, key: str, minimum: int | None = None, allow: Sequence[Any] = ()) -> int | Any:
    """`value` as an int (or one of `allow`, returned as it is), else a `UserError` naming `key`."""
    if value in allow:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(str(value))
        except ValueError:
            extra = f" or {' / '.join(map(str, allow))}" if allow else ""
            raise UserError(f"{key}={value!r} must be a whole number{extra}") from None
    if minimum is not None and value < minimum:
        raise UserError(f"{key}={value} must be at least {minimum}")
    return value


def image_size(value: Any, key: str) -> int:
    """A positive whole number of pixels. One that is not a multiple of the model's stride is rounded up by the
    command once the model is loaded (`yolo5l.base.image_size.fit_to_stride`), as v7.0's `check_img_size`."""
    imgsz = whole_number(value, key)
    if imgsz <= 0:
        raise UserError(f"{key}={imgsz} must be a positive image size in pixels, e.g. {key}=640")
    return imgsz


def switch(value: Any, key: str) -> None:
    if not isinstance(value, bool):
        raise UserError(f"{key}={value!r} must be true or false")


def _one_of(allowed: Sequence[str]) -> Check:
    def check(value: Any, key: str) -> None:
        if str(value) not in allowed:
            raise UserError(f"{key}={value!r} is not one of: {', '.join(allowed)}")

    return check


def _or_null(check: Check) -> Check:
    return lambda value, key: None if value is None else check(value, key)


def _at_least(minimum: int) -> Check:
    return lambda value, key: whole_number(value, key, minimum=minimum)


def _train_imgsz(value: Any, key: str) -> None:
    if value is None:
        raise UserError("data.imgsz=null: training needs an image size (a multiple of 32), e.g. data.imgsz=640")
    image_size(value, key)


def _batch_size(value: Any, key: str) -> None:
    batch = whole_number(value, key)
    if batch != -1 and batch <= 0:
        raise UserError(f"{key}={batch} must be positive (or -1 to find the largest that fits)")


def _freeze(value: Any, key: str) -> None:
    if value is not None and not isinstance(value, (int, list, tuple)) and not OmegaConf.is_list(value):
        raise UserError(f"{key}={value!r} must be an int N (first N layers) or a list of layer indices")


def _export_imgsz(value: Any, key: str) -> None:
    from yolo5l.deploy.options import export_imgsz

    for side in dict.fromkeys(export_imgsz(value) or ()):
        image_size(side, key)  # rounded up to the model's stride once loaded


def key_checks(config_name: str) -> dict[str, Check]:
    """Each key's own check for `conf/<config_name>.yaml`, in the order the checks run; {} for another config.

    Checks that involve several keys (the batch over the devices) or files (`data.file=`, `weights=`) are the
    config's (`yolo5l.config.check_train_config` and the others).
    """
    from yolo5l.data.cache import CACHE_MODES
    from yolo5l.data.plan import PIPELINES
    from yolo5l.training.optim import OPTIMIZER_IMPLS

    run: dict[str, Check] = {  # train's and val's (the benchmark validates): the same data, trainer and module
        "trainer.max_epochs": _or_null(_at_least(-1)),
        "trainer.num_nodes": _or_null(_at_least(1)),
        "data.imgsz": _or_null(image_size),  # null (val): the size the weights were trained at
        "data.num_workers": lambda value, key: whole_number(value, key, minimum=0, allow=("auto",)),
        "data.val_batch_size": _or_null(_at_least(1)),
        "data.cache": _one_of(CACHE_MODES),
        "data.pipeline": _one_of(PIPELINES),
        **{f"data.{name}": switch for name in DATA_SWITCHES},
        "module.optimizer_impl": _or_null(_one_of(OPTIMIZER_IMPLS)),
    }
    if config_name == "train":
        return {**run, "data.imgsz": _train_imgsz, "data.batch_size": _batch_size, "freeze": _freeze}
    if config_name in ("val", "benchmark"):
        return run
    if config_name == "predict":
        return {"imgsz": _or_null(image_size), "max_det": _at_least(1)}
    if config_name == "export":
        checks: dict[str, Check] = {"imgsz": _export_imgsz, "batch": _at_least(1)}
        checks["opset"] = _at_least(11)  # the decode's dynamic arange and Resize need opset 11 or later
        return {**checks, **{name: switch for name in EXPORT_SWITCHES}}
    return {}


_ABSENT = object()


def check_key_values(cfg: Any, config_name: str) -> None:
    """Run each key's own check (`key_checks`) on the value `cfg` holds; a key `cfg` does not have is skipped.

    Raises:
        UserError: The first value that fails, with its key.
    """
    for key, check in key_checks(config_name).items():
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is not _ABSENT:
            check(value, key)


def check_sweep_values(overrides: Sequence[Any], config_name: str) -> None:
    """Run each key's own check on every value of each sweep among `overrides` (Hydra's parsed overrides): the check
    its job's run would make, before the first job starts. A sweep without a list of values (an interval) and a
    value that interpolates another are left to the job.

    Raises:
        UserError: `<the sweep>: <the check's line for the bad value>`.
    """
    sweeps = [o for o in overrides if o.is_sweep_override() and not o.is_hydra_override()]
    checks = key_checks(config_name) if sweeps else {}
    for o in sweeps:
        check = checks.get(o.key_or_group)
        if check is None:
            continue
        try:
            values = list(o.sweep_iterator())
        except Exception:  # an interval, or another sweep without a list of values
            continue
        for value in values:
            if isinstance(value, str) and "${" in value:
                continue
            try:
                check(value, o.key_or_group)
            except UserError as e:
                raise UserError(f"{o.input_line.strip()}: {e}") from None
