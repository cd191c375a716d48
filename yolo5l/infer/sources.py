"""What `python -m yolo5l.predict source=...` reads: files, globs, URLs, webcams and streams, as v7.0's detect.py.

- an image or a video file, a folder (sorted, not recursive), a glob (`'data/**/*.jpg'`, recursive), or a list of
  those;
- an http(s) URL of an image or a video (by its suffix): downloaded into the run folder's `downloads/` through
  `yolo5l.io.download.download` (resumed, checked, complete or absent);
- a webcam index (`source=0`), an rtsp://, rtmp:// or http(s):// stream: each stream is read by its own thread, which
  keeps only the newest frame (stale frames are dropped while the model runs), and the streams are batched together,
  one frame of each per batch;
- a `.txt` list, one source per line (blank lines and `#` comments skipped; a relative path is taken from the list's
  folder). With no stream among its lines it is a list of files, each line read as it would be on the command line
  (EXIF orientation applied, images saved as images, `batch_size` batches), as ultralytics 8 reads a `.txt`. With a
  stream among them it is a list of streams, as v7.0 reads every `.txt`: its video files are read as streams too, and
  an image, a folder or a glob there is an error (put the files in a list of their own).

A source that cannot be opened is one line naming it (`yolo5l.base.errors.UserError`); a file that cannot be decoded is
reported and skipped by the caller.

Reference: ultralytics/yolov5 v7.0 `detect.py::run` (how a source string is classified), `utils/dataloaders.py`
(`LoadImages`: globs, folders, `vid_stride`; `LoadStreams`: one reader thread per stream, `grab` every frame and
`retrieve` every `vid_stride`-th, a reopened stream after a failed read), `utils/general.py::check_file` (URLs).
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from yolo5l.base.console import warn
from yolo5l.base.errors import UserError
from yolo5l.data.layout import IMG_FORMATS

__all__ = [
    "IMAGE_SUFFIXES", "STREAM_PREFIXES", "VIDEO_SUFFIXES", "Frame", "StreamReader", "StreamSet", "file_frames",
    "is_video", "resolve_sources",
]  # fmt: skip

IMAGE_SUFFIXES = {f".{s}" for s in IMG_FORMATS}
_JPEG_SUFFIXES = (".jpg", ".jpeg", ".mpo")
VIDEO_SUFFIXES = {".asf", ".avi", ".gif", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".ts", ".wmv", ".webm"}
STREAM_PREFIXES = ("rtsp://", "rtmp://", "http://", "https://")
_OPEN_TIMEOUT_MS = 10_000  # how long opening a network stream may take
_READ_RETRIES = 3  # a stream whose reads keep failing is reopened this many times, then ends
_WAIT_S = 10.0  # how long the consumer waits for a stream's next frame before it counts the stream as stalled


@dataclass
class Frame:
    """One image to run the model on.

    Attributes:
        source: The file, URL or stream it came from (as the user named it).
        index: Frame index in a video or stream; None for an image.
        image: RGB uint8 (H, W, 3), as decoded.
        fps: Frames per second of its video or stream (0 for an image).
        stream: Slot of its stream among the streams; None for files.
    """

    source: str
    index: int | None
    image: np.ndarray
    fps: float = 0.0
    stream: int | None = None


def _suffix(name: str) -> str:
    return Path(urllib.parse.urlsplit(name).path if "://" in name else name).suffix.lower()


def _is_stream(item: str) -> bool:
    """v7.0's rule: a webcam index, or a URL whose path is not an image or video file."""
    if item.isnumeric():
        return True
    return item.lower().startswith(STREAM_PREFIXES) and _suffix(item) not in IMAGE_SUFFIXES | VIDEO_SUFFIXES


def _download(url: str, folder: Path) -> Path:
    from yolo5l.io.download import download

    name = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name or "download"
    return download(url, folder / re.sub(r"[^A-Za-z0-9._+-]", "_", name), progress=False)


def _is_glob(item: str) -> bool:
    return "*" in item or "?" in item or "[" in item


