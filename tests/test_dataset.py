"""Tests of vae_trainer.data.dataset: sharding, weights, bad input, exact resume, evaluation loaders.

Most samples are solid 32x32 PNGs whose colour encodes an id (R + 256*G), so a test can tell exactly
which lines came through a stream at resolution 32.
"""

import base64
import gzip
import io
import logging
import signal
from contextlib import contextmanager

import numpy as np
import paddle
import pytest
from PIL import Image

from vae_trainer.data.dataset import (
    ImageFolder,
    ImageStream,
    StreamPosition,
    build_eval_dataloader,
    build_train_dataloader,
)

paddle.set_device("cpu")
RES = 32


def _png(image):
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def id_image(sample_id, size=RES):
    return _png(Image.new("RGB", (size, size), (sample_id % 256, sample_id // 256, 77)))


def noise_image(seed, size=40):
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return _png(Image.fromarray(pixels))


def line(image_bytes, caption=b"caption"):
    return caption + b"\t-\t" + base64.b64encode(image_bytes)


def write_part(path, lines, use_gzip=True):
    payload = b"".join(text + b"\n" for text in lines)
    path.write_bytes(gzip.compress(payload) if use_gzip else payload)
    return path


def write_filelist(path, parts):
    path.write_text("".join(f"{part.name}\n" for part in parts))
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
    values = np.asarray(pixel_values).reshape(-1, 3, RES, RES)[:, :, 0, 0]
    channels = np.rint((values + 1.0) * 127.5).astype(int)
    return (channels[:, 0] + 256 * channels[:, 1]).tolist()


def stream_ids(stream, limit=None):
    ids = []
    for number, sample in enumerate(stream):
        if limit is not None and number >= limit:
            break
        ids += ids_of(sample["pixel_values"])
    return ids


def host(value) -> np.ndarray:
    """A batch field as a numpy array (positions come as Python ints, images as tensors)."""
    return value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)


def loader_ids(loader):
    ids, shards = [], []
    for batch in loader:
        ids += ids_of(batch["pixel_values"].numpy())
        shards += host(batch["position"])[:, 0].tolist()
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
    assert f"{part}:2: skipped line (columns" in caplog.text and f"{part}:4:" in caplog.text
    assert f"{part}:7:" not in caplog.text  # only the first few per file and pass...
    assert f"{part}: 6 bad lines skipped in this pass" in caplog.text  # ...then a summary


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
    got = np.rint((samples[-1]["pixel_values"].transpose(1, 2, 0) + 1) * 127.5)
    np.testing.assert_array_equal(got, expected)  # lines come through in order, undamaged
    assert stream.skip_stats()["corrupt_gzip"] == 1
    assert f"{part}: truncated gzip stream" in caplog.text


def test_missing_part_and_empty_filelist(tmp_path):
    (tmp_path / "x.filelist").write_text("gone.gz\n")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'gone.gz'}.*x.filelist:1"):
        ImageStream(str(tmp_path / "x.filelist"), RES)
    (tmp_path / "empty.filelist").write_text("# nothing\n")
    with pytest.raises(RuntimeError, match="no part files"):
        ImageStream(str(tmp_path / "empty.filelist"), RES)


def test_no_usable_sample_raises_instead_of_hanging(tmp_path):
    part = write_part(tmp_path / "bad.gz", [b"a\tb", line(b"junk"), line(id_image(0, size=8))])
    file_list = write_filelist(tmp_path / "x.filelist", [part])
    with time_limit(30), pytest.raises(RuntimeError, match=r"shard 0 of 1.*bad\.gz"):
        next(iter(ImageStream(file_list, RES)))
    # A shard that gets no lines at all (1 line, 2 ranks) fails the same way.
    single = write_filelist(tmp_path / "one.filelist", [write_part(tmp_path / "one.gz", [line(id_image(0))])])
    with time_limit(30), pytest.raises(RuntimeError, match="shard 1 of 2"):
        next(iter(ImageStream(single, RES, rank=1, world_size=2)))


def _per_rank_ids(file_list, world_size, num_workers):
    """Ids and shard ids of one finite pass of every rank through a real DataLoader."""
    results = []
    for rank in range(world_size):
        stream = ImageStream(file_list, RES, rank=rank, world_size=world_size, infinite=False, seed=1)
        results.append(loader_ids(paddle.io.DataLoader(stream, batch_size=2, num_workers=num_workers)))
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


def test_dataloader_serves_workers_in_strict_rotation(tmp_path):
    """Paddle 3.3.1 hands out iterable-dataset batches from workers 0,1,2,0,1,2,... (resume relies on it)."""
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 3, 6))
    loader = build_train_dataloader(file_list, RES, batch_size=2, num_workers=3, seed=0, rank=0, world_size=1)
    shards = []
    with time_limit(120):
        for number, batch in enumerate(loader):
            shards.append(set(host(batch["position"])[:, 0].tolist()))
            if number == 11:
                break
    assert shards == [{k % 3} for k in range(12)]


