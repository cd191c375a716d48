"""The configuration: compose it outside the command line, and check it before anything is built.

    >>> from yolo5l import compose_config
    >>> cfg = compose_config(["experiment=smoke"], output_dir="runs/notebook")
    >>> dm = hydra.utils.instantiate(cfg.data)

`compose_config` gives what `python -m yolo5l.train experiment=smoke` would see, with `${hydra:runtime.output_dir}`
(and everything that interpolates it: loggers, checkpoints) pointing at `output_dir`, and refuses what that command
refuses before it builds anything: an unknown key or option, a value of the wrong kind.

The checks (`check_group_choices` and each key's own check in `yolo5l.config_values`, the overrides in
`yolo5l.overrides`, `check_train_config`, `check_val_config`, `check_predict_config` after composing) are the one
place where the entry points refuse a config: each mistake raises a `UserError` whose one line names the key and
the fix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

import yolo5l.base.resolvers  # noqa: F401 - the resolvers conf/ uses
from yolo5l.base.errors import UserError
from yolo5l.config_values import (
    CONFIG_MODULE,
    check_group_choices,
    check_key_values,
    config_choices,
    override_key,
    unknown_option,
)

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


def compose_config(
    overrides: Sequence[str] | None = None,
    config_name: str = "train",
    output_dir: str | os.PathLike | None = None,
) -> DictConfig:
    """Compose `conf/<config_name>.yaml` with command-line style overrides, as the entry points do.

    The overrides are checked as the command line's are (`yolo5l.overrides.compose_checked`: an unknown key gets
    the closest valid one), and so is each key's value (`yolo5l.config_values.check_key_values`: `data.imgsz=abc`),
    before any folder is created. Hydra's `${hydra:...}` interpolations resolve afterwards because the Hydra part of
    the config is installed as the current `HydraConfig` (a plain `compose` leaves them unresolvable).

    Args:
        overrides: Overrides such as `["model=yolov5n", "trainer.max_epochs=3"]`.
        config_name: `train`, `val` or `predict`.
        output_dir: The run folder (created); default: the entry point's `hydra.run.dir` under the current folder,
            a folder of its own, as the commands' (`<stamp>_2` when a run started in the same second has `<stamp>`).

    Returns:
        The composed config, without its `hydra` node.

    Raises:
        UserError: An override or value the command would refuse, in the line the command prints.
    """
    from yolo5l.io.hyp_file import apply_hyp_file, hyp_file_argv
    from yolo5l.overrides import compose_checked, config_loader

    if isinstance(overrides, str):  # compose_config("train") or compose_config("model=yolov5n"): a list was meant
        raise TypeError(
            f"compose_config: overrides is a list of 'key=value' strings, got the string {overrides!r}: e.g. "
            "compose_config(['model=yolov5n'], config_name='train')"
        )
    overrides = hyp_file_argv(list(overrides or []))  # hyp=path/to/hyp.yaml, as on the command line
    try:
        with initialize_config_module(version_base="1.3", config_module=CONFIG_MODULE):
            cfg = compose_checked(config_loader(), config_name, overrides, multirun=False)
        check_key_values(cfg, config_name)
    except UserError as e:  # the command's one line, raised here: not the checks' frames below
        raise UserError(str(e)) from None
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


def groups_help(*groups: str) -> str:
    """`group: option, option` lines for a command's `--help` (the `${yolo5l.groups:model,data}` resolver of the
    `hydra.help.template`s in conf/): the groups that command composes, not every folder of conf/."""
    return "\n".join(f"{group}: {', '.join(config_choices(group))}" for group in groups)


OmegaConf.register_new_resolver("yolo5l.groups", groups_help, replace=True)


def to_yaml(cfg: DictConfig) -> str:
    """The config as YAML with interpolations resolved where they can be."""
    return OmegaConf.to_yaml(cfg, resolve=True)


# ---- after Hydra composes -------------------------------------------------------------------------------------------
def _missing(cfg: DictConfig, key: str, hint: str) -> None:
    if OmegaConf.is_missing(cfg, key):
        raise UserError(f"{key}= is required: {hint}")


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
    if data.get("rect") and data.get("image_weights"):
        raise UserError("data.rect=true and data.image_weights=true exclude each other (v7.0 drops rect): pick one")


def check_train_config(cfg: DictConfig, multirun: bool = False) -> int:
    """Check what a user typically gets wrong in a training config.

    Returns:
        The number of training processes (devices x nodes).

    Raises:
        UserError: One sentence naming the key and the fix.
    """
    from yolo5l.base.hardware import num_devices

    check_key_values(cfg, "train")  # a size off the stride is rounded up as the model is built (yolo5l.train)
    _check_data(cfg.data)
    world = num_devices(cfg.trainer)
    batch = int(cfg.data.batch_size)
    if batch == -1 and world > 1:
        raise UserError(
            f"data.batch_size=-1 (find the largest batch) needs a single device, got {world}: "
            "tune on one device, then pass the batch size"
        )
    if batch != -1 and batch % world:
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
    check_key_values(cfg, "val")  # a size off the stride is rounded up once the model is loaded
    _check_data(cfg.data)


def check_predict_config(cfg: DictConfig) -> None:
    """Check a `conf/predict.yaml` config (weights, source, image size, thresholds).

    Raises:
        UserError: One sentence naming the key and the fix.
    """
    _missing(cfg, "weights", "pass weights=<a weights.pt, last.ckpt or yolov5*.pt>")
    _missing(cfg, "source", "pass source=<an image, a folder or a list [a.jpg,b.jpg]>")
    _check_weights(cfg.weights)
    check_key_values(cfg, "predict")  # a size off the stride is rounded up once the model is loaded


def check_export_config(cfg: DictConfig) -> None:
    """Check a `conf/export.yaml` config (weights, formats, image size, batch, opset, flags): every format listed,
    so that a list with one bad format is refused before anything is written.

    Raises:
        UserError: One sentence naming the key and the fix.
    """
    from yolo5l.deploy.formats import parse_formats
    from yolo5l.deploy.options import check_formats_options

    _missing(cfg, "weights", "pass weights=<a weights.pt, last.ckpt or yolov5*.pt>")
    _check_weights(cfg.weights, "exported again")
    formats = parse_formats(cfg.get("format"))
    check_key_values(cfg, "export")  # image size, batch, opset, switches
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
