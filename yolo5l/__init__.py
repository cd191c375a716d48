"""yolo5l: retrain YOLOv5 detectors faster, on PyTorch Lightning and Hydra.

The public API is imported lazily so that `import yolo5l` stays cheap (start-up time is a feature).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

#: The dependencies' own network calls, switched off before any of them is imported (every entry point and
#: `import yolo5l` pass here first; DataLoader workers and DDP ranks inherit the environment): albumentations'
#: version check at import, MLflow's usage telemetry. A value the user set is kept. yolo5l itself downloads only what
#: a command names (a dataset preset or `download:` list, release weights, a URL).
OFFLINE_ENV = {"NO_ALBUMENTATIONS_UPDATE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

if not any(type(f).__name__ == "MovedModuleFinder" for f in sys.meta_path):  # once, however often this runs
    from yolo5l.io.old_targets import MovedModuleFinder

    sys.meta_path.append(MovedModuleFinder())  # `import yolo5l.loss`: one line naming `yolo5l.training.loss`

_EXPORTS = {
    "YOLOv5": "yolo5l.models.yolo",
    "YOLOv5Loss": "yolo5l.training.loss",
    "YOLODataModule": "yolo5l.data.datamodule",
    "YOLOv5Module": "yolo5l.training.module",
    "compose_config": "yolo5l.config",
    "load_ultralytics": "yolo5l.models.weights",
}

__all__ = [
    "YOLODataModule",
    "YOLOv5",
    "YOLOv5Loss",
    "YOLOv5Module",
    "__version__",
    "compose_config",
    "load_ultralytics",
]

if TYPE_CHECKING:  # pragma: no cover
    from yolo5l.config import compose_config
    from yolo5l.data.datamodule import YOLODataModule
    from yolo5l.models.weights import load_ultralytics
    from yolo5l.models.yolo import YOLOv5
    from yolo5l.training.loss import YOLOv5Loss
    from yolo5l.training.module import YOLOv5Module


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'yolo5l' has no attribute {name!r}")
