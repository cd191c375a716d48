"""`python -m yolo5l.predict` sources (globs, URLs, a webcam index, `.txt` lists of files and of streams, an MJPEG
stream served on 127.0.0.1, a video read as a stream) and options (classes, agnostic_nms, max_det, save_crop,
hide_labels, hide_conf, line_thickness, half, vid_stride, visualize, save_images=false, save_txt, save_conf, augment,
batch_size)."""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
import time
from pathlib import Path
from typing import ClassVar

import cv2
import numpy as np
import pytest
import torch

from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.infer.sources import StreamReader
from yolo5l.predict import _prefetched, predict

W, H = 120, 80


def _video(path: Path, frames: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (W, H))
    for _ in range(frames):
        writer.write(rng.integers(0, 255, (H, W, 3), dtype=np.uint8))
    writer.release()
    return path


class _Server(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}
    mjpeg_frames: ClassVar[list[bytes]] = []
    streamed: ClassVar[set[str]] = set()

    def do_GET(self):
        long = self.path == "/long.mjpg"  # a camera that goes on (until the reader hangs up)
        if long or (self.path == "/live.mjpg" and self.path not in self.streamed):
            self.streamed.add(self.path)  # a live stream that ends and never comes back
            self.send_response(200)
            self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
            self.end_headers()
            for jpg in self.mjpeg_frames * (100 if long else 1):
                part = b"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(jpg)
                try:
                    self.wfile.write(part + jpg + b"\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return
                time.sleep(0.02)
            return
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tiny 2-class weights, a folder of images (one nested), a video, and an HTTP server on 127.0.0.1 serving an
    image, the video and a 12-frame MJPEG stream."""
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    tmp = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    weights = tmp / "w.pt"
    save_weights(YOLOv5(num_classes=2, depth=0.33, width=0.125), weights, ["cat", "dog"], imgsz=64)
    rng = np.random.default_rng(0)
    src = tmp / "src"
    (src / "nested").mkdir(parents=True)
    for i in range(4):
        cv2.imwrite(str(src / f"im{i}.jpg"), rng.integers(0, 255, (H, W, 3), dtype=np.uint8))
    cv2.imwrite(str(src / "nested" / "deep.png"), rng.integers(0, 255, (H, W, 3), dtype=np.uint8))
    video = _video(tmp / "clip.mp4", 7)
    _Server.files = {"/img.jpg": (src / "im0.jpg").read_bytes(), "/clip.mp4": video.read_bytes()}
    _Server.mjpeg_frames = [cv2.imencode(".jpg", np.full((H, W, 3), 20 * i, np.uint8))[1].tobytes() for i in range(12)]
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Server)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {
        "tmp": tmp,
        "weights": weights,
        "src": src,
        "video": video,
        "url": f"http://127.0.0.1:{server.server_address[1]}",
    }
    server.shutdown()


def run(env, name: str, *args: str) -> tuple[list[dict], Path]:
    out = env["tmp"] / name
    cfg = compose_config([f"weights={env['weights']}", "device=cpu", "conf_thres=0.001", "max_det=20", *args],
                         "predict", out)  # fmt: skip
    return predict(cfg), out


def test_glob_recursive_and_a_list(env):
    preds, out = run(env, "glob", f"source={env['src']}/**/*.*")
    assert {Path(p["image"]).name for p in preds} == {"im0.jpg", "im1.jpg", "im2.jpg", "im3.jpg", "deep.png"}
    assert (out / "deep.png").is_file()
    preds, _ = run(env, "list", f"source=[{env['src']}/im1.jpg,{env['video']}]")
    assert {Path(p["image"]).name for p in preds} == {"im1.jpg", "clip.mp4"}


def test_urls_of_an_image_and_a_video_are_downloaded(env):
    preds, out = run(env, "urls", f"source=[{env['url']}/img.jpg,{env['url']}/clip.mp4]")
    assert (out / "downloads" / "img.jpg").read_bytes() == (env["src"] / "im0.jpg").read_bytes()
    assert (out / "downloads" / "clip.mp4").is_file()
    assert {p.get("frame") for p in preds if p["image"].endswith("clip.mp4")} <= set(range(7))
    cap = cv2.VideoCapture(str(out / "clip.mp4"))
    assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) == 7
    with pytest.raises(UserError, match=r"could not download http://127\.0\.0\.1:\d+/gone\.jpg"):
        run(env, "url404", f"source={env['url']}/gone.jpg")


def test_an_mjpeg_stream_over_http(env, capsys):
    preds, out = run(env, "mjpeg", f"source={env['url']}/live.mjpg", "save_conf=false")
    frames = sorted({p["frame"] for p in preds})
    labels = sorted(int(p.stem.split("_")[-1]) for p in (out / "labels").glob("live_*.txt"))
    assert labels  # at least the first frame, then whatever was newest when the model asked
    assert labels == sorted(set(labels))
    assert set(frames) <= set(labels) <= set(range(12))
    cap = cv2.VideoCapture(str(out / "live.mp4"))
    assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) == len(labels)
    assert "at shape (1, 3, 64, 64)" in capsys.readouterr().out
    assert all(len(ln.split()) == 5 for f in (out / "labels").glob("*.txt") for ln in f.read_text().splitlines())


def test_a_txt_list_batches_two_streams(env, capsys):
    _Server.streamed.discard("/live.mjpg")
    listing = env["tmp"] / "streams.txt"
    listing.write_text(f"# two cameras\n{env['url']}/live.mjpg\nclip.mp4\n")  # clip.mp4 relative to the list
    preds, out = run(env, "two_streams", f"source={listing}")
    assert {Path(p["image"]).name for p in preds} == {"live.mjpg", "clip.mp4"}
    assert "at shape (2, 3, 64, 64)" in capsys.readouterr().out  # one frame of each stream per batch
    assert (out / "live.mp4").is_file()
    assert (out / "clip.mp4").is_file()


def _exif_rotated(path: Path) -> Path:
    """A JPEG stored W x H (white band on its left) with EXIF orientation 6: displayed H wide, W tall, band on top."""
    from PIL import Image

    stored = np.full((H, W, 3), 40, np.uint8)
    stored[:, :20] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.fromarray(stored).save(path, quality=95, exif=exif)
    return path


def test_a_txt_list_of_files_reads_them_as_the_files_themselves(env, monkeypatch):
    import yolo5l.infer.boxes
    from yolo5l.infer.sources import file_frames, resolve_sources

    folder = env["tmp"] / "file_list"
    folder.mkdir()
    rotated = _exif_rotated(folder / "rotated.jpg")
    (folder / "plain.jpg").write_bytes((env["src"] / "im1.jpg").read_bytes())
    listing = folder / "images.txt"
    listing.write_text(f"rotated.jpg\n# a comment\n\nplain.jpg\n{env['src']}/im2.jpg\n")  # relative to the list
    direct = [rotated, folder / "plain.jpg", env["src"] / "im2.jpg"]
    assert resolve_sources(str(listing), env["tmp"]) == (direct, [])
    frame = next(file_frames(rotated, 1, []))
    assert frame.index is None  # an image, not a one-frame video
    assert frame.image.shape == (W, H, 3)  # EXIF applied: displayed upright
    assert frame.image[:15].mean() > 200  # the band stored on the left is on top

    real, batches = yolo5l.infer.boxes.non_max_suppression, []

    def counted(prediction, *args, **kwargs):
        batches.append(len(prediction))
        return real(prediction, *args, **kwargs)

    monkeypatch.setattr(yolo5l.infer.boxes, "non_max_suppression", counted)
    listed, out = run(env, "file_list", f"source={listing}", "batch_size=2")
    assert batches == [2, 1]  # batch_size images per batch, not one stream frame each
    assert listed == run(env, "file_direct", f"source=[{','.join(map(str, direct))}]", "batch_size=2")[0]
    assert {Path(p["image"]).name for p in listed} == {"rotated.jpg", "plain.jpg", "im2.jpg"}
    assert not any("frame" in p for p in listed)
    assert not list(out.glob("*.mp4"))
    assert cv2.imread(str(out / "rotated.jpg")).shape == (W, H, 3)  # saved as an image, upright
    assert all(p["box_xyxy"][2] <= H for p in listed if p["image"].endswith("rotated.jpg"))


def test_a_txt_list_of_streams_stays_a_list_of_streams(env):
    from yolo5l.infer.sources import resolve_sources

    listing = env["tmp"] / "cameras.txt"
    sources = ["0", "rtsp://127.0.0.1:9/cam", "rtmp://127.0.0.1:9/live", "http://127.0.0.1:9/live.mjpg",
               "http://127.0.0.1:9/clip.mp4"]  # fmt: skip
    listing.write_text("\n".join([*sources, "clip.mp4"]))  # a local video among streams is read as a stream
    assert resolve_sources(str(listing), env["tmp"] / "none") == ([], [*sources, str(env["video"])])
    assert not (env["tmp"] / "none").exists()  # nothing downloaded, nothing opened
    videos = env["tmp"] / "videos.txt"
    videos.write_text("clip.mp4\n")  # videos alone: a list of files, read frame by frame
    assert resolve_sources(str(videos), env["tmp"]) == ([env["video"]], [])


@pytest.mark.parametrize(
    ("lines", "message"),
    [("{src}/im0.jpg\nrtsp://127.0.0.1:9/cam", r"mixes files and streams: line 1 \(.*im0\.jpg\) is an image, a "
      r"folder or a glob, line 2 \(rtsp://127\.0\.0\.1:9/cam\) a stream; put the files and the streams in two"),
     ("0\n\n{src}", r"line 3 \(.*src\) is an image, a folder or a glob, line 1 \(0\) a stream"),
     ("{src}/im0.jpg\ngone.jpg", r"files\.txt line 2: source '.*gone\.jpg' not found"),
     ("{src}/*.png", r"files\.txt line 1: source '.*\*\.png' matches no images or videos")],
)  # fmt: skip
def test_a_txt_list_mixing_files_and_streams_or_naming_a_missing_file_is_one_line(env, lines, message):
    from yolo5l.infer.sources import resolve_sources

    listing = env["tmp"] / "files.txt"
    listing.write_text(lines.format(src=env["src"]))
    with pytest.raises(UserError, match=message) as e:
        resolve_sources(str(listing), env["tmp"])
    assert "\n" not in str(e.value)


def test_a_video_read_as_a_stream_drops_stale_frames(env):
    video = _video(env["tmp"] / "long.mp4", 30, seed=1)
    reader = StreamReader(str(video), 0)
    deadline = time.monotonic() + 60
    while not reader.ended and time.monotonic() < deadline:  # the consumer is "busy": the reader runs ahead
        time.sleep(0.01)
    assert reader.ended
    frame = reader.next_frame(timeout=1)
    assert frame is not None
    assert frame.index == 29  # the newest frame; the 29 before it were replaced unread
    assert reader.dropped == 29
    assert frame.image.shape == (H, W, 3)
    assert reader.next_frame(timeout=1) is None  # nothing newer: the stream has ended


@pytest.mark.parametrize(
    ("source", "message"),
    [("7", "source webcam 7: cannot open it"), ("{url}/missing.mjpg", "source http://127.0.0.1:"),
     ("{tmp}/nothing_here.jpg", "not found"), ("{tmp}/none.txt", "stream list not found"),
     ("rtsp://127.0.0.1:9/cam", "source rtsp://127.0.0.1:9/cam: cannot open it")],
)  # fmt: skip
def test_a_source_that_cannot_be_opened_is_one_line(env, source, message):
    source = source.format(url=env["url"], tmp=env["tmp"])
    with pytest.raises(UserError, match=message) as e:
        run(env, "bad", f"source={source}")
    assert "\n" not in str(e.value)


def test_vid_stride_batch_size_and_nosave(env):
    preds, out = run(env, "stride", f"source={env['video']}", "vid_stride=2", "save_images=false")
    assert sorted(int(p.stem.split("_")[-1]) for p in (out / "labels").glob("*.txt")) == [1, 3, 5]  # v7.0's frames
    assert not list(out.glob("*.mp4"))
    assert {p["frame"] for p in preds} <= {1, 3, 5}
    one, _ = run(env, "b1", f"source={env['src']}", "batch_size=1")
    four, _ = run(env, "b3", f"source={env['src']}", "batch_size=3")
    assert len(one) == len(four) > 0
    for a, b in zip(one, four, strict=True):
        assert (a["image"], a["class"]) == (b["image"], b["class"])
        assert a["box_xyxy"] == pytest.approx(b["box_xyxy"], abs=0.05)


def test_classes_agnostic_max_det_and_half_on_the_cpu(env, capsys):
    from torchvision.ops import box_iou

    both, _ = run(env, "all", f"source={env['src']}", "max_det=50", "conf_thres=0.0001")
    assert {p["class"] for p in both} == {0, 1}
    only, _ = run(env, "cls", f"source={env['src']}", "max_det=50", "conf_thres=0.0001", "classes=1")
    assert only
    assert {p["class"] for p in only} == {1}
    nms = ["max_det=300", "conf_thres=0.0001", "iou_thres=0.3"]
    aware, _ = run(env, "aware", f"source={env['src']}", *nms)
    agnostic, _ = run(env, "agn", f"source={env['src']}", *nms, "agnostic_nms=true")
    assert 0 < len(agnostic) < len(aware)  # boxes of different classes now suppress each other
    # Boxes clipped at the image's edges may have overlapped less before the clipping: check those inside.
    inside = [p for p in agnostic if min(p["box_xyxy"][:2]) > 0 and p["box_xyxy"][2] < W and p["box_xyxy"][3] < H]
    assert len(inside) > 4
    for name in {p["image"] for p in inside}:
        boxes = torch.tensor([p["box_xyxy"] for p in inside if p["image"] == name])
        iou = box_iou(boxes, boxes).fill_diagonal_(0)
        assert (iou <= 0.3 + 1e-2).all()  # no overlap above the threshold, whatever the classes
    capped, _ = run(env, "cap", f"source={env['src']}/im0.jpg", "max_det=2", "conf_thres=0.0001")
    assert len(capped) == 2
    half, _ = run(env, "half", f"source={env['src']}/im0.jpg", "max_det=2", "conf_thres=0.0001", "half=true")
    assert "half=true runs on CUDA only: predicting in float32 on cpu" in capsys.readouterr().out
    assert half == capped
    with pytest.raises(UserError, match=r"classes=\[5\]: the model has classes 0..1"):
        run(env, "badcls", f"source={env['src']}", "classes=[5]")


def test_save_crop_and_drawing_options(env):
    preds, out = run(env, "crop", f"source={env['src']}/im2.jpg", "save_crop=true", "max_det=5", "hide_labels=true",
                     "line_thickness=1", "conf_thres=0.0001")  # fmt: skip
    crops = sorted((out / "crops").rglob("*.jpg"))
    assert len(crops) == len(preds) == 5
    assert {c.parent.name for c in crops} <= {"cat", "dog"}
    assert {c.name for c in crops} <= {"im2.jpg", "im22.jpg", "im23.jpg", "im24.jpg", "im25.jpg"}
    original = cv2.imread(str(env["src"] / "im2.jpg"))
    first = next(p for p in preds)
    x1, _, x2, _ = first["box_xyxy"]
    crop = cv2.imread(str(out / "crops" / first["name"] / "im2.jpg"))
    want_w = min(W, (x1 + x2) / 2 + ((x2 - x1) * 1.02 + 10) / 2) - max(0, (x1 + x2) / 2 - ((x2 - x1) * 1.02 + 10) / 2)
    assert abs(crop.shape[1] - want_w) <= 2  # the box x 1.02 + 10 pixels, clipped to the image
    drawn = cv2.imread(str(out / "im2.jpg"))
    assert (drawn != original).any()


def test_drawing_options_by_pixels():
    from yolo5l.infer.annotate import draw_detections

    base = np.zeros((100, 200, 3), np.uint8)
    det = np.array([[50.0, 40.0, 150.0, 90.0, 0.9, 0]])
    changed = {}
    for key, kwargs in {"default": {}, "thick": {"line_thickness": 6}, "thin": {"line_thickness": 1},
                        "no_labels": {"hide_labels": True}, "no_conf": {"hide_conf": True}}.items():  # fmt: skip
        changed[key] = int((draw_detections(base.copy(), det, ["cat"], **kwargs) != 0).any(2).sum())
    assert changed["thin"] < changed["default"] < changed["thick"]
    assert changed["no_labels"] < changed["no_conf"] < changed["default"]  # "cat" is shorter than "cat 0.90"


@torch.no_grad()
def test_visualize_writes_each_stage_and_augment_runs(env):
    from yolo5l.data.letterbox import letterbox
    from yolo5l.models.weights import load_weights

    _, out = run(env, "vis", f"source={env['src']}/im3.jpg", "visualize=true")
    files = sorted((out / "visualize" / "im3").glob("stage*_features.png"))
    assert len(files) >= 20  # every stage but the head
    model = load_weights(env["weights"])[0].fuse().eval()
    x = torch.from_numpy(letterbox(cv2.cvtColor(cv2.imread(str(env["src"] / "im3.jpg")), cv2.COLOR_BGR2RGB), 64)[0])
    x = x.permute(2, 0, 1)[None].float() / 255
    first = model.model[0](x)[0]
    saved = np.load(out / "visualize" / "im3" / f"stage0_{type(model.model[0]).__name__}_features.npy")
    np.testing.assert_allclose(saved, first.numpy(), atol=1e-4)
    plain, _ = run(env, "noaug", f"source={env['src']}/im3.jpg", "conf_thres=0.0001", "max_det=100")
    augmented, _ = run(env, "aug", f"source={env['src']}/im3.jpg", "conf_thres=0.0001", "max_det=100", "augment=true")
    assert augmented
    assert augmented != plain


def test_the_loader_decodes_ahead_of_the_model():
    made = [threading.Event() for _ in range(3)]

    def batches():
        for i in range(3):
            made[i].set()
            yield [i]

    it = _prefetched(batches(), depth=2)
    assert next(it) == [0]
    assert made[1].wait(10)  # produced while the consumer still holds batch 0
    assert list(it) == [[1], [2]]

    def failing():
        yield [0]
        raise UserError("bad frame")

    with pytest.raises(UserError, match="bad frame"):
        list(_prefetched(failing()))


def test_predictions_json_is_written(env):
    preds, out = run(env, "json", f"source={env['src']}/im1.jpg")
    assert json.loads((out / "predictions.json").read_text()) == preds


def test_ctrl_c_ends_a_stream_and_keeps_what_was_written(env, monkeypatch, capsys):
    import yolo5l.infer.boxes

    real, calls = yolo5l.infer.boxes.non_max_suppression, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(yolo5l.infer.boxes, "non_max_suppression", interrupted)
    preds, out = run(env, "ctrl_c", f"source={env['url']}/long.mjpg")
    assert "stopped by Ctrl-C" in capsys.readouterr().out
    assert len(list((out / "labels").glob("*.txt"))) == 1  # the batch before the interrupt
    assert json.loads((out / "predictions.json").read_text()) == preds
    assert (out / "long.mp4").is_file()
    assert not [t for t in threading.enumerate() if t.name.startswith("stream-")]  # the reader was stopped


@pytest.mark.gpu
def test_half_on_cuda_gives_the_float32_detections(env):
    full, _ = run(env, "cuda32", f"source={env['src']}", "device=cuda", "max_det=5")
    half, _ = run(env, "cuda16", f"source={env['src']}", "device=cuda", "max_det=5", "half=true")
    assert len(half) == len(full) > 0
    for name in {p["image"] for p in full}:  # near-equal scores may swap places in float16: compare sorted
        scores = [sorted(p["score"] for p in preds if p["image"] == name) for preds in (full, half)]
        assert scores[1] == pytest.approx(scores[0], abs=0.02)


def test_a_truncated_jpeg_is_predicted_on_with_a_warning(env, capsys):
    """A JPEG cut in half decodes (its lower rows grey, as v7.0's detect.py reads it) and is predicted on, with one
    warning line naming it; bytes after a whole image are no warning."""
    from yolo5l.infer.sources import file_frames

    folder = env["tmp"] / "damaged"
    folder.mkdir()
    whole = (env["src"] / "im1.jpg").read_bytes()
    (folder / "half.jpg").write_bytes(whole[: len(whole) // 2])
    (folder / "trailing.jpg").write_bytes(whole + b"\0" * 16)
    capsys.readouterr()
    skipped: list[str] = []
    half = list(file_frames(folder / "half.jpg", 1, skipped))
    trailing = list(file_frames(folder / "trailing.jpg", 1, skipped))
    assert len(half) == len(trailing) == 1
    assert not skipped
    assert half[0].image.shape == trailing[0].image.shape
    assert capsys.readouterr().out.splitlines() == [
        f"warning: {folder / 'half.jpg'}: truncated JPEG (no end marker and the data ends early): predicted on what "
        "decodes, the rest of the image grey"
    ]
