"""A run's config, composed once, with the command line's overrides checked so that every mistake is one line naming
the fix, before a run folder exists.

Hydra refuses an unknown key with a multi-line report, and takes `+key=value` for any key, which then fails deep in
the constructor it reaches (or is silently ignored). `compose_checked` composes the config with Hydra's own loader
(`ConfigLoader`, the one the command's run then uses: `yolo5l._cli`) and walks the key overrides in order against
the config as the group choices (`model=yolov5n`) composed it, before the overrides applied:

- `key=value` and `~key` need a key the config has: `unknown key data.imgsiz: did you mean data.imgsz?`;
- `+key=value` needs a key the config does not have yet, taken by the `_target_` it lands in (a constructor
  argument, or `**kwargs`), or a new entry with its own `_target_` (`+callbacks.mine={_target_: ...}`);
- `--epochs 3` and other options that are not Hydra's get the override that does it (`trainer.max_epochs=3`), or
  the reason there is none (`V7_WITHOUT`);
- `key=a,b` is a sweep, which only a multirun (`-m`) takes: without one it gets the list and quoted forms; with one,
  each of its values gets the check its job's run makes of it (`yolo5l.config_values.check_sweep_values`).

Raises `UserError`; the entry points print it as `error: ...` and exit with code 2 before a run folder exists.
"""

from __future__ import annotations

import copy
import difflib
import inspect
from collections.abc import Iterator, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from yolo5l.base.errors import UserError
from yolo5l.v7_options import V7_WITHOUT, v7_hint

__all__ = ["ConfigLoader", "check_overrides", "closest_key", "compose_checked", "config_loader", "parse_command_line"]


def check_overrides(argv: Sequence[str], config_name: str) -> None:
    """Check a Hydra command line (`sys.argv[1:]`) of the entry point composing `conf/<config_name>.yaml`, as a run
    of it would (`compose_checked`), the composed config left unused: for what composes without running (`--cfg`,
    `--info`, a notebook's check).

    Raises:
        UserError: One sentence: the override, what is wrong, and the closest valid key or option.
    """
    if any(a in ("-sc", "--shell-completion") or a.startswith("--shell-completion") for a in argv):
        return
    args, overrides = parse_command_line(argv, config_name)
    if not overrides:
        return
    loader = config_loader(args.config_dir, args.config_path, calling=(None, f"yolo5l.{config_name}"))
    compose_checked(loader, args.config_name or config_name, overrides, multirun=bool(args.multirun))


class ConfigLoader(ConfigLoaderImpl):
    """Hydra's config loader, keeping a plain copy of the config as its defaults list composed it, before the command
    line's key overrides applied (`before_overrides`): what `compose_checked` checks those overrides against, so that
    a run's config is composed once."""

    def __init__(self, config_search_path: Any, own_configs: bool = False) -> None:
        super().__init__(config_search_path=config_search_path)
        self.before_overrides: dict[str, Any] | None = None
        self.own_configs = own_configs  # a --config-dir or --config-path: configs of the user's own

    def _compose_config_from_defaults_list(self, defaults: Any, repo: Any) -> Any:  # Hydra's step before overrides
        cfg = super()._compose_config_from_defaults_list(defaults, repo)
        if self.before_overrides is None:  # a sweep's jobs compose with the same loader later: the first is kept
            self.before_overrides = OmegaConf.to_container(cfg, resolve=False)  # type: ignore[assignment]
        return cfg


def config_loader(
    config_dir: str | None = None, config_path: str | None = None, calling: tuple[str | None, str | None] | None = None
) -> ConfigLoader:
    """The loader `@hydra.main(config_path="pkg://yolo5l.conf")` composes with: yolo5l's configs, a `--config-path`
    instead of them (a relative one from `calling`, the task function's file or module, as Hydra resolves it), a
    `--config-dir` searched first (as Hydra's own `--config-dir`)."""
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    from yolo5l.config_values import CONFIG_MODULE

    file, module = calling or (None, CONFIG_MODULE)
    search_path = create_automatic_config_search_path(file, module, config_path or f"pkg://{CONFIG_MODULE}")
    if config_dir is not None:
        if not Path(config_dir).is_dir():
            raise UserError(f"--config-dir {config_dir}: no such folder (it names a folder of yaml configs)")
        search_path.prepend(
            provider="command-line", path=f"file://{Path(config_dir).absolute()}", anchor=SearchPathQuery("schema")
        )
    return ConfigLoader(search_path, own_configs=config_dir is not None or config_path is not None)


