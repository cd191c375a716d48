"""CoreML: write an `.mlpackage` (ML program) with class names and image size in its metadata; check one on Linux.

The model takes an image input `image` (RGB, scaled by 1/255 inside, as ultralytics/yolov5 v7.0
`export.py::export_coreml` declares it) and gives `output0` (1, N, 5 + nc) in pixels, the decoded layout. With
`nms=true` it is a pipeline: the detector gives `confidence` (N, nc) and `coordinates` (N, 4: cx, cy, w, h as
fractions of the image), then Core ML's NonMaximumSuppression model keeps the best boxes, the outputs that Apple's
Vision framework reads for object detection. coremltools converts on Linux but cannot run a model there, so the
export's self-check is skipped; :func:`describe_coreml` reads what a package declares.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from yolo5l.base.console import library_output
from yolo5l.deploy._io import atomic_folder
from yolo5l.deploy.formats import LIBRARY_NOISE, require_extra

__all__ = ["CoreMLHead", "describe_coreml", "export_coreml"]


class CoreMLHead(nn.Module):
    """Decoded boxes -> (confidence (N, nc), coordinates (N, 4) as fractions), the NMS model's inputs (batch 1)."""

    def __init__(self, net: nn.Module, imgsz: int) -> None:
        super().__init__()
        self.net, self.imgsz = net, float(imgsz)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        y = self.net(images)[0]  # (N, 5 + nc)
        return y[:, 5:] * y[:, 4:5], y[:, :4] / self.imgsz


