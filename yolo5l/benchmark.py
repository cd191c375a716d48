"""Formats benchmark: `python -m yolo5l.benchmark weights=best.pt [data=...|data.file=...] [int8=true]`.

As ultralytics/yolov5 v7.0 `utils/benchmarks.py` does: the weights are exported to each format of `formats`, each
file is validated on the data's val split (`python -m yolo5l.val`'s code, one run folder per format under this run's)
and timed on single images; a format that cannot be written or run here gets its one-line reason instead. The table
(format, file size, mAP@0.5:0.95, mAP@0.5, ms per image, ok or the reason) is printed and written as
`benchmark.csv` in the run folder.
"""

from __future__ import annotations

import csv
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from yolo5l._cli import guarded, one_console_line_per_log, run_entry_point
from yolo5l.base.console import info, print_outputs
from yolo5l.base.errors import UserError, shown_path
from yolo5l.base.files import atomic_open
from yolo5l.base.hardware import with_command_threads

__all__ = ["Row", "benchmark", "benchmark_formats", "format_table"]

_QUANTIZING = ("openvino", "tflite")
# The benchmark's own keys: not passed on to the validation runs.
_OWN_KEYS = ("formats", "int8", "timing_runs", "device")


@dataclass
class Row:
    """One line of the table."""

    format: str
    file: str = ""
    size_mb: float | None = None
    map: float | None = None
    map_50: float | None = None
    ms_per_image: float | None = None
    status: str = "ok"


def _size(path: Path) -> float:
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files) / 1e6


