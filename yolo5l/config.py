"""The configuration: compose it outside the command line, and check it before anything is built.

    >>> from yolo5l import compose_config
    >>> cfg = compose_config(["experiment=smoke"], output_dir="runs/notebook")
    >>> dm = hydra.utils.instantiate(cfg.data)

`compose_config` gives what `python -m yolo5l.train experiment=smoke` would see, with `${hydra:runtime.output_dir}`
(and everything that interpolates it: loggers, checkpoints) pointing at `output_dir`.

The checks (`check_group_choices` before Hydra composes, `check_train_config`, `check_val_config`,
`check_predict_config` after) are the one place where the entry points refuse a config: each mistake raises a
`UserError` whose one line names the key and the fix.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

import yolo5l.base.resolvers  # noqa: F401 - the resolvers conf/ uses
from yolo5l.base.errors import UserError

__all__ = [
    "CONFIG_MODULE",
    "check_group_choices",
    "check_predict_config",
    "check_train_config",
    "check_val_config",
    "compose_config",
    "config_choices",
    "override_key",
    "to_yaml",
    "unknown_option",
]

CONFIG_MODULE = "yolo5l.conf"
TRAIN_OPTIONS = ("single_cls", "rect", "image_weights", "multi_scale", "quad")  # v7.0 train.py's data switches


#: Config groups a user picks on the command line (`model=yolov5n`) and the ones that may be `null`.
def compose_config(
    overrides: Sequence[str] | None = None,
    config_name: str = "train",
    output_dir: str | os.PathLike | None = None,
) -> DictConfig:
    """Compose `conf/<config_name>.yaml` with command-line style overrides, as the entry points do.

    Hydra's `${hydra:...}` interpolations resolve afterwards because the Hydra part of the config is installed
    as the current `HydraConfig` (a plain `compose` leaves them unresolvable).

    Args:
        overrides: Overrides such as `["model=yolov5n", "trainer.max_epochs=3"]`.
        config_name: `train`, `val` or `predict`.
        output_dir: The run folder (created); default: the entry point's `hydra.run.dir` under the current folder,
            a folder of its own, as the commands' (`<stamp>_2` when a run started in the same second has `<stamp>`).

    Returns:
        The composed config, without its `hydra` node.
    """
    from yolo5l.io.hyp_file import apply_hyp_file, hyp_file_argv

    if isinstance(overrides, str):  # compose_config("train") or compose_config("model=yolov5n"): a list was meant
        raise TypeError(
            f"compose_config: overrides is a list of 'key=value' strings, got the string {overrides!r}: e.g. "
            "compose_config(['model=yolov5n'], config_name='train')"
        )
    overrides = hyp_file_argv(list(overrides or []))  # hyp=path/to/hyp.yaml, as on the command line
    with initialize_config_module(version_base="1.3", config_module=CONFIG_MODULE):
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        if output_dir is None:  # the time-stamped folder, numbered `_2` as the commands' when it is taken
            output_dir = claim_run_folder(cfg, overrides) or str(cfg.hydra.run.dir)
        out = Path(output_dir).absolute()
        cfg.hydra.runtime.output_dir = str(out)
        cfg.hydra.job.name = config_name
    HydraConfig.instance().set_config(cfg)
    out.mkdir(parents=True, exist_ok=True)
    with open_dict(cfg):
        del cfg["hydra"]
    return apply_hyp_file(cfg, overrides)


def claim_run_folder(cfg: DictConfig, overrides: list[str]) -> Path | None:
    """Create the command's time-stamped run folder (`hydra.run.dir`, `hydra.sweep.dir` for a sweep) now, as a
    folder of its own: when a command started in the same second has it already (two runs on two GPUs, a script's
    parallel runs), `_2`, `_3`, ... is appended, as ultralytics/yolov5 v7.0 `utils/general.py::increment_path` numbers
    exp, exp2. The folder is fixed in `cfg` and returned. A folder the user names (typed, or a config whose folder
    has no `${now:...}` stamp) is left as it is, and None returned: it is written into."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    node = "sweep" if cfg.hydra.mode == RunMode.MULTIRUN else "run"
    typed = any(o.split("=", 1)[0].lstrip("+~") == f"hydra.{node}.dir" for o in overrides)
    if typed or "${now:" not in str(OmegaConf.to_container(cfg.hydra[node], resolve=False).get("dir")):
        return None
    base = Path(str(cfg.hydra[node].dir))
    folder, n = base, 1
    while True:
        try:
            folder.mkdir(parents=True)  # atomic: of two commands, one creates it, the other takes the next name
            break
        except FileExistsError:
            n += 1
            folder = base.with_name(f"{base.name}_{n}")
    cfg.hydra[node].dir = str(folder)
    return folder


