"""Load ultralytics/yolov5 (v6.x-v7.0) ``.pt`` files and yolo5l checkpoints into :class:`~yolo5l.models.yolo.YOLOv5`.

An ultralytics ``.pt`` file is a full pickle of ``models.yolo.DetectionModel``; ``torch.load(weights_only=True)``
refuses it and ``weights_only=False`` would run whatever the pickle says. :func:`load_ultralytics` reads it through
:mod:`yolo5l.io.safe_pickle` (an allow-list of globals, inert stand-ins for the module classes): no code runs. Stripped
release files and the unstripped ``last.pt``/``best.pt`` of a running or interrupted run (optimizer state, ``opt``,
``ema`` beside ``model``, numpy ``best_fitness``) both load; the EMA weights are taken when present. The model is
the one the file holds: its yaml (P5, P6 or any v7.0 model yaml, :mod:`yolo5l.models.parse`), anchors and classes.

A yolo5l weights file (written by :func:`save_weights`: training's ``weights.pt``, ``python -m yolo5l.convert``) is
a plain dict ``{"model_config": {depth, width, num_classes, anchors, cfg}, "state_dict": ..., "names": [...]}``
that ``torch.load(weights_only=True)`` reads; :func:`load_checkpoint` builds the model from it (``cfg`` is None for
the P5 table, ``"p6"``, or the model yaml as plain data). Every checkpoint yolo5l
writes goes through :func:`atomic_save` (a temporary file, fsync, rename), so a crash never leaves half a file.

A load prints nothing on a command's console: :class:`LoadInfo` says what was transferred, and training prints it in
its start-up lines (``[yolo5l] transferred 349/349 items from yolov5s.pt``), where v7.0's train.py prints its
"Transferred 349/349 items"; validation, prediction and export load the whole file and say nothing of it, as v7.0's
val.py, detect.py and export.py do. The loader logs v7.0's line at INFO for an API user's own logging, marked to stay
off the console (``yolo5l.base.console.ConsoleHandler``).

Reference: ultralytics/yolov5 v7.0 train.py (``intersect_dicts`` by key and shape, "Transferred 349/349 items").
"""

from __future__ import annotations

import logging
import os
import pathlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from yolo5l.base.errors import UserError
from yolo5l.base.files import atomic_open
from yolo5l.io.archive import archive_damage
from yolo5l.io.safe_pickle import UnsafeCheckpointError, restricted_pickle
from yolo5l.models import ultralytics_pt as ult
from yolo5l.models.yolo import YOLOv5

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

# v7.0's P6 models are trained and evaluated at 1280 px (README); the size used when a P6 file records none.
_P6_IMGSZ = 1280


class _NotYolo5lCheckpoint(ValueError):
    """The file is not in yolo5l's checkpoint format (lets :func:`load_weights` try the ultralytics format)."""


@dataclass
class LoadInfo:
    """What a load transferred.

    Attributes:
        source: The file read.
        names: Class names (from the file; ``["0", "1", ...]`` when the model was built for another class count).
        transferred: Tensors copied from the file into the model.
        total: Tensors in the model's state dict (349 for every P5 size at depth 0.33).
        skipped: Model keys left at their fresh initialisation (the Detect convs when the class count differs).
        file_num_classes: Number of classes the file was trained on.
        imgsz: The image size the weights were trained at, as the file records it (yolo5l's ``imgsz``, an
            ultralytics file's ``opt.imgsz``); for a P6 file that records none, 1280 (v7.0's size for P6 models).
        data: The dataset yaml the weights were trained on (absolute), when the file records it (yolo5l's ``data``).
    """

    source: str
    names: list[str]
    transferred: int
    total: int
    skipped: list[str] = field(default_factory=list)
    file_num_classes: int = 0
    imgsz: int | None = None
    data: str | None = None


# ---------------------------------------------------------------------------------------------------------------
# Reading an ultralytics checkpoint (the pickle itself: yolo5l.models.ultralytics_pt)
# ---------------------------------------------------------------------------------------------------------------