def _read_list(path: Path) -> list[tuple[int, str]]:
    """The (line number, source) a `.txt` list names, one per line (blank lines and `#` comments skipped); a relative
    path is taken from the list's folder when it exists there (for a glob: when it matches there)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"source {path}: cannot read the stream list ({e.strerror or e})") from None
    out = []
    for n, line in enumerate((ln.strip() for ln in lines), 1):
        if not line or line.startswith("#"):
            continue
        local = path.parent / line
        here = glob.glob(str(local), recursive=True) if _is_glob(line) else local.exists()
        out.append((n, str(local) if not line.isnumeric() and "://" not in line and here else line))
    if not out:
        raise UserError(f"source {path}: the stream list names no source (one URL, webcam index or file per line)")
    return out


def _list_kind(line: str) -> str:
    """How a line of a `.txt` list is read: "image" (an image file, folder or glob, local or a URL of an image),
    "video" (a video file, local or a URL of one: a file in a list of files, a stream in a list of streams) or
    "stream" (a webcam index, an rtsp/rtmp/http stream, or anything else OpenCV may open, e.g. /dev/video0)."""
    if line.isnumeric():
        return "stream"
    if "://" in line:
        if line.lower().startswith(("http://", "https://")) and _suffix(line) in IMAGE_SUFFIXES | VIDEO_SUFFIXES:
            return "video" if _suffix(line) in VIDEO_SUFFIXES else "image"
        return "stream"
    if _suffix(line) in VIDEO_SUFFIXES:
        return "video"
    if _suffix(line) in IMAGE_SUFFIXES or _is_glob(line) or Path(os.path.expanduser(line)).is_dir():
        return "image"
    return "stream"


def _listed(path: Path, download_dir: Path) -> tuple[list[Path], list[str]]:
    """The files or the streams a `.txt` list names.

    A list with no stream line is a list of files, each read as it would be on the command line (URLs downloaded,
    folders and globs expanded). A list with a stream line is a list of streams, as v7.0's detect.py reads every
    list: its video files are read as streams too; an image, folder or glob there is an error.
    """
    entries = _read_list(path)
    kinds = [_list_kind(line) for _, line in entries]
    if "stream" not in kinds:
        files: list[Path] = []
        for n, line in entries:
            try:
                files += _files(line, download_dir)
            except UserError as e:
                raise UserError(f"source {path} line {n}: {e}") from None
        return files, []
    if "image" in kinds:
        (n, image), (m, stream) = (entries[kinds.index(k)] for k in ("image", "stream"))
        raise UserError(f"source {path} mixes files and streams: line {n} ({image}) is an image, a folder or a glob, "
                        f"line {m} ({stream}) a stream; put the files and the streams in two .txt lists and run "
                        "each")  # fmt: skip
    return [], [line for _, line in entries]


def _files(item: str, download_dir: Path) -> list[Path]:
    """The image and video files one source item names: a URL (downloaded), a glob, a folder or a file."""
    if item.lower().startswith(("http://", "https://")):
        return [_download(item, download_dir)]
    path = Path(os.path.expanduser(item))
    if _is_glob(item):
        found = [Path(p) for p in sorted(glob.glob(str(path), recursive=True))]
        found = [p for p in found if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES]
        if not found:
            raise UserError(f"source {item!r} matches no images or videos")
        return found
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES)
        if not found:
            raise UserError(f"source {item!r} holds no images or videos ({', '.join(sorted(IMAGE_SUFFIXES))}, ...)")
        return found
    if path.is_file():
        return [path]
    raise UserError(f"source {item!r} not found: pass an image, a video, a folder, a glob, a URL, a webcam index, a "
                    "stream URL, a .txt list of files or of streams, or a list [a.jpg,b.mp4]")  # fmt: skip


def resolve_sources(source: str | int | Sequence[str | int], download_dir: Path) -> tuple[list[Path], list[str]]:
    """Sort `source` into files and streams, as v7.0's detect.py classifies a source (a `.txt` list: `_listed`).

    Args:
        source: What `source=` holds: one item or a list.
        download_dir: Where URLs of image and video files are downloaded.

    Returns:
        (image and video files, stream sources); one of the two is empty.

    Raises:
        UserError: A missing file, an empty folder or glob, a failed download, or streams mixed with files.
    """
    items = [str(s) for s in source] if isinstance(source, (list, tuple)) else [str(source)]
    files: list[Path] = []
    streams: list[str] = []
    for item in items:
        if item.endswith(".txt"):
            if not Path(item).is_file():
                raise UserError(f"source {item}: stream list not found")
            listed_files, listed_streams = _listed(Path(item), download_dir)
            files += listed_files
            streams += listed_streams
        elif _is_stream(item):
            streams.append(item)
        else:
            files += _files(item, download_dir)
    if files and streams:
        raise UserError(f"source mixes streams ({streams[0]}) with files ({files[0]}): run them separately")
    return files, streams


def is_video(path: Path) -> bool:
    """Whether a file is read as a video (by its suffix)."""
    return path.suffix.lower() in VIDEO_SUFFIXES


def file_frames(path: Path, vid_stride: int, skipped: list[str]) -> Iterator[Frame]:
    """The frames of one image or video file (every `vid_stride`-th frame of a video: frames s-1, 2s-1, ...); what
    cannot be decoded is described in `skipped`. A truncated JPEG is predicted on (the rows it lacks decode grey, as
    in v7.0's detect.py), with a warning line: training's label scan skips such an image."""
    from yolo5l.data.images import JPEG_TRUNCATED, ImageReadError, jpeg_end_damage, read_image

    if not is_video(path):
        try:
            image = read_image(path)
            truncated = path.suffix.lower() in _JPEG_SUFFIXES and jpeg_end_damage(path) == JPEG_TRUNCATED
        except (ImageReadError, OSError, ValueError) as e:
            skipped.append(str(e).splitlines()[0])
            return
        if truncated:
            warn(f"{path}: {JPEG_TRUNCATED}: predicted on what decodes, the rest of the image grey")
        yield Frame(str(path), None, image)
        return
    cap = cv2.VideoCapture(str(path))
    fps = cap.get(cv2.CAP_PROP_FPS) or 30.0
    index, seen = -1, 0
    try:
        while True:
            for _ in range(vid_stride):
                if not cap.grab():
                    return
                index += 1
            ok, frame = cap.retrieve()
            if not ok:
                return
            seen += 1
            yield Frame(str(path), index, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB), fps)
    finally:
        cap.release()
        if seen == 0:
            skipped.append(f"{path}: no frame could be decoded")


def _open_capture(source: str) -> cv2.VideoCapture:
    """Open a stream; OpenCV's and FFmpeg's own console lines about a failure are kept quiet (the caller says it in
    one line)."""
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")  # FFmpeg's AV_LOG_QUIET, read when FFmpeg first loads
    level = cv2.utils.logging.getLogLevel()
    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)
    try:
        if source.isnumeric():
            return cv2.VideoCapture(int(source))
        if "://" in source:
            return cv2.VideoCapture(source, cv2.CAP_FFMPEG, [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, _OPEN_TIMEOUT_MS])
        return cv2.VideoCapture(source)
    finally:
        cv2.utils.logging.setLogLevel(level)


class StreamReader:
    """Read one stream in a daemon thread, keeping only its newest frame.

    Args:
        source: A webcam index ("0"), a stream URL, or a video file read as a stream.
        slot: The stream's place in the batch.
        vid_stride: Keep every `vid_stride`-th frame (the others are grabbed, not decoded).

    Raises:
        UserError: The stream cannot be opened or gives no first frame.
    """

    def __init__(self, source: str, slot: int, vid_stride: int = 1) -> None:
        self.source, self.slot, self.vid_stride = source, slot, vid_stride
        what = f"webcam {source}" if source.isnumeric() else source
        cap = _open_capture(source)
        if not cap.isOpened():
            raise UserError(f"source {what}: cannot open it (no such camera, or the stream does not answer)")
        ok, frame = cap.read()
        if not ok:
            cap.release()
            raise UserError(f"source {what}: opened, but no frame could be read")
        fps = cap.get(cv2.CAP_PROP_FPS)
        self.fps = fps if np.isfinite(fps) and 0 < fps < 1000 else 30.0  # streams may report 0 or nan
        count = cap.get(cv2.CAP_PROP_FRAME_COUNT)
        self.frames = int(count) if np.isfinite(count) and count > 0 else None  # None: a live stream
        self._cond = threading.Condition()
        self._latest: tuple[int, np.ndarray] = (0, frame)  # (frame index, BGR frame)
        self.dropped = 0  # frames read but replaced before the consumer took them
        self._taken = -1
        self.ended = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(cap,), name=f"stream-{slot}", daemon=True)
        self._thread.start()

    def _run(self, cap: cv2.VideoCapture) -> None:
        index, failures = 0, 0
        try:
            while not self._stop.is_set() and (self.frames is None or index + 1 < self.frames):
                if not cap.grab():
                    failures += 1
                    if self.frames is not None or failures > _READ_RETRIES:
                        break
                    cap.release()
                    time.sleep(0.5 * failures)
                    cap = _open_capture(self.source)  # a dropped connection: reopen, as v7.0 does
                    continue
                failures, index = 0, index + 1
                if index % self.vid_stride:
                    continue
                ok, frame = cap.retrieve()
                if ok:
                    with self._cond:
                        self.dropped += self._latest[0] > self._taken
                        self._latest = (index, frame)
                        self._cond.notify_all()
        finally:
            cap.release()
            with self._cond:
                self.ended = True
                self._cond.notify_all()

    def close(self, timeout: float = 1.0) -> None:
        """Stop reading (the thread ends after its current read) and wait up to `timeout` s for it."""
        self._stop.set()
        self._thread.join(timeout)

    def next_frame(self, timeout: float = _WAIT_S) -> Frame | None:
        """The newest frame not yet taken, waiting up to `timeout` s for one; None once the stream has ended (or
        stalled that long)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._latest[0] > self._taken or self.ended, timeout):
                return None
            index, frame = self._latest
            if index <= self._taken:
                return None
            self._taken = index
        return Frame(self.source, index, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB), self.fps, self.slot)


class StreamSet:
    """Every stream of `sources` opened (one line naming the first that fails), each read by its own thread.

    Iterating yields one frame per live stream per batch, each the newest that stream has; it ends when every
    stream has ended (a file read to its end; a live stream that stays unreachable after `_READ_RETRIES` reopenings,
    or gives no frame for `_WAIT_S` seconds).

    Args:
        sources: Webcam indices, stream URLs, video files.
        vid_stride: Keep every `vid_stride`-th frame of each stream.
    """

    def __init__(self, sources: Sequence[str], vid_stride: int = 1) -> None:
        self.readers = [StreamReader(s, i, vid_stride) for i, s in enumerate(sources)]

    def __len__(self) -> int:
        return len(self.readers)

    def close(self) -> None:
        """Stop every reader."""
        for reader in self.readers:
            reader.close()

    def __iter__(self) -> Iterator[list[Frame]]:
        live = list(self.readers)
        while live:
            batch = []
            for reader in list(live):
                frame = reader.next_frame()
                if frame is None:
                    live.remove(reader)
                else:
                    batch.append(frame)
            if batch:
                yield batch