def config_choices(group: str) -> list[str]:
    """Options of a config group (`model` -> ['yolov5l', 'yolov5m', ...]), from the shipped `yolo5l.conf`.

    Files starting with `_` are shared bases (`data/_base.yaml`), not options.
    """
    from importlib.resources import files

    folder = files(CONFIG_MODULE).joinpath(group)
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml") and p.name[0] != "_")


def groups_help(*groups: str) -> str:
    """`group: option, option` lines for a command's `--help` (the `${yolo5l.groups:model,data}` resolver of the
    `hydra.help.template`s in conf/): the groups that command composes, not every folder of conf/."""
    return "\n".join(f"{group}: {', '.join(config_choices(group))}" for group in groups)


OmegaConf.register_new_resolver("yolo5l.groups", groups_help, replace=True)


def to_yaml(cfg: DictConfig) -> str:
    """The config as YAML with interpolations resolved where they can be."""
    return OmegaConf.to_yaml(cfg, resolve=True)


# ---- before Hydra composes ------------------------------------------------------------------------------------------
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


# ---- after Hydra composes -------------------------------------------------------------------------------------------
def _missing(cfg: DictConfig, key: str, hint: str) -> None:
    if OmegaConf.is_missing(cfg, key):
        raise UserError(f"{key}= is required: {hint}")


def _int(node: Any, key: str, minimum: int | None = None, allow: Sequence[Any] = ()) -> int | Any:
    """`node[key]` as an int (or one of `allow`), else a `UserError` naming `prefix.key`."""
    value = node.get(key.rsplit(".", 1)[-1])
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


def _check_imgsz(imgsz: int, key: str) -> None:
    """Refuse a size that is not positive; one that is not a multiple of the model's stride is rounded up by the
    command once the model is loaded (`yolo5l.base.image_size.fit_to_stride`), as v7.0's `check_img_size`."""
    if imgsz <= 0:
        raise UserError(f"{key}={imgsz} must be a positive image size in pixels, e.g. {key}=640")


def _check_file(value: Any, key: str, hint: str) -> None:
    if value is not None and not Path(str(value)).is_file():
        raise UserError(f"{key}={str(value)!r}: file not found; {hint}")


def _check_weights(value: Any, use: str | None = None) -> None:
    """`weights=`: a file, a URL or release name, or an exported folder; with `use` (`trained from`) PyTorch weights
    only, an exported model refused."""
    from yolo5l.deploy.exported import not_weights
    from yolo5l.deploy.formats import find_format
    from yolo5l.io.download import weights_url

    if use is not None and (problem := not_weights(str(value), use)):
        raise UserError(f"weights={value}: {problem}")
    if weights_url(str(value)) is None and not (Path(str(value)).is_dir() and find_format(str(value))):
        # A URL or a release name (yolov5s.pt) is downloaded when loaded; an exported model folder is a folder.
        _check_file(value, "weights", "pass a yolo5l weights.pt / last.ckpt, an ultralytics yolov5*.pt or a URL")


