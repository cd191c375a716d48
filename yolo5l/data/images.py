"""Image reading: any accepted image file as 8-bit RGB, EXIF orientation applied.

:func:`read_image` decodes in full. :func:`read_image_reduced` serves a consumer that will shrink the image to a
known long side anyway (the image cache): a JPEG at least twice that size is decoded at 1/2, 1/4 or 1/8 scale
through libjpeg's DCT scaling, which skips most of the inverse DCT, upsampling and colour conversion work and
averages each block as an anti-aliased downscale would. That decode goes through simplejpeg (libjpeg-turbo's
TurboJPEG API, EXIF orientation applied here) when it is installed, else through OpenCV's ``IMREAD_REDUCED_COLOR_*``
modes; both are libjpeg-turbo and give the same pixels. A consumer that reads only the top part of the image (a
mosaic tile that the output cuts off below) can say so: the decoder then stops after the last row it needs, which
skips the entropy decoding of the rest, the one cost that DCT scaling does not shrink; this holds for a JPEG decoded
at full size too.

Each file is opened and read once: the JPEG header (size, EXIF orientation;
:func:`~yolo5l.data.jpeg_header.read_jpeg_header`) is parsed from those bytes, and every decoder, fallbacks included,
decodes the same bytes (``cv2.imdecode``, simplejpeg, PIL through ``io.BytesIO``). A JPEG decoded at full size goes
through simplejpeg too, which gives OpenCV's pixels a little faster.

Reference: ultralytics/yolov5 v7.0 ``utils/dataloaders.py::LoadImagesAndLabels.load_image`` and ``exif_size``
(behaviour); yolo5l returns RGB where ultralytics returns BGR.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import struct
from collections.abc import Callable

import cv2
import numpy as np
from PIL import Image, ImageOps

from yolo5l.data.jpeg_header import JpegHeader, read_jpeg_header
from yolo5l.data.layout import DatasetError

try:
    import simplejpeg
except ImportError:  # the reduced decode then goes through OpenCV
    simplejpeg = None

__all__ = [
    "DCT_SCALES", "JPEG_TRUNCATED", "ImageReadError", "dct_scale", "exif_hw", "jpeg_end_damage", "read_image",
    "read_image_reduced",
]  # fmt: skip

DCT_SCALES = (8, 4, 2)  # the libjpeg scale denominators that OpenCV's IMREAD_REDUCED_COLOR_* modes reach
_REDUCED_FLAGS = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}
_EXIF_ORIENTATION = 0x0112  # the EXIF tag
_ROTATED_90 = (5, 6, 7, 8)  # orientations that turn the image by 90 degrees (swap height and width)
_PIL_16BIT_MODES = ("I;16", "I;16B", "I;16L", "I")
_U8_MAX = 255.0
_U8_BITS = 8
_PNG_SIGNATURE_BYTES = 8
_PNG_CHUNK_HEAD = struct.Struct(">I4s")  # length, type; the data and a 4-byte CRC follow
_PNG_CRC_BYTES = 4
_UPRIGHT = 1  # the EXIF orientation that displays the stored rows top to bottom as they are (read_jpeg_header's
# value without an orientation, or with one outside 1-8, which OpenCV ignores too)
_SIMPLEJPEG_COMPONENTS = (1, 3)  # greyscale and YCbCr: what simplejpeg decodes to RGB as OpenCV does
# A decode that stops early goes through PIL, which costs more a row than simplejpeg: ~8% at reduced scale, ~40% at
# full size (where PIL's copies of the pixels weigh more beside the decoder's work). It is worth it below this fraction
# of the rows.
_TOP_DECODE_MAX_FRACTION = 0.9
_TOP_DECODE_MAX_FRACTION_FULL = 0.7
# EXIF orientation -> the transform of the stored pixels that displays them (as PIL's ImageOps.exif_transpose and
# OpenCV's imread do); 1 and unknown values leave the pixels as stored.
_ORIENT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda im: cv2.flip(im, 1),  # mirror left-right
    3: lambda im: cv2.rotate(im, cv2.ROTATE_180),
    4: lambda im: cv2.flip(im, 0),  # mirror top-bottom
    5: cv2.transpose,  # mirror across the main diagonal
    6: lambda im: cv2.rotate(im, cv2.ROTATE_90_CLOCKWISE),
    7: lambda im: cv2.flip(cv2.transpose(im), -1),  # mirror across the anti-diagonal
    8: lambda im: cv2.rotate(im, cv2.ROTATE_90_COUNTERCLOCKWISE),
}


class ImageReadError(DatasetError):
    """An image file that cannot be decoded."""


_JPEG_END = b"\xff\xd9"  # the end-of-image marker
JPEG_TRUNCATED = "truncated JPEG (no end marker and the data ends early)"


def jpeg_end_damage(path: str | os.PathLike) -> str | None:
    """What is wrong with the end of the JPEG file ``path``: None when it ends with its end-of-image marker, else
    :data:`JPEG_TRUNCATED` when PIL cannot decode it in full (OpenCV decodes such a file, the rows it misses grey) or
    a note that it decodes in full (bytes after the image). Reads 2 bytes, and the whole image only when they are
    not the marker."""
    with open(path, "rb") as f:
        f.seek(max(os.fstat(f.fileno()).st_size - len(_JPEG_END), 0))
        if f.read() == _JPEG_END:
            return None
    try:
        with Image.open(path) as im:
            im.load()
    except Exception:  # PIL raises OSError, SyntaxError or ValueError for a damaged stream
        return JPEG_TRUNCATED
    return "JPEG without end marker, decodes in full"


def _read_bytes(path: str) -> bytes:
    """The bytes of the file ``path``, read in one go.

    Raises:
        ImageReadError: The file is missing or cannot be read.
    """
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError as e:
        raise ImageReadError(f"Image {path} not found.") from e
    except OSError as e:
        raise ImageReadError(f"Image {path} cannot be decoded ({type(e).__name__}: {e}); remove or replace it.") from e


def _imdecode(path: str, buf: np.ndarray, flags: int) -> np.ndarray | None:
    """``cv2.imdecode`` of the bytes ``buf`` of file ``path``, else ``cv2.imread`` of the file (the same result, or
    None when OpenCV cannot decode it).

    OpenCV gives up on a buffer that ends early (a truncated JPEG), where its file reader, libjpeg's stdio source,
    pads the end with an end-of-image marker and decodes what is there (the rest grey): such a file is read again
    from disk, which only a damaged file costs.
    """
    im = cv2.imdecode(buf, flags) if buf.size else None  # imdecode rejects an empty buffer with an error
    return cv2.imread(path, flags) if im is None else im


def read_image(path: str | os.PathLike) -> np.ndarray:
    """Read an image as RGB uint8 (H, W, 3), EXIF orientation applied.

    Grayscale, RGBA (alpha dropped), palette and 16-bit images are converted to 8-bit RGB; PFM (float) images
    are scaled from [0, 1] to [0, 255]. The file is read once, and its bytes are decoded: an 8-bit greyscale or YCbCr
    JPEG by simplejpeg (the orientation from its header applied here), everything else, and such a JPEG that
    simplejpeg rejects, by OpenCV (which applies the EXIF orientation and converts 16 to 8 bits itself); PIL is the
    fallback for what OpenCV cannot decode.

    Args:
        path: Image file.

    Returns:
        (H, W, 3) uint8 RGB array.

    Raises:
        ImageReadError: The file is missing or cannot be decoded.
    """
    path = os.fspath(path)
    data = _read_bytes(path)
    return _decode_full(path, data, read_jpeg_header(data))


def _decode_full(path: str, data: bytes, header: JpegHeader | None) -> np.ndarray:
    """:func:`read_image` of the file ``path``, whose bytes are ``data`` and whose JPEG header is ``header`` (None
    when it is not a JPEG)."""
    buf = np.frombuffer(data, np.uint8)
    if path.lower().endswith(".pfm"):
        im = _imdecode(path, buf, cv2.IMREAD_UNCHANGED)
        if im is not None:
            im = np.clip(im * (_U8_MAX if im.max() <= 1.0 else 1.0), 0, _U8_MAX).astype(np.uint8)
            im = np.repeat(im[..., None], 3, axis=2) if im.ndim == 2 else im[..., ::-1]
            return np.ascontiguousarray(im)
    if header is not None and header.precision == _U8_BITS and header.components in _SIMPLEJPEG_COMPONENTS:
        im = _decode_simplejpeg(data, header, 1)
        if im is not None:
            return im
    im = _imdecode(path, buf, cv2.IMREAD_COLOR_RGB)
    if im is not None:
        return im
    try:
        with Image.open(io.BytesIO(data)) as pil:
            pil = ImageOps.exif_transpose(pil)
            if pil.mode in _PIL_16BIT_MODES:
                arr = np.asarray(pil, dtype=np.uint32) >> 8  # the high byte of each 16-bit value
                return np.ascontiguousarray(np.repeat(arr.astype(np.uint8)[..., None], 3, axis=2))
            return np.asarray(pil.convert("RGB"))
    except Exception as e:
        raise ImageReadError(f"Image {path} cannot be decoded ({type(e).__name__}: {e}); remove or replace it.") from e


def dct_scale(h0: int, w0: int, min_long_side: int) -> int:
    """The largest f of :data:`DCT_SCALES` with ``max(h0, w0) / f >= min_long_side``, or 1 when even f = 2 is too
    much (the image is smaller than twice ``min_long_side``)."""
    return next((f for f in DCT_SCALES if max(h0, w0) / f >= min_long_side), 1)


def _decode_simplejpeg(data: bytes, header: JpegHeader, f: int) -> np.ndarray | None:
    """The JPEG ``data`` decoded by simplejpeg at exactly 1/f scale (f = 1: full size), as RGB, the EXIF orientation
    of its ``header`` applied; None when simplejpeg is missing, rejects the data or gives another size.

    simplejpeg decodes at the smallest of libjpeg-turbo's scales (n/8, n = 1..16) that gives at least the requested
    size of the stored (unrotated) image; the request ``ceil(h / f) x ceil(w / f)`` is the 1/f result itself, which
    the shape check confirms. It raises on the warnings of a damaged file (``strict``), which the caller's fallback
    then decodes as before.
    """
    if simplejpeg is None:
        return None
    hf, wf = -(-header.height // f), -(-header.width // f)
    try:
        im = simplejpeg.decode_jpeg(data, "RGB", min_height=hf, min_width=wf)
    except Exception:
        return None
    if im.shape != (hf, wf, 3):
        return None
    transform = _ORIENT.get(header.orientation)
    return np.ascontiguousarray(im if transform is None else transform(im))


def _decode_top_rows_pil(data: bytes, h: int, w: int, f: int, rows: int) -> np.ndarray | None:
    """The first ``rows`` rows of the upright JPEG ``data`` of stored size (h, w) decoded at 1/f scale, the decoder
    stopped after them; None when PIL cannot do that for this file.

    PIL's ``draft`` sets libjpeg's DCT scaling (the same libjpeg-turbo decode as simplejpeg's, the same pixels),
    and a decode tile cut to ``rows`` rows makes the decoder stop there. libjpeg then reports the scanlines it was
    not asked for as an error at the end, after the rows are in place: that error is expected and ignored once the
    decode loop has finished (PIL clears ``tile`` then). An error that stops the loop itself (data that ends
    before those rows) gives None, and the caller decodes the file the usual way.
    """
    hf, wf = -(-h // f), -(-w // f)
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.draft("RGB", (w // f, h // f))  # PIL picks the largest scale that keeps at least this size: 1/f
            if im.mode != "RGB" or im.size != (wf, hf) or len(im.tile) != 1:
                return None
            tile = im.tile[0]
            cut = (tile[0], (0, 0, wf, rows), *tile[2:])
            im.tile = [type(tile)(*cut) if hasattr(tile, "_fields") else cut]
            im._size = (wf, rows)
            try:
                im.load()
            except OSError:
                if im.tile:  # the decode loop did not finish
                    return None
            out = np.asarray(im)
            return out if out.shape == (rows, wf, 3) else None
    except Exception:
        return None


def read_image_reduced(
    path: str | os.PathLike, min_long_side: int, top: float = 1.0
) -> tuple[np.ndarray, tuple[int, int]]:
    """Read an image as RGB uint8 (h, w, 3), EXIF orientation applied, decoded no larger than a consumer that
    shrinks it to long side ``min_long_side`` needs.

    The file is read once. A JPEG (by its header, :func:`~yolo5l.data.jpeg_header.read_jpeg_header`, whatever its
    name) of long side at least ``2 * min_long_side`` is decoded at 1/f scale by libjpeg-turbo (f =
    :func:`dct_scale`), which gives ``ceil(h0 / f) x ceil(w0 / f)``: still at least ``min_long_side`` on the long
    side, so the consumer only ever shrinks it. The decoder is simplejpeg (the EXIF orientation from the header
    applied to its output) when it is installed and accepts the file, else OpenCV's reduced mode (which applies the
    orientation itself). Everything else (other formats, small JPEGs) and any failure of both reduced decodes is
    :func:`read_image`'s decode of the same bytes, unchanged. OpenCV's reduced modes on a non-JPEG would decode in
    full and then shrink with a cheap filter, hence the format check.

    With ``top < 1`` the consumer needs only that fraction of the image, from the top. An upright JPEG (no EXIF
    rotation or mirroring), decoded at 1/f or at full size (f = 1), may then come back cut after row
    ``ceil(top * hf) + ceil(max(hf, wf) / min_long_side) + 2`` of the ``hf x wf`` decode (the rows that a bilinear
    resize of that fraction to long side ``min_long_side`` reads), identical to those rows of the whole decode: the
    decoder stops there (:func:`_decode_top_rows_pil`). When that is most of the image (from
    :data:`_TOP_DECODE_MAX_FRACTION` of the rows at reduced scale, :data:`_TOP_DECODE_MAX_FRACTION_FULL` at full
    size), or not possible, the whole image is decoded.

    Args:
        path: Image file.
        min_long_side: The long side the consumer resizes to.
        top: The fraction of the image's height, from the top, that the consumer reads.

    Returns:
        ``(image, (h0, w0))``: the image, and the full-size (h, w) after EXIF orientation, which equals the
        image's shape when it was decoded whole at full size. An image cut by ``top`` has the width of the whole
        decode, ``ceil(w0 / f)``, and fewer rows than ``ceil(h0 / f)``.

    Raises:
        ImageReadError: The file is missing or cannot be decoded.
    """
    path = os.fspath(path)
    data = _read_bytes(path)
    header = read_jpeg_header(data)
    if header is not None:
        h, w = header.height, header.width
        h0, w0 = (w, h) if header.orientation in _ROTATED_90 else (h, w)
        f = dct_scale(h0, w0, min_long_side)
        if top < 1 and header.orientation == _UPRIGHT:
            hf, wf = -(-h // f), -(-w // f)
            rows = math.ceil(top * hf) + math.ceil(max(hf, wf) / min_long_side) + 2
            if rows < (_TOP_DECODE_MAX_FRACTION if f > 1 else _TOP_DECODE_MAX_FRACTION_FULL) * hf:
                im = _decode_top_rows_pil(data, h, w, f, max(rows, 1))
                if im is not None:
                    return im, (h0, w0)
        if f > 1:
            im = _decode_simplejpeg(data, header, f)
            if im is not None:
                return im, (h0, w0)
            # BGR; OpenCV applies the EXIF orientation itself. The shape check catches a header that disagrees with
            # the decoder (size or orientation).
            im = _imdecode(path, np.frombuffer(data, np.uint8), _REDUCED_FLAGS[f])
            if im is not None and im.shape == (-(-h0 // f), -(-w0 // f), 3):
                return cv2.cvtColor(im, cv2.COLOR_BGR2RGB), (h0, w0)
    im = _decode_full(path, data, header)
    return im, (im.shape[0], im.shape[1])


def _png_orientation_after_idat(im: Image.Image) -> int | None:
    """The EXIF orientation in a PNG's eXIf chunk that follows the image data, or None when there is none; read by
    walking the chunk headers of the file (the image data is skipped, never inflated)."""
    path = getattr(im, "filename", None)
    if not path:
        return None
    with open(path, "rb") as f:
        f.seek(_PNG_SIGNATURE_BYTES)
        while len(head := f.read(_PNG_CHUNK_HEAD.size)) == _PNG_CHUNK_HEAD.size:
            length, kind = _PNG_CHUNK_HEAD.unpack(head)
            if kind == b"IEND":
                break
            if kind == b"eXIf":
                exif = Image.Exif()
                exif.load(f.read(length))
                return exif.get(_EXIF_ORIENTATION)
            f.seek(length + _PNG_CRC_BYTES, os.SEEK_CUR)
    return None


def exif_hw(im: Image.Image) -> tuple[int, int]:
    """(height, width) of an open PIL image once its EXIF orientation is applied (from the header only).

    PIL's ``PngImageFile.getexif`` decodes the whole image when no eXIf chunk precedes the image data, to find one
    that follows it (OpenCV applies that one too). Here such a chunk is looked up by walking the chunk headers, and
    without one the base ``Image.getexif`` reads what the chunks before the image data hold.
    """
    w, h = im.size
    with contextlib.suppress(Exception):
        orientation = None
        if im.format == "PNG" and "exif" not in im.info:
            orientation = _png_orientation_after_idat(im)
            if orientation is None:
                orientation = Image.Image.getexif(im).get(_EXIF_ORIENTATION)
        else:
            orientation = im.getexif().get(_EXIF_ORIENTATION)
        if orientation in _ROTATED_90:
            return w, h
    return h, w
