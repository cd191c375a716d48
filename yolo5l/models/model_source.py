"""Where a run's model comes from: the weights file, a v7.0 model yaml, or the ``model=`` preset.

As v7.0's ``train.py --weights`` does, ``weights=<file>`` builds the model the file holds (architecture, depth,
width, anchors; the Detect convolutions anew when the data has other classes), so ``model=`` only matters when
training from scratch. A ``model=``/``model.depth=``/``model.width=``/``model.cfg=`` typed on the command line that
asks for another architecture than the file's is refused in one line naming both; ``model.anchors=`` typed there
replaces the file's anchors (v7.0 leaves the file's anchors out of the transfer when ``--cfg`` or a hyp's
``anchors`` is given). ``model.cfg=path/to/model.yaml`` typed on the command line builds that yaml with its own
``depth_multiple``, ``width_multiple`` and ``anchors`` unless those are typed too.

``cfg.model`` stays as the user gave it (so a resumed run's command line still matches it); what was built goes into
``cfg.model_built`` (its name, ``yolov5n`` or a description, then depth, width, anchors in pixels, and ``cfg``: None
for P5, ``"p6"``, or the model yaml as plain data), which the run's saved config keeps: ``resume=`` rebuilds from it
without the weights file or the yaml.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from yolo5l.base.errors import UserError
from yolo5l.base.image_size import MAX_STRIDE

__all__ = ["build_model", "command_line_overrides", "model_stride"]

_ARCH_KEYS = ("depth", "width", "cfg")


def command_line_overrides() -> list[str]:
    """This run's command-line overrides (Hydra's task overrides; empty outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [str(o) for o in HydraConfig.get().overrides.task]


def _typed(overrides: Sequence[str]) -> dict[str, str]:
    """``{key: override}`` for the ``model`` group and ``model.<key>`` overrides among ``overrides``."""
    out: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~").strip()
        if key == "model":
            out["model"] = o
        elif key.startswith("model."):
            out[key[len("model.") :]] = o
    return out


def _yaml_kwargs(cfg: DictConfig, typed: dict[str, str]) -> dict[str, Any]:
    """For a typed ``model.cfg=<yaml>``: the yaml as plain data, and None (the yaml's own) for the multiples and
    anchors that were not typed too."""
    from yolo5l.models.parse import BUILTIN, load_spec

    value = cfg.model.get("cfg")
    if "cfg" not in typed or value is None or not isinstance(value, str) or value in ("p5", *BUILTIN):
        return {}
    try:
        spec = load_spec(value)
    except ValueError as e:
        raise UserError(f"model.cfg={value}: {str(e).splitlines()[0]}") from None
    return {"cfg": spec, **{k: None for k in ("depth", "width", "anchors") if k in cfg.model and k not in typed}}


def _record(cfg: DictConfig, model: Any) -> None:
    anchors = model.anchor_pixels().detach().cpu().reshape(model.detect.nl, -1).tolist()
    with open_dict(cfg):
        cfg.model_built = {
            "name": model.describe(), "depth": model.depth, "width": model.width, "anchors": anchors, "cfg": model.cfg,
        }  # fmt: skip


def model_stride(model: Any) -> int:
    """The model's largest stride, at least 32 (64 for P6): image sizes are multiples of it."""
    return max(int(model.stride.max()), MAX_STRIDE)


def build_model(cfg: DictConfig, num_classes: int, overrides: Sequence[str] | None = None) -> tuple[Any, Any]:
    """Build the run's model: from ``cfg.weights`` when given, else from ``cfg.model`` (or a resumed run's
    ``cfg.model_built``); records what was built in ``cfg.model_built``.

    Args:
        cfg: The training config.
        num_classes: The data's class count.
        overrides: Command-line overrides (default: this Hydra run's, :func:`command_line_overrides`).

    Returns:
        ``(model, info)``: ``info`` is the :class:`~yolo5l.models.weights.LoadInfo` of the weights, None from scratch.

    Raises:
        UserError: A model yaml or weights file that cannot be built, or a typed ``model`` override that asks for
            another architecture than the weights hold.
    """
    typed = _typed(command_line_overrides() if overrides is None else overrides)
    if not cfg.get("weights"):
        built = cfg.get("model_built")  # a resumed run: what it trained, not what its command line asked for
        kwargs = OmegaConf.to_container(built) if built is not None else _yaml_kwargs(cfg, typed)
        kwargs.pop("name", None)  # what the run's config calls it, not an argument
        model, info = _instantiate(cfg.model, num_classes, kwargs), None
    else:
        model, info = _from_weights(cfg, num_classes, typed)
    _record(cfg, model)
    return model, info


def _instantiate(node: DictConfig, num_classes: int, kwargs: Any) -> Any:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, num_classes=num_classes, _convert_="all", **kwargs)
    except (ValueError, InstantiationException) as e:  # Hydra wraps the constructor's ValueError
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else e
        if not isinstance(cause, ValueError):
            raise
        raise UserError(f"model: {str(cause).splitlines()[0]}") from None


def _from_weights(cfg: DictConfig, num_classes: int, typed: dict[str, str]) -> tuple[Any, Any]:
    from yolo5l.models.weights import load_weights, resolve_weights

    kwargs = {k: bool(cfg.model[k]) for k in ("fused_upsample", "fused_bn_act") if k in cfg.model}
    if "anchors" in typed and cfg.model.get("anchors") is not None:
        kwargs["anchors"] = OmegaConf.to_container(cfg.model.anchors)
    try:
        model, info = load_weights(resolve_weights(str(cfg.weights)), num_classes=num_classes, **kwargs)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    asked = [typed[k] for k in ("model", *_ARCH_KEYS) if k in typed]
    if asked:
        _refuse_other_architecture(cfg, model, num_classes, asked, _yaml_kwargs(cfg, typed))
    return model, info


def _refuse_other_architecture(
    cfg: DictConfig, model: Any, num_classes: int, asked: list[str], yaml_kwargs: dict[str, Any]
) -> None:
    import torch
    from hydra.utils import instantiate

    kwargs = {**yaml_kwargs, "anchors": None}  # the architecture's own anchors: any anchors fit the weights
    try:
        with torch.device("meta"):  # shapes only: the architecture is all that is compared
            wanted = instantiate(cfg.model, num_classes=num_classes, _convert_="all", **kwargs)
    except Exception as e:
        wanted, why = None, str(getattr(e, "__cause__", None) or e).splitlines()[0]
    else:
        why = ""
    if wanted is not None and wanted.architecture() == model.architecture():
        return
    what = wanted.describe() if wanted is not None else f"a model that does not build ({why})"
    raise UserError(
        f"weights={cfg.weights} holds {model.describe()} but {' '.join(asked)} asks for {what}: drop "
        f"{' '.join(a.split('=', 1)[0] + '=' for a in asked)} to fine-tune the file's model, or drop weights= to "
        "train from scratch"
    )
