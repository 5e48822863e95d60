"""Input image decoding (engine_lib/images.py): what `load_image` accepts, decoded as it decodes it; hostile
files refused with an InvalidInputError naming the input, quickly and without decoding their pixels."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import numpy as np
import pytest
from diffusers.utils import load_image
from PIL import Image

from engine_lib import images
from engine_lib.images import decode_image
from engine_lib.request import InvalidInputError
from tests.helpers.hostile_images import (base64_forms, encode, hostile, near_the_byte_limit, odd_but_valid,
                                          png_header_only)

RNG = np.random.default_rng(0)


def rgb(width: int = 24, height: int = 16) -> Image.Image:
    return Image.fromarray(RNG.integers(0, 256, (height, width, 3), dtype=np.uint8))


def as_load_image(data: bytes) -> np.ndarray:
    """What diffusers' load_image makes of the same file."""
    return np.asarray(load_image(Image.open(io.BytesIO(data))))


def refused(data, fragment: str = "") -> str:
    with pytest.raises(InvalidInputError) as info:
        decode_image(data, "image")
    message = str(info.value)
    assert message.startswith("input 'image': "), message
    assert fragment in message, message
    return message


@pytest.mark.parametrize("make", [
    lambda: encode(rgb()),
    lambda: encode(rgb(), "JPEG", quality=90),
    lambda: encode(rgb(), "WEBP", lossless=True),
    lambda: encode(rgb().convert("P", palette=Image.Palette.ADAPTIVE)),
    lambda: encode(rgb().convert("RGBA")),
    lambda: encode(rgb().convert("LA")),
    lambda: encode(rgb().convert("CMYK"), "JPEG"),
    lambda: encode(rgb().convert("L")),
], ids=["png", "jpeg", "webp", "palette", "rgba", "la", "cmyk-jpeg", "gray"])
def test_accepted_files_decode_as_load_image_does(make):
    data = make()
    decoded = decode_image(data)
    assert decoded.image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(decoded.image), as_load_image(data))
    assert decode_image(base64.b64encode(data)) == decoded  # base64 text (HTTP JSON) is the same image


def test_exif_rotation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 clockwise to display
    data = encode(rgb(24, 16), "JPEG", exif=exif)
    decoded = decode_image(data)
    assert decoded.size == (16, 24)
    np.testing.assert_array_equal(np.asarray(decoded.image), as_load_image(data))


def test_an_animation_gives_its_first_frame_without_decoding_the_rest():
    frames = [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(500)]
    data = encode(frames[0], "PNG", save_all=True, append_images=frames[1:])  # APNG, 500 frames
    start = time.monotonic()
    decoded = decode_image(data)
    assert time.monotonic() - start < 1.0  # generous: the 499 other frames are never decoded
    assert decoded.image.getpixel((0, 0)) == (0, 0, 0)


