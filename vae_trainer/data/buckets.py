"""Aspect-ratio buckets (shapes of about resolution^2 pixels, 1:2 to 2:1, sides multiples of 8) and the
per-shard batcher that emits batches of one shape each (docs/data.md, "How the stream works")."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

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


class Batcher:
    """One shard's waiting (record index, uint8 pixels) per bucket; emits a bucket's batch once it is full."""

    def __init__(self, num_buckets: int, batch_size: int) -> None:
        self.batch_size = batch_size
        self.waiting: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(num_buckets)]

    def add(self, bucket: int, index: int, pixels: np.ndarray) -> np.ndarray | None:
        """Queue one sample; return the bucket's stacked uint8 batch [B,H,W,3] once it is full."""
        self.waiting[bucket].append((index, pixels))
        return self._take(bucket) if len(self.waiting[bucket]) == self.batch_size else None

    def flush(self) -> Iterator[np.ndarray]:
        """Every non-empty bucket's samples as one (smaller) batch, in bucket order (lazily: the others stay
        pending until their turn)."""
        for bucket in range(len(self.waiting)):
            if self.waiting[bucket]:
                yield self._take(bucket)

    def pending(self) -> list[int]:
        """Record indices of the samples still waiting, ascending."""
        return sorted(index for bucket in self.waiting for index, _ in bucket)

    def _take(self, bucket: int) -> np.ndarray:
        batch = np.stack([pixels for _, pixels in self.waiting[bucket]])
        self.waiting[bucket] = []
        return batch
