"""Image files a client may send as `image` or `mask_image`: the hostile ones, each with a fragment of the error
that refuses it (engine_lib/images.py), and odd but valid ones, decoded as diffusers' `load_image` decodes them.
Shared by the decoder's unit tests, the front door's edits tests and the served check over gRPC."""

from __future__ import annotations

import base64
import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image

from engine_lib import images


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def rgb(width: int = 24, height: int = 16, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def random_png(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A PNG of random RGB pixels drawn from `rng` (a test's own seeded generator: its images stay the same)."""
    return encode(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height and whose data is a few bytes: a decompression bomb."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


@functools.cache
def hostile() -> dict[str, tuple[bytes, str]]:
    """name -> (file, a fragment of the decoder's error)."""
    frames = [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(500)]
    gray16 = Image.fromarray(np.random.default_rng(1).integers(0, 65536, (8, 8)).astype(np.uint16))
    jpeg = encode(rgb(64, 64), "JPEG")
    sof = jpeg.index(b"\xff\xc0") + 5  # the baseline frame header's height and width
    jpeg_bomb = jpeg[:sof] + struct.pack(">HH", 65000, 65000) + jpeg[sof + 4:]
    return {
        "empty": (b"", "empty"),
        "zeros-20MB": (b"\0" * (20 << 20), f"at most {images.MAX_IMAGE_BYTES} bytes"),
        "png-bomb": (png_header_only(100_000, 100_000), f"at most {images.MAX_IMAGE_PIXELS} allowed"),
        "jpeg-bomb": (jpeg_bomb, f"at most {images.MAX_IMAGE_PIXELS} allowed"),
        # inside the pixel limit, but 16 million rows: 1.5 s of decoder CPU were it decoded (its data is not)
        "png-tall": (png_header_only(1, images.MAX_IMAGE_PIXELS), f"at most {images.MAX_IMAGE_SIDE} a side"),
        "truncated-png": (encode(rgb(64, 64))[:200], "cannot be decoded"),
        "truncated-jpeg": (jpeg[:300], "cannot be decoded"),
        "gif-500-frames": (encode(frames[0], "GIF", save_all=True, append_images=frames[1:]), "not a PNG, JPEG or WebP"),
        "gray-16-bit": (encode(gray16), "16-bit"),
    }


@functools.cache
def odd_but_valid() -> dict[str, bytes]:
    """Files `load_image` reads, which the decoder takes as it does (CMYK, palette with transparency, alpha, EXIF
    rotation, an animated WebP's first frame)."""
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 clockwise to display
    frames = [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(20)]
    return {
        "cmyk-jpeg": encode(rgb(40, 48, 1).convert("CMYK"), "JPEG"),
        "palette-transparent": encode(rgb(48, 40, 2).convert("P", palette=Image.Palette.ADAPTIVE), transparency=0),
        "rgba": encode(rgb(32, 32, 3).convert("RGBA")),
        "exif-rotated": encode(rgb(48, 32, 4), "JPEG", exif=exif),
        "animated-webp": encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True),
    }


def base64_forms(data: bytes) -> dict[str, bytes]:
    """The file as base64 text in each form clients' encoders write it (Python's `base64`, the `base64` command,
    browsers' data: URLs, JSON web tokens' URL-safe unpadded alphabet): name -> text."""
    plain = base64.b64encode(data)
    return {
        "plain": plain,
        "mime-lines": base64.encodebytes(data),  # 76 columns and a newline, as the `base64` command prints
        "crlf-lines": base64.encodebytes(data).replace(b"\n", b"\r\n"),
        "surrounding-spaces": b"  \t" + plain + b" \n",
        "url-safe": base64.urlsafe_b64encode(data),
        "unpadded": plain.rstrip(b"="),
        "data-url": b"data:image/png;base64," + plain,
        "data-url-url-safe-unpadded": b"data:image/png;base64," + base64.urlsafe_b64encode(data).rstrip(b"="),
    }


@functools.cache
def near_the_byte_limit() -> bytes:
    """A PNG of random pixels between 6 and 8 MiB (1600 x 1600 x 3 bytes do not compress): as MIME base64
    (about 10 MB of text) it still fits every limit."""
    data = encode(rgb(1600, 1600, 7), compress_level=1)
    assert 6 << 20 < len(data) <= images.MAX_IMAGE_BYTES, len(data)
    return data
