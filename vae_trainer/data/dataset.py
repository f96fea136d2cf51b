"""The training stream (infinite, sharded, weighted, bucketed, exactly resumable) and the evaluation loaders.

What is read comes from :mod:`~vae_trainer.data.filelists` (sources of parts),
:mod:`~vae_trainer.data.records` (reading a part), :mod:`~vae_trainer.data.sharding` (which records
a shard reads, in which order), :mod:`~vae_trainer.data.images` (decoding, colour, cropping) and
:mod:`~vae_trainer.data.buckets` (shapes and batches). This module puts them together.

Shards and roles
    ``shard = rank * W + role`` and ``num_shards = world_size * W``, W = max(1, DataLoader
    workers); ``role`` is the worker id (remapped on resume, see below).

Epochs and weights
    In shard epoch e, each source's records are shuffled from (seed, shard, e, source, cycle)
    (:class:`~vae_trainer.data.sharding.SourcePass`). With ``infinite=True`` the sources are
    interleaved record by record: before each record a source is drawn from the RNG (seed, shard,
    e) with probability weight / (sum of weights of the sources that have records in this shard),
    so the expected fraction of *records* (bad ones included) taken from each source is
    proportional to its weight. A source that runs out restarts at once with ``cycle + 1`` (a new
    shuffle); the shard epoch ends when every source has finished its first pass. With
    ``infinite=False`` the sources are read once, one after the other in list order, then the
    stream ends (evaluation).

Batches and positions
    Training batches are made inside the stream (:class:`TrainBatches`; the DataLoader runs with
    ``batch_size=None``), one bucket shape per batch (:mod:`~vae_trainer.data.buckets`). Each batch
    carries ``"position"`` (:mod:`~vae_trainer.data.position`), a list of ints: ``[shard, epoch,
    consumed, *skipped, num_pending, *pending, num_files, *(file, skips)]`` where ``consumed`` = records
    of the shard epoch read up to and including the batch's last sample (bad ones included), ``skipped`` =
    this shard's cumulative skip counts in :data:`~vae_trainer.data.position.SKIP_REASONS` order,
    ``pending`` = record indices (this epoch) of samples waiting in other buckets, and the pairs = this
    shard's cumulative skips per part file (index into ``ImageStream.part_paths``; the worst ones). Per-sample randomness (crop,
    flip) is drawn from an RNG seeded by (seed, shard, epoch, record index), so replaying needs no RNG
    state.

    ``StreamPosition`` (:mod:`~vae_trainer.data.position`) keeps, per shard, the last batch's
    position, and the number of batches consumed B. Paddle's multi-worker DataLoader hands out iterable-dataset batches from workers
    0, 1, ..., W-1, 0, ... in strict rotation, so the next batch of an uninterrupted run would have
    come from worker B % W: on resume worker w plays role (w + B) % W, passes over the records
    before that role's saved position (without reading them when record counts are known),
    decodes the pending ones back into their buckets, and goes on exactly as the uninterrupted
    run would have; its skip counts go on from the saved ones.

Bad records
    Skipped and counted per reason (:data:`~vae_trainer.data.position.SKIP_REASONS`); the counts
    reach the main process in every batch, where ``StreamPosition`` sums them over shards for
    ``data/skipped_<reason>`` (logged by ``train_logging.TrainMonitor``, with an end-of-run summary).
    A part file that has disappeared since the start is ``missing_file`` (each of its counted records,
    or once per pass if uncounted), a part shorter than its ``.counts`` file says is ``missing``. On
    the console (logger ``vae_trainer.data``) each file's first :data:`LOGGED_PER_FILE` problems are
    shown with file:line (or tar:key, or the image path) once per process, a damaged or missing part
    once with its path, then one line saying the rest are only counted. A shard epoch that yields no
    usable sample raises RuntimeError.

Evaluation
    The first ``num_images`` usable records in list order, whatever the number of ranks, each decoded by one
    rank. Only decoding shows a truncated image, so in rounds: the next ``num_images - usable so far`` records
    are dealt to the ranks (each to the one with the fewest images), each decodes its own, and the ranks
    gather their usable counts (a collective between batches), until enough are usable or the records end.

Errors and workers
    The DataLoaders come from :mod:`~vae_trainer.data.loader`: any error in the stream stops training
    with its message, whatever the number of workers, and the workers end with their iteration.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import paddle

from .buckets import Batcher, bucket_shapes, nearest_bucket
from .filelists import read_sources
from .images import BadImage, crop, load_rgb, open_image, to_float, upright_size
from .loader import NoHangLoader, RaisesInMainThread
from .position import ShardStart, StreamPosition, encode_position
from .records import MISSING_FILE, Damaged, Missing, describe, image_bytes
from .sharding import (INTERLEAVE, PER_SAMPLE, SKIPPED, Record, ShardSource, SourcePass, assign, interleave,
                       one_after_another, rng)

logger = logging.getLogger("vae_trainer.data")

LOGGED_PER_FILE = 3
DEFAULT_SHUFFLE_BUFFER = 1000


# ---------------------------------------------------------------------------------- skip log


class _SkipLog:
    """Counts skips per reason in this process; logs each file's first few problems once per process."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        # file -> record numbers shown (-1: the whole part's damage); None: "the rest are counted" said
        self._logged: dict[str, set[int | None]] = {}

    def skip(self, record: Record, reason: str, detail: str, counts: Counter) -> None:
        counts[reason] += 1
        self.totals[reason] += 1
        file = record.part.path
        whole_part = isinstance(record.payload, (Damaged, Missing))  # one line for all its lost records
        key = -1 if whole_part else record.number
        shown = self._logged.setdefault(file, set())
        if key in shown or None in shown:
            return  # shown in an earlier pass, or the file's quota is used up
        if len(shown) < LOGGED_PER_FILE:
            shown.add(key)
            where = file if whole_part else describe(record.part, record.number, record.payload)
            logger.warning("%s: skipped (%s: %s)", where, reason, detail)
        else:
            shown.add(None)
            logger.warning("%s: further problems in this file are counted (data/skipped_* scalars, end-of-run "
                           "summary), not logged", file)


