"""The dataset yaml: an ultralytics-style data file resolved to the image files of each split and the class names.

A missing ``<folder>/data.yaml`` whose folder is named after a preset (``coco``, ``coco128``: what ``data=coco128``
points at) is written from the preset, download locations included. When the train/val data is missing, the
archives the yaml's ``download:`` lists are fetched and unpacked (:mod:`yolo5l.io.download`); a ``download:`` script,
which ultralytics runs, is refused.

Reference: ultralytics/yolov5 v7.0 ``utils/general.py::check_dataset`` (the keys, how paths resolve, where
``download:`` archives unpack), re-written from its behaviour.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from yolo5l.base.errors import UserError
from yolo5l.base.files import atomic_write, file_lock
from yolo5l.data.coco2yolo import COCO_NAMES, PRESETS
from yolo5l.data.layout import DATA_YAML, IMG_FORMATS, LIST_SUFFIX, DatasetError, is_image_file, label_cache_path
from yolo5l.io.download import ARCHIVE_SUFFIXES, Archive, archive_name, fetch_archives, is_url

__all__ = [
    "ALL_SPLITS", "PRESET_DOWNLOADS", "SPLITS", "DatasetSpec", "load_dataset_file", "preset_data", "preset_name",
]  # fmt: skip

SPLITS = ("train", "val")  # the splits every data yaml has
ALL_SPLITS = (*SPLITS, "test")  # `test:` is optional, resolved only when asked for (`python -m yolo5l.val task=test`)

#: Where ultralytics publishes the presets in YOLO format (ultralytics/yolov5 v7.0 data/coco128.yaml and
#: data/scripts/get_coco.sh). An entry unpacks into the parent of the dataset root, as ultralytics unpacks them, or
#: into ``dir`` (relative to the root): COCO's image zips hold ``train2017/`` and ``val2017/``, which go under
#: ``coco/images/``. test2017.zip (7 GB) is left out: no split uses it.
PRESET_DOWNLOADS: dict[str, list[str | dict[str, str]]] = {
    "coco128": ["https://ultralytics.com/assets/coco128.zip"],
    "coco": [
        "https://github.com/ultralytics/yolov5/releases/download/v1.0/coco2017labels.zip",  # labels + image lists
        {"url": "http://images.cocodataset.org/zips/train2017.zip", "dir": "images"},  # 19 GB, 118k images
        {"url": "http://images.cocodataset.org/zips/val2017.zip", "dir": "images"},  # 1 GB, 5k images
    ],
}
_DOWNLOAD_KEYS = ("url", "dir", "size", "sha256")
# A non-URL `download:` that spans lines or starts like this is a script (ultralytics runs it); another single line
# is a hint for the user (coco2yolo --write-yaml writes one), shown in the errors.
_SCRIPT_START = re.compile(r"\s*(from|import|bash|sh|python[\d.]*|curl|wget|exec|eval|os\.|subprocess)\b")


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
        data: The yaml's content (its optional `test:` entry is resolved on first use).
    """

    root: Path
    train: list[Path]
    val: list[Path]
    names: list[str]
    train_sources: list[Path] = field(default_factory=list)
    val_sources: list[Path] = field(default_factory=list)
    file: Path | None = None
    data: dict[str, Any] = field(default_factory=dict)
    _test: tuple[list[Path], list[Path]] | None = field(default=None, repr=False)

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.names)

    def has_split(self, split: str) -> bool:
        """Whether the yaml names ``split`` (train and val always; test when it has a ``test:`` entry)."""
        return split in SPLITS or (split == "test" and bool(self.data.get("test")))

    def _split(self, split: str) -> tuple[list[Path], list[Path]]:
        if split not in ALL_SPLITS:
            raise ValueError(f"split must be one of {ALL_SPLITS}, got {split!r}")
        if split == "test":
            if self._test is None:
                where = f"Dataset file {self.file}" if self.file else "dataset mapping"
                if not self.has_split("test"):
                    raise DatasetError(f"{where} has no 'test:' split: add test: <image folder or .txt list> to it, "
                                       "or validate on task=val")  # fmt: skip
                self._test = _split_files(self.data, "test", self.root, where)
            return self._test
        return (self.train, self.train_sources) if split == "train" else (self.val, self.val_sources)

    def files(self, split: str) -> list[Path]:
        """Image files of ``split`` ("train", "val" or "test")."""
        return self._split(split)[0]

    def cache_path(self, split: str) -> Path:
        """Where the label cache of ``split`` lives (see :func:`~yolo5l.data.layout.label_cache_path`)."""
        path = label_cache_path(*self._split(split))
        # train and val are only compared with each other (their cache names do not depend on a test split)
        others = [s for s in SPLITS if s != split] if split in SPLITS else list(SPLITS)
        for other in others:
            other_files, other_sources = self._split(other)
            if other_files and path == label_cache_path(other_files, other_sources):
                # Two splits come from the same folder: keep their caches apart.
                return path.with_name(f"{path.stem}.{split}{path.suffix}")
        return path


