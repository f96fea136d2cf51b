"""Encoded image bytes to a training crop: base64 -> bytes -> EXIF-upright 8-bit sRGB (with its alpha for a
4-channel VAE) -> uint8 crop; an unusable input raises :class:`BadImage` with a short ``reason`` (one of
position.SKIP_REASONS)."""

import binascii
import functools
import io
import re
import warnings

import numpy as np
from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

# The filter that resizes every image (PIL's bicubic widens its kernel when shrinking: it antialiases).
RESAMPLING = Image.Resampling.BICUBIC

_WHITESPACE = re.compile(rb"\s+")
_URLSAFE_TO_STANDARD = bytes.maketrans(b"-_", b"+/")
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_ORIENTATION = 0x0112
_TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
_ICC_MODES = {"RGB": ("RGB ", "RGB"), "RGBA": ("RGB ", "RGBA"), "CMYK": ("CMYK", "RGB"), "L": ("GRAY", "RGB")}
_SRGB = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))


class BadImage(ValueError):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def decode_base64(field: str | bytes) -> bytes:
    """Decode standard or urlsafe base64, ignoring whitespace and tolerating missing padding."""
    data = field.encode("ascii", "replace") if isinstance(field, str) else bytes(field)
    try:
        decoded = binascii.a2b_base64(data, strict_mode=True)  # the common case, no regex pass
    except binascii.Error:
        data = _WHITESPACE.sub(b"", data).translate(_URLSAFE_TO_STANDARD)
        data += b"=" * (-len(data) % 4)
        try:
            decoded = binascii.a2b_base64(data, strict_mode=True)
        except binascii.Error as error:
            raise BadImage("base64", str(error)) from None
    if not decoded:
        raise BadImage("base64", "empty field")
    return decoded


def open_image(data: bytes, max_pixels: int, min_size: int = 1) -> Image.Image:
    """Open lazily (header only), refusing images above `max_pixels` or with a side below `min_size`."""
    try:
        with warnings.catch_warnings():
            # Our limit below replaces PIL's warning; its hard error (at twice its default) is reported the same.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:
        raise BadImage("too_large", str(error)) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise BadImage("not_image", str(error)) from None
    check_size(*image.size, max_pixels, min_size)
    return image


def check_size(width: int, height: int, max_pixels: int, min_size: int) -> None:
    if width * height > max_pixels:
        raise BadImage("too_large", f"{width}x{height} > {max_pixels} pixels")
    if min(width, height) < max(min_size, 1):
        raise BadImage("too_small", f"{width}x{height}, shorter side < {min_size}")


