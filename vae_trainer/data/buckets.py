"""Aspect-ratio buckets: shapes of about resolution^2 pixels, 1:2 to 2:1, sides multiples of 8 (docs/data.md)."""

import math

BUCKET_MULTIPLE = 8  # the downsampling factor of the SD, SDXL and FLUX VAEs
MAX_ASPECT_RATIO = 2.0

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("aspect_ratio_buckets",), lambda f: f.aspect_ratio_buckets and f.input_size is not None,
     "it cannot be combined with --input_size (one fixed encoder input; each bucket has its own shape): drop one"),
    (("aspect_ratio_buckets",), lambda f: f.aspect_ratio_buckets and f.resolution % BUCKET_MULTIPLE,
     f"it needs a --resolution that is a multiple of {BUCKET_MULTIPLE} (bucket sides are)"),
)


def bucket_shapes(resolution: int) -> list[tuple[int, int]]:
    """The (width, height) buckets for `resolution` (a multiple of 8: REFUSALS refuse others when parsing), widest
    first; the grid step is resolution / 16 rounded to a multiple of 8 (64 px at 1024, as SDXL's buckets)."""
    step = BUCKET_MULTIPLE * max(1, round(resolution / (16 * BUCKET_MULTIPLE)))
    shapes = {(resolution, resolution)}
    for width in range(step, int(resolution * math.sqrt(MAX_ASPECT_RATIO)) + step + 1, step):
        height = (resolution * resolution // width) // step * step
        if height >= step and max(width / height, height / width) <= MAX_ASPECT_RATIO:
            shapes |= {(width, height), (height, width)}
    return sorted(shapes, key=lambda shape: -shape[0] / shape[1])


def nearest_bucket(width: int, height: int, shapes: list[tuple[int, int]]) -> int:
    """Index of the bucket whose aspect ratio is nearest to width/height (in log ratio)."""
    ratio = math.log(width / height)
    return min(range(len(shapes)), key=lambda i: abs(math.log(shapes[i][0] / shapes[i][1]) - ratio))
