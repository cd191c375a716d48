"""Detect objects: `python -m yolo5l.predict weights=<weights.pt|best.pt|last.ckpt|*.onnx|yolov5s.pt> source=...`.

`source` is anything v7.0's detect.py takes (`yolo5l.infer.sources`): images, videos, folders, globs, URLs of images and
videos, a webcam index, rtsp/rtmp/http streams, a `.txt` list of files or of streams, or a list of files. Files run in
batches of `batch_size`, decoded ahead by a background thread while the model runs; streams run one frame of each per
batch. An exported file of one input shape (exported without dynamic=true) runs at its own size and batch, as v7.0's
detect.py needs, with one warning line when imgsz= or batch_size= asks for another.
Options as detect.py's: `classes`, `agnostic_nms`, `max_det`, `augment` (`yolo5l.infer.tta`), `half` (CUDA),
`vid_stride`, `visualize` (`yolo5l.infer.feature_maps`), `save_images` (false = `--nosave`), `save_txt`,
`save_conf`, `save_crop`, `line_thickness`, `hide_labels`, `hide_conf`; the outputs are described in
`yolo5l.infer.predict_outputs`. An image or video that cannot be decoded is reported, counted and skipped; a source
that cannot be opened is one line.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn

from yolo5l._cli import guarded, run_entry_point, running
from yolo5l.base.console import info, print_outputs, warn
from yolo5l.base.errors import UserError, shown_path
from yolo5l.base.hardware import with_command_threads
from yolo5l.config import check_predict_config
from yolo5l.infer.sources import (
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    Frame,
    StreamSet,
    file_frames,
    is_video,
    resolve_sources,
)

__all__ = ["IMAGE_SUFFIXES", "VIDEO_SUFFIXES", "predict"]

_DEFAULT_IMGSZ = 640  # when neither the command line nor the weights say
_PREFETCH_BATCHES = 2  # batches decoded ahead of the model
#: A batch item: the frame, its letterboxed copy (H, W, 3) and ((ratio_h, ratio_w), (pad_w, pad_h)).
_Item = tuple[Frame, np.ndarray, tuple[tuple[float, float], tuple[float, float]]]
#: An image size: a square's side, or (height, width) (an exported file of one rectangular input).
_Size = int | tuple[int, int]


_Detector = Callable[[torch.Tensor], torch.Tensor]


def _load(cfg: DictConfig, device: torch.device) -> tuple[_Detector, list[str], _Size, Any]:
    """The detector (images in [0, 1] -> decoded (B, N, 5 + nc)), class names, the image size to run at (an exported
    file of one input shape: its own, `_fixed_input`) and the network itself (None for an exported file)."""
    from yolo5l.base.image_size import fit_to_stride
    from yolo5l.deploy.exported import is_exported, load_exported
    from yolo5l.models.weights import load_weights, resolve_weights

    net: nn.Module | None = None
    if is_exported(str(cfg.weights)):  # an ONNX / TorchScript file: returns the decoded boxes itself
        if cfg.augment or cfg.visualize:
            raise UserError(f"{'augment' if cfg.augment else 'visualize'}=true needs .pt weights: {cfg.weights} runs "
                            "its own exported graph")  # fmt: skip
        detector, names, file_imgsz, stride = load_exported(str(cfg.weights), device)
        if detector.size is not None:  # one input size: the file's own, whatever imgsz says
            return detector, [str(n) for n in (cfg.names or names)], _fixed_input(cfg, detector), net
    else:
        try:
            model, loaded = load_weights(resolve_weights(str(cfg.weights)))
        except ValueError as e:
            raise UserError(str(e).splitlines()[0]) from None
        names, file_imgsz = loaded.names or [str(i) for i in range(model.num_classes)], loaded.imgsz
        stride = int(model.stride.max())
        net = model.fuse().eval().requires_grad_(False).to(device)
        if _half(cfg, device):
            net = net.half()
        if cfg.augment:
            from yolo5l.infer.tta import TTADetector

            detector = TTADetector(net)
        else:

            def detector(images: torch.Tensor) -> torch.Tensor:
                return net.decode(net(images))

    imgsz = int(cfg.imgsz) if cfg.get("imgsz") is not None else int(file_imgsz or _DEFAULT_IMGSZ)
    return detector, [str(n) for n in (cfg.names or names)], fit_to_stride(imgsz, stride, "imgsz"), net


def _fixed_input(cfg: DictConfig, model: Any) -> _Size:
    """The size an exported file of one input shape (`model.size`, and maybe `model.batch`) runs at: its own (h, w),
    a side for a square, as v7.0's detect.py needs the file's imgsz. One warning line when the typed imgsz or
    batch_size is another, naming the file's shape and what predict uses instead."""
    from yolo5l.config import override_key
    from yolo5l.models.model_source import command_line_overrides

    (h, w), batch = model.size, model.batch
    size: _Size = h if h == w else (h, w)
    typed_batch = "batch_size" in {override_key(o) for o in command_line_overrides()}
    if (cfg.get("imgsz") is not None and (int(cfg.imgsz), int(cfg.imgsz)) != (h, w)) or (
        typed_batch and batch is not None and int(cfg.batch_size) != batch
    ):
        takes = f"{h}x{w} images" + (f", batch {batch}" if batch is not None else "")
        using = f"predicting at {_shown(size)} px" + (
            "" if batch is None else ", one image at a time" if batch == 1 else f", {batch} images at a time"
        )
        how = "dynamic=true" if model.format in ("onnx", "openvino", "engine") else "another imgsz= and batch="
        warn(f"{model.path.name} takes {takes} (a fixed input): {using}; export with {how} for other sizes")
    return size