def _transfer(
    model: YOLOv5, source: Mapping[str, Tensor], path: str, names: list[str], file_nc: int, own_anchors: bool = False
) -> tuple[YOLOv5, LoadInfo]:
    """Copy tensors matching by key and shape (yolov5's ``intersect_dicts``), cast to the model's dtypes; with
    ``own_anchors`` the model keeps the anchors it was built with (v7.0 excludes ``anchor`` keys then)."""
    target = model.state_dict()
    head = f"model.{len(model.model) - 1}."
    kept = {f"{head}anchors"} if own_anchors else set()
    new_sd: dict[str, Tensor] = {}
    for k, v in source.items():
        if k in target and target[k].shape == v.shape and k not in kept:
            new_sd[k] = v.detach().to(target[k].dtype)
    skipped = [k for k in target if k not in new_sd]
    # The Detect convs are the only tensors whose shapes depend on the class count.
    foreign = [k for k in skipped if not k.startswith(f"{head}m.") and k not in kept]
    if foreign:
        raise ValueError(
            f"{path}: {len(foreign)} tensors do not fit the model built from its config (e.g. {foreign[:3]}); "
            "the file's weights do not match the architecture it describes"
        )
    model.load_state_dict({**target, **new_sd})
    if model.num_classes != file_nc:
        names = [str(i) for i in range(model.num_classes)]
    info = LoadInfo(path, names, len(new_sd), len(target), skipped, file_nc)
    # For an API user's logging (v7.0's words), kept off a command's console (`console: False`): a command reports
    # what matters to its user from `info` once the load has succeeded (training's start-up line).
    log.info("Transferred %d/%d items from %s", info.transferred, info.total, path, extra={"console": False})
    return model, info


def _to_device(model: YOLOv5, map_location: Any) -> YOLOv5:
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        model = model.to(map_location)
    return model


def load_ultralytics(
    path: str | os.PathLike[str],
    num_classes: int | None = None,
    map_location: str | torch.device = "cpu",
    **model_kwargs: Any,
) -> tuple[YOLOv5, LoadInfo]:
    """Build the :class:`YOLOv5` an ultralytics/yolov5 v5-v7 ``.pt`` file holds, without ultralytics and without
    running pickled code.

    The architecture comes from the file's ``yaml`` (the P5 or P6 table, or any v7.0 model yaml); its anchors from
    the Detect ``anchors`` buffer (which autoanchor may have changed, unlike the yaml). Tensors are cast to float32.
    With ``num_classes`` different from the file's, everything but the Detect convolutions transfers (343/349 for
    yolov5s). Uses the EMA weights when the file has them (an unstripped ``last.pt``), as yolov5's ``attempt_load``
    does. The model is returned in training mode.

    Args:
        path: The ``.pt`` file (e.g. ``yolov5s.pt``, or a ``best.pt`` / ``last.pt`` from yolov5 train.py).
        num_classes: Classes of the model to build; None keeps the file's.
        map_location: Device to put the model on.
        **model_kwargs: Further :class:`YOLOv5` arguments that do not change the weights (``fused_upsample``,
            ``fused_bn_act``), or ``anchors`` to build with other anchors than the file's.

    Returns:
        ``(model, info)``; ``info.transferred``/``info.total`` are yolov5's "Transferred 349/349 items".

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        UnsafeCheckpointError: If the pickle refers to a global outside the allow-list (nothing is executed).
        ValueError: If the file is not a yolov5 detection checkpoint that yolo5l can build.
    """
    p = ult.check_file(path)
    ckpt = ult.unpickle(p)
    src_model = ult.find_model(ckpt, p)
    spec, arch = ult.architecture(src_model, p)
    detect = ult.module_dict(ult.layers(src_model)[-1])
    anchors = (detect.get("_buffers") or {}).get("anchors")
    stride = detect.get("stride", ult.module_dict(src_model).get("stride"))
    if not isinstance(anchors, Tensor) or not isinstance(stride, Tensor) or stride.numel() != anchors.shape[0]:
        raise ValueError(f"{p}: its Detect head has no anchors buffer or no stride per level")
    file_nc = int(spec["nc"])
    own_anchors = model_kwargs.get("anchors") is not None
    model_kwargs.setdefault("anchors", anchors.float() * stride.float().view(-1, 1, 1))  # grid units -> pixels
    model = YOLOv5(
        num_classes=file_nc if num_classes is None else num_classes,
        depth=float(spec["depth_multiple"]),
        width=float(spec["width_multiple"]),
        cfg=arch,
        **model_kwargs,
    )
    if model.detect.stride.tolist() != stride.float().tolist():
        raise ValueError(f"{p}: Detect strides {stride.tolist()} but its yaml builds {model.detect.stride.tolist()}")
    ult.check_activations(src_model, model, p)
    names = ult.file_names(src_model, file_nc)
    model, info = _transfer(model, ult.collect_state_dict(src_model), p, names, file_nc, own_anchors)
    info.imgsz = ult.opt_imgsz(ckpt) or (_P6_IMGSZ if arch == "p6" else None)
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
    """``torch.save`` through ``yolo5l.base.files.atomic_open`` (fsync before the rename).

    An interrupted write (crash, full disk, kill) leaves the previous file whole: ``os.replace`` is atomic within
    one filesystem on POSIX and Windows.

    Raises:
        OSError: The write failed (full disk, quota, file-size limit, read-only folder); nothing was replaced.
    """
    with atomic_open(path, fsync=True) as f:
        sink = _KeepWriteError(f)
        try:
            torch.save(obj, sink)
        except RuntimeError:
            if sink.error is None:
                raise
            raise sink.error from None  # the full disk, not torch's "unexpected pos"
    return pathlib.Path(path)


