"""The modules of yolo5l 0.1 under today's names.

yolo5l 0.2 put the package's modules in rooms (`yolo5l.loss` is now `yolo5l.training.loss`, ...).
- A training checkpoint keeps its run's config, and `resume=` builds that config again, so a `last.ckpt` written
  before the move names modules that are no longer there. `current_targets` renames them when the checkpoint is read
  (`yolo5l.resume.read_resume_state`); a config of today passes unchanged.
- Code written against 0.1 (`from yolo5l.loss import YOLOv5Loss`) gets a `ModuleNotFoundError` that names the module's
  place now (`MovedModuleFinder`, installed by `import yolo5l`). The public names (`from yolo5l import YOLOv5Loss`)
  did not move.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.util import find_spec
from typing import Any

__all__ = ["MOVED", "MovedModuleFinder", "current_target", "current_targets"]

#: module of yolo5l 0.1 -> its module now
MOVED = {
    "yolo5l.errors": "yolo5l.base.errors",
    "yolo5l.console": "yolo5l.base.console",
    "yolo5l.hardware": "yolo5l.base.hardware",
    "yolo5l.hostmem": "yolo5l.base.hostmem",
    "yolo5l.resolvers": "yolo5l.base.resolvers",
    "yolo5l.files": "yolo5l.base.files",
    "yolo5l.weights": "yolo5l.models.weights",
    "yolo5l.safe_pickle": "yolo5l.io.safe_pickle",
    "yolo5l.ultralytics_pt": "yolo5l.models.ultralytics_pt",
    "yolo5l.download": "yolo5l.io.download",
    "yolo5l.archive": "yolo5l.io.archive",
    "yolo5l.model_source": "yolo5l.models.model_source",
    "yolo5l.hyp_file": "yolo5l.io.hyp_file",
    "yolo5l.module": "yolo5l.training.module",
    "yolo5l.loss": "yolo5l.training.loss",
    "yolo5l.optim": "yolo5l.training.optim",
    "yolo5l.divergence": "yolo5l.training.divergence",
    "yolo5l.autoanchor": "yolo5l.training.autoanchor",
    "yolo5l.amp_check": "yolo5l.training.amp_check",
    "yolo5l.batch_search": "yolo5l.training.batch_search",
    "yolo5l.best_fitness": "yolo5l.eval.best_fitness",
    "yolo5l.boxes": "yolo5l.infer.boxes",
    "yolo5l.tta": "yolo5l.infer.tta",
    "yolo5l.annotate": "yolo5l.infer.annotate",
    "yolo5l.feature_maps": "yolo5l.infer.feature_maps",
    "yolo5l.predict_outputs": "yolo5l.infer.predict_outputs",
    "yolo5l.sources": "yolo5l.infer.sources",
    "yolo5l.metrics": "yolo5l.eval.metrics",
    "yolo5l.coco_map": "yolo5l.eval.coco_map",
    "yolo5l.per_class": "yolo5l.eval.per_class",
    "yolo5l.plots": "yolo5l.eval.plots",
    "yolo5l.label_plots": "yolo5l.eval.label_plots",
    "yolo5l.save_preds": "yolo5l.eval.save_preds",
    "yolo5l.exported": "yolo5l.deploy.exported",
    "yolo5l.loggers": "yolo5l.tracking.loggers",
    "yolo5l.tracking": "yolo5l.tracking.trackers",
    # moved within 0.2, when each folder became one floor (docs/design.md)
    "yolo5l.io.files": "yolo5l.base.files",
    "yolo5l.io.weights": "yolo5l.models.weights",
    "yolo5l.io.ultralytics_pt": "yolo5l.models.ultralytics_pt",
    "yolo5l.io.model_source": "yolo5l.models.model_source",
    "yolo5l.training.best_fitness": "yolo5l.eval.best_fitness",
    "yolo5l.training.final_val": "yolo5l.final_val",
    "yolo5l.tracking.search": "yolo5l.search",
}


def current_target(target: str) -> str:
    """`target` (a dotted `_target_`) with a 0.1 module's name replaced by today's; anything else unchanged.

    `yolo5l.tracking` was a module and is a package now: a name inside it that is one of the package's modules
    (`yolo5l.tracking.loggers.EpochCSVLogger`) is today's and stays.
    """
    for old, new in sorted(MOVED.items(), key=lambda item: -len(item[0])):  # the longest name first
        if target.startswith(old + "."):
            first = target[len(old) + 1 :].split(".")[0]
            if _exists(old) and _exists(f"{old}.{first}"):
                return target  # a module of today's package of that name
            return new + target[len(old) :]
    return target


def current_targets(config: Any) -> Any:
    """A copy of a saved config (nested dicts and lists) with every `_target_` named by `current_target`."""
    if isinstance(config, dict):
        return {
            k: current_target(v) if k == "_target_" and isinstance(v, str) else current_targets(v)
            for k, v in config.items()
        }
    if isinstance(config, list):
        return [current_targets(v) for v in config]
    return config


def _exists(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # a 0.1 name (`MovedModuleFinder`), or a parent that is not there
        return False


class MovedModuleFinder(MetaPathFinder):
    """The last finder on `sys.meta_path`: asked only for a module no other finder has, it answers a 0.1 module's
    name with a `ModuleNotFoundError` naming where the module is now."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: Any = None) -> None:
        new = MOVED.get(fullname)
        if new is not None:
            raise ModuleNotFoundError(f"No module named {fullname!r}: since yolo5l 0.2 it is {new!r}", name=fullname)
        return None
