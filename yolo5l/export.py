"""Export weights for deployment: `python -m yolo5l.export weights=<weights.pt|yolov5s.pt> [format=onnx|torchscript]`.

The file holds the Conv+BN-fused model and its decode: input `images` (B, 3, H, W) RGB in [0, 1], output `output0`
(B, N, 5 + nc) with cx, cy, w, h in input pixels, objectness and class scores, the layout of ultralytics/yolov5
v7.0 `export.py` (`export_onnx`, `export_torchscript`: Detect in export mode), so code written for those files reads
these. Class names, stride and image size are in the file: ONNX `metadata_props` (`names` as a JSON list, `stride`,
`imgsz`, ...), TorchScript `config.txt` (JSON). The file is written beside the weights (`<stem>.onnx`,
`<stem>.torchscript`) unless `output=` says where, then run on the example input (onnxruntime, `torch.jit.load`)
and compared with PyTorch in one printed line. `yolo5l.exported.load_exported` runs it again; `python -m yolo5l.val`
and `python -m yolo5l.predict` take it as `weights=`.

ONNX needs the `export` extra (`pip install -e ".[export]"`: onnx, onnxruntime).
"""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from yolo5l._cli import guarded, info, print_outputs, relpath, resume_gc, run_entry_point, unfreeze_start_up
from yolo5l.config import check_export_config
from yolo5l.divergence import first_non_finite
from yolo5l.errors import UserError
from yolo5l.exported import load_exported, require_extra
from yolo5l.models.common import Conv
from yolo5l.models.yolo import YOLOv5

__all__ = ["DecodedYOLOv5", "export_model", "export_weights", "prepare_for_export"]

_DEFAULT_IMGSZ = 640
INPUT_NAME, OUTPUT_NAME = "images", "output0"  # ultralytics v7.0 export_onnx's names


class DecodedYOLOv5(nn.Module):
    """`YOLOv5` and its decode as one module, what an exported file computes: images -> (B, N, 5 + nc) in pixels.

    Args:
        model: The detector, prepared with :func:`prepare_for_export`.
    """

    def __init__(self, model: YOLOv5) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        return self.model.decode(self.model(images))


def prepare_for_export(model: YOLOv5) -> YOLOv5:
    """Fuse Conv+BN, switch to eval mode, and take the training-only kernels out of the graph (in place).

    `fused_bn_act` (the `torch.ops.yolo5l.bn_silu_*` custom operators) runs only for a BatchNorm in training, and
    `fused_upsample` (`yolo5l_kernels.upsample`, Triton on CUDA) is an autograd function: neither has an ONNX form
    nor belongs in a TorchScript file, so both are switched off and the upsamples become `nn.Upsample`, which
    computes the same nearest 2x.

    Returns:
        `model`.
    """
    model.eval().requires_grad_(False).fuse()
    model.fused_bn_act = model.fused_upsample = False
    for m in model.modules():
        if isinstance(m, Conv):
            m.fused_bn_act = False
    model.plain_upsample()
    # A grid cached by an earlier forward would enter the trace as a constant of that size (and break dynamic axes);
    # built during the trace, it is recorded as arange ops on the input's size.
    model.detect._grids.clear()
    return model


def _check_half(half: bool, device: torch.device) -> None:
    # ultralytics v7.0 export.py refuses --half off the GPU too: fp16 convolutions are for CUDA devices.
    if half and device.type != "cuda":
        raise UserError(f"half=true needs a CUDA device (device=cuda), not {device}: drop half=true to export fp32")


def _metadata(
    names: list[str], stride: int, imgsz: int, batch: int, dynamic: bool, half: bool, device: torch.device
) -> dict[str, Any]:
    return {
        "names": names,
        "stride": stride,
        "imgsz": imgsz,
        "batch": batch,
        "dynamic": dynamic,
        "half": half,
        "device": device.type,  # where it was traced: TorchScript keeps the device of the decode's grids
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
        "layout": "images (B, 3, H, W) RGB 0-1 -> (B, N, 5 + nc): cx, cy, w, h (pixels), objectness, class scores",
        "producer": "yolo5l",
    }


