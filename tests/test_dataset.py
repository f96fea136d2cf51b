"""Tests of vae_trainer.data.dataset: sharding, weights, bad input, skip counts, exact resume for every
source kind, bucketing, per-image frequency, no hangs, LAION scale, evaluation loaders.

Most samples are solid PNGs whose colour encodes an id (R + 256*G), so a test can tell exactly which
records came through a stream, whatever the crop.
"""

import base64
import gzip
import io
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from contextlib import contextmanager

import numpy as np
import paddle
import pytest
from conftest import write_tar
from PIL import Image

from vae_trainer.data import records
from vae_trainer.data.dataset import ImageStream, build_eval_dataloader, build_train_dataloader
from vae_trainer.data.filelists import read_sources
from vae_trainer.data.position import SKIP_REASONS, StreamPosition, merge_file_skips
from vae_trainer.data.sharding import RecordSample

paddle.set_device("cpu")
RES = 32


def _png(image):
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def id_image(sample_id, size=RES, height=None):
    return _png(Image.new("RGB", (size, height or size), (sample_id % 256, sample_id // 256, 77)))


def noise_image(seed, size=40, height=None):
    pixels = np.random.default_rng(seed).integers(0, 256, (height or size, size, 3), dtype=np.uint8)
    return _png(Image.fromarray(pixels))


def line(image_bytes, caption=b"caption"):
    return caption + b"\t-\t" + base64.b64encode(image_bytes)


def write_part(path, lines, use_gzip=True):
    payload = b"".join(text + b"\n" for text in lines)
    path.write_bytes(gzip.compress(payload) if use_gzip else payload)
    return path


def write_filelist(path, parts, counts=None):
    """A .filelist naming `parts`; with `counts`, a .counts file too (records per part)."""
    path.write_text("".join(f"{part.name}\n" for part in parts))
    if counts is not None:
        rows = [f"{part.name}\t{count}\t{part.stat().st_size}\n" for part, count in zip(parts, counts)]
        (path.parent / (path.name + ".counts")).write_text("".join(rows))
    return str(path)


def id_parts(folder, num_parts, lines_per_part, first_id=0, use_gzip=True):
    """Parts whose lines hold consecutive ids starting at first_id."""
    parts = []
    for index in range(num_parts):
        start = first_id + index * lines_per_part
        lines = [line(id_image(i)) for i in range(start, start + lines_per_part)]
        parts.append(write_part(folder / f"part-{first_id}-{index}", lines, use_gzip))
    return parts


def ids_of(pixel_values):
    """Recover the ids of a batch [N,3,H,W] (or one sample [3,H,W]) of id images."""
    values = np.asarray(pixel_values)
    values = values.reshape(-1, *values.shape[-3:])[:, :, 0, 0]
    channels = np.rint((values + 1.0) * 127.5).astype(int)
    return (channels[:, 0] + 256 * channels[:, 1]).tolist()


def stream_ids(stream, limit=None):
    ids = []
    for number, sample in enumerate(stream):
        if limit is not None and number >= limit:
            break
        ids += ids_of(sample["pixel_values"])
    return ids


def loader_ids(loader):
    ids, shards = [], []
    for batch in loader:  # (batches of one sample: a position each)
        ids += ids_of(batch["pixel_values"].numpy())
        shards.append(int(batch["position"][0]))
    return ids, shards


@contextmanager
def time_limit(seconds):
    """Fail instead of hanging forever."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"no result within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _batches(loader, count, tracker=None):
    batches = []
    with time_limit(180):
        for batch in loader:
            batch = {"pixel_values": batch["pixel_values"].numpy(), "position": list(batch["position"])}
            if tracker is not None:
                tracker.update(batch["position"])
            batches.append(batch)
            if len(batches) == count:
                break
    return batches


def _skipped(position):
    """The skip counts carried in a batch position, by reason."""
    return dict(zip(SKIP_REASONS, position[3 : 3 + len(SKIP_REASONS)]))


# ------------------------------------------------------------------------------ reading, skipping


def test_gzip_and_plain_parts_read_completely_once_per_pass(tmp_path):
    parts = id_parts(tmp_path, 1, 5, 0, use_gzip=True) + id_parts(tmp_path, 1, 5, 5, use_gzip=False)
    file_list = write_filelist(tmp_path / "x.filelist", parts)
    finite = ImageStream(file_list, RES, infinite=False, shuffle=False)
    assert stream_ids(finite) == list(range(10))
    infinite = ImageStream(file_list, RES, seed=3)
    ids = stream_ids(infinite, limit=30)
    for epoch in range(3):
        assert sorted(ids[10 * epoch : 10 * epoch + 10]) == list(range(10))
    assert ids[:10] != ids[10:20]  # reshuffled each epoch
    assert ids == stream_ids(ImageStream(file_list, RES, seed=3), limit=30)  # deterministic
    assert ids != stream_ids(ImageStream(file_list, RES, seed=4), limit=30)


def test_every_bad_kind_is_counted_and_good_lines_come_through(tmp_path, caplog):
    noisy_png = noise_image(1, size=36)
    lines = [
        line(id_image(0)),
        b"only\ttwo columns",
        line(id_image(1), caption=b"\xff\xfe caption that is not utf-8"),
        b"cap\t-\t!!!***not base64",
        line(b"this is text, not an image"),
        line(id_image(2)),
        line(noisy_png[: len(noisy_png) // 2]),
        line(id_image(3, size=16)),
        line(id_image(4, size=64)),  # 4096 pixels > the limit of 40*40
        line(id_image(5)),
    ]
    file_list = write_filelist(tmp_path / "x.filelist", [write_part(tmp_path / "p", lines)])
    stream = ImageStream(file_list, RES, infinite=False, shuffle=False, max_image_pixels=40 * 40)
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        assert stream_ids(stream) == [0, 1, 2, 5]
    expected = {"columns": 1, "base64": 1, "not_image": 1, "truncated": 1, "too_small": 1, "too_large": 1}
    assert stream.skip_stats() == expected
    part = str(tmp_path / "p")
    assert f"{part}:2: skipped (columns" in caplog.text and f"{part}:4: skipped (base64" in caplog.text
    assert f"{part}:7:" not in caplog.text  # only the first few per file...
    assert f"{part}: further problems in this file are counted" in caplog.text  # ...then one line


def test_truncated_gzip_keeps_lines_read_so_far(tmp_path, caplog):
    lines = [line(noise_image(i, size=RES)) for i in range(40)]
    whole = gzip.compress(b"".join(text + b"\n" for text in lines))
    part = tmp_path / "cut.gz"
    part.write_bytes(whole[: len(whole) * 3 // 4])
    file_list = write_filelist(tmp_path / "x.filelist", [part])
    stream = ImageStream(file_list, RES, infinite=False, shuffle=False, random_crop=False, random_flip=False)
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        samples = list(iter(stream))
    assert 20 <= len(samples) < 40
    expected = np.asarray(Image.open(io.BytesIO(noise_image(len(samples) - 1, size=RES))))
    got = np.rint((samples[-1]["pixel_values"][0].transpose(1, 2, 0) + 1) * 127.5)
    np.testing.assert_array_equal(got, expected)  # lines come through in order, undamaged
    assert stream.skip_stats()["corrupt_gzip"] == 1
    assert f"{part}: skipped (corrupt_gzip: truncated gzip stream" in caplog.text


def test_missing_part_and_empty_filelist(tmp_path):
    (tmp_path / "x.filelist").write_text("gone.gz\n")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'gone.gz'}.*x.filelist:1"):
        ImageStream(str(tmp_path / "x.filelist"), RES)
    (tmp_path / "empty.filelist").write_text("# nothing\n")
    with pytest.raises(RuntimeError, match="no part files"):
        ImageStream(str(tmp_path / "empty.filelist"), RES)


@pytest.mark.parametrize("counted", [False, True])
def test_a_part_gone_since_the_start_is_skipped_as_missing_file_and_logged_once(tmp_path, caplog, counted):
    """Not corrupt_gzip (the file is not damaged, it is not there): its own reason, one console line with its
    path. Counted, each of its records is skipped (positions stay those of the intact run); not, once per pass."""
    parts = id_parts(tmp_path, 3, 4)
    file_list = write_filelist(tmp_path / "x.filelist", parts, counts=[4, 4, 4] if counted else None)
    stream = ImageStream(file_list, RES, shuffle=False, seed=1)  # every part checked here...
    parts[1].unlink()  # ...then lost, as on an unmounted share
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        ids = stream_ids(stream, limit=8 * 3)  # three passes over the 8 remaining images
    assert Counter(ids) == {i: 3 for i in (0, 1, 2, 3, 8, 9, 10, 11)}
    assert stream.skip_stats() == {"missing_file": 3 * (4 if counted else 1)}
    lines = [r.getMessage() for r in caplog.records if str(parts[1]) in r.getMessage()]
    assert len(lines) == 1 and "skipped (missing_file: part file not found" in lines[0], lines


def test_an_image_gone_from_a_folder_is_skipped_as_missing_file(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.png").write_bytes(id_image(i))
    stream = ImageStream(str(folder), RES, infinite=False, shuffle=False)
    (folder / "1.png").unlink()
    assert stream_ids(stream) == [0, 2] and stream.skip_stats() == {"missing_file": 1}


def test_no_usable_sample_raises_instead_of_hanging(tmp_path):
    part = write_part(tmp_path / "bad.gz", [b"a\tb", line(b"junk"), line(id_image(0, size=8))])
    file_list = write_filelist(tmp_path / "x.filelist", [part])
    with time_limit(30), pytest.raises(RuntimeError, match=r"shard 0 of 1.*bad\.gz"):
        next(iter(ImageStream(file_list, RES)))
    # A shard that gets no lines at all (1 line, 2 ranks) fails the same way.
    single = write_filelist(tmp_path / "one.filelist", [write_part(tmp_path / "one.gz", [line(id_image(0))])])
    with time_limit(30), pytest.raises(RuntimeError, match="shard 1 of 2"):
        next(iter(ImageStream(single, RES, rank=1, world_size=2)))


_NO_HANG = """
import sys
from vae_trainer.data.dataset import build_eval_dataloader, build_train_dataloader
file_list, folder, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
for rank, world_size in ((0, 1), (1, 2)):
    try:
        next(iter(build_train_dataloader(file_list, 32, 2, workers, 0, rank, world_size, image_column=7)))
        print("no error", flush=True)
    except Exception as error:
        print(f"train rank {rank}/{world_size}: {type(error).__name__}: {error}", flush=True)
try:
    list(build_eval_dataloader(folder, 32, 1, 0, 1, None))
    print("no error", flush=True)
except Exception as error:
    print(f"eval: {type(error).__name__}: {error}", flush=True)
"""


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_data_errors_stop_the_real_dataloader_instead_of_hanging(tmp_path, num_workers):
    """An --image_column past the last column makes every line unusable, an eval folder holds only a broken
    image: the DataLoaders must raise the error itself in the main process (0 workers: Paddle's reader
    thread would die silently and the main thread wait forever). In a subprocess with a timeout, because
    a hang blocks in C code where no Python alarm can interrupt it."""
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 2, 3))
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    result = subprocess.run([sys.executable, "-c", _NO_HANG, file_list, str(folder), str(num_workers)],
                            capture_output=True, text=True, timeout=300, env=env)
    lines = [text for text in result.stdout.splitlines() if text.startswith(("train", "eval", "no error"))]
    assert len(lines) == 3, result.stdout + result.stderr[-3000:]
    for text, rank in zip(lines, (0, 1)):
        assert text.startswith("train") and "RuntimeError" in text and f"(rank {rank})" in text, text
        assert "got no usable sample" in text and "part-0-" in text and "'columns'" in text, text
    assert lines[2].startswith("eval: RuntimeError") and "b.png" in lines[2], lines[2]


def test_skip_counts_travel_in_batches_cumulatively_and_survive_resume(tmp_path, caplog):
    """Each shard: [good, bad, good, bad, good, good] in order; the counts a batch carries cover the records
    before its last sample, cumulative over epochs, summed over shards by StreamPosition."""
    parts = []
    for k in range(2):
        ids = [10 * k + i for i in range(4)]
        lines = [line(id_image(ids[0])), b"bad", line(id_image(ids[1])), line(b"junk"),
                 line(id_image(ids[2])), line(id_image(ids[3]))]
        parts.append(write_part(tmp_path / f"p{k}.gz", lines))
    file_list = write_filelist(tmp_path / "x.filelist", parts, counts=[6, 6])
    options = dict(batch_size=2, num_workers=2, seed=0, rank=0, world_size=1, shuffle=False)
    tracker = StreamPosition(2, 1)
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        batches = _batches(build_train_dataloader(file_list, RES, **options), 8, tracker)
    carried = [(b["position"][0], _skipped(b["position"])) for b in batches]
    for shard in (0, 1):
        counts = [(c["columns"], c["not_image"]) for s, c in carried if s == shard]
        assert counts == [(1, 0), (1, 1), (2, 1), (2, 2)]  # batch = (good, good) after (bad...) in order
    assert tracker.skipped_totals()["columns"] == 4 and tracker.skipped_totals()["not_image"] == 4
    assert sum(tracker.skipped_totals().values()) == 8
    # Resumed after 4 batches: counts go on from the saved ones.
    tracker = StreamPosition(2, 1)
    _batches(build_train_dataloader(file_list, RES, **options), 4, tracker)
    resumed = _batches(build_train_dataloader(file_list, RES, resume_state=tracker.state_dict(), **options), 4)
    assert [b["position"] for b in resumed] == [b["position"] for b in batches[4:]]


BAD_LINES = (2, 4, 5, 8, 10, 11)  # 1-based, of a 12-line part; every shard of 1 or 4 keeps a good line


@pytest.mark.parametrize("num_workers, world_size, weighted", [(0, 1, False), (2, 2, False), (1, 1, True)])
def test_skips_per_file_count_each_bad_line_once_with_its_number(tmp_path, num_workers, world_size, weighted):
    """Issue 38.1: a part with 6 undecodable lines read about twice was listed with its skip events (12), not its 6
    bad lines. Per file: [skips, distinct bad records, *their smallest numbers (0-based)], summed over loader workers
    and ranks, and continued exactly by a resumed run; `weighted`: the small source restarts many times within the
    big one's first pass (one epoch)."""
    lines = [b"undecodable" if number in BAD_LINES else line(id_image(number)) for number in range(1, 13)]
    file_list = write_filelist(tmp_path / "bad.filelist", [write_part(tmp_path / "bad.gz", lines)])
    if weighted:
        big = write_filelist(tmp_path / "big.filelist", id_parts(tmp_path, 1, 40, first_id=100))
        (tmp_path / "mix.filelist.list").write_text(f"{file_list} 3\n{big} 1\n")
        file_list = str(tmp_path / "mix.filelist.list")
    merged = {}
    for rank in range(world_size):
        options = dict(batch_size=2, num_workers=num_workers, seed=3, rank=rank, world_size=world_size)

        def run(batches, state=None):
            loader = build_train_dataloader(file_list, RES, resume_state=state, **options)
            tracker = StreamPosition.from_state(state) if state else StreamPosition(num_workers, world_size)
            tracker.files = loader.dataset.part_paths
            _batches(loader, batches, tracker)
            return tracker

        straight = run(8)
        assert run(6, run(2).state_dict()).skipped_by_file() == straight.skipped_by_file()  # resumed after 2 of 8
        merge_file_skips(merged, straight.skipped_by_file())
    skips, bad, *numbers = merged[str(tmp_path / "bad.gz")]
    assert bad == 6 and numbers == [number - 1 for number in BAD_LINES] and skips > 6


def test_console_shows_each_files_problems_once_per_run(tmp_path, caplog):
    lines = [line(id_image(i)) for i in range(4)] + [b"bad 1", b"bad 2"]
    file_list = write_filelist(tmp_path / "x.filelist", [write_part(tmp_path / "p.gz", lines)])
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        stream_ids(ImageStream(file_list, RES, seed=1), limit=4 * 5)  # five passes over the file
    assert caplog.text.count("skipped (columns") == 2  # the first pass only


# ---------------------------------------------------------------------------------------- sharding


def _per_rank_ids(file_list, world_size, num_workers):
    """Ids and shard ids of one finite pass of every rank through a real DataLoader."""
    results = []
    for rank in range(world_size):
        stream = ImageStream(file_list, RES, rank=rank, world_size=world_size, infinite=False, seed=1)
        results.append(loader_ids(paddle.io.DataLoader(stream, batch_size=None, num_workers=num_workers)))
    return results


def test_fewer_files_than_shards_splits_lines(tmp_path):
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 1, 23))
    with time_limit(120):
        per_rank = _per_rank_ids(file_list, world_size=2, num_workers=2)
    all_ids = [i for ids, _ in per_rank for i in ids]
    assert sorted(all_ids) == list(range(23))  # complete and disjoint
    for rank, (ids, shards) in enumerate(per_rank):
        for shard in {rank * 2, rank * 2 + 1}:
            assert sorted(i for i, s in zip(ids, shards) if s == shard) == list(range(shard, 23, 4))


def test_more_files_than_shards_splits_files(tmp_path):
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 7, 4))
    per_rank = _per_rank_ids(file_list, world_size=2, num_workers=0)
    rank_ids = [set(ids) for ids, _ in per_rank]
    assert not rank_ids[0] & rank_ids[1] and rank_ids[0] | rank_ids[1] == set(range(28))
    for ids in rank_ids:  # whole files per rank
        assert all({4 * (i // 4) + k for k in range(4)} <= ids for i in ids)
    assert {len(ids) for ids in rank_ids} == {12, 16}


def test_counted_sources_split_records_evenly_over_ranks(tmp_path):
    """With a .counts file, 7 parts of 4 lines over 2 ranks: 14 records each, together all 28 once."""
    parts = id_parts(tmp_path, 7, 4)
    file_list = write_filelist(tmp_path / "x.filelist", parts, counts=[4] * 7)
    per_rank = _per_rank_ids(file_list, world_size=2, num_workers=0)
    assert [len(ids) for ids, _ in per_rank] == [14, 14]
    assert sorted(per_rank[0][0] + per_rank[1][0]) == list(range(28))


def test_weighted_interleaving_follows_weights(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    list_a = write_filelist(tmp_path / "a" / "a.filelist", id_parts(tmp_path / "a", 2, 10, 0))
    write_filelist(tmp_path / "b" / "b.filelist", id_parts(tmp_path / "b", 1, 7, 100))
    listing = tmp_path / "mix.filelist.list"
    listing.write_text(f"{list_a} 1\nb/b.filelist 3\n")
    ids = stream_ids(ImageStream(str(listing), RES, seed=5), limit=1200)
    fraction_b = np.mean([i >= 100 for i in ids])
    assert abs(fraction_b - 0.75) < 0.04  # binomial std ~0.0125
    # The small, heavy source restarts many times; the big one is read in full each pass.
    assert set(ids) == set(range(20)) | set(range(100, 107))


def _frequencies(file_list, seed, num_shards, samples_per_shard):
    """Ids seen when `num_shards` shards of the stream are consumed at the same rate (as the DataLoader does)."""
    shards = [iter(ImageStream(file_list, RES, seed=seed, rank=shard, world_size=num_shards))
              for shard in range(num_shards)]
    seen = Counter()
    for _ in range(samples_per_shard):
        for batches in shards:
            seen.update(ids_of(next(batches)["pixel_values"]))
    return seen


def test_every_image_is_shown_equally_often(tmp_path):
    """9 equal parts on 8 shards (2 ranks x 4 workers): with counts, per-image frequency is uniform up to one
    pass of one record; whole parts per shard would show one shard's images at half the rate."""
    parts = id_parts(tmp_path, 9, 8)
    file_list = write_filelist(tmp_path / "x.filelist", parts, counts=[8] * 9)
    seen = _frequencies(file_list, 2, num_shards=8, samples_per_shard=9 * 5)  # 9 records per shard, 5 epochs
    assert set(seen) == set(range(72))
    assert set(seen.values()) == {5}
    # Not a multiple of the shares: still within one of each other.
    seen = _frequencies(file_list, 2, num_shards=8, samples_per_shard=9 * 5 + 4)
    assert max(seen.values()) - min(seen.values()) <= 1


def test_every_image_is_shown_equally_often_through_the_dataloader(tmp_path):
    """3 equal parts on 2 workers: each worker takes 1.5 parts, so 10 batches of 3 show every image 5 times."""
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 3, 2), counts=[2, 2, 2])
    loader = build_train_dataloader(file_list, RES, batch_size=3, num_workers=2, seed=0, rank=0, world_size=1)
    seen = Counter(i for batch in _batches(loader, 10) for i in ids_of(batch["pixel_values"]))
    assert seen == {i: 5 for i in range(6)}


def test_dataloader_serves_workers_in_strict_rotation(tmp_path):
    """Paddle 3.3.1 hands out iterable-dataset batches from workers 0,1,2,0,1,2,... (resume relies on it)."""
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 3, 6))
    loader = build_train_dataloader(file_list, RES, batch_size=2, num_workers=3, seed=0, rank=0, world_size=1)
    shards = [batch["position"][0] for batch in _batches(loader, 12)]
    assert shards == [k % 3 for k in range(12)]