def test_hostile_files_are_refused_by_name():
    start = time.monotonic()
    refused(png_header_only(100_000, 100_000), "at most 16777216 allowed")  # 10^10 pixels in 100 bytes
    assert time.monotonic() - start < 1.0
    refused(png_header_only(images.MAX_IMAGE_PIXELS // 1000 + 1, 1000), "pixels")
    refused(encode(rgb(64, 64))[:200], "cannot be decoded")  # truncated
    refused(bytes(RNG.integers(0, 256, 4096, dtype=np.uint8)), "not a PNG, JPEG or WebP")
    refused(b"", "empty")
    refused(np.bytes_(b""), "empty")
    refused("a red cube", "not a PNG, JPEG or WebP")  # a text string
    refused(12, "must be an encoded image")
    frames = [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(500)]
    refused(encode(frames[0], "GIF", save_all=True, append_images=frames[1:]), "not a PNG, JPEG or WebP")
    refused(encode(rgb(), "BMP"), "not a PNG, JPEG or WebP")
    gray16 = Image.fromarray((RNG.integers(0, 65536, (8, 8))).astype(np.uint16))
    refused(encode(gray16), "16-bit")
    refused(b"\x89PNG\r\n\x1a\n" + b"\0" * images.MAX_IMAGE_BYTES, "bytes of image file allowed")


def test_sixteen_bit_rgb_keeps_its_high_bytes():
    """Pillow reads 48-bit RGB PNG as 8-bit RGB (the high byte), as load_image does."""
    pixels = RNG.integers(0, 65536, (4, 4, 3)).astype(">u2")
    rows = b"".join(b"\0" + row.tobytes() for row in pixels)
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    np.testing.assert_array_equal(np.asarray(decode_image(data).image), (pixels >> 8).astype(np.uint8))


def test_equal_files_give_equal_hashable_values():
    data = encode(rgb())
    assert hash(decode_image(data)) == hash(decode_image(data))
    assert decode_image(data) != decode_image(encode(rgb()))
    assert "sha256" in repr(decode_image(data))


def test_the_hostile_list_is_refused_naming_each_input():
    """Every hostile file, as an `image` and as a `mask_image` (one decoder, its error naming the input), at
    once: none is decoded past its header."""
    start = time.monotonic()
    for name, (data, fragment) in hostile().items():
        for input_name in ("image", "mask_image"):
            with pytest.raises(InvalidInputError) as info:
                decode_image(data, input_name)
            assert str(info.value).startswith(f"input '{input_name}': ") and fragment in str(info.value), \
                (name, str(info.value))
    assert time.monotonic() - start < 2.0  # generous: 16 refusals, the largest file 20 MB of zeros


@pytest.mark.parametrize("name", sorted(odd_but_valid()))
def test_odd_but_valid_files_decode_as_load_image_does(name):
    data = odd_but_valid()[name]
    np.testing.assert_array_equal(np.asarray(decode_image(data, "mask_image").image), as_load_image(data))


def test_every_base64_form_a_client_writes_is_the_file():
    """MIME line breaks (LF and CRLF), surrounding spaces, the URL-safe alphabet, no padding, data: URLs: each is
    the same image as the file itself (the file's base64 holds + and / and padding, so each form changes it)."""
    data = encode(rgb(24, 17))
    assert b"+" in base64.b64encode(data) and b"/" in base64.b64encode(data) and len(data) % 3
    decoded = decode_image(data)
    for name, text in base64_forms(data).items():
        assert decode_image(text) == decoded and decode_image(text.decode()) == decoded, name


@pytest.mark.parametrize("text, says", [
    (b"data:image/png," + base64.b64encode(encode(rgb())), "not a PNG, JPEG or WebP file"),  # a data: URL, not base64
    (base64.b64encode(encode(rgb()))[:-5] + b"*" + base64.b64encode(encode(rgb()))[-4:], "nor base64 text"),
    (base64.b64encode(encode(rgb()))[:4 * 20 + 1], "nor base64 text"),  # 4k + 1 characters: no whole byte count
    (b"=" + base64.b64encode(encode(rgb())), "nor base64 text"),
])
def test_text_that_is_no_base64_of_a_file_is_refused(text, says):
    refused(text, says)


def padded_png(data: bytes, size: int) -> bytes:
    """The PNG `data` grown to exactly `size` bytes by a private ancillary chunk (decoders skip it)."""
    end = data.rindex(b"IEND") - 4
    body = b"\0" * (size - len(data) - 12)
    chunk = struct.pack(">I", len(body)) + b"prVt" + body + struct.pack(">I", zlib.crc32(b"prVt" + body))
    return data[:end] + chunk + data[end:]


def test_the_byte_limit_is_exact_for_a_file_and_for_its_base64():
    """A file of exactly MAX_IMAGE_BYTES is taken, as bytes and as MIME base64 text (11.3 MB with its line
    breaks); one byte more is refused either way; a real PNG between 6 and 8 MiB as MIME base64 decodes."""
    small = encode(rgb(24, 16))
    at_limit = padded_png(small, images.MAX_IMAGE_BYTES)
    assert len(at_limit) == images.MAX_IMAGE_BYTES
    np.testing.assert_array_equal(np.asarray(decode_image(at_limit).image), np.asarray(decode_image(small).image))
    assert decode_image(base64.encodebytes(at_limit)) == decode_image(at_limit)
    over = padded_png(small, images.MAX_IMAGE_BYTES + 1)
    for data in (over, base64.encodebytes(over), b"data:image/png;base64," + base64.urlsafe_b64encode(over)):
        refused(data, f"{images.MAX_IMAGE_BYTES + 1} bytes; at most {images.MAX_IMAGE_BYTES} bytes")
    big = near_the_byte_limit()
    assert decode_image(base64_forms(big)["mime-lines"]).size == (1600, 1600)


def test_the_pixel_and_side_limits_are_exact():
    """4096 x 4096 (the pixel limit) and 8192 x 2048 (the side limit) decode; one pixel more, or one side over
    8192 inside the area, is refused from the header: the refused files' data would not even decode."""
    for width, height in ((4096, 4096), (images.MAX_IMAGE_SIDE, images.MAX_IMAGE_PIXELS // images.MAX_IMAGE_SIDE)):
        assert decode_image(encode(Image.new("RGB", (width, height)))).size == (width, height)
    refused(png_header_only(4097, 4096), f"at most {images.MAX_IMAGE_PIXELS} allowed")
    for width, height in ((images.MAX_IMAGE_SIDE + 1, 2047), (1, images.MAX_IMAGE_PIXELS), (images.MAX_IMAGE_PIXELS, 1)):
        assert width * height <= images.MAX_IMAGE_PIXELS
        refused(png_header_only(width, height), f"has a side over {images.MAX_IMAGE_SIDE} pixels")