def _transposed(image: Image.Image) -> bool:
    try:
        return image.getexif().get(_ORIENTATION) in _TRANSPOSED_ORIENTATIONS
    except Exception:  # a broken EXIF block is ignored here as exif_transpose ignores it
        return False


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of an opened image as it will be displayed (after its EXIF rotation)."""
    width, height = image.size
    return (height, width) if _transposed(image) else (width, height)


@functools.lru_cache(maxsize=32)
def _icc_transform(profile: bytes, mode: str) -> ImageCms.ImageCmsTransform | None:
    try:
        source = ImageCms.ImageCmsProfile(io.BytesIO(profile))
        space, out_mode = _ICC_MODES[mode]
        if "srgb" in (source.profile.profile_description or "").lower() or source.profile.xcolor_space != space:
            return None
        return ImageCms.buildTransform(source, _SRGB, mode, out_mode, ImageCms.Intent.PERCEPTUAL)
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError):
        return None


def has_alpha(image: Image.Image) -> bool:
    """Does an opened image carry transparency: an alpha channel, or a palette's or colour key's transparency?"""
    return image.mode in _ALPHA_MODES or "transparency" in image.info


def load_rgb(image: Image.Image, cover: tuple[int, int] | None = None, alpha: bool = False) -> Image.Image:
    """Decode to EXIF-upright 8-bit sRGB, transparent pixels composited on white (`alpha`: 8-bit RGBA, the image's
    alpha kept, straight, not premultiplied; 255 (opaque) where it has none); a JPEG may be drafted at a reduced
    scale still covering `cover`."""
    if cover is not None:  # libjpeg may decode at 1/2..1/8 scale (`cover` turned as the file stores the image)
        cover = cover[::-1] if _transposed(image) else cover
        scale = max(cover[0] / image.width, cover[1] / image.height)
        image.draft(None, (max(1, int(np.ceil(image.width * scale))), max(1, int(np.ceil(image.height * scale)))))
    try:  # the first frame of animations; broken data counts as truncated
        image.seek(0)
        image.load()
        # An embedded non-sRGB ICC profile converted to sRGB (perceptual); no profile or an unusable one: as is.
        profile = image.info.get("icc_profile")
        transform = _icc_transform(profile, image.mode) if profile and image.mode in _ICC_MODES else None
        if transform is not None:
            converted = ImageCms.applyTransform(image, transform)
            converted.info = {key: value for key, value in image.info.items() if key != "icc_profile"}
            converted.info["exif"] = image.getexif().tobytes()  # keeps the EXIF orientation for exif_transpose
            image = converted
        ImageOps.exif_transpose(image, in_place=True)  # (not in place, it copies even upright images)
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        raise BadImage("truncated", str(error)) from None
    # Any supported mode to 8-bit RGB (RGBA with `alpha`):
    if image.mode in _SIXTEEN_BIT_MODES:  # scaled to 8 bits (PIL's own convert clips)
        values = np.asarray(image).astype(np.float64)
        if not (image.mode == "I" and values.max(initial=0) <= 255):  # (an "I" image may hold 8-bit values already)
            values /= 257.0
        image = Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), mode="L")
    if image.mode == "F":
        image = image.convert("L")
    if image.mode == "RGB" and "transparency" not in image.info:
        return image.convert("RGBA") if alpha else image  # (RGB: convert() would copy it)
    if has_alpha(image):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")  # (convert() would copy an RGBA image)
        return rgba if alpha else Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)),
                                                        rgba).convert("RGB")
    try:
        rgb = image.convert("RGB")
    except (ValueError, OSError) as error:
        raise BadImage("unsupported", f"mode {image.mode}: {error}") from None
    return rgb.convert("RGBA") if alpha else rgb


def crop(image: Image.Image | list[Image.Image], size: tuple[int, int], rng: np.random.Generator | None,
         random_flip: bool, random_crop: bool = True) -> np.ndarray:
    """Cover `size` = (width, height) and crop an RGB(A) image: uint8 [H, W, C]; without `rng` centred and unflipped.
    A clip's frames (a list): every frame cropped and flipped as the first (the same draws), uint8 [T, H, W, C]."""
    frames = image if isinstance(image, list) else [image]
    width, height = frames[0].size
    scale = max(size[0] / width, size[1] / height)
    scaled = (max(size[0], round(width * scale)), max(size[1], round(height * scale)))
    if rng is None or not random_crop:
        left, top = (scaled[0] - size[0]) // 2, (scaled[1] - size[1]) // 2
    else:  # (left drawn first)
        left, top = (int(rng.integers(0, scaled[axis] - size[axis] + 1)) for axis in (0, 1))
    if scaled == (width, height):
        pixels = [np.asarray(frame.crop((left, top, left + size[0], top + size[1]))) for frame in frames]
    else:
        x_scale, y_scale = scaled[0] / width, scaled[1] / height
        box = (left / x_scale, top / y_scale, (left + size[0]) / x_scale, (top + size[1]) / y_scale)
        pixels = [np.asarray(frame.resize(size, RESAMPLING, box=box)) for frame in frames]
    if rng is not None and random_flip and rng.random() < 0.5:
        pixels = [frame[:, ::-1] for frame in pixels]
    return np.stack(pixels) if isinstance(image, list) else np.ascontiguousarray(pixels[0])


def to_float(pixels: np.ndarray, clips: bool = False) -> np.ndarray:
    """uint8 [..., H, W, C] -> float32 [..., C, H, W] in [-1, 1] (one allocation); `clips`: [..., C, T, H, W]."""
    out = np.ascontiguousarray(np.moveaxis(pixels, -1, -4 if clips else -3), dtype=np.float32)
    out /= 127.5
    out -= 1.0
    return out