def test_laion_scale_list_starts_without_opening_parts(tmp_path, monkeypatch):
    """60,000 parts (hard links to one tiny part) with counts: building the loader opens no part, and the
    first batch opens only the parts of the first shuffle blocks (the LAION-400M layout starts at once)."""
    source = write_part(tmp_path / "source.gz", [line(id_image(i)) for i in range(2)])
    folder = tmp_path / "parts"
    folder.mkdir()
    names = [f"part-{i:05d}.gz" for i in range(60_000)]
    for name in names:
        os.link(source, folder / name)
    size = source.stat().st_size
    (folder / "laion.filelist").write_text("".join(f"{name}\n" for name in names))
    (folder / "laion.filelist.counts").write_text("".join(f"{name}\t2\t{size}\n" for name in names))
    (tmp_path / "laion.filelist.list").write_text("parts/laion.filelist 1\n")
    opened = []
    real_open = records.open_part
    monkeypatch.setattr(records, "open_part", lambda path: opened.append(path) or real_open(path))
    loader = build_train_dataloader(str(tmp_path / "laion.filelist.list"), RES, batch_size=4, num_workers=0,
                                    seed=0, rank=0, world_size=1, shuffle_buffer_size=8)
    assert opened == []
    batch = _batches(loader, 1)[0]
    assert len(batch["pixel_values"]) == 4
    # A block of 8 records spans 4-5 parts of 2; Paddle's reader thread prefetches a few batches ahead.
    assert 4 <= len(set(opened)) <= 20


