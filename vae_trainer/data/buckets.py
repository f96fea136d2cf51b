"""Aspect-ratio buckets: shapes of about resolution^2 pixels, 1:2 to 2:1, sides multiples of 8 (docs/data.md)."""

from __future__ import annotations

import math

BUCKET_MULTIPLE = 8  # the downsampling factor of the SD, SDXL and FLUX VAEs
MAX_ASPECT_RATIO = 2.0


def bucket_shapes(resolution: int, multiple: int = BUCKET_MULTIPLE,
                  max_aspect: float = MAX_ASPECT_RATIO) -> list[tuple[int, int]]:
    """The (width, height) buckets for `resolution` (a multiple of `multiple`), widest first; the grid step is
    resolution / 16 rounded to a multiple of `multiple` (64 px at 1024, as SDXL's buckets)."""
    if resolution % multiple:
        raise ValueError(f"aspect-ratio buckets need a resolution that is a multiple of {multiple}, got {resolution}")
    step = multiple * max(1, round(resolution / (16 * multiple)))
    area = resolution * resolution
    shapes = {(resolution, resolution)}
    for width in range(step, int(resolution * math.sqrt(max_aspect)) + step + 1, step):
        height = (area // width) // step * step
        if height >= step and max(width / height, height / width) <= max_aspect:
            shapes |= {(width, height), (height, width)}
    return sorted(shapes, key=lambda shape: -shape[0] / shape[1])


def nearest_bucket(width: int, height: int, shapes: list[tuple[int, int]]) -> int:
    """Index of the bucket whose aspect ratio is nearest to width/height (in log ratio)."""
    ratio = math.log(width / height)
    return min(range(len(shapes)), key=lambda i: abs(math.log(shapes[i][0] / shapes[i][1]) - ratio))
