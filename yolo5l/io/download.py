"""Fetch files over HTTP(S) and unpack archives, so that nothing partial is ever visible.

- :func:`download` writes ``<dest folder>/.<name>.part``, resumes a dropped connection with an HTTP ``Range``
  request, checks the size (the server's ``Content-Length`` and the expected size, if given) and the sha256 (if
  given), then renames the file to ``dest``. A ``<dest>.lock`` file (:func:`yolo5l.base.files.file_lock`) makes DDP
  ranks and concurrent runs transfer it once: the second process waits, then finds the file.
- :func:`extract` refuses archives with absolute, ``..``, link or device members before writing anything, unpacks
  into a temporary folder beside the target and renames each top-level entry into place.
- :func:`fetch_archives` does both for the archives of a dataset yaml's ``download:``.
- :func:`weights_url` says where ``weights=`` comes from when it is a URL or a bare release name (``yolov5s.pt``).

Every failure raises a one-line :class:`~yolo5l.base.errors.UserError` naming the URL and where to put the file by hand.

References (behaviour only): ultralytics/yolov5 v7.0 ``utils/downloads.py::attempt_download`` (release assets
``https://github.com/ultralytics/yolov5/releases/download/v7.0/yolov5s.pt`` for a missing ``yolov5s.pt``) and
``utils/general.py::check_dataset`` / ``download`` (archives of ``download:`` unpack into the parent of the dataset
root; ``data/scripts/get_coco.sh`` puts COCO's image zips under ``coco/images``).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from yolo5l.base.console import info, is_rank_zero
from yolo5l.base.errors import UserError
from yolo5l.base.files import file_lock
from yolo5l.io.archive import extract
from yolo5l.io.archive import failure_reason as _reason

__all__ = [
    "ARCHIVE_SUFFIXES",
    "RELEASE_WEIGHTS",
    "WEIGHTS_RELEASE_URL",
    "Archive",
    "archive_name",
    "download",
    "extract",
    "fetch_archives",
    "is_url",
    "url_cache_path",
    "weights_url",
]

#: ultralytics/yolov5 v7.0 release assets: the bare names `weights=` resolves when no such local file exists.
WEIGHTS_RELEASE_URL = "https://github.com/ultralytics/yolov5/releases/download/v7.0/"
RELEASE_WEIGHTS = tuple(f"yolov5{size}{p6}.pt" for p6 in ("", "6") for size in "nsmlx")  # P5, then P6 sizes
ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")

_CHUNK = 1 << 20
_USER_AGENT = "yolo5l"
# Statuses a later attempt may get past; every other HTTP error (404, 403, ...) is final.
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 30.0


class _Transient(Exception):
    """An attempt failed in a way the next one may not (connection refused or dropped, timeout, 5xx)."""


class _Final(Exception):
    """The transfer cannot succeed by retrying (404, wrong size or sha256)."""


def _say(message: str) -> None:
    info(message, stream=sys.stderr)


# ---- names ---------------------------------------------------------------------------------------------------------
def is_url(value: Any) -> bool:
    """Whether ``value`` is one http(s) URL (a string without whitespace)."""
    s = str(value)
    return s.startswith(("http://", "https://")) and not any(c.isspace() for c in s)


def weights_url(value: str | os.PathLike[str]) -> str | None:
    """Where ``weights=<value>`` is downloaded from, or None when it names a local file.

    A URL is itself; a bare release name (``yolov5{n,s,m,l,x}.pt``, or ``yolov5{n,s,m,l,x}6.pt`` for P6) with no
    such file in the current folder is the v7.0 release asset, as ultralytics' ``attempt_download`` resolves it.
    """
    s = os.fspath(value)
    if is_url(s):
        return s
    if s in RELEASE_WEIGHTS and not os.path.exists(s):
        return WEIGHTS_RELEASE_URL.rstrip("/") + "/" + s
    return None


def url_cache_path(url: str) -> Path:
    """A relative path that mirrors ``url`` (``host/path``), so different URLs never share a cache file.

    ``https://github.com/ultralytics/yolov5/releases/download/v7.0/yolov5s.pt`` ->
    ``github.com/ultralytics/yolov5/releases/download/v7.0/yolov5s.pt``.
    """
    parts = urllib.parse.urlsplit(url)
    host = re.sub(r"[^A-Za-z0-9._-]", "_", parts.netloc) or "host"
    segments = [urllib.parse.unquote(s) for s in parts.path.split("/")]
    safe = [re.sub(r"[^A-Za-z0-9._+-]", "_", s) for s in segments if s not in ("", ".", "..")]
    return Path(host, *(safe or ["index"]))


def archive_name(url: str) -> str:
    """The file name of ``url`` (its last path segment)."""
    return url_cache_path(url).name


def _make_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, deepest first (to undo on failure)."""
    missing = []
    p = folder
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: Sequence[Path]) -> None:
    for p in folders:
        with contextlib.suppress(OSError):
            p.rmdir()