# ------------------------------------------------------------------------------------- other sources


def test_folder_source_reads_every_image_once_per_pass_and_counts_bad_files(tmp_path):
    folder = tmp_path / "photos"
    (folder / "nested").mkdir(parents=True)
    for i in range(5):
        (folder / ("nested" if i % 2 else ".") / f"{i}.png").write_bytes(id_image(i))
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    stream = ImageStream(str(folder), RES, seed=1)
    ids = stream_ids(stream, limit=15)
    assert [sorted(ids[k : k + 5]) for k in (0, 5, 10)] == [list(range(5))] * 3
    assert stream.skip_stats() == {"not_image": 3}  # once per pass


def _tar_dataset(tmp_path):
    """Two shards: samples with jpg/png/webp images and metadata members, one without an image."""
    def jpeg(sample_id):
        buffer = io.BytesIO()
        Image.new("RGB", (RES, RES), (sample_id % 256, 0, 77)).save(buffer, "JPEG", quality=100)
        return buffer.getvalue()

    write_tar(tmp_path / "shard-0.tar", [
        ("s/000.json", b"{}"), ("s/000.png", id_image(0)), ("__meta__", b"x"),
        ("s/001.jpg", jpeg(1)), ("s/001.txt", b"caption"),
        ("s/002.txt", b"no image here"),
        ("s/003.webp", _webp(3)),
    ])
    write_tar(tmp_path / "shard-1.tar", [(f"{i:03d}.png", id_image(i)) for i in range(4, 8)])
    return str(tmp_path / "shard-{0..1}.tar")


