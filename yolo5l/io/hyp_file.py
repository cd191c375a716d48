"""`hyp=path/to/hyp.yaml`: hyperparameters from a file, as well as the shipped presets (`hyp=scratch-low`).

Hydra's config groups take option names only, so the command line is rewritten before Hydra sees it
(:func:`hyp_file_argv`): a `hyp=` value that names a yaml file becomes `hyp_file=<its absolute path>`, and the `hyp`
group keeps its default preset. After Hydra composes, :func:`apply_hyp_file` puts the file's values into `cfg.hyp`;
keys the file lacks keep the preset's values (a v7.0 hyp yaml has no `label_smoothing`: v7.0 takes it from
`--label-smoothing`), and a `hyp.<key>=` on the command line, or a value a search (`hparams_search=evolve`) chooses,
wins over the file. The file is a flat mapping of numbers: a v7.0 `data/hyps/hyp.*.yaml`, or the `best_hyp.yaml` a
search writes. `hyp=a.yaml,b.yaml` sweeps over files, as `hyp=scratch-low,scratch-high` does over presets.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from yolo5l.base.errors import UserError
from yolo5l.base.files import atomic_write

__all__ = ["HYP_FILE_KEY", "apply_hyp_file", "hyp_file_argv", "read_hyp_file"]

HYP_FILE_KEY = "hyp_file"
_PREFIXES = ("hyp=", "+hyp=", "override hyp=")


def _is_file_value(value: str) -> bool:
    return value.endswith((".yaml", ".yml")) or "/" in value or os.sep in value


def _quoted(path: str) -> str:
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


def hyp_file_argv(argv: Sequence[str]) -> list[str]:
    """The command line with each `hyp=<file>[,<file>...]` rewritten as `hyp_file=<absolute path>[,...]`.

    Raises:
        UserError: A file that does not exist, or files mixed with preset names in one sweep.
    """
    out = []
    for arg in argv:
        prefix = next((p for p in _PREFIXES if arg.startswith(p)), None)
        values = [v.strip().strip("'\"") for v in arg[len(prefix) :].split(",")] if prefix else []
        if not any(_is_file_value(v) for v in values):
            out.append(arg)
            continue
        if not all(_is_file_value(v) for v in values):
            raise UserError(f"{arg}: sweep over hyp files or over presets, not both (hyp_file= takes the files)")
        paths = []
        for value in values:
            path = Path(value).expanduser()
            if not path.is_file():
                raise UserError(
                    f"hyp={value}: file not found; pass a hyp yaml (a v7.0 data/hyps file, a search's best_hyp.yaml) "
                    "or a preset: hyp=scratch-low or hyp=scratch-high"
                )
            paths.append(_quoted(str(path.absolute())))
        out.append(f"{HYP_FILE_KEY}={','.join(paths)}")
    return out


def read_hyp_file(path: str | os.PathLike, known: Sequence[str]) -> dict[str, int | float]:
    """The hyperparameters of a yaml file, checked against the keys `known` (the preset's).

    Raises:
        UserError: The file is missing or not a mapping, has a key `known` lacks, or a value that is not a number.
    """
    path = Path(path)
    try:
        loaded = OmegaConf.load(path)  # Hydra's YAML: `5e-4` is a number there, a string to plain PyYAML
        data = OmegaConf.to_container(loaded) if OmegaConf.is_dict(loaded) else None
    except OSError as e:
        raise UserError(f"hyp file {path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise UserError(f"hyp file {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or not data:
        raise UserError(f"hyp file {path}: not a mapping of hyperparameters (key: value lines, as conf/hyp/*.yaml)")
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise UserError(
            f"hyp file {path}: unknown key(s) {', '.join(unknown)}; the hyperparameters are {', '.join(sorted(known))}"
        )
    bad = [k for k, v in data.items() if isinstance(v, bool) or not isinstance(v, numbers.Real)]
    if bad:
        raise UserError(f"hyp file {path}: {bad[0]}={data[bad[0]]!r} is not a number")
    return {str(k): v for k, v in data.items()}


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~").removeprefix("override ").strip()


def apply_hyp_file(cfg: DictConfig, overrides: Sequence[str] = (), output_dir: Any = None) -> DictConfig:
    """Put the values of `cfg.hyp_file` (if set) into `cfg.hyp`, except the keys `overrides` sets (`hyp.lr0=...`).

    Args:
        cfg: the composed training config.
        overrides: the command line's overrides (`HydraConfig.get().overrides.task`; a sweep job's include the values
            the sweeper chose).
        output_dir: the run folder; its `.hydra/config.yaml` is rewritten with the values used (rank 0).

    Returns:
        `cfg`, changed in place.
    """
    path = cfg.get(HYP_FILE_KEY)
    if not path:
        return cfg
    values = read_hyp_file(path, [str(k) for k in cfg.hyp])
    explicit = {_override_key(o).removeprefix("hyp.") for o in overrides if _override_key(o).startswith("hyp.")}
    with open_dict(cfg):
        for key, value in values.items():
            if key not in explicit:
                cfg.hyp[key] = value
    if output_dir is not None and (Path(output_dir) / ".hydra").is_dir():
        from yolo5l.base.console import is_rank_zero

        if is_rank_zero():  # what this run really uses, beside Hydra's files (a search's best_hyp.yaml reads it)
            atomic_write(Path(output_dir) / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))
    return cfg