def _export_onnx(net: nn.Module, example: Tensor, opset: int, dynamic: bool, simplify: bool, meta: dict) -> bytes:
    onnx, _ = require_extra("format=onnx", "onnx", "onnxruntime")
    # ultralytics v7.0 export_onnx: dynamic axes are batch, height and width of `images`, batch and anchors of
    # `output0`; constant folding on.
    axes = {INPUT_NAME: {0: "batch", 2: "height", 3: "width"}, OUTPUT_NAME: {0: "batch", 1: "anchors"}}
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # The TorchScript-based exporter (dynamo=False): it needs no onnxscript and traces the decode's sizes;
        # its warnings are about the trace (the stride check in YOLOv5.forward) and its own deprecation.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net, (example,), buffer, opset_version=opset, dynamo=False, do_constant_folding=True,
            input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], dynamic_axes=axes if dynamic else None,
        )  # fmt: skip
    proto = onnx.load_from_string(buffer.getvalue())
    if simplify:
        try:
            import onnxsim
        except ImportError:
            raise UserError("simplify=true needs onnx-simplifier: pip install onnxsim") from None
        proto, ok = onnxsim.simplify(proto)
        if not ok:
            raise UserError("onnx-simplifier could not check its result: export with simplify=false")
    for key, value in meta.items():
        prop = proto.metadata_props.add()
        prop.key, prop.value = key, value if isinstance(value, str) else json.dumps(value)
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def _export_torchscript(net: nn.Module, example: Tensor, meta: dict) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        # check_trace=False: it would trace a second time to compare; the file is compared with PyTorch after it is
        # written instead.
        traced = torch.jit.trace(net, example, strict=False, check_trace=False)
        buffer = io.BytesIO()
        # ultralytics v7.0 export_torchscript: the metadata as JSON in the archive's extra file config.txt.
        torch.jit.save(traced, buffer, _extra_files={"config.txt": json.dumps({**meta, "shape": list(example.shape)})})
    return buffer.getvalue()


def _write(data: bytes, path: Path) -> None:
    # A temporary file then a rename: an interrupted export never leaves half a file under the final name.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@torch.no_grad()
