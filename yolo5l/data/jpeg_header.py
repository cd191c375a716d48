"""A JPEG's header read from its bytes: size, colour components, coding process and EXIF orientation.

One pass over the marker segments before the image data, in memory: no decoder, no second open of the file. The
device input path asks it which tiles a GPU decoder takes (8-bit baseline or extended-sequential Huffman JPEGs with
three components) and which go through the host decoder (progressive, lossless and arithmetic-coded JPEGs,
greyscale and CMYK/YCCK ones, and anything that is not a JPEG); the host decoders ask it for the orientation.

Reference: ITU-T T.81 (JPEG) Annex B (marker segments); EXIF 2.32 section 4.5 (the TIFF IFD0 in APP1).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

__all__ = ["JpegHeader", "read_jpeg_header"]

_SOI = b"\xff\xd8"
_APP1 = 0xE1
_SOS = 0xDA
_EOI = 0xD9
# Start-of-frame markers: C0 baseline, C1 extended sequential, C2 progressive, C3 lossless (Huffman); C5-C7
# differential; C9-CB and CD-CF the arithmetic-coded ones. C4 (DHT), C8 (JPG) and CC (DAC) are not frames.
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_SEQUENTIAL_HUFFMAN = frozenset({0xC0, 0xC1})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: no length field
_EXIF_ID = b"Exif\x00\x00"
_ORIENTATION_TAG = 0x0112
_SHORT = 3  # TIFF field type of the orientation
_IFD_ENTRY_BYTES = 12


class JpegHeader(NamedTuple):
    """What the header of a JPEG says (``height`` x ``width`` as stored, before the orientation)."""

    height: int
    width: int
    components: int
    precision: int
    sof: int  # the start-of-frame marker's second byte (0xC0 baseline, 0xC2 progressive, ...)
    orientation: int  # EXIF orientation, 1 (upright) when there is none

    @property
    def gpu_decodable(self) -> bool:
        """An 8-bit sequential Huffman JPEG with three components (YCbCr): what nvjpeg's batched decode takes."""
        return self.sof in _SEQUENTIAL_HUFFMAN and self.precision == 8 and self.components == 3


def _exif_orientation(segment: bytes) -> int | None:
    """The orientation in an APP1 segment's EXIF block (the TIFF header and IFD0), or None."""
    if not segment.startswith(_EXIF_ID):
        return None
    tiff = segment[len(_EXIF_ID) :]
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return None
    end = "<" if tiff[:2] == b"II" else ">"
    (ifd,) = struct.unpack_from(end + "I", tiff, 4)
    if ifd + 2 > len(tiff):
        return None
    (count,) = struct.unpack_from(end + "H", tiff, ifd)
    for k in range(count):
        at = ifd + 2 + k * _IFD_ENTRY_BYTES
        if at + _IFD_ENTRY_BYTES > len(tiff):
            return None
        tag, kind, n = struct.unpack_from(end + "HHI", tiff, at)
        if tag == _ORIENTATION_TAG:
            return struct.unpack_from(end + "H", tiff, at + 8)[0] if kind == _SHORT and n >= 1 else None
    return None


def read_jpeg_header(data: bytes | memoryview) -> JpegHeader | None:
    """The header of the JPEG in ``data``, or None when ``data`` is not a JPEG or its header is cut short or damaged.

    Walks the marker segments from SOI up to the first start-of-scan: the frame header gives size, precision and
    components; an APP1 EXIF block gives the orientation (the first one that names it; an unreadable one counts as
    upright, as OpenCV and PIL treat it).
    """
    data = memoryview(data)
    if bytes(data[:2]) != _SOI:
        return None
    pos, n = 2, len(data)
    orientation: int | None = None
    frame: tuple[int, int, int, int, int] | None = None
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker in (_SOS, _EOI):
            break
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if length < 2 or pos + 2 + length > n:
            return None
        body = data[pos + 4 : pos + 2 + length]
        if marker in _SOF and frame is None:
            if len(body) < 6:
                return None
            precision, height, width, components = struct.unpack_from(">BHHB", body, 0)
            frame = (height, width, components, precision, marker)
        elif marker == _APP1 and orientation is None:
            try:
                orientation = _exif_orientation(bytes(body))
            except struct.error:
                orientation = None
        pos += 2 + length
    if frame is None or frame[0] == 0 or frame[1] == 0:
        return None
    height, width, components, precision, sof = frame
    return JpegHeader(height, width, components, precision, sof, orientation if orientation in range(1, 9) else 1)