def _check_data(data: DictConfig) -> None:
    from yolo5l.data.dataset_yaml import preset_name

    if preset_name(data.get("file")) is None:  # a preset's data.yaml (data=coco128) is written on first load
        _check_file(data.get("file"), "data.file", "pass the path of a dataset yaml, or data=synthetic")
    if data.get("imgsz") is not None:  # null (val): the size the weights were trained at
        _check_imgsz(_int(data, "data.imgsz"), "data.imgsz")
    _int(data, "data.num_workers", minimum=0, allow=("auto",))
    if data.get("val_batch_size") is not None:
        _int(data, "data.val_batch_size", minimum=1)
    from yolo5l.data.cache import CACHE_MODES
    from yolo5l.data.plan import PIPELINES

    for key, allowed in (("cache", CACHE_MODES), ("pipeline", PIPELINES)):
        if key in data and str(data.get(key)) not in allowed:
            raise UserError(f"data.{key}={data.get(key)!r} is not one of: {', '.join(allowed)}")
    for key in ("reduced_decode", "val_reduced_decode", "persistent_workers", "pin_memory", *TRAIN_OPTIONS):
        if key in data and not isinstance(data.get(key), bool):
            raise UserError(f"data.{key}={data.get(key)!r} must be true or false")
    if data.get("rect") and data.get("image_weights"):
        raise UserError("data.rect=true and data.image_weights=true exclude each other (v7.0 drops rect): pick one")


def _check_trainer(trainer: DictConfig) -> None:
    max_epochs = trainer.get("max_epochs")
    if max_epochs is not None:
        _int(trainer, "trainer.max_epochs", minimum=-1)
    if trainer.get("num_nodes") is not None:
        _int(trainer, "trainer.num_nodes", minimum=1)


def _check_module(module: DictConfig) -> None:
    from yolo5l.training.optim import OPTIMIZER_IMPLS

    impl = module.get("optimizer_impl")
    if impl is not None and str(impl) not in OPTIMIZER_IMPLS:
        raise UserError(f"module.optimizer_impl={impl!r} is not one of: {', '.join(OPTIMIZER_IMPLS)}")


def check_train_config(cfg: DictConfig, multirun: bool = False) -> int:
    """Check what a user typically gets wrong in a training config.

    Returns:
        The number of training processes (devices x nodes).

    Raises:
        UserError: One sentence naming the key and the fix.
    """
    from yolo5l.base.hardware import num_devices

    _check_trainer(cfg.trainer)
    if cfg.data.get("imgsz") is None:
        raise UserError("data.imgsz=null: training needs an image size (a multiple of 32), e.g. data.imgsz=640")
    _check_data(cfg.data)  # a size off the stride is rounded up as the model is built (yolo5l.train)
    _check_module(cfg.module)
    world = num_devices(cfg.trainer)
    batch = _int(cfg.data, "data.batch_size")
    if batch == -1:
        if world > 1:
            raise UserError(
                f"data.batch_size=-1 (find the largest batch) needs a single device, got {world}: "
                "tune on one device, then pass the batch size"
            )
    elif batch <= 0:
        raise UserError(f"data.batch_size={batch} must be positive (or -1 to find the largest that fits)")
    elif batch % world:
        raise UserError(
            f"data.batch_size={batch} (the total over all devices) does not divide by the {world} devices: "
            f"use a multiple of {world}"
        )
    strategy = str(cfg.trainer.get("strategy", "auto"))
    if multirun and world > 1 and "spawn" not in strategy and "fork" not in strategy:
        raise UserError(
            "DDP re-launches this script per device, which re-runs the whole sweep: in a multirun (-m) use "
            "trainer.strategy=ddp_spawn, or sweep on one device"
        )
    freeze = cfg.get("freeze")
    if freeze is not None and not isinstance(freeze, int) and not OmegaConf.is_list(freeze):
        raise UserError(f"freeze={freeze!r} must be an int N (first N layers) or a list of layer indices")
    weights = cfg.get("weights")
    if weights:
        _check_weights(weights, "trained from")
    return world


