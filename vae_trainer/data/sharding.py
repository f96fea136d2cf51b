"""Which records each shard reads (:func:`assign`) and in which order (:class:`SourcePass`, :func:`interleave`);
the rules are in docs/data.md ("How the stream works")."""

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from .filelists import Part, Source
from .records import MISSING, Damaged, Payload, iterate_records

# One RNG stream per purpose, so that no two draws share a seed.
ASSIGN_PARTS, SHUFFLE_SEGMENTS, INTERLEAVE, PER_SAMPLE, SHUFFLE_BLOCK, SAMPLE = range(6)
SKIPPED = object()  # what a pass yields for a record passed over unread


def rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(key) for key in keys])


@dataclass(frozen=True)
class Segment:
    """`length` records (None: to the end) ``start, start + stride, ...`` of one part (counted: stride 1)."""

    part: Part
    start: int = 0
    length: int | None = None
    stride: int = 1


@dataclass
class ShardSource:
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
    repeat: bool = False  # read again within its shard epoch (a weighted source's later pass): not a new bad record


def assign(sources: list[Source], seed: int, shard: int, num_shards: int, shuffle: bool = True) -> list[ShardSource]:
    """What shard `shard` of `num_shards` reads of each source (without `shuffle`, parts in list order)."""
    result = []
    for index, source in enumerate(sources):
        order = rng(seed, ASSIGN_PARTS, index).permutation(len(source.parts)) if shuffle else range(len(source.parts))
        parts = [source.parts[i] for i in order]
        if source.counted:
            total, offset, segments = sum(part.records for part in parts), 0, []
            first, last = shard * total // num_shards, (shard + 1) * total // num_shards
            for part in parts:
                start, stop = max(first - offset, 0), min(last - offset, part.records)
                if start < stop:
                    segments.append(Segment(part, start, stop - start))
                offset += part.records
        elif len(parts) >= num_shards:
            segments = [Segment(part) for part in parts[shard::num_shards]]
        else:
            segments = [Segment(part, shard, None, num_shards) for part in parts]
        if segments:
            result.append(ShardSource(index, source.weight, segments))
    return result


def _segment_records(segment: Segment, skip: int = 0) -> Iterator[Record]:
    """The records of a segment from its `skip`-th on; a counted one padded to its length (damage or MISSING)."""
    part, first = segment.part, segment.start + skip * segment.stride
    expected = None if segment.length is None else segment.length - skip
    produced, damage = 0, None
    for number, payload in enumerate(iterate_records(part, first)):
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
        yield Record(part, first + missing * segment.stride, damage or MISSING)


class SourcePass:
    """One pass over a shard's records of one source, in shuffled blocks; `keys` = (shard, epoch, source, cycle)."""

    def __init__(self, source: ShardSource, seed: int, keys: tuple[int, ...], shuffle: bool, block_size: int) -> None:
        self.source, self.seed, self.keys = source, seed, keys
        self.shuffle, self.block_size, self.length = shuffle, max(1, block_size), source.length
        order = rng(seed, SHUFFLE_SEGMENTS, *keys).permutation(len(source.segments)) if shuffle else None
        self.segments = source.segments if order is None else [source.segments[i] for i in order]
        self.offset, self._reader = 0, None  # records taken (or skipped) so far; their reader, once started

    def take(self, skipping: bool = False) -> Record | object | None:
        """The next record (:data:`SKIPPED` if `skipping`: unread when the length is known), None at the end."""
        if skipping and self._reader is None and self.length is not None:
            record = SKIPPED if self.offset < self.length else None
        else:
            self._reader = self._reader or self._blocks_from(self.offset)
            record = next(self._reader, None)
        if record is None:
            return None
        self.offset += 1
        return SKIPPED if skipping else replace(record, repeat=True) if self.keys[-1] else record

    def _blocks_from(self, offset: int) -> Iterator[Record]:
        block, drop = divmod(offset, self.block_size)
        records = self._records_from(block * self.block_size)
        while items := list(itertools.islice(records, self.block_size)):
            if self.shuffle:
                items = [items[i] for i in rng(self.seed, SHUFFLE_BLOCK, *self.keys, block).permutation(len(items))]
            yield from items[drop:]
            block, drop = block + 1, 0

    def _records_from(self, offset: int) -> Iterator[Record]:
        """The pass's records in segment order from record `offset` (only counted passes start past 0)."""
        for segment in self.segments:
            if segment.length is not None and offset >= segment.length:
                offset -= segment.length
                continue
            yield from _segment_records(segment, offset)
            offset = 0


