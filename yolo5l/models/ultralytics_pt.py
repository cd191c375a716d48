"""What an ultralytics/yolov5 ``.pt`` file holds, read without running its code (:mod:`yolo5l.io.safe_pickle`).

The file is a pickle of a dict (``model``, ``ema``, ``opt``, ... as v7.0's ``train.py`` saves it) whose models are
``models.yolo.DetectionModel`` objects; here they are inert stand-ins whose ``__dict__`` is read as
``nn.Module.state_dict`` would walk it. :func:`yolo5l.models.weights.load_ultralytics` builds the model from what these
functions find: the model (EMA first), its yaml, its tensors, its class names and the training size.

Reference: ultralytics/yolov5 v7.0 ``models/experimental.py::attempt_load`` (``ckpt.get('ema') or ckpt['model']``),
``train.py`` (the checkpoint dict), ``utils/general.py::strip_optimizer``.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from yolo5l.io.safe_pickle import StandIn, UnsafeCheckpointError, restricted_pickle
from yolo5l.models.common import Conv
from yolo5l.models.parse import builtin_name, normalize_spec

__all__ = [
    "architecture",
    "check_activations",
    "check_file",
    "collect_state_dict",
    "file_names",
    "find_model",
    "layers",
    "module_dict",
    "opt_imgsz",
    "unpickle",
]


def check_file(path: str | os.PathLike[str]) -> str:
    """``path`` as a string; FileNotFoundError (naming it) when there is no such file."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"{p}: no such file; pass the path of a yolov5 .pt file (e.g. yolov5s.pt)")
    return p


def _is_torchscript(path: str) -> bool:
    # torch.load hands TorchScript archives to torch.jit.load, which runs the archive's code: refuse those first.
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return any(n.endswith("constants.pkl") or "/code/" in n for n in zf.namelist())


def unpickle(path: str) -> Any:
    """The file's object through the restricted unpickler (TorchScript archives refused before torch.load sees
    them); ValueError for what is not a readable checkpoint, UnsafeCheckpointError naming a refused global."""
    if _is_torchscript(path):
        raise ValueError(f"{path}: a TorchScript export, not a training checkpoint; use the yolov5 .pt file")
    try:
        with warnings.catch_warnings():
            # The legacy format stores class sources to compare against; stand-ins have none. Not a problem.
            warnings.filterwarnings("ignore", message="Couldn't retrieve source code for container")
            return torch.load(path, map_location="cpu", pickle_module=restricted_pickle, weights_only=False)
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(e.module, e.name, path) from None
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None


def module_dict(obj: Any) -> dict[str, Any]:
    """A stand-in's attributes (an empty dict for anything else)."""
    return obj.__dict__ if isinstance(obj, StandIn) else {}