def _shown(size: _Size) -> str:
    return str(size) if isinstance(size, int) else f"{size[0]}x{size[1]}"


def _half(cfg: DictConfig, device: torch.device) -> bool:
    return bool(cfg.half) and device.type == "cuda"


def _check_options(cfg: DictConfig, device: torch.device) -> None:
    for key in ("batch_size", "vid_stride"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise UserError(f"{key}={cfg[key]!r} must be a whole number >= 1")
    if cfg.line_thickness is not None and (not isinstance(cfg.line_thickness, int) or cfg.line_thickness < 1):
        raise UserError(f"line_thickness={cfg.line_thickness!r} must be a number of pixels >= 1, or null")
    classes = cfg.classes if OmegaConf.is_list(cfg.classes) or cfg.classes is None else [cfg.classes]
    if classes is not None and any(not isinstance(c, int) or c < 0 for c in classes):
        raise UserError(f"classes={list(classes)} must be class ids (whole numbers >= 0), e.g. classes=[0,2]")
    if cfg.half and device.type != "cuda":
        info(f"half=true runs on CUDA only: predicting in float32 on {device.type}")


def _classes(cfg: DictConfig, num_classes: int) -> list[int] | None:
    if cfg.classes is None:
        return None
    classes = [int(c) for c in (cfg.classes if OmegaConf.is_list(cfg.classes) else [cfg.classes])]
    if any(c >= num_classes for c in classes):
        raise UserError(f"classes={classes}: the model has classes 0..{num_classes - 1}")
    return classes


def _letterboxed(frame: Frame, imgsz: _Size) -> _Item:
    from yolo5l.data.letterbox import letterbox

    boxed, ratio, pad = letterbox(frame.image, imgsz, auto=False)
    return frame, boxed, (ratio, pad)


def _file_batches(files: Sequence[Path], batch_size: int, vid_stride: int, imgsz: _Size, skipped: list[str],
                  workers: int) -> Iterator[list[_Item]]:  # fmt: skip
    """Batches of letterboxed frames of `files` in order; images decoded by `workers` threads, videos in order."""

    def image(path: Path) -> list[_Item]:
        return [_letterboxed(f, imgsz) for f in file_frames(path, vid_stride, skipped)]

    batch: list[_Item] = []
    with ThreadPoolExecutor(workers, thread_name_prefix="decode") as pool:
        i = 0
        while i < len(files):
            if is_video(files[i]):
                frames: Iterator[_Item] = (_letterboxed(f, imgsz) for f in file_frames(files[i], vid_stride, skipped))
                i += 1
            else:  # a run of images, decoded in parallel
                run = []
                while i < len(files) and not is_video(files[i]) and len(run) < 4 * batch_size:
                    run.append(files[i])
                    i += 1
                frames = (item for items in pool.map(image, run) for item in items)
            for item in frames:
                batch.append(item)
                if len(batch) == batch_size:
                    yield batch
                    batch = []
    if batch:
        yield batch


def _prefetched(batches: Iterator[list[_Item]], depth: int = _PREFETCH_BATCHES) -> Iterator[list[_Item]]:
    """Run `batches` in a background thread, `depth` batches ahead of the consumer (errors re-raised here)."""
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def produce() -> None:
        try:
            for b in batches:
                while not stop.is_set():
                    try:
                        q.put(b, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # handed to the consumer, which raises it
            q.put(e)

    thread = threading.Thread(target=produce, name="predict-loader", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


@torch.inference_mode()
@with_command_threads(lambda cfg: str(cfg.device))  # on the CPU: as many threads as cores are free at the start
def predict(cfg: DictConfig) -> list[dict]:
    """Run detection as `cfg` (conf/predict.yaml) says; returns the detections written to predictions.json."""
    import os

    from yolo5l.base.hardware import inference_device
    from yolo5l.eval.stage_times import StageTimes, speed_line
    from yolo5l.infer.boxes import non_max_suppression, scale_boxes
    from yolo5l.infer.feature_maps import FeatureMaps
    from yolo5l.infer.predict_outputs import PredictOutputs

    check_predict_config(cfg)
    device = inference_device(str(cfg.device))
    _check_options(cfg, device)
    out = Path(HydraConfig.get().runtime.output_dir)
    source = OmegaConf.to_container(cfg.source) if OmegaConf.is_list(cfg.source) else str(cfg.source)
    files, streams = resolve_sources(source, out / "downloads")
    opened = StreamSet(streams, int(cfg.vid_stride)) if streams else None  # one line if one cannot be opened
    detector, names, imgsz, net = _load(cfg, device)
    fixed_batch = getattr(detector, "batch", None)  # an exported file of one batch size runs batches of it
    batch_size = int(fixed_batch or cfg.batch_size)
    classes = _classes(cfg, len(names))
    outputs = PredictOutputs(
        out, names, save_images=bool(cfg.save_images), save_txt=bool(cfg.save_txt), save_conf=bool(cfg.save_conf),
        save_crop=bool(cfg.save_crop), line_thickness=cfg.line_thickness, hide_labels=bool(cfg.hide_labels),
        hide_conf=bool(cfg.hide_conf),
    )  # fmt: skip
    skipped: list[str] = []
    maps = FeatureMaps(net) if cfg.visualize and net is not None else None
    times = StageTimes(device)
    if opened is not None:
        batches: Iterator[list[_Item]] = ([_letterboxed(f, imgsz) for f in b] for b in opened)
    else:
        workers = max(1, min(batch_size, os.cpu_count() or 1, 4))
        batches = _prefetched(_file_batches(files, batch_size, int(cfg.vid_stride), imgsz, skipped, workers))
    with running():
        stopped, largest = False, 0  # the largest batch run: the Speed line's shape
        try:
            for batch in batches:
                largest = max(largest, len(batch))
                with times.stage(0):
                    x = torch.from_numpy(np.stack([b[1] for b in batch])).to(device).permute(0, 3, 1, 2)
                    x = (x.half() if _half(cfg, device) else x.float()) / 255
                with times.stage(1), maps if maps is not None else contextlib.nullcontext():
                    decoded = detector(x)
                with times.stage(2):
                    dets = non_max_suppression(
                        decoded.float(), conf_thres=float(cfg.conf_thres), iou_thres=float(cfg.iou_thres),
                        classes=classes, agnostic=bool(cfg.agnostic_nms), max_det=int(cfg.max_det),
                    )  # fmt: skip
                times.images += len(batch)
                for j, ((frame, _, ratio_pad), det) in enumerate(zip(batch, dets, strict=True)):
                    det = scale_boxes(x.shape[2:], det.cpu(), frame.image.shape[:2], ratio_pad)
                    outputs.add(frame, det.numpy())
                    if maps is not None:
                        stem = Path(frame.source).stem + ("" if frame.index is None else f"_{frame.index}")
                        maps.write(out / "visualize" / stem, j)
        except KeyboardInterrupt:  # Ctrl-C is how a live stream ends: what was seen is written
            if opened is None:
                raise
            stopped = True
        finally:
            if opened is not None:
                opened.close()
            json_path = outputs.close()
    for line in skipped:
        info(f"skipped {line}")
    print(f"{len(outputs.results)} detections in {outputs.frames} images or frames at {_shown(imgsz)} px"
          + (f"; {len(skipped)} source(s) skipped (cannot be decoded)" if skipped else "")
          + ("; stopped by Ctrl-C" if stopped else ""))  # fmt: skip
    if outputs.frames:
        batch = fixed_batch or largest
        h, w = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
        print(speed_line(times.per_image_ms(), (batch, 3, h, w)))
    print_outputs(
        "Outputs:",
        {
            "images": shown_path(out) if cfg.save_images else None,
            "detections": shown_path(json_path),
            "YOLO txt": shown_path(out / "labels") if cfg.save_txt else None,
            "crops": f"{outputs.crops} in {shown_path(out / 'crops')}" if cfg.save_crop else None,
            "feature maps": shown_path(out / "visualize") if maps is not None else None,
        },
    )
    return outputs.results


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="predict")
@guarded
def _hydra_main(cfg: DictConfig) -> None:
    predict(cfg)


def main() -> None:
    """Console entry point (`python -m yolo5l.predict`, `yolo5l-predict`)."""
    run_entry_point(_hydra_main, "predict")


if __name__ == "__main__":
    main()