def interleave(sources: list[ShardSource], seed: int, shard: int, epoch: int, skip: int, shuffle: bool,
               block_size: int, weighted: bool) -> Iterator[Record | object]:
    """One shard epoch (the first `skip` records :data:`SKIPPED`): `weighted` record-by-record interleaving, or one
    pass over each source in list order."""
    chooser = rng(seed, INTERLEAVE, shard, epoch) if weighted else None
    passes = {source.index: SourcePass(source, seed, (shard, epoch, source.index, 0), shuffle, block_size)
              for source in sources}
    pending, position = set(passes), 0  # the sources that have not finished their first pass; records yielded
    while pending:
        if chooser is None:
            index = min(pending)
        elif len(passes) == 1:
            index = next(iter(passes))  # no draw: resuming a one-source stream then costs no RNG work per record
        else:
            indices = sorted(passes)
            cumulative = np.cumsum([passes[i].source.weight for i in indices])
            pick = int(np.searchsorted(cumulative, chooser.random() * cumulative[-1], side="right"))
            index = indices[min(pick, len(indices) - 1)]
        record = passes[index].take(position < skip)
        if record is None:
            pending.discard(index)
            if chooser is not None and passes[index].offset > 0:  # (one with no records for this shard is dropped)
                if not pending:
                    return
                keys = (shard, epoch, index, passes[index].keys[-1] + 1)  # its next cycle
                passes[index] = SourcePass(passes[index].source, seed, keys, shuffle, block_size)
                record = passes[index].take(position < skip)
            if record is None:
                del passes[index]
                continue
        position += 1
        yield record


class RecordSample:
    """The records of every part of `sources` (each part once) drawn at random from `seed`, each at most once, as many
    at a time as asked (`take`): a uniform sample of the whole list however it is sorted. A part without a record
    count is counted first, by one read of it (its payloads passed over)."""

    def __init__(self, sources: list[Source], seed: int) -> None:
        self.parts = list({part.path: part for source in sources for part in source.parts}.values())
        counts = [part.records if part.records is not None else sum(1 for _ in iterate_records(part, 2**62))
                  for part in self.parts]
        self.ends, self.total = np.cumsum(counts, dtype=np.int64), sum(counts)
        self.rng, self.drawn = rng(seed, SAMPLE), set()

    def take(self, count: int | None) -> Iterator[tuple[int, Record]]:
        """(index in the list, record) of `count` (None: all) records not taken before, read in list order."""
        count = min(self.total - len(self.drawn), self.total if count is None else count)
        if 2 * (len(self.drawn) + count) > self.total:  # most of what is left: draw from it directly
            left = np.setdiff1d(np.arange(self.total), np.fromiter(self.drawn, np.int64))
            chosen = set(self.rng.choice(left, count, replace=False).tolist())
        else:  # a few of many: draw until enough are new
            chosen = set()
            while len(chosen) < count:
                chosen.update(i for i in self.rng.integers(self.total, size=count - len(chosen)).tolist()
                              if i not in self.drawn)
        self.drawn |= chosen
        wanted = np.sort(np.fromiter(chosen, np.int64))
        owners, firsts = np.unique(np.searchsorted(self.ends, wanted, side="right"), return_index=True)
        for owner, indices in zip(owners, np.split(wanted, firsts[1:])):
            start = int(self.ends[owner - 1]) if owner else 0
            numbers = set((indices - start).tolist())
            segment = Segment(self.parts[owner], min(numbers), max(numbers) - min(numbers) + 1)
            yield from ((start + record.number, record) for record in _segment_records(segment)
                        if record.number in numbers)