def preset_name(path: str | os.PathLike | None) -> str | None:
    """The preset whose data yaml ``path`` is (``<folder named coco or coco128>/data.yaml``), else None."""
    if path is None:
        return None
    p = Path(os.path.expanduser(str(path)))
    return p.parent.name if p.name == DATA_YAML and p.parent.name in PRESETS else None


def preset_data(preset: str) -> dict[str, Any]:
    """The data yaml of a preset: the dataset root is the yaml's folder; names, splits and download locations."""
    return {
        "path": ".",
        **PRESETS[preset],
        "names": dict(enumerate(COCO_NAMES)),
        "download": list(PRESET_DOWNLOADS[preset]),
    }


def _write_preset(preset: str, path: Path) -> dict[str, Any]:
    data = preset_data(preset)
    text = f"# data={preset}: written by yolo5l; the data is downloaded on first use when missing\n"
    # Concurrent ranks write the same text: whichever rename lands last is whole. A read-only location: the
    # content is used without the file.
    with contextlib.suppress(OSError):
        atomic_write(path, text + yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return data


def _read_yaml(path: Path) -> dict[str, Any]:
    preset = preset_name(path)
    if preset is not None and not path.is_file():
        return _write_preset(preset, path)
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


def _root_candidates(data: Mapping[str, Any], file: Path | None) -> list[Path]:
    """Where the dataset root may be, in the order looked at (one candidate unless ``path`` is relative)."""
    raw = data.get("path")
    if raw is None or str(raw) == "":
        return [(file.parent if file is not None else Path.cwd()).resolve()]
    p = Path(os.path.expanduser(str(raw)))
    if p.is_absolute():
        return [p]
    return [c.resolve() for c in ([file.parent / p] if file is not None else []) + [Path.cwd() / p]]


def _resolve_root(data: Mapping[str, Any], file: Path | None, where: str) -> Path:
    """The dataset root: ``path`` as given if absolute; else relative to the yaml's folder, then to the cwd."""
    candidates = _root_candidates(data, file)
    raw = data.get("path")
    if raw is None or str(raw) == "" or Path(os.path.expanduser(str(raw))).is_absolute():
        return candidates[0]
    for c in candidates:
        if c.is_dir():
            return c
    looked = " and ".join(str(c) for c in candidates)
    raise DatasetError(
        f"{where}: dataset root path={raw!r} not found (looked at {looked}).{_backslashes(raw)}{_hint(data)}"
    )


def _backslashes(value: Any) -> str:
    """A hint for a Windows-style path (`images\\train`, `C:\\data`) read where `/` separates folders: a relative
    one written with forward slashes; one on a drive (`C:`) has no meaning here, so the hint names this system's
    forms instead of a `C:/...` that is no path here either."""
    text = str(value)
    if os.sep == "\\":
        return ""
    drive = re.match(r"^([A-Za-z]):[\\/]", text)
    if drive:
        tail = "/".join([p for p in re.split(r"[\\/]", text[3:]) if p][-2:]) or "mydata"
        return (
            f" It is a Windows path on drive {drive.group(1).upper()}:, which this system does not have: name the"
            f" folder as it is here, an absolute path such as '/home/me/{tail}' or one relative to the yaml's folder"
            f" such as '{tail}'."
        )
    if "\\" not in text:
        return ""
    forward = text.replace("\\", "/")
    return f" Its backslashes are Windows separators: write it with forward slashes ({forward!r}), as on every system."


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
                f"{root}).{_backslashes(e)}{_hint(data)}"
            )
        files.extend(found)
        sources.append(p)
    return files, sources


def _entry_present(root: Path, entry: Any) -> bool:
    """Whether a train/val entry is there: a file, a non-empty folder, or a list whose first image exists."""
    p = Path(os.path.expanduser(str(entry)))
    p = Path(os.path.normpath(p if p.is_absolute() else root / p))
    if p.is_dir():
        return any(p.iterdir())
    if p.is_file() and p.suffix == LIST_SUFFIX:
        first = next(iter(_images_in_list(p)), None)
        return first is None or first.exists()  # an empty list is the user's to fix, not a download's
    return p.is_file()


def _splits_present(data: Mapping[str, Any], root: Path) -> bool:
    for split in SPLITS:
        entry = data.get(split)
        entries = [] if entry is None else [entry] if isinstance(entry, (str, Path)) else list(entry)
        if not all(_entry_present(root, e) for e in entries):
            return False
    return True


def _is_script(text: str) -> bool:
    return "\n" in text.strip() or bool(_SCRIPT_START.match(text))


def _refuse_script(text: str, root: Path, where: str) -> UserError:
    first = text.strip().splitlines()[0]
    return UserError(
        f"{where}: download: is a script ({first!r}...), which yolo5l never runs: do its steps by hand so that the "
        f"data is under {root}, or list the URLs of zip/tar archives in download:"
    )


