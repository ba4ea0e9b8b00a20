"""Images in tasks (docs/vision.md): read once when the taskset loads, checked and normalised
with Pillow, and named by the hash of their normalised bytes.

An image may be given as a path (relative to the taskset's folder, or absolute), as bytes, as
a `datasets` / Parquet image cell (`{"bytes": ..., "path": ...}`), or as an OpenAI content
part's `data:` URL. Whatever the source, `normalise` returns the same thing: a PNG of the RGB
pixels, so the bytes (and their hash) depend on the picture alone, never on how it was stored.
That hash is the image's name from then on: an experience refers to it, and the buffer stores
each image once (docs/design.md §3).

Checks, in order, before any pixel is decoded: at most `MAX_IMAGE_BYTES` of input, one of
`FORMATS`, at most `MAX_IMAGE_PIXELS` pixels by the header (the decompression-bomb guard: a
small file that claims a huge canvas is refused before Pillow allocates it), then a full decode
that must succeed (a truncated or corrupt file fails here, not later in an engine). Pillow is
imported on first use, so a taskset without images never loads it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path
from typing import Any

from .errors import ConfigError

MAX_IMAGE_BYTES = 32 * 1024 * 1024  # encoded input
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height, checked from the header before decoding
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


class BadImage(ValueError):
    """An image that cannot be used: unreadable, not an image, too large, or corrupt."""


def image_hash(data: bytes) -> str:
    """The content name of normalised image bytes: 128-bit BLAKE2b, hex."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def normalise(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> bytes:
    """`data` (an encoded image) checked and re-encoded as an RGB PNG; BadImage says why not."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError(["master.taskset: a task carries images, which need Pillow: "
                           "pip install 'tandem-common[vision]'"]) from None

    if len(data) > MAX_IMAGE_BYTES:
        raise BadImage(f"is {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES}")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            width, height = im.size
            if width < 1 or height < 1:
                raise BadImage(f"is {width}x{height} pixels")
            if width * height > max_pixels:
                raise BadImage(f"is {width}x{height} pixels, over the limit of {max_pixels} "
                               "(a decompression-bomb guard)")
            im.load()
            rgb = im.convert("RGB")
    except BadImage:
        raise
    except UnidentifiedImageError:
        raise BadImage(f"is not an image in a known format ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError as exc:
        raise BadImage(f"is refused as a decompression bomb: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:  # truncated, corrupt: Pillow's own words
        raise BadImage(f"cannot be decoded: {' '.join(str(exc).split())}") from None
    out = io.BytesIO()
    rgb.save(out, format="PNG")
    return out.getvalue()


def image_bytes(value: Any, base: Path | None) -> bytes:
    """The encoded bytes an image value names: bytes, a path (relative to `base`), a `data:`
    URL, or a `datasets` image cell `{"bytes": ..., "path": ...}`; BadImage says why not."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return image_bytes(value["bytes"], base)
        if value.get("path"):
            return image_bytes(str(value["path"]), base)
        raise BadImage("is a mapping with neither bytes nor path")
    if isinstance(value, str):
        if value.startswith("data:"):
            head, sep, payload = value.partition(",")
            if not sep or not head.endswith(";base64"):
                raise BadImage("is a data: URL that is not base64")
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise BadImage("is a data: URL whose base64 does not decode") from None
        if "://" in value:
            raise BadImage(f"is a URL ({value[:60]}); tandem reads local files only: download "
                           "it into the taskset's folder")
        path = Path(value)
        if not path.is_absolute() and base is not None:
            path = base / path
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise BadImage(f"file {str(path)!r} cannot be read: {exc.strerror}") from None
        if size > MAX_IMAGE_BYTES:
            raise BadImage(f"file {str(path)!r} is {size} bytes, over the limit of "
                           f"{MAX_IMAGE_BYTES}")
        try:
            return path.read_bytes()
        except OSError as exc:
            raise BadImage(f"file {str(path)!r} cannot be read: {exc.strerror}") from None
    raise BadImage(f"must be a path, bytes or {{bytes, path}}, got {type(value).__name__}")


def load_image(value: Any, base: Path | None) -> bytes:
    """`image_bytes` then `normalise`: the image's normalised PNG bytes."""
    return normalise(image_bytes(value, base))


def image_parts(messages: list[dict[str, Any]]) -> list[Any]:
    """The image values of chat messages' content parts, in order: OpenAI's
    `{"type": "image_url", "image_url": {"url": ...}}` (or `"image_url": "..."`) and the
    processor style `{"type": "image", "image": ...}`."""
    found = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            found += [part_image(p) for p in content if is_image_part(p)]
    return found


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def part_image(part: dict[str, Any]) -> Any:
    """The image value of one image content part."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image")


def placeholder_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each image part replaced by `{"type": "image"}`: the form a processor's
    chat template expands into the model's image placeholder tokens; the images themselves go
    beside the messages, in the same order."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [{"type": "image"} if is_image_part(p) else p
                                  for p in content]}
        out.append(m)
    return out


__all__ = [
    "FORMATS",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "BadImage",
    "image_bytes",
    "image_hash",
    "image_parts",
    "is_image_part",
    "load_image",
    "normalise",
    "part_image",
    "placeholder_messages",
]