def compose_checked(loader: ConfigLoader, config_name: str, overrides: list[str], multirun: bool) -> DictConfig:
    """The config of a run (or the master config of a sweep), composed once by Hydra's `loader`, with each override
    checked against the config it was applied to (the module docstring has the rules).

    A config that does not compose is diagnosed by the same checks; one they do not explain gets Hydra's own message
    on one line.

    Raises:
        UserError: One sentence: the override, what is wrong, and the closest valid key or option.
    """
    from hydra.errors import HydraException
    from hydra.types import RunMode

    from yolo5l.config_values import check_group_choices, check_sweep_values

    if any(o.startswith("hydra.searchpath=") for o in overrides):  # searched folders may add options, as a --config-dir
        loader.own_configs = True
    if not loader.own_configs:  # yolo5l's options, each of a sweep's too; a --config-dir may add options
        check_group_choices(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise UserError(_parse_problem(overrides, e)) from None

    def is_group(key: str) -> bool:  # a --config-dir may add groups of its own
        return _is_group(key) or (loader.own_configs and loader.repository.group_exists(key.split("@", 1)[0]))

    groups = [o for o in parsed if is_group(o.key_or_group)]
    values = [o for o in parsed if not is_group(o.key_or_group)]
    loader.before_overrides = None
    cfg, problem = None, None
    try:  # sweeps are checked below, with the mode the config asks for (`hparams_search=evolve` implies -m)
        run_mode = RunMode.MULTIRUN if multirun else RunMode.RUN
        cfg = loader.load_configuration(config_name, overrides, run_mode=run_mode, validate_sweep_overrides=False)
    except HydraException as e:
        problem = e
    tree = loader.before_overrides
    if tree is None or any(o.is_sweep_override() for o in groups):
        # the defaults list failed (a group option), or a sweep over groups: check against its first options
        tree = _compose_groups(loader, config_name, [c for c in map(_first_choice, groups) if c is not None])
    mode = cfg.hydra.mode if cfg is not None else tree.get("hydra", {}).get("mode")
    if not multirun and "MULTIRUN" not in str(mode):
        _check_no_sweep(parsed)
    for o in parsed:
        if o.is_sweep_override() and o.is_hydra_override():
            shown = o.input_line.strip()
            raise UserError(f"{shown}: Hydra's own settings (hydra.*) are not swept; sweep the run's keys")
    _check_values(tree, values, config_name)
    check_sweep_values(values, config_name)  # each value as its job's run checks it, before the first job
    if problem is not None:
        lines = [ln.strip() for ln in str(problem).strip().splitlines() if ln.strip()]
        raise UserError(" ".join(lines[:3]) or type(problem).__name__)
    return cfg  # type: ignore[return-value]


def _check_values(tree: dict[str, Any], values: Sequence[Any], config_name: str) -> None:
    """Walk the key overrides in order against `tree` (the config before them), applying each to it; a resumed run
    walks them again against the config its checkpoint holds (keys its first command line added are there)."""
    composed = copy.deepcopy(tree)
    try:
        for o in values:
            _check_value_override(tree, o, config_name)
    except UserError:
        # A resumed run's config is the checkpoint's: keys its first command line added (+callbacks.x...) are there.
        resumed = _resumed_config(values, composed) if config_name == "train" else None
        if resumed is None:
            raise
        tree = copy.deepcopy(composed)
        _merge(tree, resumed)
        for o in values:  # `+key` for a key only the checkpoint has is what Hydra needs: not "already a key"
            _check_value_override(tree, o, config_name, composed=composed)


# ---- the command line ------------------------------------------------------------------------------------------------
def parse_command_line(argv: Sequence[str], config_name: str) -> tuple[Any, list[str]]:
    """Hydra's parsed options and the overrides of `argv`; an option Hydra does not know is a `UserError` naming
    what to write instead."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    args, unknown = parser.parse_known_args(list(argv))
    for item in unknown:
        if item.startswith("-"):
            option = item.split("=", 1)[0]
            instead = v7_hint(config_name, option, _typed_value(argv, item))
            without = V7_WITHOUT.get(config_name, {}).get(option)
            more = " (docs/cli.md maps every v7.0 train.py flag)" if config_name == "train" else ""
            hint = f"write {instead}" if instead else f"see python -m yolo5l.{config_name} --help{more}"
            if without:
                hint = f"v7.0's {option} has no counterpart here: {without}"
            raise UserError(f"unknown option {option}: yolo5l takes key=value overrides; {hint}")
    if unknown:  # overrides on both sides of an option (`data=coco -m data.batch_size=16,32`): all of them, in order
        args = parser.parse_intermixed_args(list(argv))
    return args, [str(o) for o in args.overrides or []]


def _typed_value(argv: Sequence[str], item: str) -> str | None:
    """The value typed with the option `item` (`--epochs=3`, or `--epochs 3`: the next argument, unless that is an
    option or an override), else None."""
    if "=" in item:
        return item.split("=", 1)[1]
    at = list(argv).index(item) + 1 if item in argv else len(argv)
    after = argv[at] if at < len(argv) else ""
    if "=" in after or (after.startswith("-") and not after[1:].replace(".", "", 1).isdigit()):
        return None
    return after or None


def _check_no_sweep(parsed: Sequence[Any]) -> None:
    """A sweep (`key=a,b`) without a multirun: Hydra refuses it in a paragraph; here in one line with the forms."""
    for o in parsed:
        if o.is_sweep_override():
            key, value = o.key_or_group, o.input_line.split("=", 1)[-1].strip()
            raise UserError(
                f"{o.input_line.strip()}: values separated by commas are a sweep, one run each (add -m); for a list "
                f"write {key}=[{value}], for text with commas quote it: {key}='{value}'"
            )


def _parse_problem(overrides: Sequence[str], error: Exception) -> str:
    bad = next((o for o in overrides if "=" not in o and not o.lstrip().startswith("~")), None)
    if bad is not None:
        return f"cannot read the override {bad!r}: write key=value (e.g. {bad.lstrip('+')}=...)"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"cannot read the overrides: {first} (quote values with spaces or commas: 'key=\"a, b\"')"


def _is_group(key: str) -> bool:
    """Whether `key` picks a config group's option (`model`, `module/optimizer`, `hydra/launcher`, `db@pkg`)."""
    if "/" in key or "@" in key:
        return True
    return files("yolo5l.conf").joinpath(key).is_dir()


def _first_choice(o: Any) -> str | None:
    """The override as Hydra's compose takes it: a sweep (`model=yolov5n,yolov5s`) reduced to its first option;
    None for a sweep without a list of options (an interval)."""
    prefix = "~" if o.is_delete() else "++" if o.is_force_add() else "+" if o.is_add() else ""
    key = o.key_or_group + (f"@{o.package}" if o.package else "")
    if o.is_delete() and o.value() is None:
        return f"{prefix}{key}"
    if not o.is_sweep_override():
        return f"{prefix}{key}={o.get_value_element_as_str()}"
    try:
        return f"{prefix}{key}={next(iter(o.sweep_string_iterator()))}"
    except Exception:  # an interval, or another sweep without a list of options
        return None


def _compose_groups(loader: ConfigLoader, config_name: str, group_overrides: list[str]) -> dict[str, Any]:
    """The config with the group choices applied, `hydra` node included, as plain containers (not resolved)."""
    from hydra.errors import HydraException
    from hydra.types import RunMode

    def compose(overrides: list[str]) -> DictConfig:
        return loader.load_configuration(config_name, overrides, run_mode=RunMode.MULTIRUN)

    try:
        cfg = compose(group_overrides)
    except HydraException as e:
        raise UserError(_group_problem(loader, config_name, group_overrides, compose([]), e)) from None
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _group_problem(
    loader: ConfigLoader, config_name: str, group_overrides: Sequence[str], base: Any, error: Exception
) -> str:
    choices = {k for k, v in base.hydra.runtime.choices.items() if not k.startswith("hydra/")}
    for override in group_overrides:
        if override.startswith(("+", "~")):
            continue
        group, _, option = override.partition("=")
        group = group.split("@", 1)[0]
        if not group.startswith("hydra/") and group not in choices:
            return (
                f"{override}: python -m yolo5l.{config_name} has no {group} group (its groups: "
                f"{', '.join(sorted(choices))})"
            )
        options = [o for o in loader.get_group_options(group) if not o.startswith("_")]  # a --config-dir's too
        if options and option not in options and option not in ("null", ""):
            from yolo5l.config_values import unknown_option

            return unknown_option(group, option, options)
    return str(error).strip().splitlines()[0]


def _resumed_config(values: Sequence[Any], tree: dict[str, Any]) -> dict[str, Any] | None:
    """The config stored in the checkpoint `resume=` names, or None (no resume, or train reports the problem)."""
    resume = next((o for o in values if o.key_or_group == "resume" and not o.is_delete()), None)
    if resume is None or resume.is_sweep_override():
        return None
    runs_dir = next((_value(o) for o in values if o.key_or_group == "paths.runs_dir"), None)
    from yolo5l.resume import stored_config

    return stored_config(_value(resume), str(runs_dir or _lookup(tree, ["paths", "runs_dir"])))


def _merge(tree: dict[str, Any], extra: dict[str, Any]) -> None:
    """Add `extra`'s keys to `tree` (recursively); what `tree` has stays."""
    for key, value in extra.items():
        if key not in tree:
            tree[key] = value
        elif isinstance(tree[key], dict) and isinstance(value, dict):
            _merge(tree[key], value)


# ---- one override ----------------------------------------------------------------------------------------------------
_ABSENT = object()


def _lookup(tree: Any, parts: Sequence[str]) -> Any:
    node = tree
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            return _ABSENT
    return node


def _assign(tree: dict[str, Any], parts: Sequence[str], value: Any, delete: bool = False) -> None:
    node: Any = tree
    for part in parts[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(part, {})
        elif isinstance(node, list) and part.lstrip("-").isdigit():
            node = node[int(part)]
        else:
            return
    leaf = parts[-1]
    if isinstance(node, dict):
        if delete:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    elif isinstance(node, list) and leaf.lstrip("-").isdigit() and not delete:
        node[int(leaf)] = value


def _check_value_override(
    tree: dict[str, Any], o: Any, config_name: str, composed: dict[str, Any] | None = None
) -> None:
    """Check one key override against `tree` (then apply it there). `composed`: for a resumed run, the config as
    Hydra composes it, without the checkpoint's keys (a `+key` may name one of those)."""
    key: str = o.key_or_group
    parts = key.split(".")
    current = _lookup(tree, parts)
    shown = o.input_line.strip()
    if o.is_delete():
        if current is _ABSENT:
            raise UserError(f"{shown}: {_unknown(tree, key, config_name)}")
        _assign(tree, parts, None, delete=True)
        return
    from_checkpoint = composed is not None and _lookup(composed, parts) is _ABSENT
    if o.is_add() and not o.is_force_add() and current is not _ABSENT and not from_checkpoint:
        raise UserError(f"{shown}: {key} is already a key: drop the + ({key}=...)")
    if current is _ABSENT:
        if not (o.is_add() or o.is_force_add()):
            target = _taken_by(tree, key)
            if target is not None:  # an argument the config leaves at its default
                value = shown.split("=", 1)[1] if "=" in shown else "..."
                raise UserError(
                    f"{shown}: {key} is not in the config, but {target} takes it: add it with +{key}={value}"
                )
            raise UserError(f"{shown}: {_unknown(tree, key, config_name, value=shown.partition('=')[2] or None)}")
        if not key.startswith("hydra."):
            _check_new_key(tree, key, _value(o), shown, config_name)
    elif isinstance(current, dict) and isinstance(_value(o), str):
        group = key.replace(".", "/")
        if files("yolo5l.conf").joinpath(group).is_dir():
            raise UserError(f"{shown} would replace the whole {key} node with a string: pick the option with {group}=")
    if not o.is_sweep_override():
        _assign(tree, parts, _value(o))


def _value(o: Any) -> Any:
    if o.is_sweep_override():
        return None
    try:
        return o.value()
    except Exception:  # a value only Hydra's resolvers read
        return o.get_value_element_as_str()


def _check_new_key(tree: dict[str, Any], key: str, value: Any, shown: str, config_name: str) -> None:
    """A `+key` must be an argument of the `_target_` it lands in, or a new entry that names its own `_target_`."""
    parts = key.split(".")
    if isinstance(value, dict) and "_target_" in value:
        return  # a new callback / logger entry: instantiated as it says
    if parts[-1].startswith("_") and parts[-1].endswith("_"):
        return  # Hydra's own keys (`+callbacks.mine._target_=...`, `_partial_`): the arguments that follow are checked
    owner, depth = None, 0
    for i in range(len(parts) - 1, -1, -1):
        node = _lookup(tree, parts[:i])
        if isinstance(node, dict) and "_target_" in node:
            owner, depth = node, i
            break
        if node is not _ABSENT and not isinstance(node, dict):
            return  # inside a list or a value: what reads it decides
    if owner is None:
        raise UserError(f"{shown}: {_unknown(tree, key, config_name, adding=True)}")
    argument = parts[depth]
    if argument in owner:
        return  # inside an argument's value (`+logger.mlflow.tags.team=x`)
    params = _parameters(str(owner["_target_"]))
    if params is None or argument in params:
        return
    where = ".".join(parts[:depth]) or "the config"
    known = sorted({*params, *(k for k in owner if not k.startswith("_"))})
    close = difflib.get_close_matches(argument, known, n=1, cutoff=0.6)
    hint = f"did you mean {'.'.join([*parts[:depth], close[0]])}?" if close else f"it takes: {', '.join(known)}"
    target = str(owner["_target_"]).rsplit(".", 1)[-1]
    raise UserError(f"{shown}: {target} ({where}) takes no argument {argument!r}; {hint}")


def _taken_by(tree: dict[str, Any], key: str) -> str | None:
    """The `_target_` (short name) whose node `key` is a direct child of and which names it as an argument."""
    parts = key.split(".")
    owner = _lookup(tree, parts[:-1])
    if not (isinstance(owner, dict) and "_target_" in owner):
        return None
    params = _parameters(str(owner["_target_"]))
    return str(owner["_target_"]).rsplit(".", 1)[-1] if params is not None and parts[-1] in params else None


def _parameters(target: str) -> set[str] | None:
    """The keyword arguments `target` takes, or None when it takes any (`**kwargs`) or cannot be inspected."""
    from hydra.utils import get_object

    try:
        obj = get_object(target)
        signature = inspect.signature(obj)
    except Exception:  # an extra that is not installed, a builtin without a signature: the constructor decides
        return None
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


# ---- suggestions -----------------------------------------------------------------------------------------------------
def _keys(tree: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            if str(k).startswith("_") and str(k).endswith("_"):
                continue  # _target_, _partial_: Hydra's, not settings
            full = f"{prefix}.{k}" if prefix else str(k)
            yield full
            yield from _keys(v, full)


def closest_key(tree: dict[str, Any], key: str) -> str | None:
    """The key of `tree` a mistyped `key` most likely meant: a close leaf among its siblings, the same leaf under
    another node, or the closest dotted key."""
    parts = key.split(".")
    parent = _lookup(tree, parts[:-1])
    if isinstance(parent, dict):
        siblings = [str(k) for k in parent if not str(k).startswith("_")]
        close = [k for k in siblings if k.startswith(f"{parts[-1]}_")][:1]  # conf -> conf_thres
        close = close or difflib.get_close_matches(parts[-1], siblings, n=1, cutoff=0.6)
        if close:
            return ".".join([*parts[:-1], close[0]])
    hydra_key = key.startswith("hydra.")
    every = [k for k in _keys(tree) if k.startswith("hydra.") == hydra_key]
    same_leaf = [k for k in every if k.rsplit(".", 1)[-1] == parts[-1] and k != key]
    if same_leaf:
        return min(same_leaf, key=lambda k: (k.count("."), k))
    close = difflib.get_close_matches(key, every, n=1, cutoff=0.7)
    if close:
        return close[0]
    leaves = {k.rsplit(".", 1)[-1]: k for k in sorted(every, key=lambda k: -k.count("."))}
    close = difflib.get_close_matches(parts[-1], list(leaves), n=1, cutoff=0.8)
    return leaves[close[0]] if close else None


def _unknown(tree: dict[str, Any], key: str, config_name: str, adding: bool = False, value: str | None = None) -> str:
    what = f"nothing in python -m yolo5l.{config_name} reads {key}" if adding else f"unknown key {key}"
    close = closest_key(tree, key)
    if close is not None:
        return f"{what}; did you mean {close}?"
    v7 = v7_hint(config_name, "--" + key.replace("_", "-"), value)
    if v7 is not None:  # ultralytics' option names as keys (include=onnx)
        return f"{what}; write {v7}"
    without = V7_WITHOUT.get(config_name, {}).get("--" + key.replace("_", "-"))
    if without is not None:
        return f"{what}; v7.0's --{key.replace('_', '-')} has no counterpart here: {without}"
    parts = key.split(".")
    parent = _lookup(tree, parts[:-1])
    if isinstance(parent, dict) and parts[:-1]:
        keys = [str(k) for k in parent if not str(k).startswith("_")]
        return f"{what}; {'.'.join(parts[:-1])} has: {', '.join(keys)}"
    top = [k for k in tree if k != "hydra"]
    return f"{what}; the top-level keys are: {', '.join(top)}"