def _download_archives(data: Mapping[str, Any], root: Path, where: str) -> list[Archive]:
    """The archives of ``download:`` (none for a text hint).

    ``download:`` is a URL, a ``{url, dir, size, sha256}`` mapping, or a list of those; ``dir`` (relative to the
    dataset root) is where the archive unpacks, by default the root's parent (the archives hold the dataset folder).
    """
    raw = data.get("download")
    if isinstance(raw, str):
        if not is_url(raw.strip()):
            if _is_script(raw):
                raise _refuse_script(raw, root, where)
            return []  # a hint for the user
        items: list[Any] = [raw.strip()]
    elif isinstance(raw, Mapping):
        items = [raw]
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        raise DatasetError(f"{where}: download: must be a URL, a {{url: ...}} mapping or a list of those")
    archives = []
    for item in items:
        item = {"url": item} if isinstance(item, str) else item
        if not isinstance(item, Mapping) or set(item) - set(_DOWNLOAD_KEYS) or "url" not in item:
            raise DatasetError(f"{where}: download entry {item!r} must be a URL or a mapping of {_DOWNLOAD_KEYS}")
        url = str(item["url"]).strip()
        if not is_url(url):
            if _is_script(url):
                raise _refuse_script(url, root, where)
            raise DatasetError(f"{where}: download entry {url!r} is not an http(s) URL")
        if not archive_name(url).lower().endswith(ARCHIVE_SUFFIXES):
            raise DatasetError(f"{where}: download entry {url} is not an archive ({', '.join(ARCHIVE_SUFFIXES)})")
        sub = PurePosixPath(str(item.get("dir") or "."))
        if sub.is_absolute() or ".." in sub.parts:
            raise DatasetError(f"{where}: download dir {str(sub)!r} must be a folder inside the dataset root")
        sha256 = item.get("sha256")
        if sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", str(sha256)):
            raise DatasetError(f"{where}: download sha256 {sha256!r} of {url} is not 64 hex digits")
        size = item.get("size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise DatasetError(f"{where}: download size {size!r} of {url} is not a byte count")
        dest = root.parent if item.get("dir") is None else root / sub
        archives.append(Archive(url, dest, str(sha256).lower() if sha256 else None, size))
    return archives


def _fetch_missing(data: Mapping[str, Any], file: Path | None, where: str) -> None:
    """Download and unpack ``download:`` when a train/val entry is missing (once, whatever the number of ranks)."""
    if not data.get("download"):
        return
    candidates = _root_candidates(data, file)
    root = next((c for c in candidates if c.is_dir()), candidates[0])  # missing: where the lookup starts
    if _splits_present(data, root):
        return
    archives = _download_archives(data, root, where)
    if not archives:
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(root.with_name(root.name + ".lock"), f"fetching the dataset {root}"):
        if not _splits_present(data, root):  # else another process fetched it while this one waited
            fetch_archives(archives)


def load_dataset_file(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> DatasetSpec:
    """Load an ultralytics-style dataset yaml (or its content as a mapping).

    Keys: ``path`` (dataset root), ``train`` and ``val`` (each an image folder searched recursively, a ``.txt``
    list of image paths, or a list of those), ``names`` (a list or an ``{id: name}`` mapping), optional ``nc``
    (checked against ``names``) and ``download``: a URL, a ``{url, dir, size, sha256}`` mapping or a list of those,
    the zip/tar archives fetched and unpacked when a train/val entry is missing (into the root's parent, as
    ultralytics does, or into ``dir`` under the root); a single line of text is a hint shown in errors; a script is
    refused, never run. A missing ``<coco or coco128>/data.yaml`` is written from the preset first.

    Path resolution: an absolute ``path`` is used as is; a relative one is tried against the yaml's folder,
    then against the current directory (ultralytics resolves it against its repository folder, which is the
    current directory when run from there). ``train``/``val`` entries are relative to the root; relative
    paths inside a ``.txt`` list are relative to the list's folder (ultralytics does so for ``./`` entries).
    A missing ``path`` means the yaml's folder. A relative ``path`` that exists nowhere is downloaded beside the yaml.

    Args:
        path_or_dict: The yaml file, or a mapping with the same keys (relative paths then start at the cwd).

    Returns:
        The resolved :class:`DatasetSpec`.

    Raises:
        DatasetError: A missing file, folder or key, named with where it was looked for.
        UserError: A download failed, or ``download:`` is a script.
    """
    if isinstance(path_or_dict, Mapping):
        data, file = dict(path_or_dict), None
        where = "dataset mapping"
    else:
        file = Path(os.path.expanduser(str(path_or_dict))).resolve()
        data = _read_yaml(file)
        where = f"Dataset file {file}"
    names = _parse_names(data, where)
    _fetch_missing(data, file, where)
    root = _resolve_root(data, file, where)
    (train, train_sources), (val, val_sources) = (_split_files(data, split, root, where) for split in SPLITS)
    return DatasetSpec(root, train, val, names, train_sources, val_sources, file, data)