# --------------------------------------------------------------------------------- the stream


@dataclass
class _Sample:
    pixels: np.ndarray  # uint8 [H, W, 3]
    bucket: int
    epoch: int
    index: int  # record index in the shard epoch
    restored: bool  # decoded again to refill a bucket on resume (already counted)


@dataclass
class _EpochEnd:
    epoch: int
    records: int


class ImageStream(RaisesInMainThread):
    """Decoded, cropped images from sources; see the module doc for every rule.

    Iterated directly it yields single samples ``{"pixel_values": float32 [3,H,W] in [-1, 1],
    "position": [shard, epoch, consumed]}`` (evaluation, tests); :class:`TrainBatches` makes batches.
    """

    def __init__(
        self,
        file_list: str,
        resolution: int,
        *,
        image_column: int = 2,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        infinite: bool = True,
        shuffle: bool = True,
        random_crop: bool = True,
        random_flip: bool = True,
        min_image_size: int = 32,
        max_image_pixels: int = 8192 * 8192,
        aspect_ratio_buckets: bool = False,
        shuffle_buffer_size: int = DEFAULT_SHUFFLE_BUFFER,
        resume_state: dict | None = None,
        draft_decode: bool = True,
        record_counts: bool = True,
    ) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.file_list = file_list
        self.sources = read_sources(file_list, counts=record_counts)
        self.draft_decode = draft_decode
        if not any(source.parts for source in self.sources):
            raise RuntimeError(f"{file_list}: names no part files")
        # Every part file once, in list order: positions count skips per file by index into this list.
        self.part_paths = list(dict.fromkeys(part.path for source in self.sources for part in source.parts))
        self._part_index = {path: index for index, path in enumerate(self.part_paths)}
        self.resolution, self.image_column = resolution, image_column
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.infinite, self.shuffle, self.shuffle_buffer_size = infinite, shuffle, shuffle_buffer_size
        self.random_crop, self.random_flip = random_crop, random_flip
        self.min_image_size, self.max_image_pixels = min_image_size, max_image_pixels
        self.buckets = bucket_shapes(resolution) if aspect_ratio_buckets else [(resolution, resolution)]
        self.flush_each_epoch = aspect_ratio_buckets
        self.resume = StreamPosition.from_state(resume_state) if resume_state else None
        if self.resume:
            self.resume.check_resume(world_size, seed, shuffle_buffer_size)
            self.resume.files = self.part_paths
        self._log = _SkipLog()

    def skip_stats(self) -> dict[str, int]:
        """Skipped records per reason, counted in the calling process."""
        return dict(self._log.totals)

    def worker_shard(self) -> tuple[int, int, ShardStart]:
        """(shard, num_shards, start) of the calling DataLoader worker (module doc, "Batches and positions")."""
        worker = paddle.io.get_worker_info()
        num_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        role, start = worker_id, ShardStart()
        if self.resume is not None:
            self.resume.check_workers(num_workers)
            role = (worker_id + self.resume.batches_consumed) % num_workers
            start = self.resume.start_of(self.rank * num_workers + role)
        return self.rank * num_workers + role, self.world_size * num_workers, start

    def _items(self) -> Iterator[dict[str, np.ndarray]]:
        shard, num_shards, start = self.worker_shard()
        for item in self.samples(shard, num_shards, start, _start_counts(start)):
            if isinstance(item, _Sample) and not item.restored:
                position = np.array([shard, item.epoch, item.index + 1], dtype=np.int64)
                yield {"pixel_values": to_float(item.pixels), "position": position}

    def samples(self, shard: int, num_shards: int, start: ShardStart, counts: Counter) -> Iterator[_Sample | _EpochEnd]:
        """This shard's samples from `start` on, an :class:`_EpochEnd` after each epoch; skips go to `counts`."""
        sources = assign(self.sources, self.seed, shard, num_shards, self.shuffle)
        epoch, resume_at, restore = start.epoch, start.consumed, set(start.pending)
        skip = min(restore, default=resume_at)
        while True:
            usable, fresh, end = 0, resume_at == 0, skip
            for index, record in enumerate(self._epoch_records(sources, shard, epoch, skip)):
                end = index + 1
                replaying = index < resume_at
                if record is SKIPPED or (replaying and index not in restore):
                    continue
                decoded = self._decode(record, (shard, epoch, index), None if replaying else counts)
                if decoded is not None:
                    usable += 1
                    yield _Sample(decoded[1], decoded[0], epoch, index, replaying)
            if usable == 0 and fresh:
                raise RuntimeError(self._no_samples_message(shard, num_shards, sources, records=end))
            yield _EpochEnd(epoch, end)
            if not self.infinite:
                return
            epoch, skip, resume_at, restore = epoch + 1, 0, 0, set()

    def _epoch_records(self, sources: list[ShardSource], shard: int, epoch: int, skip: int) -> Iterator:
        def make_pass(source: ShardSource, cycle: int) -> SourcePass:
            keys = (shard, epoch, source.index, cycle)
            return SourcePass(source, self.seed, keys, self.shuffle, self.shuffle_buffer_size)

        if not self.infinite:
            return one_after_another(sources, make_pass, skip)
        return interleave(sources, make_pass, rng(self.seed, INTERLEAVE, shard, epoch), skip)

    def _decode(self, record: Record, keys: tuple[int, int, int], counts: Counter | None):
        """(bucket, uint8 crop) of one record, or None if it is unusable (counted if `counts` is given)."""
        payload = record.payload
        try:
            if isinstance(payload, Damaged):
                before = "" if payload.reason == MISSING_FILE else "; the records before the damage are used"
                raise BadImage(payload.reason, payload.detail + before)
            if isinstance(payload, Missing):
                raise BadImage("missing", "the part holds fewer records than its .counts file says")
            image = open_image(image_bytes(payload, self.image_column), self.max_image_pixels, self.min_image_size)
            bucket = nearest_bucket(*upright_size(image), self.buckets) if len(self.buckets) > 1 else 0
            size = self.buckets[bucket]
            image = load_rgb(image, cover=size if self.draft_decode else None)
        except BadImage as bad:
            if counts is not None:
                self._log.skip(record, bad.reason, bad.detail, counts)
                if record.part.path in self._part_index:  # per file, for the end-of-run summary
                    counts[self._part_index[record.part.path]] += 1
            return None
        sample_rng = rng(self.seed, PER_SAMPLE, *keys)
        if self.random_crop:
            return bucket, crop(image, size, sample_rng, self.random_flip)
        pixels = crop(image, size, None, False)
        if self.random_flip and sample_rng.random() < 0.5:
            pixels = np.ascontiguousarray(pixels[:, ::-1])
        return bucket, pixels

    def _no_samples_message(self, shard: int, num_shards: int, sources: list[ShardSource], records: int) -> str:
        files = sorted({segment.part.path for source in sources for segment in source.segments})
        shown = ", ".join(files[:10]) + (f" ... ({len(files)} files)" if len(files) > 10 else "")
        message = (
            f"{self.file_list}: shard {shard} of {num_shards} (rank {self.rank}) got no usable sample "
            f"in a whole pass over its files: [{shown}]; skipped so far: {self.skip_stats()}"
        )
        if records > 0:
            return message
        parts = sum(len(source.parts) for source in self.sources)
        known = [part.records for source in self.sources for part in source.parts]
        held = (f"holds {sum(known)} records in {parts} part(s), fewer than" if None not in known
                else f"'s {parts} part(s) hold too few records for")
        workers = num_shards // self.world_size
        return (
            f"{message}. It got no record at all: the data{held} the {num_shards} shards ({self.world_size} "
            f"process(es) x {workers} DataLoader worker(s) each; every shard needs at least one record). Use fewer "
            "--dataloader_num_workers or processes, or more images."
        )


