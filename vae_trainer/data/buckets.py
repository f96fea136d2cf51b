"""Aspect-ratio buckets, and grouping one shard's samples into batches that each hold one shape.

Shapes (:func:`bucket_shapes`): (width, height) pairs with width * height <= resolution^2 (as close as
the grid allows), aspect ratios from 1:2 to 2:1, both sides multiples of :data:`BUCKET_MULTIPLE` =
8, the downsampling factor of the SD, SDXL and FLUX VAEs (and a multiple of every smaller power of
two, so the tiny test VAEs too): the VAE, LPIPS and the PatchGAN take any such size. The grid step
grows with the resolution (resolution / 16 rounded to a multiple of 8, i.e. 64 px at 1024 as in
SDXL's buckets), which keeps about a dozen buckets at resolutions of 256 and up; the square
resolution x resolution is always one of them. An image
goes to the bucket whose aspect ratio is nearest to its own (in log ratio), is scaled to cover it
and cropped to it.

Batches (:class:`Batcher`): each shard keeps one list per bucket and emits a batch as soon as one
list holds `batch_size` samples, so no shard ever waits for another (ranks may train different
shapes in the same step, which the gradient all-reduce does not mind). Samples still waiting are
"pending"; their record indices go into every batch's position, so a resumed run can put them back
(see :mod:`vae_trainer.data.dataset`). With bucketing, the pending samples are emitted at the end of
each shard epoch as smaller batches, so every image is used once per epoch and no rare shape waits
forever. Without bucketing there is one bucket and batches simply run across epochs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

BUCKET_MULTIPLE = 8
MAX_ASPECT_RATIO = 2.0


def bucket_shapes(resolution: int, multiple: int = BUCKET_MULTIPLE, max_aspect: float = MAX_ASPECT_RATIO) -> list[tuple[int, int]]:
    """The (width, height) buckets for `resolution` (a multiple of `multiple`), widest first."""
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


@dataclass
class Batcher:
    """Per-bucket lists of (record index, uint8 pixels) of one shard; emits full (or flushed) batches."""

    num_buckets: int
    batch_size: int
    waiting: list[list[tuple[int, np.ndarray]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.waiting = [[] for _ in range(self.num_buckets)]

    def add(self, bucket: int, index: int, pixels: np.ndarray) -> np.ndarray | None:
        """Queue one sample; return the bucket's stacked uint8 batch [B,H,W,3] once it is full."""
        self.waiting[bucket].append((index, pixels))
        if len(self.waiting[bucket]) < self.batch_size:
            return None
        return self._take(bucket)

    def flush(self):
        """Every non-empty bucket's samples as one (smaller) batch, in bucket order."""
        for bucket in range(self.num_buckets):
            if self.waiting[bucket]:
                yield self._take(bucket)

    def pending(self) -> list[int]:
        """Record indices of the samples still waiting, ascending."""
        return sorted(index for bucket in self.waiting for index, _ in bucket)

    def _take(self, bucket: int) -> np.ndarray:
        batch = np.stack([pixels for _, pixels in self.waiting[bucket]])
        self.waiting[bucket] = []
        return batch