def export_model(
    model: YOLOv5,
    path: str | os.PathLike[str],
    fmt: str = "onnx",
    names: list[str] | None = None,
    imgsz: int = _DEFAULT_IMGSZ,
    batch: int = 1,
    dynamic: bool = False,
    half: bool = False,
    device: str | torch.device = "cpu",
    opset: int = 17,
    simplify: bool = False,
) -> tuple[Path, float]:
    """Export `model` (fused and prepared here, in place) and check the file against PyTorch.

    Args:
        model: The detector.
        path: The file to write.
        fmt: `onnx` or `torchscript`.
        names: Class names (default `"0"`, `"1"`, ...).
        imgsz: Square size of the example input.
        batch: Batch of the example input.
        dynamic: ONNX: dynamic batch, height and width (TorchScript's trace takes any size either way).
        half: fp16 (CUDA only).
        device: Where the model is traced (and where the file is checked).
        opset: ONNX opset.
        simplify: ONNX: run onnx-simplifier.

    Returns:
        `(path, largest absolute difference between the file's output and PyTorch's on the example input)`.

    Raises:
        UserError: fp16 off CUDA, or the export extra missing.
        ValueError: An unknown format.
    """
    if fmt not in ("onnx", "torchscript"):
        raise ValueError(f"fmt must be onnx or torchscript, got {fmt!r}")
    device = torch.device(device)
    _check_half(half, device)
    names = [str(i) for i in range(model.num_classes)] if names is None else [str(n) for n in names]
    if fmt == "onnx":
        require_extra("format=onnx", "onnx", "onnxruntime")  # before the work, not after it
    net = DecodedYOLOv5(prepare_for_export(model)).to(device)
    dtype = torch.float16 if half else torch.float32
    net = net.to(dtype)
    bad = first_non_finite(net.state_dict().items())
    if bad is not None:  # an exported file never holds NaN or inf (weights beyond fp16's range turn inf in half)
        why = "in fp16: export in fp32 (drop half=true)" if half else "(a diverged run?)"
        raise UserError(f"not exporting {os.fspath(path)}: {bad} holds NaN or inf {why}")
    # Not ultralytics' zeros: random pixels make the check below compare every output, not mostly constant ones.
    example = torch.rand(batch, 3, imgsz, imgsz, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    expected = net(example).float()
    meta = _metadata(names, int(model.stride.max()), imgsz, batch, dynamic or fmt == "torchscript", half, device)
    if fmt == "onnx":
        data = _export_onnx(net, example, opset, dynamic, simplify, meta)
    else:
        data = _export_torchscript(net, example, meta)
    path = Path(path)
    _write(data, path)
    model.detect._grids.clear()  # the eager run above cached grids; leave the model as prepare_for_export did
    exported, *_ = load_exported(path, device)
    diff = float((exported(example).to(expected.device) - expected).abs().max())
    return path, diff


def export_weights(cfg: DictConfig) -> Path:
    """Export as `cfg` (conf/export.yaml) says; returns the file written."""
    from yolo5l.download import weights_url
    from yolo5l.hardware import inference_device
    from yolo5l.model_source import check_stride
    from yolo5l.weights import load_weights, resolve_weights

    check_export_config(cfg)
    fmt = str(cfg.format)
    device = inference_device(str(cfg.device))
    _check_half(bool(cfg.half), device)  # before the weights load
    if fmt == "onnx":
        require_extra("format=onnx", "onnx", "onnxruntime")
    weights = resolve_weights(str(cfg.weights))  # a URL or a release name (yolov5s.pt) is downloaded once
    # Beside the weights; a downloaded file's export goes to the current folder, not into the download cache.
    folder = weights.parent if weights_url(str(cfg.weights)) is None else Path.cwd()
    output = Path(str(cfg.output)) if cfg.output else folder / f"{weights.stem}.{fmt}"
    if output.absolute() == weights.absolute():
        raise UserError(f"output={output} would overwrite the weights: pass another output=")
    try:
        model, load_info = load_weights(weights)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    # The training size where the weights file records one; else YOLOv5's 640.
    imgsz = int(cfg.imgsz or getattr(load_info, "imgsz", None) or _DEFAULT_IMGSZ)
    check_stride(model, imgsz, "imgsz")
    resume_gc()  # set-up is built (the command line paused the collector for it); tracing makes cyclic garbage
    path, diff = export_model(
        model, output, fmt, names=list(load_info.names), imgsz=imgsz, batch=int(cfg.batch), dynamic=bool(cfg.dynamic),
        half=bool(cfg.half), device=device, opset=int(cfg.opset), simplify=bool(cfg.simplify),
    )  # fmt: skip
    unfreeze_start_up()
    runtime = "onnxruntime" if fmt == "onnx" else "torch.jit"
    shape = f"({int(cfg.batch)}, 3, {imgsz}, {imgsz}) {'fp16' if cfg.half else 'fp32'}"
    info(f"{runtime} vs PyTorch on the example input {shape}: max abs difference {diff:.3g}")
    print_outputs("Outputs:", {fmt: f"{relpath(path)} ({path.stat().st_size / 1e6:.1f} MB)"})
    return path


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="export")
@guarded
def _hydra_main(cfg: DictConfig) -> None:
    export_weights(cfg)


def main() -> None:
    """Console entry point (`python -m yolo5l.export`, `yolo5l-export`)."""
    run_entry_point(_hydra_main, "export")


if __name__ == "__main__":
    main()
