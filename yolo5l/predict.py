"""Detect objects: `python -m yolo5l.predict weights=<weights.pt|best.pt|last.ckpt|*.onnx|yolov5s.pt> source=...`.

`source` is an image, a video, a folder (sorted, not recursive) or a list of those. Writes into the run folder: each
image with its boxes drawn and each video annotated frame by frame (`save_images`), `predictions.json` (every
detection: image or video and frame, class id and name, score, xyxy box in original pixels) and YOLO txt labels
(`labels/<stem>.txt`, `labels/<stem>_<frame>.txt` for videos: class cx cy w h score, normalised; `save_txt`). An image
or video that cannot be decoded is reported, counted and skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import cv2
import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from yolo5l._cli import guarded, info, print_outputs, relpath, resume_gc, run_entry_point, unfreeze_start_up
from yolo5l.config import check_predict_config
from yolo5l.data.layout import IMG_FORMATS
from yolo5l.errors import UserError

IMAGE_SUFFIXES = {f".{s}" for s in IMG_FORMATS}
VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv"}
_DEFAULT_IMGSZ = 640  # when neither the command line nor the weights say


def list_sources(source: str | list[str]) -> list[Path]:
    """Image and video files of `source`: one file, a folder (sorted, not recursive) or a list of either."""
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    files: list[Path] = []
    for item in map(Path, map(str, items)):
        if item.is_dir():
            files += sorted(p for p in item.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES)
        elif item.is_file():
            files.append(item)
        else:
            raise UserError(f"source {str(item)!r} not found: pass an image, a video, a folder or a list [a.jpg,b.mp4]")
    if not files:
        raise UserError(f"source {source!r} holds no images or videos ({', '.join(sorted(IMAGE_SUFFIXES))}, ...)")
    return files


def _frames(path: Path, skipped: list[str]) -> Iterator[tuple[int | None, np.ndarray, float]]:
    """(frame index or None for an image, RGB frame, fps) of one source; what cannot be decoded goes to `skipped`."""
    from yolo5l.data.images import ImageReadError, read_image

    if path.suffix.lower() in VIDEO_SUFFIXES:
        cap = cv2.VideoCapture(str(path))
        fps = cap.get(cv2.CAP_PROP_FPS) or 30.0
        index = 0
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            yield index, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB), fps
            index += 1
        cap.release()
        if index == 0:
            skipped.append(f"{path}: no frame could be decoded")
        return
    try:
        yield None, read_image(path), 0.0
    except (ImageReadError, OSError, ValueError) as e:
        skipped.append(str(e).splitlines()[0])


def _load(cfg: DictConfig, device: torch.device) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[str], int]:
    """The detector (images in [0, 1] -> decoded (B, N, 5 + nc)), class names and the image size to run at."""
    from yolo5l.exported import is_exported, load_exported
    from yolo5l.weights import load_weights, resolve_weights

    if is_exported(str(cfg.weights)):  # an ONNX / TorchScript file: returns the decoded boxes itself
        detector, names, file_imgsz, _ = load_exported(str(cfg.weights), device)
    else:
        try:
            model, loaded = load_weights(resolve_weights(str(cfg.weights)))
        except ValueError as e:
            raise UserError(str(e).splitlines()[0]) from None
        names, file_imgsz = loaded.names or [str(i) for i in range(model.num_classes)], loaded.imgsz
        model = model.fuse().eval().to(device)

        def detector(images: torch.Tensor) -> torch.Tensor:
            return model.decode(model(images))

    imgsz = int(cfg.imgsz) if cfg.get("imgsz") is not None else int(file_imgsz or _DEFAULT_IMGSZ)
    return detector, [str(n) for n in (cfg.names or names)], imgsz


@torch.inference_mode()
def predict(cfg: DictConfig) -> list[dict]:
    """Run detection as `cfg` (conf/predict.yaml) says; returns the detections written to predictions.json."""
    from yolo5l.annotate import draw_detections
    from yolo5l.boxes import non_max_suppression, scale_boxes
    from yolo5l.data.augment import letterbox
    from yolo5l.hardware import inference_device

    check_predict_config(cfg)
    source = OmegaConf.to_container(cfg.source) if OmegaConf.is_list(cfg.source) else str(cfg.source)
    files = list_sources(source)
    device = inference_device(str(cfg.device))
    detector, names, imgsz = _load(cfg, device)
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "labels").mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    skipped: list[str] = []
    frames_seen = 0
    resume_gc()  # set-up is built (the command line paused the collector for it)
    for path in files:
        writer = None
        for frame, im, fps in _frames(path, skipped):
            frames_seen += 1
            im_boxed, ratio, pad = letterbox(im, imgsz, auto=False)
            batch = torch.from_numpy(im_boxed[None]).permute(0, 3, 1, 2).to(device).float() / 255
            det = non_max_suppression(
                detector(batch), conf_thres=float(cfg.conf_thres), iou_thres=float(cfg.iou_thres),
                max_det=int(cfg.max_det),
            )[0].cpu()  # fmt: skip
            scale_boxes((imgsz, imgsz), det, im.shape[:2], (ratio, pad))  # ratio is (ratio_h, ratio_w)
            stem = path.stem if frame is None else f"{path.stem}_{frame}"
            h, w = im.shape[:2]
            lines = []
            for x1, y1, x2, y2, score, cls in det.tolist():
                c = int(cls)
                entry = {"image": str(path), "class": c, "name": names[c] if c < len(names) else str(c),
                         "score": round(score, 5), "box_xyxy": [round(v, 2) for v in (x1, y1, x2, y2)]}  # fmt: skip
                results.append(entry if frame is None else {**entry, "frame": frame})
                lines.append(f"{c} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} "
                             f"{(y2 - y1) / h:.6f} {score:.5f}")  # fmt: skip
            if cfg.save_txt:
                (out / "labels" / f"{stem}.txt").write_text("".join(ln + "\n" for ln in lines))
            if cfg.save_images:
                drawn = draw_detections(cv2.cvtColor(im, cv2.COLOR_RGB2BGR), det.numpy(), names)
                if frame is None:
                    cv2.imwrite(str(out / path.name), drawn)
                else:
                    if writer is None:
                        fourcc = cv2.VideoWriter_fourcc(*"mp4v")
                        writer = cv2.VideoWriter(str(out / f"{path.stem}.mp4"), fourcc, fps, (w, h))
                    writer.write(drawn)
        if writer is not None:
            writer.release()
    unfreeze_start_up()  # this run's objects become collectable (the next run of a sweep needs the memory)
    (out / "predictions.json").write_text(json.dumps(results, indent=1))
    for line in skipped:
        info(f"skipped {line}")
    print(f"{len(results)} detections in {frames_seen} images or frames at {imgsz} px"
          + (f"; {len(skipped)} source(s) skipped (cannot be decoded)" if skipped else ""))  # fmt: skip
    print_outputs(
        "Outputs:",
        {
            "images": relpath(out) if cfg.save_images else None,
            "detections": relpath(out / "predictions.json"),
            "YOLO txt": relpath(out / "labels") if cfg.save_txt else None,
        },
    )
    return results


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="predict")
@guarded
def _hydra_main(cfg: DictConfig) -> None:
    predict(cfg)


def main() -> None:
    """Console entry point (`python -m yolo5l.predict`, `yolo5l-predict`)."""
    run_entry_point(_hydra_main)


if __name__ == "__main__":
    main()