def _start_counts(start: ShardStart) -> Counter:
    """A shard's skip counts to go on from: per reason (str keys) and per part file (int keys)."""
    return Counter({**start.skipped, **start.skipped_files})


class TrainBatches(RaisesInMainThread):
    """Batches of one bucket shape each, with their positions (module doc, "Batches and positions")."""

    def __init__(self, stream: ImageStream, batch_size: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.stream, self.batch_size = stream, batch_size

    def _items(self) -> Iterator[dict]:
        shard, num_shards, start = self.stream.worker_shard()
        counts = _start_counts(start)
        batcher = Batcher(len(self.stream.buckets), self.batch_size)
        for item in self.stream.samples(shard, num_shards, start, counts):
            if isinstance(item, _EpochEnd):
                if self.stream.flush_each_epoch:
                    for pixels in batcher.flush():
                        yield self._batch(pixels, shard, item.epoch, item.records, counts, batcher)
                continue
            pixels = batcher.add(item.bucket, item.index, item.pixels)
            if pixels is not None:
                yield self._batch(pixels, shard, item.epoch, item.index + 1, counts, batcher)

    @staticmethod
    def _batch(pixels: np.ndarray, shard: int, epoch: int, consumed: int, counts: Counter, batcher: Batcher) -> dict:
        position = encode_position(shard, epoch, consumed, counts, batcher.pending())
        return {"pixel_values": to_float(pixels), "position": position}


def build_train_dataloader(
    file_list: str,
    resolution: int,
    batch_size: int,
    num_workers: int,
    seed: int,
    rank: int,
    world_size: int,
    resume_state: dict | None = None,
    **stream_kwargs,
) -> paddle.io.DataLoader:
    """The infinite training DataLoader of one rank; batches hold "pixel_values" and "position".

    `stream_kwargs` go to :class:`ImageStream` (image_column, random_crop, random_flip,
    min_image_size, aspect_ratio_buckets, shuffle_buffer_size, ...).
    """
    stream = ImageStream(
        file_list, resolution, seed=seed, rank=rank, world_size=world_size, resume_state=resume_state, **stream_kwargs
    )
    return NoHangLoader(TrainBatches(stream, batch_size), batch_size=None, num_workers=num_workers)


# ---------------------------------------------------------------------------------- evaluation


class _EvalShare(RaisesInMainThread):
    """This rank's records of one evaluation round, decoded (module doc, "Evaluation"): of `records`,
    (index, Record) pairs, those whose owner (from `owners`) is `rank`; counts what it reads and keeps."""

    def __init__(self, stream: ImageStream, records: Iterator, owners: Iterator[int], rank: int) -> None:
        super().__init__()
        self.stream, self.records, self.owners, self.rank = stream, records, owners, rank
        self.read = self.usable = 0

    def _items(self) -> Iterator[dict[str, np.ndarray]]:
        counts = Counter()
        for (index, record), owner in zip(self.records, self.owners):
            self.read += 1
            decoded = self.stream._decode(record, (0, 0, index), counts) if owner == self.rank else None
            if decoded is not None:
                self.usable += 1
                yield {"pixel_values": to_float(decoded[1])}


def _owners(images: list[int]) -> Iterator[int]:
    """Ranks for a round's records, each record to the rank with the fewest images (held or given), lowest first."""
    images = list(images)
    while True:
        rank = images.index(min(images))
        images[rank] += 1
        yield rank


def _gather(value: int, world_size: int) -> list[int]:
    """`value` of every rank, in rank order (a collective when `world_size` > 1)."""
    if world_size == 1:
        return [value]
    values = []
    paddle.distributed.all_gather(values, paddle.to_tensor([value], dtype="int64"))
    return [int(tensor.item()) for tensor in values]


def _eval_batches(stream: ImageStream, batch_size: int, rank: int, world_size: int,
                  num_images: int | None) -> Iterator[dict]:
    sources = assign(stream.sources, stream.seed, 0, 1, shuffle=False)
    records = enumerate(stream._epoch_records(sources, 0, 0, 0))
    images, read = [0] * world_size, 0  # usable images per rank so far
    while True:
        wanted = None if num_images is None else num_images - sum(images)
        share = _EvalShare(stream, itertools.islice(records, wanted), _owners(images), rank)
        yield from NoHangLoader(share, batch_size=batch_size, drop_last=False)
        images = [held + new for held, new in zip(images, _gather(share.usable, world_size))]
        read += share.read
        if wanted is None or share.read < wanted or sum(images) == num_images:
            break
    if sum(images) == 0:
        raise RuntimeError(stream._no_samples_message(0, 1, sources, records=read))


def build_eval_dataloader(
    path: str, resolution: int, batch_size: int, rank: int, world_size: int, num_images: int | None
) -> Iterator[dict]:
    """Evaluation batches of this rank from an image folder or any training source; ranks never overlap.

    The source is read once in list order (a folder sorted by relative path), decoded at full size,
    centre-cropped to a square and unflipped; unusable images are skipped and logged as in training.
    The ranks together evaluate the first `num_images` usable images (all if None), whatever their number,
    each decoding its share (module doc, "Evaluation"). Every rank must iterate to the end: it is collective.
    """
    # Full-size decoding (JPEG draft mode changes pixels: evaluation.EvalProtocol), and no record counts
    # (they only even out training frequencies, so their warnings do not concern evaluation).
    stream = ImageStream(path, resolution, infinite=False, shuffle=False, random_crop=False, random_flip=False,
                         draft_decode=False, record_counts=False)
    return _eval_batches(stream, batch_size, rank, world_size, num_images)