def _resume_data(tmp_path):
    """3 parts of 7 noisy lines (one bad), so crops/flips are visible and epochs get crossed."""
    parts = []
    for index in range(3):
        lines = [line(noise_image(100 * index + i)) for i in range(7)]
        lines[3 + index] = b"bad\tline"
        parts.append(write_part(tmp_path / f"part-{index}.gz", lines))
    return write_filelist(tmp_path / "x.filelist", parts)


def _batches(loader, count, tracker=None):
    batches = []
    for batch in loader:
        batch = {key: host(value) for key, value in batch.items()}
        if tracker is not None:
            tracker.update(batch["position"])
        batches.append(batch)
        if len(batches) == count:
            break
    return batches


@pytest.mark.parametrize("num_workers, world_size", [(0, 1), (0, 2), (2, 1), (2, 2)])
def test_resume_continues_exactly(tmp_path, num_workers, world_size):
    file_list = _resume_data(tmp_path)
    consumed, more = 3, 6
    for rank in range(world_size):
        options = dict(batch_size=3, num_workers=num_workers, seed=7, rank=rank, world_size=world_size)
        with time_limit(120):
            reference = _batches(build_train_dataloader(file_list, RES, **options), consumed + more)
            tracker = StreamPosition(num_workers, world_size)
            _batches(build_train_dataloader(file_list, RES, **options), consumed, tracker)
            state = tracker.state_dict()
            resumed = _batches(build_train_dataloader(file_list, RES, resume_state=state, **options), more)
        for expected, got in zip(reference[consumed:], resumed, strict=True):
            np.testing.assert_array_equal(got["position"], expected["position"])
            np.testing.assert_array_equal(got["pixel_values"], expected["pixel_values"])
        assert max(p[1] for b in reference for p in b["position"].tolist()) >= 1  # epochs were crossed


def test_position_state_round_trip_and_layout_check(tmp_path):
    position = StreamPosition()
    position.update(np.array([[1, 0, 4], [1, 0, 6]]))
    position.update(paddle.to_tensor(np.array([[0, 2, 9]], np.int64)))
    state = position.state_dict()
    assert state["positions"] == {"0": [2, 9], "1": [0, 6]} and state["batches_consumed"] == 2
    tracker = StreamPosition.from_state(state)
    assert tracker.positions == {0: (2, 9), 1: (0, 6)}
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 1, 4))
    saved = StreamPosition(num_workers=2, world_size=1).state_dict()
    with pytest.raises(ValueError, match="num_workers=2"):
        next(iter(ImageStream(file_list, RES, resume_state=saved)))
    with pytest.raises(ValueError, match="world_size 1"):
        ImageStream(file_list, RES, rank=0, world_size=2, resume_state=saved)


def test_eval_filelist_takes_first_usable_samples_split_over_ranks(tmp_path):
    lines = [line(id_image(i)) for i in range(12)]
    lines[2] = b"broken"
    file_list = write_filelist(tmp_path / "x.filelist", [write_part(tmp_path / "p.gz", lines)])
    first_usable = [0, 1, 3, 4, 5, 6, 7, 8]
    per_rank = []
    for rank in range(3):
        loader = build_eval_dataloader(file_list, RES, batch_size=2, rank=rank, world_size=3, num_images=8)
        per_rank.append([i for batch in loader for i in ids_of(batch["pixel_values"].numpy())])
    assert per_rank == [first_usable[rank::3] for rank in range(3)]


def test_eval_folder_sorted_centre_crop(tmp_path):
    (tmp_path / "sub").mkdir()
    for name, sample_id in [("b.png", 2), ("a.png", 1), ("sub/c.png", 3)]:
        (tmp_path / name).write_bytes(id_image(sample_id))
    wide = np.zeros((32, 64, 3), np.uint8)
    wide[:, 16:48] = (4, 0, 77)  # only the centre square carries the id
    Image.fromarray(wide).save(tmp_path / "d.webp", lossless=True)
    (tmp_path / "notes.txt").write_text("not an image")
    folder = ImageFolder(str(tmp_path), RES)
    assert [path.name for path in folder.files] == ["a.png", "b.png", "d.webp", "c.png"]
    ranks = []
    for rank in range(2):
        loader = build_eval_dataloader(str(tmp_path), RES, batch_size=4, rank=rank, world_size=2, num_images=None)
        ranks.append([i for batch in loader for i in ids_of(batch["pixel_values"].numpy())])
    assert ranks == [[1, 4], [2, 3]]
