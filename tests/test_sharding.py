"""Tests of vae_trainer.data.sharding: even record ranges, skipping without reading, blocks, MISSING padding."""

import gzip
from collections import Counter

import pytest

from vae_trainer.data import records
from vae_trainer.data.filelists import LINES, Part, Source
from vae_trainer.data.records import MISSING
from vae_trainer.data.sharding import SKIPPED, ShardSource, Segment, SourcePass, assign


def _parts(tmp_path, sizes, counted=True):
    parts = []
    for index, size in enumerate(sizes):
        path = tmp_path / f"p{index}.gz"
        path.write_bytes(gzip.compress(b"".join(b"%d:%d\n" % (index, i) for i in range(size))))
        parts.append(Part(str(path), LINES, size if counted else None))
    return parts


def _read_all(source_pass):
    out = []
    while (record := source_pass.take()) is not None:
        out.append(record)
    return out


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8, 23])
def test_counted_sources_give_every_shard_an_equal_share_once(tmp_path, num_shards):
    parts = _parts(tmp_path, [5, 1, 9, 3, 0, 4])
    seen, lengths = Counter(), []
    for shard in range(num_shards):
        for source in assign([Source("s", 1.0, parts)], 0, shard, num_shards):
            lengths.append(source.length)
            for segment in source.segments:
                seen.update((segment.part.path, i) for i in range(segment.start, segment.start + segment.length))
    assert sum(lengths) == 22 and max(lengths) - min(lengths + [0] * (num_shards - len(lengths))) <= 1
    assert len(seen) == 22 and set(seen.values()) == {1}


def test_uncounted_sources_keep_whole_parts_or_split_lines(tmp_path):
    parts = _parts(tmp_path, [3, 3, 3], counted=False)
    whole = [assign([Source("s", 1.0, parts)], 0, shard, 2)[0].segments for shard in range(2)]
    assert sorted(len(s) for s in whole) == [1, 2] and all(seg.stride == 1 and seg.length is None for s in whole for seg in s)
    strided = assign([Source("s", 1.0, parts)], 0, 3, 4)[0].segments
    assert [(seg.start, seg.stride) for seg in strided] == [(3, 4)] * 3


def test_known_length_pass_skips_without_reading(tmp_path, monkeypatch):
    parts = _parts(tmp_path, [7, 5, 6])
    source = ShardSource(0, 1.0, [Segment(p, 0, p.records) for p in parts])
    reference = _read_all(SourcePass(source, 3, (0, 0, 0, 0), shuffle=True, block_size=4))
    assert len(reference) == 18 and len({(r.part.path, r.number) for r in reference}) == 18
    opened = []
    real = records.open_part
    monkeypatch.setattr(records, "open_part", lambda path: opened.append(path) or real(path))
    for offset in (0, 3, 4, 9, 17):
        moved = SourcePass(source, 3, (0, 0, 0, 0), shuffle=True, block_size=4)
        for _ in range(offset):
            assert moved.take(skipping=True) is SKIPPED
        assert opened == []  # nothing read to get there
        rest = _read_all(moved)
        assert [(r.part.path, r.number) for r in rest] == [(r.part.path, r.number) for r in reference[offset:]]
        opened.clear()
    done = SourcePass(source, 3, (0, 0, 0, 0), shuffle=True, block_size=4)
    assert all(done.take(skipping=True) is SKIPPED for _ in range(18)) and done.take(skipping=True) is None


def test_blocks_shuffle_consecutive_records_only(tmp_path):
    (part,) = _parts(tmp_path, [12])
    source = ShardSource(0, 1.0, [Segment(part, 0, 12)])
    order = [r.number for r in _read_all(SourcePass(source, 0, (0, 0, 0, 0), shuffle=True, block_size=5))]
    assert [sorted(order[k : k + 5]) for k in (0, 5, 10)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    assert order != list(range(12))
    unshuffled = [r.number for r in _read_all(SourcePass(source, 0, (0, 0, 0, 0), shuffle=False, block_size=5))]
    assert unshuffled == list(range(12))


def test_part_shorter_than_its_count_is_padded_with_missing_records(tmp_path):
    (part,) = _parts(tmp_path, [3])
    promised = Part(part.path, LINES, 5)
    source = ShardSource(0, 1.0, [Segment(promised, 1, 4)])  # records 1..4 of a part that has 0..2
    got = _read_all(SourcePass(source, 0, (0, 0, 0, 0), shuffle=False, block_size=10))
    assert [(r.number, r.payload) for r in got] == [(1, b"0:1"), (2, b"0:2"), (3, MISSING), (4, MISSING)]