def _webp(sample_id):
    buffer = io.BytesIO()
    Image.open(io.BytesIO(id_image(sample_id))).save(buffer, "WEBP", lossless=True)
    return buffer.getvalue()


def test_tar_shards_brace_pattern_and_pipe(tmp_path):
    pattern = _tar_dataset(tmp_path)
    stream = ImageStream(pattern, RES, infinite=False, shuffle=False)
    assert stream_ids(stream) == [0, 1, 3, 4, 5, 6, 7]
    assert stream.skip_stats() == {"no_image": 1}
    listing = tmp_path / "tars.filelist"
    listing.write_text(f"pipe:cat {tmp_path / 'shard-1.tar'}\nshard-0.tar\n")
    assert stream_ids(ImageStream(str(listing), RES, infinite=False, shuffle=False)) == [4, 5, 6, 7, 0, 1, 3]


def test_damaged_tar_and_failing_pipe_are_counted(tmp_path, caplog):
    good = write_tar(tmp_path / "a.tar", [(f"{i:03d}.png", noise_image(i)) for i in range(6)]).read_bytes()
    (tmp_path / "cut.tar").write_bytes(good[: len(good) // 2])
    listing = tmp_path / "x.filelist"
    listing.write_text(f"cut.tar\npipe:cat {tmp_path / 'a.tar'} && exit 3\n")
    stream = ImageStream(str(listing), RES, infinite=False, shuffle=False)
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        samples = [sample for sample in stream]
    assert 1 <= len(samples) - 6 < 6  # the whole pipe output, the undamaged start of the cut tar
    assert stream.skip_stats() == {"corrupt_tar": 2}
    assert "exited with status 3" in caplog.text and "cut.tar: skipped (corrupt_tar" in caplog.text


# ---------------------------------------------------------------------------------------- buckets


def _mixed_aspect_parts(tmp_path, count=18):
    """Solid id images of three aspect ratios (2:1, 1:1, 1:2) at various sizes, in 3 parts."""
    shapes = [(64, 32), (40, 40), (32, 64), (96, 44), (50, 48), (36, 80)]
    lines = [line(id_image(i, *shapes[i % len(shapes)])) for i in range(count)]
    return [write_part(tmp_path / f"mixed-{k}.gz", lines[k::3]) for k in range(3)]


def test_bucketing_batches_hold_one_nearest_shape_and_every_image_once_per_epoch(tmp_path):
    parts = _mixed_aspect_parts(tmp_path)
    file_list = write_filelist(tmp_path / "x.filelist", parts, counts=[6, 6, 6])
    loader = build_train_dataloader(file_list, RES, batch_size=4, num_workers=0, seed=3, rank=0, world_size=1,
                                    aspect_ratio_buckets=True)
    expected_shape = {0: (24, 40), 1: (32, 32), 2: (40, 24)}  # (H, W) for wide, square, tall
    epoch_ids, shapes = Counter(), set()
    for batch in _batches(loader, 12):
        pixels, position = batch["pixel_values"], batch["position"]
        shapes.add(pixels.shape[2:])
        for sample_id in ids_of(pixels):
            kind = {0: 0, 3: 0, 1: 1, 4: 1, 2: 2, 5: 2}[sample_id % 6]
            assert pixels.shape[2:] == expected_shape[kind], (sample_id, pixels.shape)
        if position[1] == 0:
            epoch_ids.update(ids_of(pixels))
    assert shapes == set(expected_shape.values())
    assert epoch_ids == {i: 1 for i in range(18)}  # epoch 0: every image exactly once (partial batches flushed)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bucketing_resume_with_pending_samples_is_exact(tmp_path, num_workers):
    file_list = write_filelist(tmp_path / "x.filelist", _mixed_aspect_parts(tmp_path), counts=[6, 6, 6])
    options = dict(batch_size=3, num_workers=num_workers, seed=4, rank=0, world_size=1, aspect_ratio_buckets=True)
    reference = _batches(build_train_dataloader(file_list, RES, **options), 14)
    tracker = StreamPosition(num_workers, 1)
    _batches(build_train_dataloader(file_list, RES, **options), 3, tracker)
    state = tracker.state_dict()
    assert state["pending"]  # samples were waiting in other buckets: they must come back
    resumed = _batches(build_train_dataloader(file_list, RES, resume_state=state, **options), 11)
    for expected, got in zip(reference[3:], resumed, strict=True):
        assert got["position"] == expected["position"]
        np.testing.assert_array_equal(got["pixel_values"], expected["pixel_values"])


def test_bucketing_needs_a_resolution_multiple_of_8(tmp_path):
    from vae_trainer.argument_parser import parse_arguments

    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 1, 2))
    with pytest.raises(ValueError, match="multiple of 8"):  # refused when parsing, before any stream is built
        parse_arguments(["--file_list", file_list, "--vae_config_file", "configs/vae_micro.json", "--resolution", "36",
                         "--aspect_ratio_buckets", "--max_steps", "2", "--output_dir", str(tmp_path / "out")])


