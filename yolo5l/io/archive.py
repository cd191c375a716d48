"""Archives: safe unpacking of downloaded zip / tar files, and telling a damaged checkpoint file (a zip) apart.

Unpacking checks every member first (absolute paths, `..`, links and devices are refused before anything is written),
unpacks into a temporary folder inside the target and renames into place, so a half dataset is never visible.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import tempfile
import urllib.error
import zipfile
from pathlib import Path, PurePosixPath

from yolo5l.base.errors import UserError

__all__ = ["archive_damage", "extract", "failure_reason"]


def failure_reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        e = e.reason if isinstance(e.reason, BaseException) else e
    if isinstance(e, TimeoutError) or (isinstance(e, OSError) and "timed out" in str(e)):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def _check_member(name: str, archive: Path) -> None:
    n = name.replace("\\", "/")
    if n.startswith("/") or re.match(r"[A-Za-z]:", n) or ".." in PurePosixPath(n).parts:
        raise UserError(
            f"archive {archive} holds the unsafe member {name!r} (an absolute or '..' path): refused, nothing unpacked"
        )


def _open_archive(archive: Path) -> zipfile.ZipFile | tarfile.TarFile:
    try:
        if zipfile.is_zipfile(archive):
            return zipfile.ZipFile(archive)
        return tarfile.open(archive, "r:*")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise UserError(
            f"archive {archive} cannot be read as zip or tar ({failure_reason(e)}): delete it and run again to "
            "download it anew"
        ) from None


def _check_members(ar: zipfile.ZipFile | tarfile.TarFile, archive: Path) -> None:
    """Refuse before anything is written: absolute or ``..`` names (zip-slip), links and device files."""
    if isinstance(ar, zipfile.ZipFile):
        for info in ar.infolist():
            _check_member(info.filename, archive)
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise UserError(
                    f"archive {archive} holds the symbolic link {info.filename!r}: refused, nothing unpacked"
                )
        return
    for m in ar.getmembers():
        _check_member(m.name, archive)
        if not (m.isfile() or m.isdir()):
            raise UserError(f"archive {archive} holds the link or device {m.name!r}: refused, nothing unpacked")


def _move_into(src: Path, dst: Path) -> list[Path]:
    """Rename each entry of ``src`` into ``dst``; folders that exist on both sides are merged, files kept."""
    placed = []
    for child in sorted(src.iterdir()):
        target = dst / child.name
        if not target.exists() and not target.is_symlink():
            os.replace(child, target)  # one rename: the whole subtree appears at once
            placed.append(target)
        elif child.is_dir() and target.is_dir() and not target.is_symlink():
            _move_into(child, target)
            placed.append(target)
        # else: an existing file wins (a file the user put there, or one a previous unpack already placed)
    return placed


def extract(archive: str | os.PathLike[str], dest: str | os.PathLike[str]) -> list[Path]:
    """Unpack a zip or tar(.gz/.bz2/.xz) archive into ``dest`` safely.

    The members are checked first (no absolute or ``..`` paths, no links or device files); the archive is unpacked
    into a temporary folder inside ``dest``, then each top-level entry is renamed into place (folders that already
    exist are merged; existing files are kept). A failure removes the temporary folder.

    Args:
        archive: The archive file.
        dest: Folder to unpack into (created).

    Returns:
        The top-level paths placed in ``dest``.

    Raises:
        UserError: An unsafe member, an unreadable archive, or a disk error.
    """
    archive, dest = Path(archive), Path(dest)
    with _open_archive(archive) as ar:
        _check_members(ar, archive)
        dest.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{archive.name}.", suffix=".unpack", dir=dest))
        try:
            if isinstance(ar, tarfile.TarFile) and hasattr(tarfile, "data_filter"):
                ar.extractall(tmp, filter="data")
            else:
                ar.extractall(tmp)
            return _move_into(tmp, dest)
        except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError) as e:
            raise UserError(f"could not unpack {archive} into {dest}: {failure_reason(e)}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def archive_damage(path: str | os.PathLike) -> str | None:
    """What is wrong with a PyTorch checkpoint file (a zip archive since torch 1.6) that is damaged, else None.

    Catches a file cut short (no zip directory at its end: a copy or a write that stopped) and bytes changed inside
    it: every member's CRC-32, which torch writes and `torch.load` never checks, so a damaged tensor would load as
    wrong numbers. Reads the whole file once (about a second per GB). A file that is not a zip archive at all (the
    legacy format, or not a checkpoint) returns None: the loader says what it is.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    if size == 0:
        return "empty file"
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        # A torch zip starts with a local file header; without its directory, the end of the file is missing.
        return "cut short: its end is missing" if head == b"PK\x03\x04" else None
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    try:
        with zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as e:  # RuntimeError: zlib's
        return f"its contents are garbled ({e})"
    return f"{bad} does not match its checksum" if bad is not None else None
