"""Load ultralytics/yolov5 (v6.x-v7.0) ``.pt`` files and yolo5l checkpoints into :class:`~yolo5l.models.yolo.YOLOv5`.

An ultralytics ``.pt`` file is a full pickle of ``models.yolo.DetectionModel``; ``torch.load(weights_only=True)``
refuses it and ``weights_only=False`` would run whatever the pickle says. :func:`load_ultralytics` reads it through
:mod:`yolo5l.safe_pickle` (an allow-list of globals, inert stand-ins for the module classes): no code runs.

A yolo5l weights file (written by :func:`save_weights`: training's ``weights.pt``, ``python -m yolo5l.convert``) is
a plain dict ``{"model_config": {depth, width, num_classes, anchors}, "state_dict": ..., "names": [...]}`` that
``torch.load(weights_only=True)`` reads; :func:`load_checkpoint` builds the model from it. Every checkpoint yolo5l
writes goes through :func:`atomic_save` (a temporary file, fsync, rename), so a crash never leaves half a file.

Reference: ultralytics/yolov5 v7.0 train.py (``intersect_dicts`` by key and shape, "Transferred 349/349 items").
"""

from __future__ import annotations

import logging
import os
import pathlib
import pickle
import tempfile
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from yolo5l.archive import archive_damage
from yolo5l.errors import UserError
from yolo5l.models.yolo import _LAYERS, ANCHORS_P3_P5, STRIDES, YOLOv5
from yolo5l.safe_pickle import StandIn, UnsafeCheckpointError, restricted_pickle

log = logging.getLogger(__name__)

__all__ = [
    "LoadInfo",
    "UnsafeCheckpointError",
    "atomic_save",
    "load_checkpoint",
    "load_pretrained",
    "load_ultralytics",
    "load_weights",
    "resolve_weights",
    "restricted_pickle",
    "save_weights",
]

# Keys of the Detect convolutions: the only tensors whose shapes depend on the number of classes.
_HEAD_CONV_PREFIX = f"model.{len(_LAYERS) - 1}.m."


class _NotYolo5lCheckpoint(ValueError):
    """The file is not in yolo5l's checkpoint format (lets :func:`load_weights` try the ultralytics format)."""


@dataclass
class LoadInfo:
    """What a load transferred.

    Attributes:
        source: The file read.
        names: Class names (from the file; ``["0", "1", ...]`` when the model was built for another class count).
        transferred: Tensors copied from the file into the model.
        total: Tensors in the model's state dict (349 for every size at depth 0.33).
        skipped: Model keys left at their fresh initialisation (the Detect convs when the class count differs).
        file_num_classes: Number of classes the file was trained on.
    """

    source: str
    names: list[str]
    transferred: int
    total: int
    skipped: list[str] = field(default_factory=list)
    file_num_classes: int = 0
    imgsz: int | None = None  # the image size the weights were trained at, when the file records it


# ---------------------------------------------------------------------------------------------------------------
# Reading an ultralytics checkpoint
# ---------------------------------------------------------------------------------------------------------------


def _check_file(path: str | os.PathLike[str]) -> str:
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


def _unpickle_ultralytics(path: str) -> Any:
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


def _module_dict(obj: Any) -> dict[str, Any]:
    return obj.__dict__ if isinstance(obj, StandIn) else {}


