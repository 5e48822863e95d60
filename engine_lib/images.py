"""Input images: one encoded file from a request, decoded under explicit limits, as diffusers' `load_image` does.

Every image input (an image to start from or edit, an inpainting mask) goes through `decode_image`, at admission, so a
file that cannot become an RGB image is refused with an InvalidInputError naming the input
before the request is queued, never a crash deep in a tick. What is accepted, and how:

* PNG, JPEG and WebP only (other Pillow decoders are never reached), as the file's bytes or
  as base64 text of them (Triton's HTTP JSON carries BYTES as text), in every form a client's
  encoder writes (`decode_base64`): MIME line breaks (what the `base64` command prints) and
  surrounding spaces, the URL-safe alphabet, no padding, a `data:` URL;
* at most MAX_IMAGE_BYTES of file (8 MiB: its base64 text, 10.7 MiB, still fits the gRPC
  gate's 16 MiB message), MAX_IMAGE_PIXELS pixels (4096 x 4096) and MAX_IMAGE_SIDE pixels a
  side, checked on the size the header declares, before any pixel is decoded (a decompression
  bomb costs nothing; the side limit bounds the decoder's work per row: a PNG of 1 x 16777216
  pixels, inside the area, took up to 1.5 s of CPU, one of 2048 x 8192 takes what 4096 x 4096
  does: `python -m benchmarks.admission_images`);
* animated files (APNG, animated WebP): the first frame, as `load_image` takes it;
* EXIF orientation applied (`ImageOps.exif_transpose`), then `convert("RGB")`, as
  `load_image` does: alpha (LA, RGBA, palette transparency) is dropped, CMYK and palette
  images convert;
* refused: 16-bit and float pixels (Pillow's convert to RGB clips them to near white),
  truncated or corrupt files, empty or unknown data.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from typing import Any

from engine_lib.request import InvalidInputError

MAX_IMAGE_BYTES = 8 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGE_SIDE = 8192  # twice the square's side: a 2:1 panorama at the pixel limit still fits
# Base64 text is bounded at twice the file limit before any work: the base64 of a file at the limit, with
# line breaks and a data: URL's header, is about 1.37 times it.
_MAX_TEXT_BYTES = 2 * MAX_IMAGE_BYTES
_URL_SAFE = bytes.maketrans(b"-_", b"+/")
FORMATS = ("PNG", "JPEG", "WEBP")
# File signatures of the accepted formats: anything else is read as base64 text.
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF")
# Modes `convert("RGB")` would clip or misread instead of converting.
_REFUSED_MODES = ("I", "F")


class InputImage:
    """A decoded input image (an RGB PIL image) that compares and hashes by its file's digest, so
    request params holding it stay hashable and equal files give equal params."""

    __slots__ = ("image", "digest")

    def __init__(self, image: Any, digest: str):
        self.image = image
        self.digest = digest

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), as PIL says it."""
        return self.image.size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InputImage) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"InputImage({self.size[0]}x{self.size[1]}, sha256 {self.digest[:12]})"


def decode_image(data: Any, name: str = "image") -> InputImage:
    """One encoded image (bytes, or base64 text of them) -> an RGB InputImage, or InvalidInputError naming `name`."""
    from PIL import Image, ImageOps, UnidentifiedImageError  # noqa: PLC0415 (only image requests pay the import)

    def fail(message: str) -> InvalidInputError:
        return InvalidInputError(name, message)

    if isinstance(data, str):
        data = data.encode("utf-8", "replace")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise fail(f"must be an encoded image (bytes), got {type(data).__name__}")
    data = bytes(data)
    if len(data) > (MAX_IMAGE_BYTES if data.startswith(_MAGIC) else _MAX_TEXT_BYTES):
        raise fail(f"{len(data)} bytes; at most {MAX_IMAGE_BYTES} bytes of image file allowed")
    if not data.startswith(_MAGIC):
        try:
            data = decode_base64(data)
        except (binascii.Error, ValueError):
            raise fail("is not a PNG, JPEG or WebP file (nor base64 text of one)") from None
    if not data:
        raise fail("is empty: send one PNG, JPEG or WebP file")
    if len(data) > MAX_IMAGE_BYTES:
        raise fail(f"{len(data)} bytes; at most {MAX_IMAGE_BYTES} bytes of image file allowed")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's own bomb warning and palette notes: our limits decide
            image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise fail(f"{width}x{height} is {width * height} pixels; at most {MAX_IMAGE_PIXELS} allowed")
            if max(width, height) > MAX_IMAGE_SIDE:
                raise fail(f"{width}x{height} has a side over {MAX_IMAGE_SIDE} pixels; at most {MAX_IMAGE_SIDE} a side "
                           f"(and {MAX_IMAGE_PIXELS} pixels) allowed")
            if width < 1 or height < 1:
                raise fail(f"has no pixels ({width}x{height})")
            if image.mode.split(";")[0] in _REFUSED_MODES:
                raise fail(f"16-bit or float pixels (mode {image.mode}) are not supported: send an 8-bit image")
            image.seek(0)  # an animation's first frame
            image.load()
            image = ImageOps.exif_transpose(image).convert("RGB")
    except InvalidInputError:
        raise
    except Image.DecompressionBombError:  # Pillow's own check, at open, of sizes far past ours
        raise fail(f"declares more than {MAX_IMAGE_PIXELS} pixels; at most {MAX_IMAGE_PIXELS} allowed") from None
    except UnidentifiedImageError:
        raise fail("is not a PNG, JPEG or WebP file") from None
    except Exception as exc:  # noqa: BLE001 (whatever a hostile file makes a decoder raise refuses the file)
        raise fail(f"cannot be decoded ({type(exc).__name__}: {exc})"[:200]) from None
    return InputImage(image, hashlib.sha256(data).hexdigest())


def decode_base64(text: bytes) -> bytes:
    """The file base64 text holds, in any form a client's encoder writes it: MIME or PEM line breaks and
    surrounding spaces (removed), a `data:[<type>];base64,` URL (its header removed), the URL-safe alphabet
    (`-_` read as `+/`), missing padding (added). Anything else outside the alphabet raises binascii.Error, as
    `base64.b64decode(validate=True)` does."""
    text = b"".join(text.split())  # every ASCII space, tab and line break
    if text[:5].lower() == b"data:":
        header, _, text = text.partition(b",")
        if not header.lower().endswith(b";base64"):
            raise ValueError("a data: URL without ;base64")
    text = text.rstrip(b"=").translate(_URL_SAFE)
    return base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
