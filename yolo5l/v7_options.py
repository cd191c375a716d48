"""ultralytics/yolov5 v7.0's command-line options and what yolo5l writes instead: the one-line answers to `--epochs 3`
and the like (`yolo5l.overrides`); docs/cli.md's tables say the same to a reader."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["V7_OPTIONS", "V7_WITHOUT", "v7_hint"]

#: ultralytics/yolov5 v7.0 options (train.py, val.py, detect.py, export.py) and the overrides that do the same here
#: (docs/cli.md has the whole train.py table).
V7_OPTIONS = {
    "train": {
        "--epochs": "trainer.max_epochs=N", "--img": "data.imgsz=N", "--imgsz": "data.imgsz=N",
        "--img-size": "data.imgsz=N", "--batch-size": "data.batch_size=N", "--batch": "data.batch_size=N",
        "--data": "data.file=path/to/data.yaml", "--weights": "weights=path.pt", "--cfg": "model=yolov5s",
        "--hyp": "hyp=scratch-low", "--device": "trainer.devices=N (trainer.accelerator=cpu)",
        "--workers": "data.num_workers=N", "--cache": "data.cache=ram", "--resume": "resume=true",
        "--freeze": "freeze=N", "--seed": "seed=N", "--optimizer": "module/optimizer=adamw",
        "--cos-lr": "module/scheduler=cosine", "--patience": "callbacks.early_stopping.patience=N",
        "--project": "hydra.run.dir=runs/train/name", "--name": "hydra.run.dir=runs/train/name",
        "--noval": "callbacks.val_interval.n=N", "--evolve": "hparams_search=evolve",
        "--rect": "data.rect=true", "--image-weights": "data.image_weights=true",
        "--multi-scale": "data.multi_scale=true", "--single-cls": "data.single_cls=true", "--quad": "data.quad=true",
        "--noplots": "plots=false", "--label-smoothing": "hyp.label_smoothing=X",
        "--save-period": "callbacks.checkpoint.save_period=N", "--sync-bn": "+trainer.sync_batchnorm=true",
    },
    "val": {
        "--data": "data.file=path/to/data.yaml", "--weights": "weights=path.pt", "--img": "data.imgsz=N",
        "--imgsz": "data.imgsz=N", "--batch-size": "data.val_batch_size=N", "--conf-thres": "module.conf_thres=X",
        "--iou-thres": "module.iou_thres=X", "--device": "trainer.accelerator=cpu|gpu", "--task": "task=val",
        "--augment": "augment=true", "--save-txt": "save_txt=true", "--save-conf": "save_conf=true",
        "--save-hybrid": "save_hybrid=true", "--save-json": "save_json=true", "--single-cls": "data.single_cls=true",
        "--half": "half=true",
    },
    "predict": {
        "--source": "source=path", "--weights": "weights=path.pt", "--img": "imgsz=N", "--imgsz": "imgsz=N",
        "--conf-thres": "conf_thres=X", "--iou-thres": "iou_thres=X", "--max-det": "max_det=N",
        "--device": "device=cpu|cuda", "--nosave": "save_images=false", "--save-txt": "save_txt=true",
        "--save-conf": "save_conf=true", "--save-crop": "save_crop=true", "--classes": "classes=[0,2]",
        "--agnostic-nms": "agnostic_nms=true", "--augment": "augment=true", "--visualize": "visualize=true",
        "--half": "half=true", "--vid-stride": "vid_stride=N", "--line-thickness": "line_thickness=N",
        "--hide-labels": "hide_labels=true", "--hide-conf": "hide_conf=true",
    },
    "export": {
        "--weights": "weights=path.pt",
        "--include": "format=onnx|torchscript|openvino|tflite|ncnn|coreml|engine (several: format=[onnx,openvino])",
        "--img": "imgsz=N (or imgsz=[h,w])", "--imgsz": "imgsz=N (or imgsz=[h,w])",
        "--img-size": "imgsz=N (or imgsz=[h,w])", "--batch-size": "batch=N", "--dynamic": "dynamic=true",
        "--half": "half=true", "--simplify": "simplify=true", "--opset": "opset=N", "--device": "device=cpu|cuda",
        "--data": "calib_data=path/to/data.yaml (int8 calibration)", "--optimize": "optimize=true",
        "--int8": "int8=true (with calib_data=path/to/data.yaml)", "--workspace": "workspace=N", "--nms": "nms=true",
        "--agnostic-nms": "agnostic_nms=true (with nms=true)", "--topk-per-class": "topk_per_class=N (with nms=true)",
        "--topk-all": "max_det=N (with nms=true)", "--conf-thres": "conf_thres=X (with nms=true)",
        "--iou-thres": "iou_thres=X (with nms=true)",
    },
}  # fmt: skip

#: ultralytics/yolov5 v7.0 options with no counterpart here, and why (docs/cli.md's tables give the same reasons).
V7_WITHOUT = {
    "export": {
        "--inplace": "the exported decode is written with split and cat, as v7.0 writes it without --inplace (the "
        "same numbers either way)",
        "--keras": "it picks Keras for TF SavedModel, which yolo5l does not write (format=onnx, then onnx2tf)",
        "--verbose": "TensorRT's warnings and errors are printed as warning: lines; its verbose build log is not shown",
    },
}

#: The placeholders of `V7_OPTIONS`' hints that the value typed after the option replaces (`--epochs 3`), and the
#: options whose hint shows an example value that it replaces the same way (`--task test` -> `task=test`).
_PLACEHOLDERS = ("N", "X", "path", "path.pt", "path/to/data.yaml")
_EXAMPLES = ("--task", "--hyp", "--cache", "--include", "--optimizer")


def v7_hint(config_name: str, option: str, value: str | None = None) -> str | None:
    """What to write instead of v7.0's `option` of `python -m yolo5l.<config_name>`, with `value` (what was typed
    after it) in place of the hint's placeholder: `--epochs 3` -> `trainer.max_epochs=3`, `--data coco128.yaml` (no
    such file, a preset's name) -> `data=coco128`; the hint as `V7_OPTIONS` writes it without a value (or for an
    option whose value does not carry over, `--name`); None for an option with no counterpart."""
    hint = V7_OPTIONS.get(config_name, {}).get(option)
    if hint is None or not value:
        return hint
    if option == "--device":
        return _device(config_name, value) or hint
    key, _, rest = hint.partition("=")
    example, space, note = rest.partition(" ")
    if example not in _PLACEHOLDERS and option not in _EXAMPLES:
        return hint
    if option == "--optimizer":
        value = value.lower()  # v7.0's SGD, Adam, AdamW
    if key == "data.file" and not Path(value).is_file() and "/" not in value:
        from yolo5l.config_values import config_choices

        if Path(value).stem in config_choices("data"):  # v7.0's own data/coco128.yaml: the preset here
            return f"data={Path(value).stem}"
    return f"{key}={value}{space}{note}"


def _device(config_name: str, value: str) -> str | None:
    """v7.0's `--device cpu` / `--device 0` / `--device 0,1` as this command's keys; None for another value."""
    cpu = {"train": "trainer.accelerator=cpu", "val": "trainer.accelerator=cpu"}.get(config_name, "device=cpu")
    if value == "cpu":
        return cpu
    if not re.fullmatch(r"\d+(,\d+)*", value):
        return None
    if config_name == "train":
        return f"trainer.devices=[{value}]"
    if config_name == "val":
        return f"trainer.accelerator=gpu trainer.devices=[{value}]"
    return f"device=cuda:{value}" if value.isdigit() else None
