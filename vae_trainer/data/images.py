"""Turning one sample's image field into a training tensor: base64 -> bytes -> RGB image -> array.

Everything that makes an input unusable is reported as :class:`BadImage` with a short machine
``reason`` (one of :data:`REASONS`), so the stream can count skips per reason.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# Why a sample was skipped. "columns" and "corrupt_gzip" are raised by the stream, not here.
REASONS = ("columns", "base64", "not_image", "truncated", "too_small", "too_large", "unsupported")

# The filter that resizes every image's shorter side (training and evaluation; evaluation.EvalProtocol states it).
# PIL's bicubic widens its kernel when shrinking, i.e. it antialiases.
RESAMPLING = Image.Resampling.BICUBIC

_WHITESPACE = re.compile(rb"\s+")
_URLSAFE_TO_STANDARD = bytes.maketrans(b"-_", b"+/")
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


class BadImage(ValueError):
    """An unusable sample; `reason` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def decode_base64(field: str | bytes) -> bytes:
    """Decode standard or urlsafe base64, ignoring whitespace and tolerating missing padding."""
    data = field.encode("ascii", "replace") if isinstance(field, str) else bytes(field)
    data = _WHITESPACE.sub(b"", data).translate(_URLSAFE_TO_STANDARD)
    data += b"=" * (-len(data) % 4)
    try:
        decoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadImage("base64", str(error)) from None
    if not decoded:
        raise BadImage("base64", "empty field")
    return decoded


def _open(data: bytes, max_pixels: int, min_size: int) -> Image.Image:
    """Open lazily and check the size before any pixel is decoded."""
    try:
        with warnings.catch_warnings():
            # Our own limit below replaces PIL's process-wide default; PIL's hard error at twice its
            # default still applies to anything larger and is reported the same way.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:
        raise BadImage("too_large", str(error)) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise BadImage("not_image", str(error)) from None
    width, height = image.size
    if width * height > max_pixels:
        raise BadImage("too_large", f"{width}x{height} > {max_pixels} pixels")
    if min(width, height) < max(min_size, 1):
        raise BadImage("too_small", f"{width}x{height}, shorter side < {min_size}")
    return image


def _load(image: Image.Image) -> Image.Image:
    """Decode the pixels (first frame of animations); broken data counts as truncated."""
    try:
        image.seek(0)
        image.load()
        return ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        raise BadImage("truncated", str(error)) from None


def _sixteen_bit_to_l(image: Image.Image) -> Image.Image:
    """Scale 16-bit grey to 8 bits (PIL's own convert clips instead of scaling)."""
    values = np.asarray(image).astype(np.float64)
    if image.mode == "I" and values.max(initial=0) <= 255:
        scaled = values  # an "I" image that already holds 8-bit values
    else:
        scaled = values / 257.0
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L")


def _has_transparency(image: Image.Image) -> bool:
    return image.mode in _ALPHA_MODES or "transparency" in image.info


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any supported mode -> 8-bit RGB; transparent pixels are composited on white."""
    if image.mode in _SIXTEEN_BIT_MODES:
        image = _sixteen_bit_to_l(image)
    if image.mode == "F":
        image = image.convert("L")
    if _has_transparency(image):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    try:
        return image.convert("RGB")
    except (ValueError, OSError) as error:
        raise BadImage("unsupported", f"mode {image.mode}: {error}") from None


def decode_image(data: bytes, max_pixels: int, min_size: int = 1) -> Image.Image:
    """Decode image bytes to an EXIF-upright 8-bit RGB image, or raise :class:`BadImage`.

    Sizes are checked from the header before decoding: more than `max_pixels` pixels is
    "too_large" (a decompression bomb), a shorter side below `min_size` is "too_small".
    """
    image = _open(data, max_pixels, min_size)
    return _to_rgb(_load(image))


def _resized_to_shorter_side(image: Image.Image, resolution: int) -> Image.Image:
    width, height = image.size
    scale = resolution / min(width, height)
    size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    if size == image.size:
        return image
    return image.resize(size, RESAMPLING)


def preprocess(
    image: Image.Image, resolution: int, rng: np.random.Generator | None, random_flip: bool
) -> np.ndarray:
    """Resize the shorter side to `resolution`, crop a square, maybe flip; float32 [3,H,W] in [-1,1].

    With `rng` the crop is random and, if `random_flip`, the image is mirrored with p=0.5; without
    `rng` the crop is centred and nothing is flipped.
    """
    image = _resized_to_shorter_side(image.convert("RGB"), resolution)
    width, height = image.size
    if rng is None:
        left, top = (width - resolution) // 2, (height - resolution) // 2
    else:
        left = int(rng.integers(0, width - resolution + 1))
        top = int(rng.integers(0, height - resolution + 1))
    pixels = np.asarray(image.crop((left, top, left + resolution, top + resolution)))
    if rng is not None and random_flip and rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    return (pixels.transpose(2, 0, 1).astype(np.float32) / 127.5 - 1.0).copy()