def _collect_state_dict(obj: StandIn, prefix: str = "", out: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Walk ``_parameters``/``_buffers``/``_modules`` of the stand-in tree as ``nn.Module.state_dict`` does."""
    out = {} if out is None else out
    d = _module_dict(obj)
    non_persistent = d.get("_non_persistent_buffers_set") or set()
    for k, v in (d.get("_parameters") or {}).items():
        if isinstance(v, Tensor):
            out[prefix + k] = v
    for k, v in (d.get("_buffers") or {}).items():
        if isinstance(v, Tensor) and k not in non_persistent:
            out[prefix + k] = v
    for k, m in (d.get("_modules") or {}).items():
        if isinstance(m, StandIn):
            _collect_state_dict(m, f"{prefix}{k}.", out)
    return out


def _find_model(ckpt: Any, path: str) -> StandIn:
    if isinstance(ckpt, StandIn):
        return ckpt
    if isinstance(ckpt, Mapping):
        if "model_config" in ckpt and "state_dict" in ckpt:
            raise ValueError(f"{path}: a yolo5l checkpoint, not an ultralytics one; use yolo5l.weights.load_checkpoint")
        # Like yolov5's attempt_load: the EMA weights when present (training checkpoints), else `model`.
        for key in ("ema", "model"):
            if isinstance(ckpt.get(key), StandIn):
                return ckpt[key]
        raise ValueError(
            f"{path}: no yolov5 model in this file (keys: {sorted(map(str, ckpt))}); "
            "expected a checkpoint written by ultralytics/yolov5 train.py (yolov5s.pt, best.pt, last.pt)"
        )
    raise ValueError(f"{path}: holds a {type(ckpt).__name__}, not a yolov5 checkpoint dict")


def _check_architecture(model: StandIn, path: str) -> list[StandIn]:
    seq = _module_dict(model).get("_modules", {}).get("model")
    layers = list((_module_dict(seq).get("_modules") or {}).values())
    found = [type(m).__name__ for m in layers]
    expected = [block for _, _, block, _ in _LAYERS]
    if found != expected:
        hint = ""
        if found[:1] == ["Focus"]:
            hint = " (a yolov5 v5.0-or-older file with a Focus stem; re-export it with yolov5 v6+)"
        elif found[-1:] == ["Segment"] or found[-1:] == ["Classify"]:
            hint = f" (a yolov5 {found[-1]} model; yolo5l loads detection models)"
        elif len(found) > len(expected):
            hint = " (a P6 model such as yolov5s6?)"
        pairs = enumerate(zip(found, expected, strict=False))
        i = next((j for j, (a, b) in pairs if a != b), min(len(found), len(expected)))
        got = found[i] if i < len(found) else "nothing"
        raise ValueError(
            f"{path}: layer {i} is {got} where the YOLOv5 v6/v7 P3-P5 detector (yolov5n/s/m/l/x) that yolo5l builds "
            f"has {expected[i] if i < len(expected) else 'no layer'} ({len(found)} layers, expected {len(expected)})"
            f"{hint}"
        )
    return layers


def _file_names(model: StandIn, nc: int) -> list[str]:
    names = _module_dict(model).get("names")
    if isinstance(names, Mapping):
        names = [names[k] for k in sorted(names)]
    if isinstance(names, (list, tuple)) and len(names) == nc:
        return [str(n) for n in names]
    return [str(i) for i in range(nc)]


def _transfer(
    model: YOLOv5, source: Mapping[str, Tensor], path: str, names: list[str], file_nc: int
) -> tuple[YOLOv5, LoadInfo]:
    """Copy tensors matching by key and shape (yolov5's ``intersect_dicts``), cast to the model's dtypes."""
    target = model.state_dict()
    new_sd: dict[str, Tensor] = {}
    for k, v in source.items():
        if k in target and target[k].shape == v.shape:
            new_sd[k] = v.detach().to(target[k].dtype)
    skipped = [k for k in target if k not in new_sd]
    foreign = [k for k in skipped if not k.startswith(_HEAD_CONV_PREFIX)]
    if foreign:
        raise ValueError(
            f"{path}: {len(foreign)} tensors do not fit the model built from its config (e.g. {foreign[:3]}); "
            "the file's architecture differs from yolo5l's YOLOv5"
        )
    model.load_state_dict({**target, **new_sd})
    if model.num_classes != file_nc:
        names = [str(i) for i in range(model.num_classes)]
    info = LoadInfo(path, names, len(new_sd), len(target), skipped, file_nc)
    log.info("Transferred %d/%d items from %s", info.transferred, info.total, path)
    return model, info


def _to_device(model: YOLOv5, map_location: Any) -> YOLOv5:
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        model = model.to(map_location)
    return model


def load_ultralytics(
    path: str | os.PathLike[str], num_classes: int | None = None, map_location: str | torch.device = "cpu"
) -> tuple[YOLOv5, LoadInfo]:
    """Build a :class:`YOLOv5` from an ultralytics/yolov5 v6-v7 ``.pt`` file, without ultralytics and without
    running pickled code.

    The model's depth/width come from the file's ``yaml``; its anchors from the ``model.24.anchors`` buffer (which
    autoanchor may have changed, unlike the yaml). Tensors are cast to float32. With ``num_classes`` different from
    the file's, everything but the Detect convolutions transfers (343/349 for yolov5s). Uses the EMA weights when
    the file has them, as yolov5's ``attempt_load`` does. The model is returned in training mode.

    Args:
        path: The ``.pt`` file (e.g. ``yolov5s.pt``, or a ``best.pt`` from yolov5 train.py).
        num_classes: Classes of the model to build; None keeps the file's.
        map_location: Device to put the model on.

    Returns:
        ``(model, info)``; ``info.transferred``/``info.total`` are yolov5's "Transferred 349/349 items".

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        UnsafeCheckpointError: If the pickle refers to a global outside the allow-list (nothing is executed).
        ValueError: If the file is not a yolov5 v6-v7 P3-P5 detection checkpoint.
    """
    p = _check_file(path)
    ckpt = _unpickle_ultralytics(p)
    src_model = _find_model(ckpt, p)
    layers = _check_architecture(src_model, p)
    cfg = _module_dict(src_model).get("yaml")
    if not isinstance(cfg, Mapping) or not {"nc", "depth_multiple", "width_multiple"} <= set(cfg):
        raise ValueError(f"{p}: the model has no yaml with nc/depth_multiple/width_multiple; not a yolov5 v6+ file")
    detect = _module_dict(layers[-1])
    anchors = (detect.get("_buffers") or {}).get("anchors")
    stride = detect.get("stride", _module_dict(src_model).get("stride"))
    if not isinstance(anchors, Tensor) or not isinstance(stride, Tensor) or stride.tolist() != list(STRIDES):
        raise ValueError(f"{p}: Detect has no anchors buffer or strides other than {list(STRIDES)}")
    file_nc = int(cfg["nc"])
    anchor_px = anchors.float() * stride.float().view(-1, 1, 1)  # grid units -> pixels
    model = YOLOv5(
        num_classes=file_nc if num_classes is None else num_classes,
        depth=float(cfg["depth_multiple"]),
        width=float(cfg["width_multiple"]),
        anchors=anchor_px,
    )
    model, info = _transfer(model, _collect_state_dict(src_model), p, _file_names(src_model, file_nc), file_nc)
    return _to_device(model, map_location), info


# ---------------------------------------------------------------------------------------------------------------
# yolo5l checkpoints
# ---------------------------------------------------------------------------------------------------------------


class _KeepWriteError:
    """The file `torch.save` writes through, keeping the `OSError` of a failed write (ENOSPC, EDQUOT, EFBIG): torch's
    zip writer reports it only as `RuntimeError: ... unexpected pos`, which says nothing of a full disk."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> pathlib.Path:
    """``torch.save`` to a temporary file in the same folder, fsync, then ``os.replace`` onto ``path``.

    An interrupted write (crash, full disk, kill) leaves the previous file whole: ``os.replace`` is atomic within
    one filesystem on POSIX and Windows.

    Raises:
        OSError: The write failed (full disk, quota, file-size limit, read-only folder); nothing was replaced.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            sink = _KeepWriteError(f)
            try:
                torch.save(obj, sink)
            except RuntimeError:
                if sink.error is None:
                    raise
                raise sink.error from None  # the full disk, not torch's "unexpected pos"
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_weights(
    model: YOLOv5,
    path: str | os.PathLike[str],
    names: list[str] | None = None,
    half: bool = True,
    imgsz: int | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
) -> pathlib.Path:
    """Write a yolo5l weights file that ``torch.load(weights_only=True)`` reads (atomically).

    Args:
        model: The model (with ``EMACallback``, training passes the EMA weights).
        path: Output file.
        names: Class names (defaults to ``["0", "1", ...]``).
        half: Store floating tensors in half precision, as YOLOv5's ``strip_optimizer`` does (half the size; the
            model is built in float32 again when loaded). A tensor with values beyond half's range stays float32:
            YOLOv5 would store inf there.
        imgsz: The training image size, recorded so that predict and export default to it.
        state_dict: Weights to write instead of the model's own (e.g. the EMA weights of a checkpoint), with the
            model's keys.

    Returns:
        The path written.

    Raises:
        ValueError: If ``names`` does not have ``model.num_classes`` entries.
    """
    names = [str(i) for i in range(model.num_classes)] if names is None else [str(n) for n in names]
    if len(names) != model.num_classes:
        raise ValueError(f"{len(names)} names for a model with {model.num_classes} classes")
    source = model.state_dict() if state_dict is None else state_dict
    bad = next((k for k, v in source.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise ValueError(f"not writing {os.fspath(path)}: {bad} holds non-finite values (a diverged run?)")
    state = {k: _stored(v.detach(), half).cpu().clone() for k, v in source.items()}
    ckpt = {
        "model_config": {
            "depth": float(model.depth),
            "width": float(model.width),
            "num_classes": int(model.num_classes),
            "anchors": model.anchor_pixels().detach().cpu().float().reshape(len(STRIDES), -1).tolist(),
        },
        "state_dict": state,
        "names": names,
        "imgsz": None if imgsz is None else int(imgsz),
    }
    return atomic_save(ckpt, path)


def _stored(t: Tensor, half: bool) -> Tensor:
    """`t` as a weights file stores it: floating tensors in half precision, except one whose values lie beyond
    half's range (65504; a BatchNorm variance of a run close to diverging), which would turn into inf there."""
    if not (half and t.is_floating_point()):
        return t
    low = t.half()
    return low if bool(torch.isfinite(low).all()) else t  # one host sync per tensor: at save time only


def load_checkpoint(
    path: str | os.PathLike[str], num_classes: int | None = None, map_location: str | torch.device = "cpu"
) -> tuple[YOLOv5, LoadInfo]:
    """Build a :class:`YOLOv5` from a yolo5l weights file (:func:`save_weights`).

    Args:
        path: The checkpoint.
        num_classes: Classes of the model to build; None keeps the checkpoint's (else the Detect convs are fresh).
        map_location: Device to put the model on.

    Returns:
        ``(model, info)`` as :func:`load_ultralytics`.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the file is not a yolo5l checkpoint.
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"{p}: no such file; pass a yolo5l checkpoint written by `python -m yolo5l.convert`")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise _NotYolo5lCheckpoint(
            f"{p}: not a yolo5l checkpoint (it needs more than weights to unpickle); for an ultralytics .pt use "
            "yolo5l.weights.load_ultralytics or `python -m yolo5l.convert`"
        ) from None
    except (EOFError, RuntimeError, ValueError) as e:
        raise _NotYolo5lCheckpoint(f"{p}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None
    if isinstance(ckpt, Mapping) and {"state_dict", "hyper_parameters"} <= set(ckpt):
        ckpt = _from_training_checkpoint(ckpt, p)
    if not isinstance(ckpt, Mapping) or not {"model_config", "state_dict"} <= set(ckpt):
        keys = sorted(map(str, ckpt)) if isinstance(ckpt, Mapping) else type(ckpt).__name__
        raise _NotYolo5lCheckpoint(f"{p}: not a yolo5l checkpoint (expected model_config and state_dict, found {keys})")
    cfg = ckpt["model_config"]
    file_nc = int(cfg["num_classes"])
    model = YOLOv5(
        num_classes=file_nc if num_classes is None else num_classes,
        depth=float(cfg["depth"]),
        width=float(cfg["width"]),
        anchors=cfg["anchors"],
    )
    names = [str(n) for n in ckpt.get("names") or range(file_nc)]
    model, info = _transfer(model, ckpt["state_dict"], p, names, file_nc)
    info.imgsz = int(ckpt["imgsz"]) if isinstance(ckpt.get("imgsz"), int) else None
    return _to_device(model, map_location), info


def _from_training_checkpoint(ckpt: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A Lightning `last.ckpt` / `best.ckpt` of yolo5l as a weights file: its `state_dict` (the EMA weights when the
    run had `EMACallback`), the model's size from the run's config, the class names from the module's."""
    run = ckpt.get("yolo5l_config")
    names = (ckpt.get("hyper_parameters") or {}).get("names")
    if not isinstance(run, Mapping) or not names:
        raise ValueError(f"{path}: a training checkpoint without yolo5l's run config: use the run's weights.pt")
    model = run["model"]
    imgsz = (run.get("data") or {}).get("imgsz")
    return {
        "model_config": {
            "depth": model["depth"], "width": model["width"], "num_classes": len(names),
            "anchors": model.get("anchors") or [list(a) for a in ANCHORS_P3_P5],
        },
        "state_dict": {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")},
        "names": list(names),
        "imgsz": imgsz if isinstance(imgsz, int) else None,
    }  # fmt: skip


def load_weights(
    path: str | os.PathLike[str], num_classes: int | None = None, map_location: str | torch.device = "cpu"
) -> tuple[YOLOv5, LoadInfo]:
    """Load either format: a yolo5l checkpoint, else an ultralytics/yolov5 ``.pt`` (restricted unpickling).

    Args:
        path: The file.
        num_classes: Classes of the model to build; None keeps the file's.
        map_location: Device to put the model on.

    Returns:
        ``(model, info)``.
    """
    if os.path.isfile(path) and (damage := archive_damage(path)):  # torch.load never checks the checksums
        raise ValueError(f"{os.fspath(path)} is damaged ({damage}): use another copy of it")
    try:
        return load_checkpoint(path, num_classes, map_location)
    except _NotYolo5lCheckpoint:
        return load_ultralytics(path, num_classes, map_location)


def resolve_weights(name_or_url: str | os.PathLike[str]) -> pathlib.Path:
    """The local file of ``weights=``: a path as given; a URL or a bare release name downloaded once into the cache.

    A URL, or ``yolov5{n,s,m,l,x}.pt`` with no such file in the current folder (the ultralytics v7.0 release asset,
    see :func:`yolo5l.download.weights_url`), is fetched into ``<user cache>/weights/<host>/<url path>`` (see
    :func:`yolo5l.data.layout.user_cache_dir`); later runs find it there. The file is read by the loaders as any
    other, through the restricted unpickler.

    Raises:
        UserError: The download failed (the message names the URL and where to put the file by hand).
    """
    from yolo5l.data.layout import user_cache_dir
    from yolo5l.download import download, url_cache_path, weights_url

    url = weights_url(name_or_url)
    if url is None:
        return pathlib.Path(name_or_url)
    return download(url, user_cache_dir("weights") / url_cache_path(url))


def load_pretrained(model: YOLOv5, path: str | os.PathLike[str]) -> LoadInfo:
    """Copy the weights of an ultralytics ``.pt`` or a yolo5l weights file into ``model`` (weights only).

    The file's Detect convolutions are skipped when its class count differs (fine-tuning on new classes).

    Raises:
        UserError: The file is not a YOLOv5 checkpoint, or holds another model size than ``model``.
    """
    try:
        loaded, info = load_weights(path, num_classes=model.num_classes)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    if (loaded.depth, loaded.width) != (model.depth, model.width):
        raise UserError(
            f"weights {os.fspath(path)} are a depth={loaded.depth} width={loaded.width} model but the config builds "
            f"depth={model.depth} width={model.width}: pick the matching model= option"
        )
    model.load_state_dict(loaded.state_dict())
    return info
