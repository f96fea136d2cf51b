"""The training stream (infinite, sharded, weighted, exactly resumable) and the evaluation datasets.

Part files
    gzip (recognised by its magic bytes) or plain text; one sample per line, tab-separated, the
    base64 image bytes in column ``image_column``. Lines are read as bytes; other columns are
    never decoded. A whole part is held in memory while it is read.

Shards
    ``shard = rank * W + role`` and ``num_shards = world_size * W``, where W = max(1, DataLoader
    workers) and ``role`` is the worker id (remapped on resume, see below). Per source: if it has at
    least ``num_shards`` parts, its parts are permuted once from the seed (never per epoch) and
    shard k reads ``permuted[k::num_shards]``; otherwise every shard reads every part and keeps the
    lines whose 0-based index i in the file has ``i % num_shards == k``. Either way one pass over all
    shards reads each line exactly once.

Epochs and weights
    In shard epoch e, each source's parts and lines are shuffled from (seed, shard, e, source,
    cycle). With ``infinite=True`` the sources are interleaved line by line: before each line a
    source is drawn from the RNG (seed, shard, e) with probability weight / (sum of weights of the
    sources that have lines in this shard), so the expected fraction of *lines* (bad lines included)
    taken from each source is proportional to its weight. A source that runs out restarts at once
    with ``cycle + 1`` (a new shuffle); the shard epoch ends when every source has finished its first
    pass, and partial later cycles are dropped. With ``infinite=False`` the sources are read once,
    one after the other in list order (weights cannot matter in a single pass), then the stream ends.

Positions and resume
    Each sample carries ``position = (shard, epoch, n)``, n = lines of the shard epoch consumed up to
    and including it (bad lines count). Per-sample randomness (crop, flip) is drawn from an RNG
    seeded by (seed, shard, epoch, line index), so replaying a position needs no RNG state.
    :class:`StreamPosition` keeps, per shard, the position of the last sample trained on and the
    number of batches consumed B. Paddle's multi-worker DataLoader hands out iterable-dataset
    batches from workers 0, 1, ..., W-1, 0, ... in strict rotation, so the next batch of an
    uninterrupted run would have come from worker B % W: on resume worker w plays role
    (w + B) % W and starts right after that role's saved position, skipping the lines before it
    without decoding them.

Bad lines are skipped, counted per reason (:meth:`ImageStream.skip_stats`) and logged on logger
``vae_trainer.data`` with file:line, at most :data:`LOGGED_PER_FILE_PASS` per file per pass plus a
summary of the rest. A shard epoch that yields no usable sample raises RuntimeError.
"""

from __future__ import annotations

import itertools
import logging
import os
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
from PIL import Image

from .filelists import PartSource, read_sources
from .images import BadImage, decode_base64, decode_image, preprocess

logger = logging.getLogger("vae_trainer.data")

LOGGED_PER_FILE_PASS = 3
GZIP_MAGIC = b"\x1f\x8b"
_GZIP_CHUNK = 1 << 16

# Separate RNG streams for separate purposes, so that no two draws share a seed.
_ASSIGN_PARTS, _SHUFFLE_PASS, _INTERLEAVE, _PER_SAMPLE = range(4)


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(key) for key in keys])


# ----------------------------------------------------------------------------------- part files


def _gunzip(raw: bytes) -> tuple[bytes, str | None]:
    """Decompress all gzip members; on damage keep what was decoded and return an error text."""
    output, remaining = [], raw
    while remaining.startswith(GZIP_MAGIC):
        member = zlib.decompressobj(wbits=31)
        try:
            for start in range(0, len(remaining), _GZIP_CHUNK):
                output.append(member.decompress(remaining[start : start + _GZIP_CHUNK]))
                if member.eof:
                    break
        except zlib.error as error:
            return b"".join(output), f"corrupt gzip data ({error})"
        if not member.eof:
            return b"".join(output), "truncated gzip stream"
        remaining = member.unused_data + remaining[start + _GZIP_CHUNK :]
    return b"".join(output), None


def read_part_lines(path: str) -> tuple[list[bytes], str | None]:
    """The lines of a part file (gzip or plain) as bytes, and an error text if the gzip is damaged."""
    with open(path, "rb") as handle:
        raw = handle.read()
    data, error = _gunzip(raw) if raw.startswith(GZIP_MAGIC) else (raw, None)
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return [line.rstrip(b"\r") for line in lines], error


# --------------------------------------------------------------------------------------- shards


@dataclass
class _ShardSource:
    """The part of one source that one shard reads."""

    index: int
    weight: float
    parts: list[str]
    line_stride: int
    line_offset: int


@dataclass
class _Line:
    source: int
    part: str
    line_number: int  # 1-based, in the file
    raw: bytes


