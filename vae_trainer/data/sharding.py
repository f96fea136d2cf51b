"""Which records each shard reads, and in which order one pass reads them.

Shards
    ``shard = rank * W + role`` and ``num_shards = world_size * W``, W = max(1, DataLoader
    workers) (see :mod:`vae_trainer.data.dataset` for roles). One pass of every shard over its
    share reads each record of a source exactly once. The assignment is fixed for the whole run.

Assignment, per source (:func:`assign`)
    * counted (every part's record count known: image folders, tar or part filelists with a
      ``.counts`` file): the parts are permuted once from the seed and concatenated; shard k
      takes records ``[k*L//N, (k+1)*L//N)`` of that sequence (L records in all, N shards). Shares
      differ by at most one record, so every image is shown equally often (all shards are
      consumed at the same rate). A shard opens only the parts its range covers; a part cut by the
      range's start is read from its beginning (gzip and tar cannot seek), so with fewer parts than
      shards each shard decompresses on average about half of each part it shares, instead of all
      of it. Smaller parts (``make_parts.py --lines_per_part``) avoid even that.
    * not counted, at least N parts: the permuted parts are dealt out whole, ``permuted[k::N]``.
      Shards then hold different numbers of records, and records of smaller shards are shown more
      often (a warning at start says how to write the counts).
    * not counted, fewer parts than shards: every shard reads every part and keeps the records
      whose 0-based index i in the part has ``i % N == k``.

Passes (:class:`SourcePass`)
    A pass over one shard's records of one source, in shard epoch e and cycle c, reads the shard's
    segments in an order shuffled from (seed, shard, e, source, c), in blocks of
    ``shuffle_buffer_size`` consecutive records, each block shuffled from (..., block index).
    Memory: one block of encoded records (folder images are read only when decoded). If the pass
    length is known (counted sources) a pass moves forward without reading anything
    (:meth:`SourcePass.skip`), so a resumed run reads at most one block per source to get back to
    its position. A counted part that turns out shorter than counted yields
    :class:`~vae_trainer.data.records.Missing` records for the difference, and a damaged or missing one
    its :class:`~vae_trainer.data.records.Damaged` marker for each record lost, so positions mean the
    same thing in every run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .filelists import Part, Source
from .records import Damaged, Missing, Payload, iterate_records

# Separate RNG streams for separate purposes, so that no two draws share a seed.
ASSIGN_PARTS, SHUFFLE_SEGMENTS, INTERLEAVE, PER_SAMPLE, SHUFFLE_BLOCK = range(5)


def rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(key) for key in keys])


@dataclass(frozen=True)
class Segment:
    """Records ``start, start + stride, ...`` (below `stop`, or to the end if None) of one part."""

    part: Part
    start: int = 0
    stop: int | None = None
    stride: int = 1

    @property
    def length(self) -> int | None:
        return None if self.stop is None else len(range(self.start, self.stop, self.stride))


@dataclass
class ShardSource:
    """What one shard reads of one source."""

    index: int
    weight: float
    segments: list[Segment]

    @property
    def length(self) -> int | None:
        lengths = [segment.length for segment in self.segments]
        return None if None in lengths else sum(lengths)


@dataclass(frozen=True)
class Record:
    part: Part
    number: int  # 0-based record number in the part
    payload: Payload


def _counted_range(parts: list[Part], shard: int, num_shards: int) -> list[Segment]:
    """Segments of records [k*L//N, (k+1)*L//N) of the concatenated parts."""
    total = sum(part.records for part in parts)
    first, last = shard * total // num_shards, (shard + 1) * total // num_shards
    segments, offset = [], 0
    for part in parts:
        start, stop = max(first - offset, 0), min(last - offset, part.records)
        if start < stop:
            segments.append(Segment(part, start, stop))
        offset += part.records
        if offset >= last:
            break
    return segments


def assign(sources: list[Source], seed: int, shard: int, num_shards: int, shuffle: bool = True) -> list[ShardSource]:
    """What shard `shard` of `num_shards` reads of each source (module doc, "Assignment").

    Without `shuffle` (evaluation) the parts keep their list order.
    """
    result = []
    for index, source in enumerate(sources):
        parts = source.parts
        if shuffle:
            parts = [parts[i] for i in rng(seed, ASSIGN_PARTS, index).permutation(len(parts))]
        if source.counted:
            segments = _counted_range(parts, shard, num_shards)
        elif len(parts) >= num_shards:
            segments = [Segment(part) for part in parts[shard::num_shards]]
        else:
            segments = [Segment(part, shard, None, num_shards) for part in parts]
        if segments:
            result.append(ShardSource(index, source.weight, segments))
    return result


def _segment_records(segment: Segment, skip: int = 0) -> Iterator[Record]:
    """The records of a segment from its `skip`-th on; counted segments are padded to their length (with the
    part's damage, if it is damaged, else with :class:`Missing`)."""
    part, first = segment.part, segment.start + skip * segment.stride
    expected = None if segment.length is None else segment.length - skip
    produced, damage = 0, None
    for number, payload in enumerate(iterate_records(part, first), start=0):
        if expected is not None and produced >= expected:
            return
        if isinstance(payload, Damaged):
            yield Record(part, first + produced * segment.stride, payload)
            produced, damage = produced + 1, payload
            break
        if payload is None or (number - first) % segment.stride:
            continue
        yield Record(part, number, payload)
        produced += 1
    for missing in range(produced, expected or 0):
        yield Record(part, first + missing * segment.stride, damage or Missing())


class SourcePass:
    """One pass over a shard's records of one source (module doc, "Passes")."""

    def __init__(
        self, source: ShardSource, seed: int, keys: tuple[int, ...], shuffle: bool, block_size: int
    ) -> None:
        """`keys` = (shard, epoch, source index, cycle) seed the shuffles."""
        self.seed, self.keys, self.shuffle, self.block_size = seed, keys, shuffle, max(1, block_size)
        segments = source.segments
        if shuffle:
            segments = [segments[i] for i in rng(seed, SHUFFLE_SEGMENTS, *keys).permutation(len(segments))]
        self.segments = segments
        self.length = source.length
        self.offset = 0  # records taken (or skipped) so far
        self._reader: Iterator[Record] | None = None

    def skip(self) -> bool:
        """Pass over one record, without reading if the length is known; False if the pass is over."""
        if self._reader is None and self.length is not None:
            if self.offset >= self.length:
                return False
            self.offset += 1
            return True
        return self.next() is not None

    def next(self) -> Record | None:
        """The next record, or None when the pass is over."""
        if self._reader is None:
            self._reader = self._blocks_from(self.offset)
        record = next(self._reader, None)
        if record is not None:
            self.offset += 1
        return record

    def _records_from(self, offset: int) -> Iterator[Record]:
        """The pass's records in segment order from record `offset` (only counted passes start past 0)."""
        for segment in self.segments:
            length = segment.length
            if length is not None and offset >= length:
                offset -= length
                continue
            yield from _segment_records(segment, offset)
            offset = 0

    def _blocks_from(self, offset: int) -> Iterator[Record]:
        block, drop = divmod(offset, self.block_size)
        records = self._records_from(block * self.block_size)
        while True:
            items = list(itertools.islice(records, self.block_size))
            if not items:
                return
            if self.shuffle:
                items = [items[i] for i in rng(self.seed, SHUFFLE_BLOCK, *self.keys, block).permutation(len(items))]
            yield from items[drop:]
            block, drop = block + 1, 0


SKIPPED = object()  # what :func:`interleave` yields for a record passed over unread


def interleave(
    sources: list[ShardSource], make_pass, chooser: np.random.Generator, skip: int
) -> Iterator[Record | object]:
    """One shard epoch of weighted line-by-line interleaving (see dataset module doc, "Epochs").

    Before each record a source is drawn with probability weight / (sum of weights of the sources
    still in play); a source that runs out restarts with the next cycle; the epoch ends when every
    source has finished its first pass. The first `skip` records are :data:`SKIPPED`.
    `make_pass(source, cycle)` builds a :class:`SourcePass`.
    """
    by_index = {source.index: source for source in sources}
    passes = {index: make_pass(source, 0) for index, source in by_index.items()}
    cycles = dict.fromkeys(by_index, 0)
    pending = set(by_index)  # sources that have not finished their first pass
    started: set[int] = set()  # sources whose current pass has produced a record
    position = 0
    while pending:
        index = _choose(chooser, sorted(passes), by_index)
        record = _take(passes[index], position < skip)
        if record is None:
            pending.discard(index)
            if index not in started:  # no records for this shard: drop the source
                del passes[index]
                continue
            if not pending:
                return
            cycles[index] += 1
            passes[index] = make_pass(by_index[index], cycles[index])
            started.discard(index)
            record = _take(passes[index], position < skip)
            if record is None:
                del passes[index]
                continue
        started.add(index)
        position += 1
        yield record


def one_after_another(sources: list[ShardSource], make_pass, skip: int) -> Iterator[Record | object]:
    """A single pass over every source in list order (the first `skip` records :data:`SKIPPED`)."""
    position = 0
    for source in sources:
        current = make_pass(source, 0)
        while (record := _take(current, position < skip)) is not None:
            position += 1
            yield record


def _take(source_pass: SourcePass, skipping: bool) -> Record | object | None:
    if skipping:
        return SKIPPED if source_pass.skip() else None
    return source_pass.next()


def _choose(chooser: np.random.Generator, indices: list[int], by_index: dict[int, ShardSource]) -> int:
    if len(indices) == 1:
        return indices[0]  # no draw: resuming a one-source stream then costs no RNG work per record
    cumulative = np.cumsum([by_index[index].weight for index in indices])
    pick = int(np.searchsorted(cumulative, chooser.random() * cumulative[-1], side="right"))
    return indices[min(pick, len(indices) - 1)]
