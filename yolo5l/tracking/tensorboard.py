"""`TensorBoardLogger`: Lightning's TensorBoard logger, whose `log_graph=True` adds the detector's graph, as YOLOv5's
TensorBoard logging does, without touching the model in training, and whose scalars are the fit's.

Reference: ultralytics/yolov5 v7.0 `utils/loggers/__init__.py::log_tensorboard_graph` (a trace of the model on one
zero image of the training size, after the first batch).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger as _LightningTensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from yolo5l.base.console import warn
from yolo5l.tracking.loggers import fitting

__all__ = ["TensorBoardLogger"]

#: The image side traced when the data module does not say (YOLOv5's default training size).
DEFAULT_IMGSZ = 640


class TensorBoardLogger(_LightningTensorBoardLogger):
    """Lightning's `TensorBoardLogger`; with `log_graph=True` the Graphs tab shows the detector.

    Lightning calls `log_graph` as fitting starts (before the sanity check), on global rank 0 only; the graph is
    written at the logger's first call. Lightning's own traces the LightningModule on the training device with its
    `example_input_array`; this one traces a CPU copy of the detector (`pl_module.model`) in eval mode on a zero
    image of the data module's `imgsz`, so the weights, batch-norm statistics, random state and device of the model
    in training are untouched, and nothing runs after the start (about 3 s for yolov5s at 640 on one CPU core).
    A trace that fails costs one warning line; training goes on without the graph.
    A LightningModule without a `model` detector gets Lightning's own `log_graph`.

    Scalars are written while the trainer fits only (`yolo5l.tracking.loggers.fitting`, read as `log_graph` is
    called): a `trainer.validate` or `trainer.test` of the same trainer trained no epoch, so its metrics (returned by
    the call) add no point to the training curves, and after a fit, whose end closes the writer, they open no second
    event file.
    """

    #: Whether the graph was written (or tried): Lightning calls `log_graph` at each fit, validate and test.
    _graph_done = False
    #: Whether scalars are written: False while the trainer validates or tests outside fit.
    _recording = True

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._recording:
            super().log_metrics(metrics, step)

    @override
    @rank_zero_only
    def log_graph(self, model: Any, input_array: Tensor | None = None) -> None:  # type: ignore[override]
        self._recording = fitting(model)  # Lightning calls it as each fit, validate and test starts
        net = getattr(model, "model", None)
        if not self._log_graph or not isinstance(net, nn.Module):
            super().log_graph(model, input_array)
            return
        if self._graph_done:
            return
        self._graph_done = True
        try:
            clone, image = _traceable(net, model, input_array)
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")  # the tracer's warnings about Python values in forward
                # Traced here rather than by add_graph, which prints a failure's message before raising it.
                traced = torch.jit.trace(clone, image, strict=False, check_trace=False)  # a picture: one run, not three
                self.experiment.add_graph(traced, [])  # a traced module is kept as it is
        except Exception as e:  # the graph is a picture: a model that does not trace still trains
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            warn(f"TensorBoard: no model graph ({type(e).__name__}{': ' + first if first else ''}); training goes on")


def _traceable(net: nn.Module, module: Any, input_array: Tensor | None) -> tuple[nn.Module, Tensor]:
    """A float32 eval-mode CPU copy of `net` (a compiled model's original) and the zero image to trace it on."""
    net = getattr(net, "_orig_mod", net)  # torch.compile's wrapper: trace the module it compiled
    if input_array is None:
        datamodule = getattr(getattr(module, "trainer", None), "datamodule", None)
        imgsz = getattr(datamodule, "imgsz", None) or DEFAULT_IMGSZ
        h, w = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
        input_array = torch.zeros(1, 3, int(h), int(w))  # zeros, as YOLOv5 traces (an empty tensor can hold NaN)
    clone = copy.deepcopy(net).to("cpu", torch.float32).eval()
    return clone, input_array.detach().to("cpu", torch.float32)