def shard_sources(sources: list[PartSource], seed: int, shard: int, num_shards: int) -> list[_ShardSource]:
    """What shard `shard` of `num_shards` reads of each source (see module doc, "Shards")."""
    result = []
    for index, source in enumerate(sources):
        if len(source.parts) >= num_shards:
            order = _rng(seed, _ASSIGN_PARTS, index).permutation(len(source.parts))
            parts = [source.parts[i] for i in order[shard::num_shards]]
            result.append(_ShardSource(index, source.weight, parts, 1, 0))
        elif source.parts:
            result.append(_ShardSource(index, source.weight, list(source.parts), num_shards, shard))
    return result


class _SkipLog:
    """Counts skipped lines per reason; logs the first few per file and pass, then a summary."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self._pass_counts: dict[str, Counter[str]] = {}

    def bad_line(self, line: _Line, bad: BadImage) -> None:
        self.totals[bad.reason] += 1
        counts = self._pass_counts.setdefault(line.part, Counter())
        counts[bad.reason] += 1
        if counts.total() <= LOGGED_PER_FILE_PASS:
            logger.warning("%s:%d: skipped line (%s)", line.part, line.line_number, bad)

    def bad_part(self, part: str, error: str) -> None:
        self.totals["corrupt_gzip"] += 1
        logger.warning("%s: %s; using the lines read before the damage", part, error)

    def end_pass(self, part: str) -> None:
        counts = self._pass_counts.pop(part, None)
        if counts and counts.total() > LOGGED_PER_FILE_PASS:
            logger.warning(
                "%s: %d bad lines skipped in this pass (%s), only the first %d logged",
                part, counts.total(), dict(counts), LOGGED_PER_FILE_PASS,
            )


# ---------------------------------------------------------------------------------- the stream


class ImageStream(paddle.io.IterableDataset):
    """Decoded, cropped image tensors from a filelist; see the module doc for every rule."""

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
        resume_state: dict | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.file_list = file_list
        self.sources = read_sources(file_list)
        if not any(source.parts for source in self.sources):
            raise RuntimeError(f"{file_list}: names no part files")
        self.resolution, self.image_column = resolution, image_column
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.infinite, self.shuffle = infinite, shuffle
        self.random_crop, self.random_flip = random_crop, random_flip
        self.min_image_size, self.max_image_pixels = min_image_size, max_image_pixels
        self.resume = StreamPosition.from_state(resume_state) if resume_state else None
        if self.resume and self.resume.world_size not in (None, world_size):
            raise ValueError(f"resume_state was saved with world_size {self.resume.world_size}, not {world_size}")
        self._log = _SkipLog()

    def skip_stats(self) -> dict[str, int]:
        """Skipped lines (and damaged gzip parts) per reason, counted in the calling process."""
        return dict(self._log.totals)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        worker = paddle.io.get_worker_info()
        num_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        role, epoch, skip = self._start(worker_id, num_workers)
        shard = self.rank * num_workers + role
        return self._samples(shard, self.world_size * num_workers, epoch, skip)

    def _start(self, worker_id: int, num_workers: int) -> tuple[int, int, int]:
        """(role, epoch, lines to skip) for this worker, from the resume state if there is one."""
        if self.resume is None:
            return worker_id, 0, 0
        self.resume.check_workers(num_workers)
        role = (worker_id + self.resume.batches_consumed) % num_workers
        epoch, lines = self.resume.positions.get(self.rank * num_workers + role, (0, 0))
        return role, epoch, lines

    def _samples(self, shard: int, num_shards: int, epoch: int, skip: int) -> Iterator[dict[str, np.ndarray]]:
        sources = shard_sources(self.sources, self.seed, shard, num_shards)
        while True:
            usable, fresh_epoch = 0, skip == 0
            for index, line in enumerate(self._epoch_lines(sources, shard, epoch)):
                if index < skip:
                    continue  # replaying up to the resume position: no decoding
                pixels = self._pixels(line, _rng(self.seed, _PER_SAMPLE, shard, epoch, index))
                if pixels is not None:
                    usable += 1
                    position = np.array([shard, epoch, index + 1], dtype=np.int64)
                    yield {"pixel_values": pixels, "position": position}
            if usable == 0 and fresh_epoch:
                raise RuntimeError(self._no_samples_message(shard, num_shards, sources))
            if not self.infinite:
                return
            epoch, skip = epoch + 1, 0

    def _no_samples_message(self, shard: int, num_shards: int, sources: list[_ShardSource]) -> str:
        files = sorted({part for source in sources for part in source.parts})
        shown = ", ".join(files[:10]) + (f" ... ({len(files)} files)" if len(files) > 10 else "")
        return (
            f"{self.file_list}: shard {shard} of {num_shards} (rank {self.rank}) got no usable sample "
            f"in a whole pass over its files: [{shown}]; skipped so far: {self.skip_stats()}"
        )

    def _pixels(self, line: _Line, rng: np.random.Generator) -> np.ndarray | None:
        """The preprocessed image of one line, or None (counted and logged) if it is unusable."""
        columns = line.raw.split(b"\t")
        try:
            if len(columns) <= self.image_column:
                raise BadImage("columns", f"{len(columns)} columns, image expected in column {self.image_column}")
            data = decode_base64(columns[self.image_column])
            image = decode_image(data, self.max_image_pixels, self.min_image_size)
        except BadImage as bad:
            self._log.bad_line(line, bad)
            return None
        if self.random_crop:
            return preprocess(image, self.resolution, rng, self.random_flip)
        pixels = preprocess(image, self.resolution, None, False)
        if self.random_flip and rng.random() < 0.5:
            pixels = np.ascontiguousarray(pixels[:, :, ::-1])
        return pixels

    def _epoch_lines(self, sources: list[_ShardSource], shard: int, epoch: int) -> Iterator[_Line]:
        if not self.infinite:
            return itertools.chain.from_iterable(self._source_pass(s, shard, epoch, 0) for s in sources)
        return self._interleaved(sources, shard, epoch)

    def _interleaved(self, sources: list[_ShardSource], shard: int, epoch: int) -> Iterator[_Line]:
        """Weighted line-by-line interleaving of one shard epoch (see module doc)."""
        chooser = _rng(self.seed, _INTERLEAVE, shard, epoch)
        by_index = {source.index: source for source in sources}
        passes = {index: self._source_pass(source, shard, epoch, 0) for index, source in by_index.items()}
        cycles = dict.fromkeys(by_index, 0)
        pending = set(by_index)  # sources that have not finished their first pass
        started = set()  # sources whose current pass has produced a line
        while pending:
            index = self._choose(chooser, sorted(passes), by_index)
            line = next(passes[index], None)
            if line is None:
                pending.discard(index)
                if index not in started:  # no lines for this shard: drop the source
                    del passes[index]
                    continue
                if not pending:
                    return
                cycles[index] += 1
                passes[index] = self._source_pass(by_index[index], shard, epoch, cycles[index])
                started.discard(index)
                line = next(passes[index], None)
                if line is None:
                    del passes[index]
                    continue
            started.add(index)
            yield line

    @staticmethod
    def _choose(chooser: np.random.Generator, indices: list[int], by_index: dict[int, _ShardSource]) -> int:
        cumulative = np.cumsum([by_index[index].weight for index in indices])
        pick = int(np.searchsorted(cumulative, chooser.random() * cumulative[-1], side="right"))
        return indices[min(pick, len(indices) - 1)]

    def _source_pass(self, source: _ShardSource, shard: int, epoch: int, cycle: int) -> Iterator[_Line]:
        """One pass over this shard's lines of one source, shuffled per (epoch, cycle) if asked."""
        shuffler = _rng(self.seed, _SHUFFLE_PASS, shard, epoch, source.index, cycle) if self.shuffle else None
        parts = source.parts
        if shuffler is not None:
            parts = [parts[i] for i in shuffler.permutation(len(parts))]
        for part in parts:
            lines, error = read_part_lines(part)
            if error:
                self._log.bad_part(part, error)
            numbers = range(source.line_offset, len(lines), source.line_stride)
            order = shuffler.permutation(len(numbers)) if shuffler is not None else range(len(numbers))
            self._log.end_pass(part)
            for position in order:
                number = numbers[position]
                yield _Line(source.index, part, number + 1, lines[number])
            self._log.end_pass(part)


