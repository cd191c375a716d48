"""``data.image_weights=true``: each epoch draws its training images by weight, favouring the classes that are rare in
the labels and badly detected at the last validation (ultralytics/yolov5 v7.0 ``train.py --image-weights``).

v7.0's definitions, for ``nc`` classes, training labels ``labels`` and ``maps`` the per-class mAP@0.5:0.95 of the last
validation (zeros before the first one):

- class weights ``class_weights = nc * labels_to_class_weights(labels, nc)``: the inverse of each class's label count
  (a class without labels counts 1), normalised to sum 1, as float32 (``utils/general.py::labels_to_class_weights``);
- per epoch ``cw = class_weights * (1 - maps) ** 2 / nc`` and an image's weight is the sum of ``cw`` over its labels
  (``utils/general.py::labels_to_image_weights``): an image without labels is never drawn;
- ``maps[c]`` is class c's AP where the validation had labels of c, else the mean over those classes (``val.py``).

:class:`ImageWeights` keeps the label-side arrays and the ``maps`` in force; the sampler asks it for the weights when
an epoch starts (:meth:`yolo5l.data.samplers.ShardSampler.set_image_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ImageWeights", "class_maps", "class_weights", "image_weights"]


def class_weights(labels: Sequence[np.ndarray], nc: int) -> np.ndarray:
    """v7.0's ``labels_to_class_weights(labels, nc) * nc``: (nc,) float32, summing to nc.

    Args:
        labels: per image, (n, 5+) labels with the class in column 0.
        nc: number of classes.
    """
    classes = np.concatenate([np.asarray(lb)[:, 0] for lb in labels]).astype(np.int64) if len(labels) else []
    counts = np.bincount(np.asarray(classes, dtype=np.int64), minlength=nc).astype(np.float64)
    counts[counts == 0] = 1  # a class without labels counts once
    weights = 1 / counts
    weights /= weights.sum()
    return weights.astype(np.float32) * np.float32(nc)


def image_weights(labels: Sequence[np.ndarray], nc: int, cw: np.ndarray) -> np.ndarray:
    """v7.0's ``labels_to_image_weights``: (n,) the sum of ``cw[class]`` over each image's labels."""
    sizes = np.array([len(lb) for lb in labels], dtype=np.int64)
    classes = np.concatenate([np.asarray(lb)[:, 0] for lb in labels]).astype(np.int64) if sizes.sum() else []
    owner = np.repeat(np.arange(len(labels)), sizes)
    return np.bincount(owner, weights=np.asarray(cw, dtype=np.float64)[classes], minlength=len(labels))


def class_maps(classes: np.ndarray, ap: np.ndarray, nc: int) -> np.ndarray:
    """v7.0's ``maps`` from a validation: (nc,) ``ap[i]`` for class ``classes[i]``, the mean of ``ap`` elsewhere.

    Args:
        classes: (K,) the classes the validation had labels of (`PerClassResults.classes`).
        ap: (K,) their mAP@0.5:0.95 (`PerClassResults.map`).
        nc: number of classes.
    """
    ap = np.asarray(ap, dtype=np.float64)
    maps = np.full(nc, ap.mean() if ap.size else 0.0)
    maps[np.asarray(classes, dtype=np.int64)] = ap
    return maps


class ImageWeights:
    """The weights of one training set's images, given the per-class mAPs of the last validation.

    Args:
        labels: per image, (n, 5) labels [class, x, y, w, h] (single_cls already applied).
        nc: number of classes.
    """

    def __init__(self, labels: Sequence[np.ndarray], nc: int) -> None:
        self.labels = labels
        self.nc = int(nc)
        self.class_weights = class_weights(labels, self.nc)
        self.maps = np.zeros(self.nc)  # v7.0 starts from zeros: until the first validation, only the counts count

    def update_maps(self, maps: np.ndarray | None) -> None:
        """Take the per-class mAPs of a newer validation (None: keep the current ones)."""
        if maps is not None:
            self.maps = np.asarray(maps, dtype=np.float64).reshape(self.nc).copy()

    def __call__(self) -> np.ndarray:
        """(n,) every image's weight for an epoch that starts now."""
        cw = self.class_weights * (1 - self.maps) ** 2 / self.nc
        return image_weights(self.labels, self.nc, cw)

    def state_dict(self) -> dict[str, Any]:
        """The maps in force (a resumed run draws its next epoch with them)."""
        return {"image_weights_maps": self.maps.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (absent: keep the current maps)."""
        if "image_weights_maps" in state:
            self.update_maps(np.asarray(state["image_weights_maps"], dtype=np.float64))
