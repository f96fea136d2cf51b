"""Tests of the clip reader (vae_trainer.data.clips) and of clips in the training stream and the evaluation loader.

Most clips are "numbered": frame i is a solid colour whose red channel is 12 * i, so a test can tell exactly which
frames a window holds; the others are pans and zooms over the demo photos written by scripts/make_demo_clips.py,
whose frames are compared pixel for pixel with a naive decode of the whole file.
"""

import io
import logging

import av
import numpy as np
import pytest
from conftest import load_script, write_tar
from PIL import Image
from test_dataset import _batches, time_limit

from vae_trainer.data import clips
from vae_trainer.data.clips import read_window
from vae_trainer.data.dataset import ImageStream, build_eval_dataloader, build_train_dataloader
from vae_trainer.data.images import BadImage
from vae_trainer.data.position import SKIP_REASONS, StreamPosition

RES = 32
DEMO = "data/demo/train"


class Pipe(io.RawIOBase):
    """A write-only sink that cannot seek (a recorder's, or ffmpeg's to stdout): a webm written to it has neither a
    frame count nor a duration."""

    def __init__(self):
        super().__init__()
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, chunk):
        self.data += bytes(chunk)
        return len(chunk)


def numbered(path, frames=20, keyframe_interval=4, codec="libx264", options=None):
    """A clip whose frame i is solid red 12 * i (crf 0: ids survive the YUV round trip within +-2); `path` may be a
    Pipe (webm)."""
    target = path if isinstance(path, Pipe) else str(path)
    with av.open(target, "w", format="webm" if target is path else None, options=options or {}) as container:
        stream = container.add_stream(codec, rate=24)
        stream.width = stream.height = RES
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = keyframe_interval
        if codec == "libx264":
            stream.options = {"crf": "0", "x264-params": f"keyint={keyframe_interval}:scenecut=0"}
        for i in range(frames):
            pixels = np.zeros((RES, RES, 3), np.uint8)
            pixels[..., 0], pixels[..., 1] = 12 * i, 255 - 12 * i
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return str(path)


def ids(frames):
    """Frame ids of PIL frames, a uint8 [T, H, W, 3] clip or float32 pixel values [..., 3, T, H, W]."""
    if isinstance(frames, np.ndarray) and frames.dtype == np.float32:
        red = (np.moveaxis(frames, -4, -3)[..., 0, :, :] + 1.0) * 127.5  # [..., T, H, W]
        return np.rint(red.mean(axis=(-1, -2)) / 12).astype(int).tolist()
    return [round(np.asarray(frame)[..., 0].mean() / 12) for frame in frames]


def naive_frames(path):
    """Every frame of a file, decoded from its start."""
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def demo_clips(folder, frames=20, keyframe_interval=30, num_clips=2, codec="libx264", size=48):
    return load_script("make_demo_clips").main(
        ["--image_dir", DEMO, "--output_dir", str(folder), "--num_clips", str(num_clips), "--frames", str(frames),
         "--size", str(size), "--keyframe_interval", str(keyframe_interval), "--codec", codec])


class CountingOpen:
    """av.open whose containers count the frames they decode (a seek that works decodes few); `overshoot`: their
    seeks land that many time-base units late (as a demuxer that seeks by decode time may)."""

    def __init__(self, monkeypatch, overshoot=0):
        self.decoded, real_open = 0, av.open

        def counting(*args, **kwargs):
            container = real_open(*args, **kwargs)
            real_decode = container.decode

            def decode(*a, **k):
                for frame in real_decode(*a, **k):
                    self.decoded += 1
                    yield frame

            proxy = _Proxy(container, decode)
            proxy.seek = lambda target, **k: container.seek(target + overshoot if target else target, **k)
            return proxy

        monkeypatch.setattr(clips.av, "open", counting)


