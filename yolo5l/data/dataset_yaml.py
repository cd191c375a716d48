"""The dataset yaml: an ultralytics-style data file resolved to the image files of each split and the class names.

Reference: ultralytics/yolov5 v7.0 ``utils/general.py::check_dataset`` (the keys and how paths resolve),
re-written from its behaviour.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from yolo5l.data.coco2yolo import PRESETS
from yolo5l.data.layout import IMG_FORMATS, LIST_SUFFIX, DatasetError, is_image_file, label_cache_path

__all__ = ["SPLITS", "DatasetSpec", "load_dataset_file"]

SPLITS = ("train", "val")


@dataclass
class DatasetSpec:
    """A resolved dataset: image file lists of the train and val splits and the class names.

    Attributes:
        root: Dataset root (the yaml's ``path``), absolute.
        train: Train image files, absolute, sorted within each source.
        val: Val image files.
        names: Class names; the class id is the index.
        train_sources: The folders / ``.txt`` lists the train files came from (used for cache paths and messages).
        val_sources: Same for val.
        file: The yaml file the spec was loaded from (None for a mapping).
    """

    root: Path
    train: list[Path]
    val: list[Path]
    names: list[str]
    train_sources: list[Path] = field(default_factory=list)
    val_sources: list[Path] = field(default_factory=list)
    file: Path | None = None

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.names)

    def _split(self, split: str) -> tuple[list[Path], list[Path]]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return (self.train, self.train_sources) if split == "train" else (self.val, self.val_sources)

    def files(self, split: str) -> list[Path]:
        """Image files of ``split`` ("train" or "val")."""
        return self._split(split)[0]

    def cache_path(self, split: str) -> Path:
        """Where the label cache of ``split`` lives (see :func:`~yolo5l.data.layout.label_cache_path`)."""
        path = label_cache_path(*self._split(split))
        (other,) = (s for s in SPLITS if s != split)
        other_files, other_sources = self._split(other)
        if other_files and path == label_cache_path(other_files, other_sources):
            # Both splits come from the same folder: keep their caches apart.
            path = path.with_name(f"{path.stem}.{split}{path.suffix}")
        return path


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        preset = path.parent.name if path.parent.name in PRESETS else "{" + ",".join(sorted(PRESETS)) + "}"
        raise DatasetError(
            f"Dataset file {path} not found: pass the path of an ultralytics-style data yaml. For COCO or COCO128 in "
            f"YOLO format, write it with `python -m yolo5l.data.coco2yolo --write-yaml {preset} --out {path.parent}`; "
            "to convert COCO JSON annotations, `python -m yolo5l.data.coco2yolo --json ... --images ... --out ...`."
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise DatasetError(f"Dataset file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise DatasetError(f"Dataset file {path} must hold a mapping with path/train/val/names keys.")
    return data


def _parse_names(data: Mapping[str, Any], where: str) -> list[str]:
    names = data.get("names")
    nc = data.get("nc")
    if names is None:
        if nc is None:
            raise DatasetError(f"{where}: no 'names' (a list or {{id: name}} mapping) and no 'nc'.")
        names = [f"class{i}" for i in range(int(nc))]
    elif isinstance(names, Mapping):
        keys = sorted(int(k) for k in names)
        if keys != list(range(len(keys))):
            raise DatasetError(f"{where}: 'names' ids must be 0..{len(keys) - 1} without gaps, got {keys}.")
        names = [str(names[k] if k in names else names[str(k)]) for k in keys]
    elif isinstance(names, (list, tuple)) or (hasattr(names, "__iter__") and not isinstance(names, str)):
        names = [str(n) for n in names]
    else:
        raise DatasetError(f"{where}: 'names' must be a list or an {{id: name}} mapping, got {type(names).__name__}.")
    if nc is not None and int(nc) != len(names):
        raise DatasetError(f"{where}: nc={nc} but {len(names)} names are listed.")
    if not names:
        raise DatasetError(f"{where}: 'names' is empty.")
    return names


def _resolve_root(data: Mapping[str, Any], file: Path | None, where: str) -> Path:
    """The dataset root: ``path`` as given if absolute; else relative to the yaml's folder, then to the cwd."""
    raw = data.get("path")
    if raw is None or str(raw) == "":
        return (file.parent if file is not None else Path.cwd()).resolve()
    p = Path(os.path.expanduser(str(raw)))
    if p.is_absolute():
        return p
    candidates = ([file.parent / p] if file is not None else []) + [Path.cwd() / p]
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    looked = " and ".join(str(c.resolve()) for c in candidates)
    raise DatasetError(f"{where}: dataset root path={raw!r} not found (looked at {looked}).{_hint(data)}")


def _hint(data: Mapping[str, Any]) -> str:
    hint = data.get("download")
    return f" {str(hint).strip()}" if hint and isinstance(hint, str) and not hint.startswith("http") else ""


def _images_in_folder(folder: Path) -> list[Path]:
    out = [p for p in folder.rglob("*") if is_image_file(p) and p.is_file()]
    return sorted(out)


def _images_in_list(list_file: Path) -> list[Path]:
    out = []
    for line in list_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        p = Path(line)
        # Relative entries (ultralytics writes "./images/train2017/x.jpg") are relative to the list's folder.
        out.append(p if p.is_absolute() else list_file.parent / p)
    return [Path(os.path.normpath(p)) for p in out]


def _split_files(data: Mapping[str, Any], split: str, root: Path, where: str) -> tuple[list[Path], list[Path]]:
    entry = data.get(split)
    if entry is None:
        raise DatasetError(f"{where}: no '{split}' key (an image folder, a .txt list of images, or a list of both).")
    entries = [entry] if isinstance(entry, (str, Path)) else list(entry)
    files: list[Path] = []
    sources: list[Path] = []
    for e in entries:
        p = Path(os.path.expanduser(str(e)))
        p = p if p.is_absolute() else root / p
        p = Path(os.path.normpath(p))
        if p.is_dir():
            found = _images_in_folder(p)
            if not found:
                raise DatasetError(
                    f"{where}: {split} folder {p} holds no images ({', '.join(IMG_FORMATS)}).{_hint(data)}"
                )
        elif p.is_file() and p.suffix == LIST_SUFFIX:
            found = _images_in_list(p)
            if not found:
                raise DatasetError(f"{where}: {split} list {p} lists no images.")
        elif p.is_file() and is_image_file(p):
            found = [p]
        else:
            raise DatasetError(
                f"{where}: {split} entry {str(e)!r} not found (looked for {p}, relative to the dataset root "
                f"{root}).{_hint(data)}"
            )
        files.extend(found)
        sources.append(p)
    return files, sources


def load_dataset_file(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> DatasetSpec:
    """Load an ultralytics-style dataset yaml (or its content as a mapping).

    Keys: ``path`` (dataset root), ``train`` and ``val`` (each an image folder searched recursively, a ``.txt``
    list of image paths, or a list of those), ``names`` (a list or an ``{id: name}`` mapping), optional ``nc``
    (checked against ``names``) and ``download`` (a text hint shown in errors; URLs are ignored).

    Path resolution: an absolute ``path`` is used as is; a relative one is tried against the yaml's folder,
    then against the current directory (ultralytics resolves it against its repository folder, which is the
    current directory when run from there). ``train``/``val`` entries are relative to the root; relative
    paths inside a ``.txt`` list are relative to the list's folder (ultralytics does so for ``./`` entries).
    A missing ``path`` means the yaml's folder.

    Args:
        path_or_dict: The yaml file, or a mapping with the same keys (relative paths then start at the cwd).

    Returns:
        The resolved :class:`DatasetSpec`.

    Raises:
        DatasetError: A missing file, folder or key, named with where it was looked for.
    """
    if isinstance(path_or_dict, Mapping):
        data, file = dict(path_or_dict), None
        where = "dataset mapping"
    else:
        file = Path(os.path.expanduser(str(path_or_dict))).resolve()
        data = _read_yaml(file)
        where = f"Dataset file {file}"
    names = _parse_names(data, where)
    root = _resolve_root(data, file, where)
    (train, train_sources), (val, val_sources) = (_split_files(data, split, root, where) for split in SPLITS)
    return DatasetSpec(root, train, val, names, train_sources, val_sources, file)