# ----------------------------------------------------------------------------------------- resume


def _noisy_lines(first, count, bad_at):
    lines = [line(noise_image(first + i, size=40 + (first + i) % 7, height=40)) for i in range(count)]
    lines[bad_at] = b"bad\tline"
    return lines


def _resume_sources(tmp_path, kind):
    """Noisy images (crops and flips visible), one bad record per part, several parts, epochs get crossed."""
    if kind in ("parts", "counted_parts"):
        parts = [write_part(tmp_path / f"part-{k}.gz", _noisy_lines(100 * k, 7, 3 + k)) for k in range(3)]
        return write_filelist(tmp_path / "x.filelist", parts, counts=[7] * 3 if kind == "counted_parts" else None)
    if kind == "folder":
        folder = tmp_path / "folder"
        folder.mkdir()
        for i in range(13):
            (folder / f"{i:02d}.png").write_bytes(noise_image(i, size=40 + i % 5))
        (folder / "bad.png").write_bytes(b"broken")
        return str(folder)
    if kind == "tar":
        for k in range(3):
            members = [(f"{i:03d}.png", noise_image(100 * k + i)) for i in range(6)] + [("x.txt", b"no image")]
            write_tar(tmp_path / f"shard-{k}.tar", members)
        return str(tmp_path / "shard-{0..2}.tar")
    raise ValueError(kind)


