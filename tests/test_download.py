"""Downloads against an HTTP server on 127.0.0.1 that each test starts: resume, failures, locking, archives,
dataset yaml ``download:``, and ``weights=`` release names.

The server serves bytes the test gives it and can be told, per path, to drop the connection mid-body, to announce a
wrong ``Content-Length``, to answer late, or to hold the body until the test lets it go; it records every request
(path and ``Range`` header) so that tests count transfers.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import random
import socket
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from PIL import Image

from yolo5l.base.errors import UserError
from yolo5l.data import dataset_yaml
from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.io import download as dl
from yolo5l.io.download import download, extract


# ---- the loopback server -------------------------------------------------------------------------------------------
@dataclass
class Rule:
    """How the server misbehaves for one path."""

    drop_after: int | None = None  # send this many body bytes, then close the connection ...
    drops: int = 1  # ... this many times
    extra_length: int = 0  # announce this many bytes more than are sent (every time)
    delay: float = 0.0  # seconds before answering
    hold: threading.Event | None = None  # send half the body, then wait for this event


@dataclass
class Server:
    url: str
    files: dict[str, bytes] = field(default_factory=dict)
    rules: dict[str, Rule] = field(default_factory=dict)
    hits: list[tuple[str, str | None]] = field(default_factory=list)

    def serve(self, name: str, data: bytes, rule: Rule | None = None) -> str:
        self.files["/" + name] = data
        if rule is not None:
            self.rules["/" + name] = rule
        return f"{self.url}/{name}"

    def count(self, name: str) -> int:
        return sum(path == "/" + name for path, _ in self.hits)


def _handler(state: Server) -> type[http.server.BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            path, rng = self.path, self.headers.get("Range")
            with lock:
                state.hits.append((path, rng))
            rule = state.rules.get(path, Rule())
            if rule.delay:
                time.sleep(rule.delay)
            data = state.files.get(path)
            if data is None:
                self.send_error(404, "Not Found")
                return
            start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
            if start >= len(data) and rng:
                self.send_error(416, "Range Not Satisfiable")
                return
            body = data[start:]
            self.send_response(206 if rng else 200)
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data) + rule.extra_length}")
            self.send_header("Content-Length", str(len(body) + rule.extra_length))
            self.end_headers()
            with lock:
                drop = rule.drop_after is not None and rule.drops > 0
                rule.drops -= drop
            if drop:
                self.wfile.write(body[: rule.drop_after])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if rule.hold is not None:
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                rule.hold.wait(timeout=30)
                body = body[len(body) // 2 :]
            self.wfile.write(body)
            if rule.extra_length:
                self.close_connection = True

    return Handler


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    state = Server(f"http://127.0.0.1:{httpd.server_address[1]}")
    httpd.RequestHandlerClass = _handler(state)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()


def _payload(n: int = 3 * (1 << 20) + 123, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _one_line_error(exc: pytest.ExceptionInfo, url: str, dest: Path) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    assert url in msg
    assert str(dest) in msg
    return msg


# ---- download ------------------------------------------------------------------------------------------------------
def test_download_checks_sha256_and_writes_only_the_file(server, tmp_path, capsys):
    data = _payload()
    url = server.serve("w.bin", data)
    dest = tmp_path / "sub" / "w.bin"
    assert download(url, dest, sha256=hashlib.sha256(data).hexdigest(), size=len(data)) == dest
    assert dest.read_bytes() == data
    assert _leftovers(dest.parent) == ["w.bin"]  # no .part, no .lock
    assert url in capsys.readouterr().err  # the "downloading" line and the bar go to stderr
    download(url, dest)  # present: no transfer
    assert server.count("w.bin") == 1


def test_dropped_connection_resumes_with_range(server, tmp_path):
    data = _payload()
    url = server.serve("big.bin", data, Rule(drop_after=1 << 20, drops=2))
    dest = tmp_path / "big.bin"
    download(url, dest, sha256=hashlib.sha256(data).hexdigest(), retries=1, backoff=0, progress=False)
    assert dest.read_bytes() == data
    ranges = [r for p, r in server.hits if p == "/big.bin"]
    assert ranges == [None, f"bytes={1 << 20}-", f"bytes={2 << 20}-"]  # each drop resumed where it stopped
    assert _leftovers(tmp_path) == ["big.bin"]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("404", "HTTP 404"),
        ("wrong_size", r"sends \d+ bytes, expected"),
        ("short_body", r"gave up after 3 attempts"),  # announces 10 bytes more than it has, every time
        ("sha256", "sha256 .* differs"),
        ("timeout", "timed out"),
        ("refused", "refused"),
    ],
)
def test_failures_are_one_line_and_leave_nothing(server, tmp_path, case, match):
    data = _payload(50_000)
    url = server.serve("f.bin", data, Rule(extra_length=10 if case == "short_body" else 0))
    kwargs = {}
    if case == "404":
        url = f"{server.url}/missing.bin"
    elif case == "wrong_size":
        kwargs["size"] = len(data) + 1
    elif case == "sha256":
        kwargs["sha256"] = "0" * 64
    elif case == "timeout":
        url = server.serve("slow.bin", data, Rule(delay=1.0))
        kwargs["timeout"] = 0.2
    elif case == "refused":
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}/f.bin"
    dest = tmp_path / "new" / "f.bin"
    t0 = time.monotonic()
    with pytest.raises(UserError, match=match) as exc:
        download(url, dest, retries=2, backoff=0, progress=False, **kwargs)
    assert time.monotonic() - t0 < 5
    assert "put it at" in _one_line_error(exc, url, dest)
    assert not dest.parent.exists()  # the folder it made is gone again: no file, no .part, no .lock
    if case == "404":
        assert server.count("missing.bin") == 1  # not retried


_CHILD = """
import sys
from yolo5l.io.download import download
download(sys.argv[1], sys.argv[2], progress=False)
"""


def test_two_processes_transfer_once(server, tmp_path):
    data = _payload()
    hold = threading.Event()
    url = server.serve("shared.bin", data, Rule(hold=hold))
    dest = tmp_path / "shared.bin"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, url, str(dest)], stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    waiting = threading.Event()
    logs: list[list[str]] = [[], []]

    def read(i: int) -> None:
        for line in procs[i].stderr:
            logs[i].append(line)
            if "waiting for another process" in line:
                waiting.set()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for r in readers:
        r.start()
    try:
        # The transfer is held mid-body until the other process queues on the lock: both run at once.
        assert waiting.wait(timeout=20), logs
    finally:
        hold.set()
    assert [p.wait(timeout=30) for p in procs] == [0, 0], logs
    for r in readers:
        r.join(timeout=5)
    assert server.count("shared.bin") == 1
    assert dest.read_bytes() == data
    assert _leftovers(tmp_path) == ["shared.bin"]


# ---- archives ------------------------------------------------------------------------------------------------------
def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _tar(members: dict[str, bytes], symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tf.addfile(info)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("evil.zip", lambda: _zip({"ok/a.txt": b"a", "../evil": b"x"})),
        ("abs.zip", lambda: _zip({"ok/a.txt": b"a", "/tmp/evil": b"x"})),
        ("evil.tar.gz", lambda: _tar({"ok/a.txt": b"a", "ok/../../evil": b"x"})),
        ("link.tar.gz", lambda: _tar({"ok/a.txt": b"a"}, symlink="ok/passwd")),
    ],
)
def test_unsafe_archive_is_refused_before_anything_is_written(tmp_path, name, make):
    archive = tmp_path / name
    archive.write_bytes(make())
    dest = tmp_path / "out"
    with pytest.raises(UserError, match="refused, nothing unpacked") as exc:
        extract(archive, dest)
    assert "\n" not in str(exc.value)
    assert str(archive) in str(exc.value)
    assert _leftovers(dest) == []
    assert not (tmp_path / "evil").exists()


def test_extract_merges_into_existing_folders_and_keeps_files(tmp_path):
    dest = tmp_path / "datasets"
    (dest / "mini").mkdir(parents=True)
    (dest / "mini" / "data.yaml").write_text("mine")
    archive = tmp_path / "mini.tar.gz"
    archive.write_bytes(_tar({"mini/images/a.png": b"png", "mini/data.yaml": b"theirs"}))
    assert extract(archive, dest) == [dest / "mini"]
    assert (dest / "mini" / "images" / "a.png").read_bytes() == b"png"
    assert (dest / "mini" / "data.yaml").read_text() == "mine"
    assert _leftovers(dest) == ["mini"]  # the temporary folder is gone


# ---- dataset yaml download: ----------------------------------------------------------------------------------------
def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_yaml_download_fetched_and_unpacked_on_first_load(server, tmp_path):
    """COCO's layout: labels and image lists unpack into the root's parent, the image zip into root/images."""
    labels = _zip({
        "mini/labels/train/1.txt": b"0 0.5 0.5 0.2 0.2\n", "mini/labels/val/2.txt": b"",
        "mini/train.txt": b"./images/train/1.png\n", "mini/val.txt": b"./images/val/2.png\n",
    })  # fmt: skip
    images = _zip({"train/1.png": _png(), "val/2.png": _png()})
    labels_url = server.serve("mini_labels.zip", labels)
    images_url = server.serve("mini_images.zip", images)
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    yaml_file = cfg / "mini.yaml"
    data = {
        "path": "../datasets/mini", "train": "train.txt", "val": "val.txt", "names": ["thing"],
        "download": [
            {"url": labels_url, "sha256": hashlib.sha256(labels).hexdigest(), "size": len(labels)},
            {"url": images_url, "dir": "images"},  # COCO's image zips hold train2017/: they go under images/
        ],
    }  # fmt: skip
    yaml_file.write_text(yaml.safe_dump(data))
    spec = load_dataset_file(yaml_file)
    root = tmp_path / "datasets" / "mini"
    assert spec.root == root
    assert spec.train == [root / "images/train/1.png"]
    assert spec.val == [root / "images/val/2.png"]
    assert all(p.is_file() for p in spec.train + spec.val)
    assert _leftovers(tmp_path / "datasets") == ["mini"]  # archives deleted, no lock or temporary folder
    assert _leftovers(root / "images") == ["train", "val"]
    load_dataset_file(yaml_file)
    assert server.count("mini_labels.zip") == server.count("mini_images.zip") == 1


def test_preset_data_yaml_is_written_and_its_data_fetched(server, tmp_path, monkeypatch):
    """data=coco128: the config check lets the missing preset yaml through; the first load writes and fetches it."""
    from yolo5l.config import check_train_config, compose_config

    url = server.serve(
        "coco128.zip", _zip({"coco128/images/train2017/1.png": _png(), "coco128/labels/train2017/1.txt": b""})
    )
    monkeypatch.setitem(dataset_yaml.PRESET_DOWNLOADS, "coco128", [url])
    monkeypatch.setenv("YOLO5L_DATASETS", str(tmp_path / "datasets"))
    cfg = compose_config(["data=coco128"], output_dir=tmp_path / "run")
    check_train_config(cfg)
    spec = load_dataset_file(cfg.data.file)
    root = tmp_path / "datasets" / "coco128"
    assert spec.train == spec.val == [root / "images/train2017/1.png"]
    assert len(spec.names) == 80
    assert yaml.safe_load((root / "data.yaml").read_text())["download"] == [url]
    assert _leftovers(tmp_path / "datasets") == ["coco128"]


@pytest.mark.parametrize("script", ["multi-line", "bash"])
def test_yaml_download_script_is_refused_not_run(tmp_path, script):
    marker = tmp_path / "ran"
    text = (
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        if script == "multi-line"
        else f"bash -c 'touch {marker}'"
    )
    yaml_file = tmp_path / "d.yaml"
    yaml_file.write_text(
        yaml.safe_dump({"path": "ds", "train": "images", "val": "images", "names": ["a"], "download": text})
    )
    with pytest.raises(UserError, match="download: is a script") as exc:
        load_dataset_file(yaml_file)
    assert "\n" not in str(exc.value)
    assert str(yaml_file) in str(exc.value)
    assert not marker.exists()


def test_yaml_download_failure_names_where_to_put_the_archive(server, tmp_path):
    url = f"{server.url}/gone.zip"
    yaml_file = tmp_path / "d.yaml"
    yaml_file.write_text(
        yaml.safe_dump({"path": "ds", "train": "images", "val": "images", "names": ["a"], "download": url})
    )
    with pytest.raises(UserError, match="HTTP 404") as exc:
        load_dataset_file(yaml_file)
    _one_line_error(exc, url, tmp_path / "gone.zip")
    assert _leftovers(tmp_path) == ["d.yaml"]


# ---- weights= ------------------------------------------------------------------------------------------------------
def test_release_weights_name_downloads_once_into_the_cache(server, tmp_path, monkeypatch):
    import torch

    from yolo5l.config import check_predict_config, compose_config
    from yolo5l.models.weights import load_weights, resolve_weights, save_weights
    from yolo5l.models.yolo import YOLOv5
    from yolo5l.predict import predict

    torch.manual_seed(0)
    src = save_weights(YOLOv5(num_classes=3, depth=0.33, width=0.25), tmp_path / "made" / "w.pt")
    server.serve("v7.0/yolov5n.pt", src.read_bytes())
    monkeypatch.setattr(dl, "WEIGHTS_RELEASE_URL", f"{server.url}/v7.0/")
    monkeypatch.setenv("YOLO5L_CACHE_DIR", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # no yolov5n.pt here

    Image.new("RGB", (64, 48), (90, 120, 30)).save(work / "img.png")
    cfg = compose_config(["weights=yolov5n.pt", "source=img.png", "imgsz=64"], "predict", tmp_path / "run")
    check_predict_config(cfg)  # a release name is not "file not found"
    predict(cfg)  # resolves, downloads and loads through the safe loader
    path = resolve_weights("yolov5n.pt")
    assert path.is_relative_to(tmp_path / "cache" / "weights")
    assert path.name == "yolov5n.pt"
    assert path.read_bytes() == src.read_bytes()
    model, _ = load_weights(path)
    assert (model.width, model.num_classes) == (0.25, 3)
    assert server.count("v7.0/yolov5n.pt") == 1  # the second resolve found the cached file

    (work / "yolov5n.pt").write_bytes(src.read_bytes())
    assert resolve_weights("yolov5n.pt") == Path("yolov5n.pt")  # a local file wins
    bad = compose_config(["weights=yolov5z.pt", "source=img.png"], "predict", tmp_path / "run")
    with pytest.raises(UserError, match="file not found"):
        check_predict_config(bad)