def save_weights(
    model: YOLOv5,
    path: str | os.PathLike[str],
    names: list[str] | None = None,
    half: bool = True,
    imgsz: int | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
    data: str | os.PathLike[str] | None = None,
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
        data: The dataset yaml the model was trained on, recorded (absolute) so that val defaults to it.

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
            "anchors": model.anchor_pixels().detach().cpu().float().reshape(model.detect.nl, -1).tolist(),
            "cfg": model.cfg,
        },
        "state_dict": state,
        "names": names,
        "imgsz": None if imgsz is None else int(imgsz),
        "data": None if data is None else os.path.abspath(data),
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
    path: str | os.PathLike[str],
    num_classes: int | None = None,
    map_location: str | torch.device = "cpu",
    **model_kwargs: Any,
) -> tuple[YOLOv5, LoadInfo]:
    """Build a :class:`YOLOv5` from a yolo5l weights file (:func:`save_weights`) or training checkpoint.

    Args:
        path: The checkpoint.
        num_classes: Classes of the model to build; None keeps the checkpoint's (else the Detect convs are fresh).
        map_location: Device to put the model on.
        **model_kwargs: As :func:`load_ultralytics`.

    Returns:
        ``(model, info)`` as :func:`load_ultralytics`.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the file is not a yolo5l checkpoint.
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"{p}: no such file; pass yolo5l weights (a run's best.pt or last.ckpt)")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise _NotYolo5lCheckpoint(
            f"{p}: not a yolo5l checkpoint (it needs more than weights to unpickle); for an ultralytics .pt use "
            "yolo5l.models.weights.load_ultralytics or `python -m yolo5l.convert`"
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
    own_anchors = model_kwargs.get("anchors") is not None
    model_kwargs.setdefault("anchors", cfg.get("anchors"))
    try:
        model = YOLOv5(
            num_classes=file_nc if num_classes is None else num_classes,
            depth=float(cfg["depth"]),
            width=float(cfg["width"]),
            cfg=cfg.get("cfg"),
            **model_kwargs,
        )
    except ValueError as e:
        raise ValueError(f"{p}: its model_config does not build ({str(e).splitlines()[0]})") from None
    names = [str(n) for n in ckpt.get("names") or range(file_nc)]
    model, info = _transfer(model, ckpt["state_dict"], p, names, file_nc, own_anchors)
    info.imgsz = int(ckpt["imgsz"]) if isinstance(ckpt.get("imgsz"), int) else None
    info.data = str(ckpt["data"]) if isinstance(ckpt.get("data"), str) else None
    return _to_device(model, map_location), info


def _from_training_checkpoint(ckpt: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A Lightning `last.ckpt` / `best.ckpt` of yolo5l as a weights file: its `state_dict` (the EMA weights when the
    run had `EMACallback`), the model's size from the run's config, the class names from the module's."""
    run = ckpt.get("yolo5l_config")
    names = (ckpt.get("hyper_parameters") or {}).get("names")
    if not isinstance(run, Mapping) or not names:
        raise ValueError(f"{path}: a training checkpoint without yolo5l's run config: use the run's weights.pt")
    model = run.get("model_built") or run["model"]  # what was built (yolo5l.models.model_source), else what was asked
    imgsz = _resolved_imgsz(run)
    return {
        "data": _run_data_file(run.get("data") or {}),
        "model_config": {
            "depth": model.get("depth"), "width": model.get("width"), "num_classes": len(names),
            "anchors": model.get("anchors"), "cfg": model.get("cfg"),
        },
        "state_dict": {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")},
        "names": list(names),
        "imgsz": imgsz if isinstance(imgsz, int) else None,
    }  # fmt: skip


def _resolved_imgsz(run: Mapping[str, Any]) -> Any:
    """`data.imgsz` of a run's saved (unresolved) config: a number, or an interpolation of its data node such as
    the synthetic preset's `${if_file:...}`; None when it cannot be resolved here."""
    from omegaconf import OmegaConf

    import yolo5l.base.resolvers  # noqa: F401 - the resolvers conf/ uses

    data = run.get("data") or {}
    imgsz = data.get("imgsz")
    if isinstance(imgsz, str):
        try:
            imgsz = OmegaConf.create({"data": dict(data)}).data.imgsz
        except Exception:  # an interpolation reaching outside the data node: the caller's default applies
            return None
    return imgsz


def _run_data_file(data: Mapping[str, Any]) -> str | None:
    """A run's dataset yaml (`data.file`, else the synthetic `<root>/data.yaml`); None for an unresolved `${...}`."""
    root = (data.get("synthetic") or {}).get("root")
    path = data.get("file") or (os.path.join(root, "data.yaml") if isinstance(root, str) else None)
    return os.path.abspath(path) if isinstance(path, str) and "${" not in path else None


def load_weights(
    path: str | os.PathLike[str],
    num_classes: int | None = None,
    map_location: str | torch.device = "cpu",
    **model_kwargs: Any,
) -> tuple[YOLOv5, LoadInfo]:
    """Load either format: a yolo5l checkpoint, else an ultralytics/yolov5 ``.pt`` (restricted unpickling).

    Args:
        path: The file.
        num_classes: Classes of the model to build; None keeps the file's.
        map_location: Device to put the model on.
        **model_kwargs: As :func:`load_ultralytics`.

    Returns:
        ``(model, info)``: the model the file holds (architecture, anchors, classes unless ``num_classes``).
    """
    if os.path.isfile(path) and (damage := archive_damage(path)):  # torch.load never checks the checksums
        raise ValueError(f"{os.fspath(path)} is damaged ({damage}): use another copy of it")
    try:
        return load_checkpoint(path, num_classes, map_location, **model_kwargs)
    except _NotYolo5lCheckpoint:
        return load_ultralytics(path, num_classes, map_location, **model_kwargs)


def resolve_weights(name_or_url: str | os.PathLike[str]) -> pathlib.Path:
    """The local file of ``weights=``: a path as given; a URL or a bare release name downloaded once into the cache.

    A URL, or ``yolov5{n,s,m,l,x}.pt`` with no such file in the current folder (the ultralytics v7.0 release asset,
    see :func:`yolo5l.io.download.weights_url`), is fetched into ``<user cache>/weights/<host>/<url path>`` (see
    :func:`yolo5l.base.files.user_cache_dir`); later runs find it there. The file is read by the loaders as any
    other, through the restricted unpickler.

    Raises:
        UserError: The download failed (the message names the URL and where to put the file by hand).
    """
    from yolo5l.base.files import user_cache_dir
    from yolo5l.io.download import download, url_cache_path, weights_url

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
    if loaded.architecture() != model.architecture():
        raise UserError(
            f"weights {os.fspath(path)} hold {loaded.describe()} but the config builds {model.describe()}: "
            "pick the matching model= option"
        )
    model.load_state_dict(loaded.state_dict())
    return info