# --------------------------------------------------------------------------------- resume state


class StreamPosition:
    """What the trainer must save to resume the stream exactly: see module doc, "Positions".

    Call :meth:`update` with ``batch["position"]`` of every batch the trainer takes from the
    DataLoader (one instance per rank; `num_workers`/`world_size` are stored to catch a resume
    with a different layout).
    """

    def __init__(self, num_workers: int | None = None, world_size: int | None = None) -> None:
        self.num_workers, self.world_size = num_workers, world_size
        self.positions: dict[int, tuple[int, int]] = {}
        self.batches_consumed = 0

    def update(self, positions: np.ndarray | paddle.Tensor) -> None:
        """Record one consumed batch; the last row of each shard is its position."""
        if isinstance(positions, paddle.Tensor):
            positions = positions.numpy()
        for shard, epoch, lines in np.asarray(positions, dtype=np.int64).reshape(-1, 3):
            self.positions[int(shard)] = (int(epoch), int(lines))
        self.batches_consumed += 1

    def state_dict(self) -> dict:
        """Plain ints, lists and string keys, so the state survives JSON as well as pickle."""
        return {
            "positions": {str(shard): list(position) for shard, position in sorted(self.positions.items())},
            "batches_consumed": self.batches_consumed,
            "num_workers": self.num_workers,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        self.positions = {int(shard): (int(p[0]), int(p[1])) for shard, p in state["positions"].items()}
        self.batches_consumed = int(state["batches_consumed"])
        self.num_workers, self.world_size = state.get("num_workers"), state.get("world_size")

    @classmethod
    def from_state(cls, state: dict) -> StreamPosition:
        tracker = cls()
        tracker.load_state_dict(state)
        return tracker

    def check_workers(self, num_workers: int) -> None:
        """Raise if the state was saved with a different number of DataLoader workers."""
        if self.num_workers is not None and max(1, self.num_workers) != num_workers:
            raise ValueError(
                f"resume_state was saved with num_workers={self.num_workers}; exact resume needs the same "
                f"number of DataLoader workers, this run has {num_workers}"
            )


# ---------------------------------------------------------------------------------- evaluation


def _image_suffixes() -> set[str]:
    return {suffix for suffix, format_name in Image.registered_extensions().items() if format_name in Image.OPEN}


class ImageFolder(paddle.io.Dataset):
    """Every image file under `root` (recursive, sorted by relative path), centre-cropped, unflipped."""

    def __init__(self, root: str, resolution: int, max_image_pixels: int = 8192 * 8192) -> None:
        super().__init__()
        suffixes = _image_suffixes()
        base = Path(root)
        self.files = sorted(
            (path for path in base.rglob("*") if path.is_file() and path.suffix.lower() in suffixes),
            key=lambda path: path.relative_to(base).as_posix(),
        )
        if not self.files:
            raise FileNotFoundError(f"{root}: no image files found")
        self.resolution, self.max_image_pixels = resolution, max_image_pixels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        path = self.files[index]
        try:
            image = decode_image(path.read_bytes(), self.max_image_pixels)
        except BadImage as bad:
            raise BadImage(bad.reason, f"{path}: {bad.detail}") from None
        return {"pixel_values": preprocess(image, self.resolution, None, False)}


class _FirstUsableSamples(paddle.io.IterableDataset):
    """This rank's share (every world_size-th) of the first `num_images` usable samples of a stream."""

    def __init__(self, stream: ImageStream, num_images: int | None, rank: int, world_size: int) -> None:
        super().__init__()
        self.stream, self.num_images, self.rank, self.world_size = stream, num_images, rank, world_size

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        samples = itertools.islice(self.stream, self.num_images)
        for number, sample in enumerate(samples):
            if number % self.world_size == self.rank:
                yield {"pixel_values": sample["pixel_values"]}


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
    """The infinite training DataLoader of one rank; batches hold "pixel_values" and "position"."""
    stream = ImageStream(
        file_list, resolution, seed=seed, rank=rank, world_size=world_size, resume_state=resume_state, **stream_kwargs
    )
    return paddle.io.DataLoader(stream, batch_size=batch_size, num_workers=num_workers, drop_last=True,
                                collate_fn=collate_positions_on_host)


def collate_positions_on_host(samples: list[dict]) -> dict:
    """Default collation, except "position": Python ints, which the DataLoader leaves on the host.

    As an array it would become a device tensor on GPU, and reading it back for the StreamPosition
    on every micro-batch would be a device-to-host synchronisation.
    """
    batch = paddle.io.dataloader.collate.default_collate_fn(
        [{k: v for k, v in sample.items() if k != "position"} for sample in samples])
    batch["position"] = [[int(v) for v in sample["position"]] for sample in samples]
    return batch


def build_eval_dataloader(
    path: str, resolution: int, batch_size: int, rank: int, world_size: int, num_images: int | None
) -> paddle.io.DataLoader:
    """Evaluation batches of this rank from an image folder or a filelist; ranks never overlap.

    A filelist is read once, unshuffled, centre-cropped and unflipped; every rank decodes the same
    first `num_images` usable samples and keeps those with ``index % world_size == rank``. A folder
    is split the same way by sorted file index. Ranks may get one batch item more than others.
    """
    if os.path.isdir(path):
        folder = ImageFolder(path, resolution)
        count = len(folder) if num_images is None else min(num_images, len(folder))
        dataset = paddle.io.Subset(folder, list(range(rank, count, world_size)))
        return paddle.io.DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False)
    stream = ImageStream(
        path, resolution, infinite=False, shuffle=False, random_crop=False, random_flip=False
    )
    dataset = _FirstUsableSamples(stream, num_images, rank, world_size)
    return paddle.io.DataLoader(dataset, batch_size=batch_size, drop_last=False)