def _check_resume(file_list, num_workers, world_size, consumed=3, more=6, **extra):
    skips_seen = 0
    for rank in range(world_size):
        options = dict(batch_size=3, num_workers=num_workers, seed=7, rank=rank, world_size=world_size, **extra)
        reference = _batches(build_train_dataloader(file_list, RES, **options), consumed + more)
        tracker = StreamPosition(num_workers, world_size)
        _batches(build_train_dataloader(file_list, RES, **options), consumed, tracker)
        state = tracker.state_dict()
        resumed = _batches(build_train_dataloader(file_list, RES, resume_state=state, **options), more)
        for expected, got in zip(reference[consumed:], resumed, strict=True):
            assert got["position"] == expected["position"]
            np.testing.assert_array_equal(got["pixel_values"], expected["pixel_values"])
        assert max(b["position"][1] for b in reference) >= 1  # epochs were crossed
        skips_seen += max(sum(_skipped(b["position"]).values()) for b in reference)
    assert skips_seen >= 1  # and a bad record was met


@pytest.mark.parametrize("num_workers, world_size", [(0, 2), (2, 1)])  # (0, 1) and (2, 2): every source kind below
def test_resume_continues_exactly(tmp_path, num_workers, world_size):
    _check_resume(_resume_sources(tmp_path, "parts"), num_workers, world_size)