def check_val_config(cfg: DictConfig) -> None:
    """Check a `conf/val.yaml` config (weights, data, image size, batch).

    Raises:
        UserError: One sentence naming the key and the fix.
    """
    _missing(cfg, "weights", "pass weights=<a weights.pt, last.ckpt or yolov5*.pt>")
    _check_weights(cfg.weights)
    _check_trainer(cfg.trainer)
    _check_data(cfg.data)  # a size off the stride is rounded up once the model is loaded
    _check_module(cfg.module)


def check_predict_config(cfg: DictConfig) -> None:
    """Check a `conf/predict.yaml` config (weights, source, image size, thresholds).

    Raises:
        UserError: One sentence naming the key and the fix.
    """
    _missing(cfg, "weights", "pass weights=<a weights.pt, last.ckpt or yolov5*.pt>")
    _missing(cfg, "source", "pass source=<an image, a folder or a list [a.jpg,b.jpg]>")
    _check_weights(cfg.weights)
    if cfg.get("imgsz") is not None:
        _check_imgsz(_int(cfg, "imgsz"), "imgsz")  # rounded up to the model's stride once loaded
    _int(cfg, "max_det", minimum=1)


def override_key(override: str) -> str:
    """The dotted key an override sets: `+a.b=1`, `~a.b`, `override a/b=c` -> `a.b`."""
    key = override.split("=", 1)[0].lstrip("+~")
    return key.removeprefix("override ").strip().replace("/", ".")


def check_export_config(cfg: DictConfig) -> None:
    """Check a `conf/export.yaml` config (weights, formats, image size, batch, opset, flags): every format listed,
    so that a list with one bad format is refused before anything is written.

    Raises:
        UserError: One sentence naming the key and the fix.
    """
    from yolo5l.deploy.formats import parse_formats
    from yolo5l.deploy.options import check_formats_options, export_imgsz

    _missing(cfg, "weights", "pass weights=<a weights.pt, last.ckpt or yolov5*.pt>")
    _check_weights(cfg.weights, "exported again")
    formats = parse_formats(cfg.get("format"))
    for side in dict.fromkeys(export_imgsz(cfg.get("imgsz")) or ()):
        _check_imgsz(side, "imgsz")  # rounded up to the model's stride once loaded
    _int(cfg, "batch", minimum=1)
    _int(cfg, "opset", minimum=11)  # the decode's dynamic arange and Resize need opset 11 or later
    for key in ("dynamic", "half", "simplify", "int8", "nms", "optimize"):
        if not isinstance(cfg.get(key, False), bool):
            raise UserError(f"{key}={cfg.get(key)!r} must be true or false")
    check_formats_options(cfg, formats)


def check_search_space(cfg: DictConfig) -> None:
    """Check a hyperparameter search (`hparams_search=evolve`) before its first trial: every `hyp.*` key it searches,
    in `hydra.sweeper.params` or as a sweep on the command line (`'hyp.lr0=interval(0.001,0.01)'`), must be a key of
    `cfg.hyp` (a trial overriding any other fails, and each trial would).

    Args:
        cfg: the multirun's composed config, `hydra` node included.

    Raises:
        UserError: A searched `hyp.*` key that the hyperparameters do not have.
    """
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}
    task = OmegaConf.select(cfg, "hydra.overrides.task", default=None) or []
    keys = [str(k) for k in params] + [override_key(o) for o in task if not str(o).lstrip().startswith(("+", "~"))]
    known = set(cfg.get("hyp") or {})
    for key in keys:
        leaf = key.removeprefix("hyp.")
        if key.startswith("hyp.") and leaf not in known:
            raise UserError(
                f"hparams_search: {key} is not a hyperparameter (hyp has no {leaf!r}): search one of "
                f"{', '.join(sorted(known))}"
            )
