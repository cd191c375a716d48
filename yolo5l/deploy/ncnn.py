"""ncnn: write a model folder through pnnx (PyTorch -> ncnn), and run it with ncnn's Python binding.

The folder (`<stem>_ncnn_model/`, as later ultralytics releases name it) holds `model.ncnn.param`,
`model.ncnn.bin` and `metadata.yaml` (names, stride, imgsz, ...). The graph is the TorchScript trace of the model and
its decode at one input size, converted by the `pnnx` tool that the `pnnx` package ships: input `in0` (3, H, W) RGB in
[0, 1], output `out0` (N, 5 + nc) with cx, cy, w, h in pixels. ncnn takes one image at a time.
"""

from __future__ import annotations

import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from yolo5l.base.errors import UserError
from yolo5l.deploy._io import atomic_folder, write_yaml
from yolo5l.deploy.formats import require_extra

__all__ = ["export_ncnn", "load_ncnn"]

PARAM, BIN, META = "model.ncnn.param", "model.ncnn.bin", "metadata.yaml"


def export_ncnn(net: nn.Module, folder: Path, meta: dict[str, Any], imgsz: int, half: bool = False) -> Path:
    """Convert `net` (images -> decoded boxes, fp32 on the CPU) to an ncnn model folder.

    Args:
        net: `yolo5l.exporter.DecodedYOLOv5`.
        folder: The folder to write.
        meta: The metadata, written as `metadata.yaml`.
        imgsz: The square input size.
        half: fp16 weights (pnnx's `fp16=1`).

    Returns:
        The folder.

    Raises:
        UserError: The `ncnn` extra missing, or pnnx failing (its last line).
    """
    pnnx, _ = require_extra("format=ncnn", "pnnx", "ncnn", extra="ncnn")
    example = torch.rand(1, 3, imgsz, imgsz, generator=torch.Generator().manual_seed(0))
    with atomic_folder(folder) as out, tempfile.TemporaryDirectory(dir=folder.parent) as work:
        traced = Path(work) / "model.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the trace's warnings (the stride check) and torch.jit's deprecation
            torch.jit.trace(net, example, strict=False, check_trace=False).save(str(traced))
        cmd = [
            pnnx.EXEC_PATH, str(traced), f"inputshape=[1,3,{imgsz},{imgsz}]", f"fp16={int(half)}",
            f"ncnnparam={out / PARAM}", f"ncnnbin={out / BIN}", f"ncnnpy={Path(work) / 'ncnn.py'}",
            f"pnnxparam={Path(work) / 'p.param'}", f"pnnxbin={Path(work) / 'p.bin'}",
            f"pnnxpy={Path(work) / 'p.py'}", f"pnnxonnx={Path(work) / 'p.onnx'}",
        ]  # fmt: skip
        r = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if r.returncode != 0 or not (out / PARAM).is_file():
            last = (r.stderr.strip() or r.stdout.strip() or f"exit code {r.returncode}").splitlines()[-1]
            raise UserError(f"format=ncnn: pnnx failed ({last})")
        write_yaml(out / META, meta)
    return folder


def load_ncnn(path: Path, device: torch.device) -> tuple[Callable[[Tensor], Tensor], dict[str, Any], dict]:
    """Load an ncnn model folder (or its `.param`; the `.bin` beside it).

    Returns:
        `(run, metadata, shape)`: `run(images)` -> (B, N, 5 + nc) float32 in pixels, one image at a time;
        `metadata.yaml`'s content; `shape` with batch 1 and the export's size.
    """
    import yaml

    (ncnn,) = require_extra(f"{path.name} (ncnn)", "ncnn", extra="ncnn")
    folder = path.parent if path.is_file() else path
    param = path if path.is_file() else folder / PARAM
    if not param.is_file():
        found = sorted(folder.glob("*.param"))
        if not found:
            raise UserError(f"{path}: no ncnn .param in this folder (export with format=ncnn)")
        param = found[0]
    weights = param.with_name(param.name.removesuffix(".param") + ".bin")
    meta_file = folder / META
    meta = yaml.safe_load(meta_file.read_text()) if meta_file.is_file() else {}
    net = ncnn.Net()
    net.opt.num_threads = max(1, torch.get_num_threads())
    # fp32 arithmetic: ncnn stores and computes in fp16 / bf16 where the CPU has them unless told not to.
    for flag in ("use_fp16_packed", "use_fp16_storage", "use_fp16_arithmetic", "use_bf16_storage"):
        if hasattr(net.opt, flag):
            setattr(net.opt, flag, False)
    if net.load_param(str(param)) != 0 or net.load_model(str(weights)) != 0:
        raise UserError(f"{param}: ncnn cannot load it (or its .bin)")
    imgsz = meta.get("imgsz")
    size = (int(imgsz), int(imgsz)) if imgsz else None

    def run(images: Tensor) -> Tensor:
        x = images.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        outs = []
        for im in x:
            with net.create_extractor() as ex:
                ex.input("in0", ncnn.Mat(np.ascontiguousarray(im)).clone())
                _, y = ex.extract("out0")
                outs.append(np.array(y, dtype=np.float32))
        return torch.from_numpy(np.stack(outs)).to(images.device)

    run.net = net  # type: ignore[attr-defined]  # kept alive with the function
    return run, meta, {"batch": 1, "size": size}