@pytest.mark.parametrize("kind", ["counted_parts", "folder", "tar"])
@pytest.mark.parametrize("num_workers, world_size", [(0, 1), (2, 2)])
def test_resume_continues_exactly_for_every_source_kind(tmp_path, kind, num_workers, world_size):
    _check_resume(_resume_sources(tmp_path, kind), num_workers, world_size, shuffle_buffer_size=4)


def test_position_state_round_trip_and_layout_check(tmp_path):
    position = StreamPosition()
    reasons = len(SKIP_REASONS)
    position.update([1, 0, 6] + [0] * reasons + [2, 1, 4])
    position.update(np.array([0, 2, 9, 3] + [0] * (reasons - 1) + [0], np.int64))
    state = position.state_dict()
    assert state["positions"] == {"0": [2, 9], "1": [0, 6]} and state["batches_consumed"] == 2
    assert state["pending"] == {"1": [1, 4]} and state["skipped"] == {"0": {SKIP_REASONS[0]: 3}}
    tracker = StreamPosition.from_state(state)
    assert tracker.start_of(1) == (0, 6, {1, 4}, Counter(), {})
    assert tracker.start_of(0) == (2, 9, set(), Counter({SKIP_REASONS[0]: 3}), {})
    assert tracker.skipped_totals()[SKIP_REASONS[0]] == 3
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 1, 4))
    saved = StreamPosition(num_workers=2, world_size=1).state_dict()
    with pytest.raises(ValueError, match="num_workers=2"):
        next(iter(ImageStream(file_list, RES, resume_state=saved)))
    with pytest.raises(ValueError, match="world_size 1"):
        ImageStream(file_list, RES, rank=0, world_size=2, resume_state=saved)


def test_resume_with_another_seed_or_shuffle_buffer_is_refused(tmp_path):
    """A position counts records in the order the seed and the shuffle blocks made: refused, not silently elsewhere."""
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 2, 6), counts=[6, 6])
    options = dict(batch_size=2, num_workers=0, rank=0, world_size=1)
    tracker = StreamPosition(0, 1, seed=7, shuffle_buffer_size=4)
    _batches(build_train_dataloader(file_list, RES, seed=7, shuffle_buffer_size=4, **options), 2, tracker)
    state = tracker.state_dict()
    assert (state["seed"], state["shuffle_buffer_size"]) == (7, 4)
    with pytest.raises(ValueError, match=r"--seed 7 \(this run: 8\).*same values"):
        build_train_dataloader(file_list, RES, seed=8, shuffle_buffer_size=4, resume_state=state, **options)
    with pytest.raises(ValueError, match=r"--shuffle_buffer_size 4 \(this run: 1000\)"):
        build_train_dataloader(file_list, RES, seed=7, resume_state=state, **options)
    assert _batches(build_train_dataloader(file_list, RES, seed=7, shuffle_buffer_size=4, resume_state=state,
                                           **options), 1)


def test_the_drivers_data_position_records_seed_and_shuffle_buffer(tmp_path):
    """What the drivers checkpoint (build.build_train_data's tracker) carries the values the check needs."""
    from vae_trainer.argument_parser import parse_arguments
    from vae_trainer.build import build_train_data

    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 1, 4))
    _, data_args, _, training_args = parse_arguments([
        "--file_list", file_list, "--vae_config_file", "configs/vae_micro.json", "--max_steps", "2",
        "--output_dir", str(tmp_path / "out"), "--seed", "11", "--shuffle_buffer_size", "5", "--device", "cpu"])
    _, position = build_train_data(data_args, training_args)
    state = position.state_dict()
    assert (state["seed"], state["shuffle_buffer_size"]) == (11, 5)


# ------------------------------------------------------------------------------------- evaluation


def _eval_on_ranks(monkeypatch, path, world_size, num_images, batch_size=2, sample_seed=None):
    """(image ids, decode calls) of each of `world_size` ranks evaluating `path` (with `sample_seed`: a random
    sample of it), faked in one process: each rank runs in a thread, and the loader's gathering of a number from
    every rank meets at a barrier."""
    barrier, values = threading.Barrier(world_size, timeout=60), {}

    def all_gather(gathered, value):
        values[threading.get_ident()] = value
        barrier.wait()
        gathered += [values[thread.ident] for thread in threads]  # in rank order
        barrier.wait()  # (nobody overwrites a value before every rank has read them all)

    monkeypatch.setattr(paddle.distributed, "all_gather", all_gather)
    decodes, decode = Counter(), ImageStream._decode
    monkeypatch.setattr(ImageStream, "_decode", lambda self, *a: decodes.update([id(self)]) or decode(self, *a))
    ids = {}

    def run(rank):
        sample = RecordSample(read_sources(path), sample_seed) if sample_seed is not None else None
        loader = build_eval_dataloader(path, RES, batch_size, rank, world_size, num_images, sample)
        ids[rank] = [i for batch in loader for i in ids_of(batch["pixel_values"].numpy())]

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(ids) == world_size, "a rank failed or hung"
    return [ids[rank] for rank in range(world_size)], sorted(decodes.values())