def _time(run: Any, imgsz: int, runs: int) -> float:
    """Median milliseconds of `run` on one (1, 3, imgsz, imgsz) image, after two warm-up runs."""
    x = torch.rand(1, 3, imgsz, imgsz, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(2):
            run(x)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _val_overrides() -> list[str]:
    """The command line's overrides for the validation runs; the .pt is scored in fp32 (not the CPU's bf16 autocast)
    unless `trainer.precision=` says otherwise, as the exported files run and as v7.0's benchmark validates it."""
    task = HydraConfig.get().overrides.task
    keys = [o.split("=", 1)[0].lstrip("+~") for o in task]
    own = [o for o, k in zip(task, keys, strict=True) if k not in (*_OWN_KEYS, "weights")]
    return own if "trainer.precision" in keys else ["trainer.precision=32", *own]


def _calibration(cfg: DictConfig, imgsz: int) -> Any:
    """int8 calibration inputs from the data's train images (the data yaml, or the synthetic set's)."""
    from yolo5l.deploy.calibration import calibration_files, calibration_images

    data = cfg.data.get("file") or Path(str(cfg.data.synthetic.root)) / "data.yaml"
    return calibration_images(calibration_files(data), imgsz)


def _one(
    name: str, cfg: DictConfig, overrides: list[str], weights: Path, out: Path, imgsz: int, calibration: Any
) -> Row:
    from yolo5l.config import compose_config
    from yolo5l.deploy.exported import load_exported
    from yolo5l.deploy.formats import output_path
    from yolo5l.exporter import ExportOptions, export_model
    from yolo5l.models.weights import load_weights
    from yolo5l.validation import validate_weights

    fmt, _, precision = name.partition("-")
    row = Row(name)
    try:
        device = torch.device(str(cfg.device))
        if fmt == "pytorch":
            path = weights
            from yolo5l.exporter import DecodedYOLOv5, prepare_for_export

            net = DecodedYOLOv5(prepare_for_export(load_weights(weights)[0])).to(device)
        else:
            model, loaded = load_weights(weights)
            path = output_path(out / "files", weights.stem, fmt, int8=precision == "int8")
            opt = ExportOptions(imgsz=imgsz, dynamic=fmt in ("onnx", "openvino"), int8=precision == "int8",
                                calibration=calibration if precision == "int8" else None)  # fmt: skip
            path, _ = export_model(model, path, fmt, names=list(loaded.names), device=device, options=opt,
                                  data=loaded.data)  # fmt: skip
            net = load_exported(path, device)[0]
        row.file, row.size_mb = shown_path(path), round(_size(path), 2)
        GlobalHydra.instance().clear()  # this run's Hydra is set up; the validation composes its own config
        val_cfg = compose_config([*overrides, f"weights={path}", f"data.imgsz={imgsz}"], "val", out / name)
        metrics = validate_weights(val_cfg)
        row.map, row.map_50 = round(metrics["val/map"], 4), round(metrics["val/map_50"], 4)
        row.ms_per_image = round(_time(net, imgsz, int(cfg.timing_runs)), 2)
    except UserError as e:
        row.status = str(e).splitlines()[0]
    return row


def benchmark_formats(value: Any) -> list[str]:
    """The formats of `formats=`: one name (`formats=onnx`, the same as `formats=[onnx]`) or a list
    (`formats=[pytorch,onnx]`); lower-cased, in order, each once.

    Raises:
        UserError: No format; text with commas (`formats='onnx,openvino'`: the list form is named); a name that is
            neither `pytorch` nor an export format.
    """
    from yolo5l.deploy.formats import FORMATS

    if isinstance(value, str):
        if "," in value:
            listed = ",".join(v.strip() for v in value.split(",") if v.strip())
            raise UserError(f"formats={value!r}: several formats are written as a list: formats=[{listed}]")
        items = [value]
    else:
        items = [] if value is None else [str(v) for v in value]
    names = [name.strip().lower() for name in items if name.strip()]
    if not names:
        raise UserError(f"formats={value!r} names no format: pass formats=onnx, or several as formats=[pytorch,onnx]")
    unknown = [name for name in names if name != "pytorch" and name not in FORMATS]
    if unknown:
        raise UserError(f"formats: {', '.join(unknown)} not one of pytorch, {', '.join(FORMATS)}")
    return list(dict.fromkeys(names))


@with_command_threads(lambda cfg: str(cfg.device))
def benchmark(cfg: DictConfig) -> list[Row]:
    """Export, validate and time each format of `cfg.formats` (conf/benchmark.yaml); returns the table's rows.

    On the CPU every format runs at the intra-op thread count picked once at the start, from the cores free then
    (`yolo5l.base.hardware.command_threads`): the validations inside keep it.
    """
    from yolo5l.models.weights import load_weights, resolve_weights

    out = Path(HydraConfig.get().runtime.output_dir)
    names = benchmark_formats(cfg.formats)
    weights = resolve_weights(str(cfg.weights))
    try:
        _, loaded = load_weights(weights)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    imgsz = int(cfg.data.get("imgsz") or getattr(loaded, "imgsz", None) or 640)
    if cfg.int8:
        names += [f"{f}-int8" for f in names if f in _QUANTIZING]
    overrides = _val_overrides()  # read before the validation runs install their own Hydra config
    rows, calibration = [], None
    for name in names:
        info(f"benchmark: {name}")
        if name.endswith("-int8") and calibration is None:
            calibration = _calibration(cfg, imgsz)
        rows.append(_one(name, cfg, overrides, weights, out, imgsz, calibration))
    with atomic_open(out / "benchmark.csv", "w") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    print("\n" + format_table(rows, imgsz))
    print_outputs("Outputs:", {"table": shown_path(out / "benchmark.csv")})
    return rows


def format_table(rows: list[Row], imgsz: int) -> str:
    """The rows as an aligned text table."""
    head = f"{'format':<16}{'size MB':>9}{'mAP50-95':>10}{'mAP50':>8}{f'ms/img@{imgsz}':>13}  status"
    cell = lambda v, w, f: f"{v:>{w}{f}}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    lines = [head]
    for r in rows:
        lines.append(f"{r.format:<16}{cell(r.size_mb, 9, '.2f')}{cell(r.map, 10, '.4f')}{cell(r.map_50, 8, '.4f')}"
                     f"{cell(r.ms_per_image, 13, '.1f')}  {r.status}")  # fmt: skip
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="benchmark")
@guarded
def _hydra_main(cfg: DictConfig) -> None:
    one_console_line_per_log()  # as val's: Lightning's records one line each, its notes that say nothing left out
    benchmark(cfg)


def main() -> None:
    """Console entry point (`python -m yolo5l.benchmark`, `yolo5l-benchmark`)."""
    run_entry_point(_hydra_main, "benchmark")


if __name__ == "__main__":
    main()