# ---- download ------------------------------------------------------------------------------------------------------
def _content_range(value: str | None) -> tuple[int, int | None] | None:
    """``bytes 100-199/200`` -> (100, 200); None when absent or malformed."""
    m = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*", value or "")
    if not m:
        return None
    return int(m.group(1)), None if m.group(2) == "*" else int(m.group(2))


class _Transfer:
    """One file's transfer into an open ``.part`` file: attempts, resumption, sha256 as the bytes arrive."""

    def __init__(self, url: str, f: IO[bytes], expected: int | None, timeout: float, name: str, show: bool) -> None:
        self.url, self.f, self.expected, self.timeout, self.name, self.show = url, f, expected, timeout, name, show
        self.hash = hashlib.sha256()
        self.bar: Any = None

    def _track(self, total: int | None) -> None:
        """Show progress towards ``total``; the bar appears with the first answer, so a failed connection shows none."""
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=self.f.tell(), unit="B", unit_scale=True, unit_divisor=1024, desc=self.name,
                file=sys.stderr, disable=not self.show, dynamic_ncols=True,
            )  # fmt: skip
        elif self.bar.total != total:
            self.bar.reset(total=total)
            self.bar.update(self.f.tell())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def restart(self) -> None:
        self.f.seek(0)
        self.f.truncate()
        self.hash = hashlib.sha256()
        if self.bar is not None:
            self.bar.reset(total=self.bar.total)

    def _open(self, offset: int) -> http.client.HTTPResponse:
        headers = {"User-Agent": _USER_AGENT, "Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        try:
            return urllib.request.urlopen(urllib.request.Request(self.url, headers=headers), timeout=self.timeout)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 416 and offset:  # nothing left to resume from that offset: start over
                self.restart()
                raise _Transient(f"HTTP {e.code} {e.reason} to a resume request") from None
            if e.code in _RETRY_STATUS:
                raise _Transient(f"HTTP {e.code} {e.reason}") from None
            raise _Final(f"HTTP {e.code} {e.reason}") from None
        except (OSError, http.client.HTTPException) as e:  # URLError (refused, DNS), timeouts, reset connections
            raise _Transient(_reason(e)) from None

    def attempt(self) -> None:
        """Read the rest of the file; raises :class:`_Transient` if the connection ends early."""
        offset = self.f.tell()
        with self._open(offset) as resp:
            length = resp.headers.get("Content-Length")
            total = None
            if offset and resp.status == 206:
                span = _content_range(resp.headers.get("Content-Range"))
                if span is None or span[0] != offset:  # not the bytes asked for: start over
                    self.restart()
                    raise _Transient("the server resumed at another offset")
                total = span[1]
            else:
                if offset:  # the server ignored the Range request and sends the whole file
                    self.restart()
                total = int(length) if length and length.isdigit() else None
            if total is not None and self.expected is not None and total != self.expected:
                raise _Final(f"the server sends {total} bytes, expected {self.expected}")
            self._track(total if total is not None else self.expected)
            while True:
                try:
                    chunk = resp.read(_CHUNK)
                except (OSError, http.client.HTTPException) as e:
                    raise _Transient(f"connection lost after {self.f.tell()} bytes ({_reason(e)})") from None
                if not chunk:
                    break
                self.f.write(chunk)
                self.hash.update(chunk)
                self.bar.update(len(chunk))
        # http.client returns b"" rather than raising when the peer closes before Content-Length: compare.
        if total is not None and self.f.tell() < total:
            raise _Transient(f"connection closed after {self.f.tell()} of {total} bytes")


def _fetch(
    url: str, part: Path, sha256: str | None, size: int | None, retries: int, timeout: float, backoff: float,
    progress: bool,
) -> None:  # fmt: skip
    failures = reached = 0
    name = part.name[1 : -len(".part")]
    with (
        open(part, "wb") as f,
        contextlib.closing(_Transfer(url, f, size, timeout, name, progress and is_rank_zero())) as transfer,
    ):
        while True:
            try:
                transfer.attempt()
                break
            except _Transient as e:
                # An attempt that got further than any before does not count: a long download may drop many times.
                # (Further than any before, not than its own start: a server that makes it start over must not
                # look like progress forever.)
                failures = 0 if f.tell() > reached else failures + 1
                reached = max(reached, f.tell())
                if failures > retries:
                    raise _Final(f"{e} (gave up after {retries + 1} attempts)") from None
                if failures:
                    time.sleep(min(backoff * 2 ** (failures - 1), _MAX_BACKOFF_S))
        got = f.tell()
        if size is not None and got != size:
            raise _Final(f"got {got} bytes, expected {size}")
        digest = transfer.hash.hexdigest()
        if sha256 and digest != sha256.lower():
            raise _Final(f"sha256 {digest} differs from the expected {sha256.lower()}")
        f.flush()
        os.fsync(f.fileno())


def download(
    url: str,
    dest: str | os.PathLike[str],
    sha256: str | None = None,
    size: int | None = None,
    retries: int = 3,
    timeout: float = 30.0,
    *,
    backoff: float = 1.0,
    progress: bool = True,
) -> Path:
    """Download ``url`` to ``dest`` unless ``dest`` exists; the file appears there only complete and checked.

    Args:
        url: An http(s) URL (redirects are followed).
        dest: The file to write; its folder is created.
        sha256: Expected sha256 (hex); checked when given.
        size: Expected size in bytes; checked against the server's ``Content-Length`` and the bytes received.
        retries: Failed attempts allowed after the first; an attempt that received bytes does not count, and the
            next one resumes where it stopped (HTTP ``Range``).
        timeout: Seconds to wait for the connection or for the next bytes.
        backoff: Seconds before the first retry, doubling after each failed attempt (30 at most).
        progress: Show a progress bar on stderr (rank 0 only).

    Returns:
        ``dest``. An existing file is returned as is (a file put there by hand is trusted).

    Raises:
        UserError: The transfer failed (offline, refused, HTTP error, timeout, wrong size or sha256, disk error);
            nothing is left at ``dest`` and no ``.part`` file remains.
    """
    dest = Path(dest)
    if dest.is_file():
        return dest
    made: list[Path] = []
    part = dest.with_name(f".{dest.name}.part")
    try:
        made = _make_dirs(dest.parent)
        with file_lock(dest.with_name(dest.name + ".lock"), f"downloading {url}"):
            if not dest.is_file():  # else another process fetched it while this one waited
                _say(f"downloading {url} to {dest}")
                _fetch(url, part, sha256, size, retries, timeout, backoff, progress)
                os.replace(part, dest)
    except BaseException as e:
        part.unlink(missing_ok=True)
        _remove_empty(made)
        if isinstance(e, _Final):
            reason = str(e)
        elif isinstance(e, OSError):
            reason = f"{e.strerror or e} ({e.filename or dest.parent})"
        else:
            raise
        raise UserError(
            f"could not download {url}: {reason}; check the network, or download it by hand and put it at {dest}"
        ) from None
    return dest


# ---- archives ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Archive:
    """An archive to download and unpack.

    Attributes:
        url: Where it is.
        dest: Folder it unpacks into; the archive itself is downloaded there too.
        sha256: Expected sha256 (hex), if known.
        size: Expected size in bytes, if known.
    """

    url: str
    dest: Path
    sha256: str | None = None
    size: int | None = None

    @property
    def file(self) -> Path:
        """Where the archive is downloaded (and where to put it by hand)."""
        return self.dest / archive_name(self.url)


def fetch_archives(archives: Sequence[Archive], **download_kwargs: Any) -> list[Path]:
    """Download every archive, then unpack each; the archives are deleted once all are unpacked.

    Unpacking starts only after every download succeeded, so a failed download leaves no half dataset, and the
    archives already downloaded stay for the next run (which skips their transfer).

    Args:
        archives: What to fetch.
        **download_kwargs: ``retries``, ``timeout``, ``backoff``, ``progress`` of :func:`download`.

    Returns:
        The top-level paths placed.
    """
    files = [download(a.url, a.file, a.sha256, a.size, **download_kwargs) for a in archives]
    placed: list[Path] = []
    for a, f in zip(archives, files, strict=True):
        _say(f"unpacking {f} into {a.dest}")
        placed += extract(f, a.dest)
    for f in files:
        f.unlink(missing_ok=True)
    return placed