def test_eval_ranks_decode_their_share_of_the_first_usable_samples(tmp_path, monkeypatch):
    """Each of 3 ranks decodes about a third of the records, and together they evaluate exactly the first
    usable samples in order (those of one rank), though an image that only its full decode shows to be
    unusable (truncated) shifts the ones that follow."""
    lines = [line(id_image(i)) for i in range(16)]
    lines[2] = b"broken"
    lines[5] = line(id_image(5, size=8))  # too small (header)
    lines[7] = line(noise_image(7)[:600])  # truncated: its header is fine
    file_list = write_filelist(tmp_path / "x.filelist", [write_part(tmp_path / "p.gz", lines)])
    first_usable = [0, 1, 3, 4, 6, 8, 9, 10, 11, 12]  # 10 usable among the first 13 records
    (one,), [one_decodes] = _eval_on_ranks(monkeypatch, file_list, 1, num_images=10)
    assert one == first_usable and one_decodes == 13
    three, decodes = _eval_on_ranks(monkeypatch, file_list, 3, num_images=10)
    assert sorted(i for ids in three for i in ids) == first_usable
    assert sum(decodes) == 13 and max(decodes) <= 5, decodes  # each record decoded once, by one rank
    assert max(map(len, three)) - min(map(len, three)) <= 1
    clean = write_filelist(tmp_path / "y.filelist", id_parts(tmp_path, 1, 8))
    assert _eval_on_ranks(monkeypatch, clean, 3, num_images=7)[0] == [[0, 3, 6], [1, 4], [2, 5]]  # as before


def test_a_seeded_sample_takes_images_of_the_whole_list_each_once_on_any_number_of_ranks(tmp_path, monkeypatch):
    """The latent statistics of --file_list (issue 42.4): 12 of its 40 records (a counted part, then one counted by
    a read), drawn at random from all of them, where the list's first 12 are one part's; a bad record is replaced by
    a further draw, no image twice; the same images on 1 and 3 ranks, each record decoded once, by one rank."""
    lines = [line(id_image(i)) if i % 4 else b"broken" for i in range(40)]
    first, second = write_part(tmp_path / "a.gz", lines[:20]), write_part(tmp_path / "b.gz", lines[20:])
    write_filelist(tmp_path / "a.filelist", [first], counts=[20])
    write_filelist(tmp_path / "b.filelist", [second])
    (tmp_path / "x.filelist.list").write_text("a.filelist\nb.filelist\n")
    file_list = str(tmp_path / "x.filelist.list")
    (one,), [read] = _eval_on_ranks(monkeypatch, file_list, 1, num_images=12, sample_seed=5)
    assert len(set(one)) == len(one) == 12 and all(i % 4 for i in one) and read > 12  # broken ones replaced
    assert min(one) < 20 <= max(one)  # both parts, not the first 12 usable (all of a.gz)
    three, decodes = _eval_on_ranks(monkeypatch, file_list, 3, num_images=12, sample_seed=5)
    assert sorted(i for ids in three for i in ids) == sorted(one) and sum(decodes) == read
    (other,), _ = _eval_on_ranks(monkeypatch, file_list, 1, num_images=12, sample_seed=6)
    assert sorted(other) != sorted(one)


def test_eval_folder_sorted_centre_crop(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    for name, sample_id in [("b.png", 2), ("a.png", 1), ("sub/c.png", 3)]:
        (tmp_path / name).write_bytes(id_image(sample_id))
    wide = np.zeros((32, 64, 3), np.uint8)
    wide[:, 16:48] = (4, 0, 77)  # only the centre square carries the id
    Image.fromarray(wide).save(tmp_path / "d.webp", lossless=True)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "c_broken.png").write_bytes(b"broken")  # skipped, like a bad line of a filelist
    ranks, decodes = _eval_on_ranks(monkeypatch, str(tmp_path), 2, num_images=None, batch_size=4)
    assert ranks == [[1, 3], [2, 4]] and decodes == [2, 3]  # a.png, b.png, (c_broken.png), d.webp, sub/c.png
    loader = build_eval_dataloader(str(tmp_path), RES, batch_size=4, rank=0, world_size=1, num_images=2)
    assert [i for batch in loader for i in ids_of(batch["pixel_values"].numpy())] == [1, 2]


def test_a_rank_that_fails_mid_evaluation_stops_the_others_instead_of_leaving_them_in_the_gather(tmp_path,
                                                                                                monkeypatch):
    """Rank 1's decode fails in the first round: it still joins the round's gather (with its failure), so rank 0
    stops with a message naming it instead of waiting for a gather rank 1 never reaches (a hang on GPUs)."""
    from vae_trainer.data import dataset

    part = write_part(tmp_path / "p.gz", [line(id_image(i)) for i in range(8)])
    path = write_filelist(tmp_path / "eval.filelist", [part])
    barrier, values, errors = threading.Barrier(2, timeout=60), {}, {}

    def all_gather(gathered, value):
        values[threading.get_ident()] = value
        barrier.wait()
        gathered += [values[thread.ident] for thread in threads]
        barrier.wait()

    monkeypatch.setattr(paddle.distributed, "all_gather", all_gather)
    items = dataset._EvalShare._items

    def failing_items(self):
        if self.rank == 1:
            raise RuntimeError("decode failed on rank 1")
        yield from items(self)

    def run(rank):
        try:
            for _ in build_eval_dataloader(path, RES, 2, rank, 2, 6):
                pass
        except Exception as error:  # noqa: BLE001
            errors[rank] = str(error)

    monkeypatch.setattr(dataset._EvalShare, "_items", failing_items)
    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert "decode failed on rank 1" in errors[1]
    assert "rank 1" in errors[0] and "failed" in errors[0]  # rank 0 stopped too, naming rank 1