def _convert(ct: Any, module: nn.Module, example: Tensor, outputs: list[str], half: bool) -> Any:
    # torch.export (not a TorchScript trace): Python-level shape checks run at export, not as graph ops.
    program = torch.export.export(module.eval(), (example,)).run_decompositions({})
    image = ct.ImageType(name="image", shape=tuple(example.shape), scale=1 / 255, bias=[0, 0, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # coremltools warns about untested torch versions
        return ct.convert(
            program, inputs=[image], outputs=[ct.TensorType(name=n) for n in outputs], convert_to="mlprogram",
            compute_precision=ct.precision.FLOAT16 if half else ct.precision.FLOAT32,
        )  # fmt: skip


def _nms_model(ct: Any, detector: Any, nc: int, names: list[str], opt: Any) -> Any:
    """Core ML's NonMaximumSuppression model after the detector (the Vision framework's detection outputs)."""
    spec = detector.get_spec()
    conf_out, coord_out = spec.description.output
    nms = ct.proto.Model_pb2.Model()
    nms.specificationVersion = spec.specificationVersion
    for i, src in enumerate((conf_out, coord_out)):
        for desc in (nms.description.input.add(), nms.description.output.add()):
            desc.ParseFromString(src.SerializeToString())
            desc.type.multiArrayType.shape[:] = []
            shape = desc.type.multiArrayType.shapeRange.sizeRanges
            shape.add(lowerBound=0, upperBound=-1)
            shape.add(lowerBound=nc if i == 0 else 4, upperBound=nc if i == 0 else 4)
            desc.type.multiArrayType.dataType = ct.proto.FeatureTypes_pb2.ArrayFeatureType.DOUBLE
    p = nms.nonMaximumSuppression
    p.confidenceInputFeatureName, p.coordinatesInputFeatureName = conf_out.name, coord_out.name
    p.confidenceOutputFeatureName, p.coordinatesOutputFeatureName = "confidence", "coordinates"
    nms.description.output[0].name, nms.description.output[1].name = "confidence", "coordinates"
    p.iouThresholdInputFeatureName, p.confidenceThresholdInputFeatureName = "iouThreshold", "confidenceThreshold"
    for name, default in (("iouThreshold", opt.iou_thres), ("confidenceThreshold", opt.conf_thres)):
        desc = nms.description.input.add()
        desc.name = name
        desc.type.doubleType.SetInParent()
        desc.type.isOptional = True
        setattr(p, name, default)
    p.pickTop.perClass = not opt.agnostic_nms  # agnostic: boxes of any classes suppress each other
    p.stringClassLabels.vector.extend(names)
    return ct.models.MLModel(nms)


def export_coreml(net: nn.Module, path: Path, meta: dict[str, Any], example: Tensor, opt: Any) -> Path:
    """Write `path` (`.mlpackage`).

    Args:
        net: Images -> (B, N, 5 + nc) decoded boxes (`yolo5l.exporter.DecodedYOLOv5`), fp32 on the CPU.
        path: The package folder.
        meta: The metadata: names, stride, imgsz, task, ... go to the model's user-defined metadata (JSON strings).
        example: The example input (1, 3, H, W).
        opt: `yolo5l.exporter.ExportOptions` (half: fp16 compute; int8: 8-bit weights; nms: the NMS pipeline,
            class-agnostic with agnostic_nms).

    Returns:
        `path`.
    """
    (ct,) = require_extra("format=coreml", "coremltools", extra="coreml")
    example = example[:1]
    names = list(meta["names"])
    # coremltools logs every op it converts and draws a bar per pass: library_output keeps its warnings only.
    with library_output(ignore=LIBRARY_NOISE["coremltools"]):
        if opt.nms:
            head = CoreMLHead(net, opt.imgsz)
            detector = _convert(ct, head, example, ["raw_confidence", "raw_coordinates"], opt.half)
        else:
            detector = _convert(ct, net, example, ["output0"], opt.half)
        if opt.int8:  # 8-bit weights (v7.0 quantizes weights with k-means; linear here, which runs everywhere)
            from coremltools.optimize.coreml import (
                OpLinearQuantizerConfig,
                OptimizationConfig,
                linear_quantize_weights,
            )

            config = OptimizationConfig(global_config=OpLinearQuantizerConfig(mode="linear_symmetric"))
            detector = linear_quantize_weights(detector, config)
        nms = _nms_model(ct, detector, len(names), names, opt) if opt.nms else None
        model = ct.utils.make_pipeline(detector, nms) if nms is not None else detector
        _describe(model, meta)
        with atomic_folder(path) as out:
            target = out / path.name
            model.save(str(target))
            _flatten(target, out)
    return path


def _flatten(package: Path, out: Path) -> None:
    """Move the saved package's content up into the atomic folder (which becomes `path`)."""
    for item in package.iterdir():
        item.rename(out / item.name)
    package.rmdir()


def _describe(model: Any, meta: dict[str, Any]) -> None:
    model.short_description = f"yolo5l YOLOv5 detector, {len(meta['names'])} classes, {meta['imgsz']} px"
    model.author = "yolo5l"
    for key, value in meta.items():
        model.user_defined_metadata[key] = value if isinstance(value, str) else json.dumps(value)


def describe_coreml(path: Path) -> dict[str, Any]:
    """What a CoreML package declares (readable on Linux): its inputs and outputs (name -> type text), its
    user-defined metadata (JSON values decoded) and whether it is a pipeline.

    Returns:
        `{"inputs": {...}, "outputs": {...}, "metadata": {...}, "pipeline": bool, "spec": the Model proto}`.
    """
    (ct,) = require_extra(f"{path.name} (CoreML)", "coremltools", extra="coreml")
    spec = ct.utils.load_spec(str(path))
    meta = {}
    for key, value in spec.description.metadata.userDefined.items():
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError:
            meta[key] = value
    return {
        "inputs": {i.name: i.type.WhichOneof("Type") for i in spec.description.input},
        "outputs": {o.name: o.type.WhichOneof("Type") for o in spec.description.output},
        "metadata": meta,
        "pipeline": spec.WhichOneof("Type") in ("pipeline", "pipelineRegressor", "pipelineClassifier"),
        "spec": spec,
    }