class _Proxy:
    def __init__(self, container, decode):
        self._container, self.decode = container, decode

    def __getattr__(self, name):
        return getattr(self._container, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._container.close()


# ------------------------------------------------------------------------------ windows


@pytest.mark.parametrize("codec, suffix", [("libx264", "mp4"), ("libvpx-vp9", "webm"), ("libx264", "mkv")])
def test_windows_hold_the_frames_of_their_stride_and_seek_from_a_keyframe(tmp_path, codec, suffix, monkeypatch):
    path = numbered(tmp_path / f"n.{suffix}", codec=codec)
    with av.open(path) as container:
        assert (container.streams.video[0].frames == 0) == (suffix != "mp4")  # webm, mkv: an estimated count
    naive = naive_frames(path)
    assert ids(naive) == list(range(20))
    starts, counter = set(), CountingOpen(monkeypatch)
    for seed in range(12):
        frames = read_window(path, 5, 2, np.random.default_rng(seed))
        got = ids(frames)
        starts.add(got[0])
        assert got == list(range(got[0], got[0] + 9, 2)) and 0 <= got[0] <= 11, got
        assert all(np.array_equal(np.asarray(f), naive[i]) for f, i in zip(frames, got))
    assert len(starts) >= 5  # random starts, the whole range reachable
    assert ids(read_window(path, 5, 2, np.random.default_rng(0), first=True)) == [0, 2, 4, 6, 8]
    assert ids(read_window(path, 20, 1, np.random.default_rng(0))) == list(range(20))  # the whole file
    if suffix == "mp4":  # keyframes every 4 frames: a window decodes its span plus at most 3 frames before it
        assert counter.decoded <= 14 * (9 + 3) + 1 + 20


def test_a_webm_written_to_a_pipe_has_its_frames_counted(tmp_path):
    pipe = Pipe()
    numbered(pipe, codec="libvpx-vp9")
    path = tmp_path / "piped.webm"
    path.write_bytes(pipe.data)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert (stream.frames, stream.duration, container.duration) == (0, None, None)
    starts = set()
    for seed in range(8):
        got = ids(read_window(str(path), 5, 2, np.random.default_rng(seed)))
        starts.add(got[0])
        assert got == list(range(got[0], got[0] + 9, 2)) and 0 <= got[0] <= 11, got
    assert len(starts) >= 4 and ids(read_window(str(path), 5, 1, np.random.default_rng(0), first=True)) == [0, 1, 2, 3, 4]


class StartAt:
    """A generator stand-in that draws the window start `start`."""

    def __init__(self, start):
        self.integers = lambda low, high: start


def test_keyframe_seek_equals_decoding_from_the_start_with_a_long_keyframe_interval(tmp_path):
    """Pans over the demo photos, one keyframe in 60 frames (x264's B-frames reorder around it): windows in the
    middle equal the naive decode exactly."""
    path = demo_clips(tmp_path, frames=60, keyframe_interval=50, num_clips=1)[0]
    naive = naive_frames(path)
    for start in (7, 29, 49, 50, 51):
        frames = read_window(str(path), 3, 3, StartAt(start))
        assert all(np.array_equal(np.asarray(f), naive[start + 3 * k]) for k, f in enumerate(frames)), start


def test_a_seek_that_lands_past_the_window_falls_back_to_the_first_frame(tmp_path, monkeypatch):
    path = numbered(tmp_path / "n.mp4")
    CountingOpen(monkeypatch, overshoot=3 * 512)  # 3 frames late (time base 1/12288 at 24 fps)
    for start in (1, 5, 11):
        assert ids(read_window(path, 5, 2, StartAt(start))) == list(range(start, start + 9, 2))


def test_an_estimated_frame_count_too_high_gives_the_window_at_the_end(tmp_path):
    """An mkv cut short: its header's duration promises 20 frames; windows past the real end move back to it."""
    data = open(numbered(tmp_path / "n.mkv"), "rb").read()
    (tmp_path / "cut.mkv").write_bytes(data[: len(data) * 6 // 10])
    decodable = len(naive_frames(tmp_path / "cut.mkv"))
    assert 9 <= decodable < 20
    windows = [ids(read_window(str(tmp_path / "cut.mkv"), 5, 2, np.random.default_rng(seed))) for seed in range(8)]
    assert [decodable - 9, decodable - 7, decodable - 5, decodable - 3, decodable - 1] in windows
    assert all(w == list(range(w[0], w[0] + 9, 2)) and w[-1] < decodable for w in windows)


def audio_only(path):
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())


@pytest.mark.parametrize("make, reason", [
    (lambda p: p.write_text("not a video"), "not_video"),
    (lambda p: audio_only(p), "not_video"),
    (lambda p: numbered(p, frames=8), "too_short"),
    (lambda p: p.write_bytes(open(numbered(p.with_suffix(".tmp.mp4"), options={"movflags": "faststart"}), "rb")
                             .read()[:2500]), "truncated"),
])
def test_unusable_files_raise_their_reason(tmp_path, make, reason):
    path = tmp_path / "bad.mp4"
    make(path)
    with pytest.raises(BadImage) as raised:
        read_window(str(path), 5, 2, np.random.default_rng(0))
    assert raised.value.reason == reason, raised.value


# ------------------------------------------------------------------------------ the stream


def mixed_folder(folder, clips=4, images=3, bad=True):
    (folder / "sub").mkdir(parents=True)
    for k in range(clips):
        numbered(folder / f"sub/c{k}.mp4")
    for k in range(images):
        Image.new("RGB", (40, 40), (12 * (k + 1), 0, 0)).save(folder / f"i{k}.png")
    if bad:
        (folder / "b_not.mp4").write_text("junk")
        numbered(folder / "b_short.mkv", frames=6)
    return str(folder)


def test_skips_are_counted_per_reason_and_file_and_logged_and_the_stream_goes_on(tmp_path, caplog):
    folder = mixed_folder(tmp_path / "d", images=0)
    stream = ImageStream(folder, RES, num_frames=5, frame_stride=2, infinite=False)
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        samples = [sample["pixel_values"] for sample in stream]
    assert len(samples) == 4 and all(s.shape == (1, 3, 5, RES, RES) for s in samples)
    assert stream.skip_stats() == {"not_video": 1, "too_short": 1}
    per_file = {stream.part_paths[key]: n for key, n in stream.counts.items() if isinstance(key, int)}
    assert sorted(p.rsplit("/", 1)[1] for p in per_file) == ["b_not.mp4", "b_short.mkv"]
    assert "b_not.mp4: skipped (not_video" in caplog.text and "b_short.mkv: skipped (too_short" in caplog.text


def test_every_frame_of_a_clip_gets_the_same_crop_and_flip(tmp_path):
    """A still textured picture (ffv1: lossless), 96 x 64 px, read at 32: a clip's frames are equal, clips differ."""
    picture = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    (tmp_path / "d").mkdir()
    with av.open(str(tmp_path / "d" / "still.mkv"), "w") as container:
        stream = container.add_stream("ffv1", rate=24)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv444p"
        for _ in range(12):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
    stream = ImageStream(str(tmp_path / "d"), RES, num_frames=5)
    clips_read = [sample["pixel_values"][0] for _, sample in zip(range(8), stream)]
    assert all(np.array_equal(clip[:, 0], clip[:, t]) for clip in clips_read for t in range(1, 5))
    assert len({clip[:, 0].tobytes() for clip in clips_read}) >= 4  # random crops and flips


def test_num_frames_1_reads_a_folders_images_only(tmp_path):
    stream = ImageStream(mixed_folder(tmp_path / "d"), RES, infinite=False)
    assert [p.rsplit("/", 1)[1] for p in stream.part_paths] == ["i0.png", "i1.png", "i2.png"]


def test_tar_shards_of_video_members_and_a_list_of_video_files(tmp_path):
    mp4 = open(numbered(tmp_path / "n.mp4"), "rb").read()
    png = io.BytesIO()
    Image.new("RGB", (40, 40), (24, 0, 0)).save(png, "PNG")
    shard = write_tar(tmp_path / "s.tar", [("a.mp4", mp4), ("a.json", b"{}"), ("b.png", png.getvalue()),
                                           ("c.mp4", mp4[:100]), ("d.webm", mp4)])
    stream = ImageStream(str(shard), RES, num_frames=5, infinite=False, shuffle=False)
    shapes = [sample["pixel_values"].shape for sample in stream]
    assert shapes == [(1, 3, 5, RES, RES), (1, 3, RES, RES), (1, 3, 5, RES, RES)]
    assert stream.skip_stats() == {"not_video": 1}
    # An image run reads the shard's images and never holds its video members (they may be large).
    from vae_trainer.data.filelists import read_sources
    from vae_trainer.data.records import iterate_records

    for videos in (False, True):
        [part] = read_sources(str(shard), videos=videos)[0].parts
        held = [sample.video for sample in iterate_records(part) if sample.video is not None]
        assert held == ([mp4, mp4[:100], mp4] if videos else [])
    table = tmp_path / "videos.csv"  # a CSV of paths and captions (one over two lines) under a header, from Excel
    table.write_text('\ufeffpath,caption\nn.mp4,"a pan,\nslow"\n' f"{shard},shards too\n", encoding="utf-8")
    assert sum(1 for _ in ImageStream(str(table), RES, num_frames=5, infinite=False, shuffle=False)) == 4
    table.write_text('n.mp4,"a pan,\nslow"\nnope,x\n', encoding="utf-8")  # no header: a first row is data
    with pytest.raises(FileNotFoundError, match=r"nope: not found \(named at .*videos.csv:3\)"):
        ImageStream(str(table), RES, num_frames=5)
    listed = tmp_path / "videos.txt"
    listed.write_text(f"n.mp4\n{shard}\n")
    stream = ImageStream(str(listed), RES, num_frames=9, infinite=False, shuffle=False)
    samples = [sample["pixel_values"][0] for sample in stream]
    window = ids(samples[0])
    assert len(samples) == 4 and window == list(range(window[0], window[0] + 9))


def clip_batches(folder, count, state=None, ratio=0.0, workers=None, batch_size=2):
    options = dict(num_frames=5, frame_stride=2, video_image_ratio=ratio, seed=3)
    if workers is not None:
        loader = build_train_dataloader(folder, RES, batch_size, workers, rank=0, world_size=1, resume_state=state,
                                        **options)
        tracker = StreamPosition.from_state(state) if state else StreamPosition(workers, 1, 3, 1000)
        tracker.files = loader.dataset.part_paths
        return _batches(loader, count, tracker), tracker
    stream = ImageStream(folder, RES, resume_state=state, batch_size=batch_size, **options)
    tracker = StreamPosition.from_state(state) if state else StreamPosition(None, 1, 3, 1000)
    tracker.files, batches = stream.part_paths, []
    for batch in stream:
        tracker.update(batch["position"])
        batches.append(batch)
        if len(batches) == count:
            return batches, tracker


def test_mixed_images_and_clips_batch_by_frame_count_and_resume_exactly(tmp_path):
    folder = mixed_folder(tmp_path / "d")
    batches, _ = clip_batches(folder, 12, ratio=0.3)
    shapes = {batch["pixel_values"].shape[1:] for batch in batches}
    assert shapes == {(3, RES, RES), (3, 5, RES, RES)}, shapes
    assert all(batch["pixel_values"].dtype == np.float32 and -1 <= batch["pixel_values"].min() for batch in batches)
    assert any(len(batch["pixel_values"]) == 1 for batch in batches)  # flushed at a shard epoch's end
    for stop in (3, 5, 8):  # pending samples of the other frame count refilled on resume
        _, tracker = clip_batches(folder, stop, ratio=0.3)
        resumed, _ = clip_batches(folder, 12 - stop, state=tracker.state_dict(), ratio=0.3)
        for a, b in zip(batches[stop:], resumed):
            assert a["position"] == b["position"] and np.array_equal(a["pixel_values"], b["pixel_values"])


def test_video_image_ratio_is_the_share_of_single_frames_and_reproducible(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    numbered(folder / "c.mp4")
    singles = []
    for run in range(2):
        stream = ImageStream(str(folder), RES, num_frames=5, video_image_ratio=0.25, seed=1)
        single = [sample["pixel_values"].ndim == 4 for _, sample in zip(range(200), stream)]
        singles.append(single)
    assert singles[0] == singles[1]
    assert abs(np.mean(singles[0]) - 0.25) < 0.09, np.mean(singles[0])  # 2.9 standard deviations


@pytest.mark.parametrize("workers", [0, 2])
def test_the_dataloader_serves_clips_with_0_and_2_workers_and_resumes(tmp_path, workers):
    folder = mixed_folder(tmp_path / "d", bad=False)
    with time_limit(60):
        batches, _ = clip_batches(folder, 6, workers=workers, batch_size=1)
        _, tracker = clip_batches(folder, 3, workers=workers, batch_size=1)
        resumed, _ = clip_batches(folder, 3, state=tracker.state_dict(), workers=workers, batch_size=1)
    assert {b["pixel_values"].shape for b in batches} == {(1, 3, 5, RES, RES), (1, 3, RES, RES)}
    assert all(np.array_equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(batches[3:], resumed))


def test_a_data_state_saved_before_the_clip_reasons_still_resumes(tmp_path):
    """The literal state of a run before not_video / too_short existed (13 reasons): it loads, its counts go on."""
    folder = mixed_folder(tmp_path / "d")
    bad = str(tmp_path / "d" / "b_not.mp4")
    old = {"positions": {"0": [0, 2]}, "pending": {}, "skipped": {"0": {"truncated": 2, "missing_file": 1}},
           "skipped_files": {"0": {bad: 3}}, "bad_records": {}, "batches_consumed": 1, "num_workers": None,
           "world_size": 1, "seed": 3, "shuffle_buffer_size": 1000}
    resumed, tracker = clip_batches(folder, 6, state=old)
    counts = dict(zip(SKIP_REASONS, resumed[-1]["position"][3:]))
    assert counts["truncated"] == 2 and counts["missing_file"] == 1 and counts["not_video"] >= 1
    assert tracker.skipped_by_file()[bad][0] >= 4 and tracker.batches_consumed == 7


def test_the_eval_loader_gives_each_videos_first_window_centre_cropped(tmp_path, caplog):
    folder = mixed_folder(tmp_path / "d")
    with av.open(str(tmp_path / "d" / "wide.mp4"), "w") as container:  # 2 x RES wide, green rising 4 per column
        stream = container.add_stream("libx264", rate=24, options={"crf": "0"})
        stream.width, stream.height, stream.pix_fmt = 2 * RES, RES, "yuv444p"
        for i in range(12):
            pixels = np.zeros((RES, 2 * RES, 3), np.uint8)
            pixels[..., 0], pixels[..., 1] = 12 * i, 4 * np.arange(2 * RES)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    with caplog.at_level(logging.WARNING, logger="vae_trainer.data"):
        batches = list(build_eval_dataloader(folder, RES, 2, 0, 1, None, num_frames=5, frame_stride=2))
    values = np.concatenate([batch["pixel_values"].numpy() for batch in batches])
    assert values.shape == (5, 3, 5, RES, RES)
    assert ids(values) == [[0, 2, 4, 6, 8]] * 5
    green = (values[-1, 1] + 1) * 127.5  # the wide clip (last by name): its centre columns, RES // 2 onwards
    np.testing.assert_allclose(green.mean(axis=(0, 1)), 4 * np.arange(RES // 2, RES // 2 + RES), atol=3)
    assert caplog.text.count("skipped (not_video") == 4 and "b_short.mkv: skipped (too_short" in caplog.text