def collect_state_dict(obj: StandIn, prefix: str = "", out: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Walk ``_parameters``/``_buffers``/``_modules`` of the stand-in tree as ``nn.Module.state_dict`` does."""
    out = {} if out is None else out
    d = module_dict(obj)
    non_persistent = d.get("_non_persistent_buffers_set") or set()
    for k, v in (d.get("_parameters") or {}).items():
        if isinstance(v, Tensor):
            out[prefix + k] = v
    for k, v in (d.get("_buffers") or {}).items():
        if isinstance(v, Tensor) and k not in non_persistent:
            out[prefix + k] = v
    for k, m in (d.get("_modules") or {}).items():
        if isinstance(m, StandIn):
            collect_state_dict(m, f"{prefix}{k}.", out)
    return out


def find_model(ckpt: Any, path: str) -> StandIn:
    """The model of a checkpoint: ``ema`` when present, else ``model`` (or the file's object itself)."""
    if isinstance(ckpt, StandIn):
        return ckpt
    if isinstance(ckpt, Mapping):
        if "model_config" in ckpt and "state_dict" in ckpt:
            raise ValueError(
                f"{path}: a yolo5l checkpoint, not an ultralytics one; use yolo5l.models.weights.load_checkpoint"
            )
        # Like yolov5's attempt_load: the EMA weights when present (training checkpoints), else `model`.
        for key in ("ema", "model"):
            if isinstance(ckpt.get(key), StandIn):
                return ckpt[key]
        raise ValueError(
            f"{path}: no yolov5 model in this file (keys: {sorted(map(str, ckpt))}); "
            "expected a checkpoint written by ultralytics/yolov5 train.py (yolov5s.pt, best.pt, last.pt)"
        )
    raise ValueError(f"{path}: holds a {type(ckpt).__name__}, not a yolov5 checkpoint dict")


def layers(model: StandIn) -> list[StandIn]:
    """The stand-ins of ``model.model[i]``, in order."""
    seq = module_dict(model).get("_modules", {}).get("model")
    return list((module_dict(seq).get("_modules") or {}).values())


def architecture(model: StandIn, path: str) -> tuple[dict[str, Any], str | dict[str, Any] | None]:
    """The file's model yaml (normalised) and the ``cfg`` that builds it: None (P5 table), "p6", or the yaml."""
    found = [type(m).__name__ for m in layers(model)]
    if found[-1:] in (["Segment"], ["Classify"]):
        raise ValueError(f"{path}: a yolov5 {found[-1]} model; yolo5l loads detection models (a Detect head)")
    raw = module_dict(model).get("yaml")
    if not isinstance(raw, Mapping) or not {"backbone", "head"} <= set(raw):
        raise ValueError(f"{path}: the model has no yaml with backbone and head lists; not a yolov5 v5-v7 file")
    spec = normalize_spec(raw, f"{path}: its model yaml")
    rows = len(spec["backbone"]) + len(spec["head"])
    if len(found) != rows:
        raise ValueError(f"{path}: {len(found)} layers but its model yaml lists {rows}; the file is damaged")
    name = builtin_name(spec)
    return spec, None if name == "p5" else name or spec


def check_activations(src: StandIn, model: nn.Module, path: str) -> None:
    """Refuse a file whose Conv activations differ from the ones its yaml builds (yolov5 v4 and older used
    LeakyReLU/Hardswish without saying so in the yaml): the weights would load but compute something else."""
    for name, module in model.named_modules():
        if not isinstance(module, Conv):
            continue
        node: Any = src
        for part in name.split("."):
            node = (module_dict(node).get("_modules") or {}).get(part)
        theirs = (module_dict(node).get("_modules") or {}).get("act")
        if theirs is None:
            continue
        ours = type(module.act).__name__
        if type(theirs).__name__ != ours:
            raise ValueError(
                f"{path}: {name} activates with {type(theirs).__name__} where the model its yaml describes has "
                f"{ours} (a yolov5 v4-or-older file?); re-export it with yolov5 v6+"
            )


def opt_imgsz(ckpt: Any) -> int | None:
    """``opt.imgsz`` (v6-v7) or ``opt.img_size[0]`` (v5) of an ultralytics training checkpoint, when recorded."""
    opt = ckpt.get("opt") if isinstance(ckpt, Mapping) else None
    opt = module_dict(opt) if isinstance(opt, StandIn) else opt
    if not isinstance(opt, Mapping):
        return None
    size = opt.get("imgsz", opt.get("img_size"))
    size = size[0] if isinstance(size, (list, tuple)) and size else size
    return int(size) if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def file_names(model: StandIn, nc: int) -> list[str]:
    """The model's class names (a list or an index dict), or ``"0"``, ``"1"``, ... when it has none for ``nc``."""
    names = module_dict(model).get("names")
    if isinstance(names, Mapping):
        names = [names[k] for k in sorted(names)]
    if isinstance(names, (list, tuple)) and len(names) == nc:
        return [str(n) for n in names]
    return [str(i) for i in range(nc)]
