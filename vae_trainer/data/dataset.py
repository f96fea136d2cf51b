"""The training stream (infinite, sharded, weighted, bucketed, exactly resumable) and the evaluation loader, whose
ranks each decode their share; the rules are in docs/data.md ("How the stream works")."""

import itertools
import logging
from collections import Counter, defaultdict
from collections.abc import Iterator

import numpy as np
import paddle

from .buckets import bucket_shapes, nearest_bucket
from .clips import read_window
from .filelists import IMAGE, VIDEO_SUFFIXES, read_sources
from .images import BadImage, crop, has_alpha, load_rgb, open_image, to_float, upright_size
from .loader import NoHangLoader, RaisesInMainThread
from .position import NOTES, OPAQUE, StreamPosition, encode_position, note_bad
from .records import MISSING, MISSING_FILE, Damaged, TarSample, describe, image_bytes
from .sharding import PER_SAMPLE, SKIPPED, Record, RecordSample, ShardSource, assign, interleave, rng

logger = logging.getLogger("vae_trainer.data")

LOGGED_PER_FILE = 3


class ImageStream(RaisesInMainThread):
    """Decoded, cropped images and clips (`num_frames` > 1: a random window of each video, or one frame with
    probability `video_image_ratio`; `first_windows`: each video's first, images skipped), in batches of one bucket
    (shape and frame count) each: float32 [B, C, (T,) H, W] in [-1, 1] and their position, partly filled ones flushed
    at each shard epoch's end when there are several buckets. `channels` 4: images keep their alpha (RGBA), and one
    without is read as opaque and counted (position.OPAQUE)."""

    def __init__(self, file_list: str, resolution: int, *, image_column: int = 2, seed: int = 0, rank: int = 0,
                 world_size: int = 1, infinite: bool = True, shuffle: bool = True, random_crop: bool = True,
                 random_flip: bool = True, min_image_size: int = 32, max_image_pixels: int = 8192 * 8192,
                 aspect_ratio_buckets: bool = False, shuffle_buffer_size: int = 1000, resume_state: dict | None = None,
                 draft_decode: bool = True, record_counts: bool = True, num_frames: int = 1, frame_stride: int = 1,
                 video_image_ratio: float = 0.0, first_windows: bool = False, channels: int = 3,
                 batch_size: int = 1, num_workers: int | None = None) -> None:
        super().__init__()
        self.file_list = file_list
        self.sources = read_sources(file_list, counts=record_counts, videos=num_frames > 1)
        if not any(source.parts for source in self.sources):
            raise RuntimeError(f"{file_list}: names no part files")
        # Every part file once, in list order: positions count skips per file by index into this list.
        self.part_paths = list(dict.fromkeys(part.path for source in self.sources for part in source.parts))
        self._part_index = {path: index for index, path in enumerate(self.part_paths)}
        self.image_column, self.draft_decode, self.seed = image_column, draft_decode, seed
        self.rank, self.world_size, self.infinite, self.shuffle = rank, world_size, infinite, shuffle
        self.shuffle_buffer_size, self.random_crop, self.random_flip = shuffle_buffer_size, random_crop, random_flip
        self.min_image_size, self.max_image_pixels, self.first_windows = min_image_size, max_image_pixels, first_windows
        self.buckets = bucket_shapes(resolution) if aspect_ratio_buckets else [(resolution, resolution)]
        self.num_frames, self.frame_stride, self.video_image_ratio = num_frames, frame_stride, video_image_ratio
        self.alpha, self.opaque_logged = channels == 4, False  # keep alpha (a 4-channel VAE's RGBA images)
        # (Batches of several shapes or frame counts: one waiting at an epoch's end would resume in the wrong epoch.)
        self.flush_each_epoch = aspect_ratio_buckets or num_frames > 1
        # Where the shards start, and the rank's position the main process updates with each batch taken: the shards
        # read their starts once, before the first batch (a worker from its fork's copy, 0 workers: the reader thread).
        self.position = (StreamPosition.from_state(resume_state) if resume_state
                         else StreamPosition(num_workers, world_size, seed, shuffle_buffer_size))
        self.position.check_resume(world_size, seed, shuffle_buffer_size)
        self.position.files = self.part_paths
        self.counts: Counter = Counter()  # the skips of the shard being read: per reason and per part index
        self.bad_records: dict[int, list[int]] = {}  # and its distinct bad records per part index (note_bad)
        self._logged: dict[str, set[int]] = {}  # file -> problems shown (record numbers; -1: the whole part)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size

    def skip_stats(self) -> dict[str, int]:
        return {reason: n for reason, n in self.counts.items() if isinstance(reason, str) and reason not in NOTES}

    def _log_skip(self, record: Record, bad: BadImage) -> None:
        """Log each file's first few problems once per process."""
        whole_part = isinstance(record.payload, Damaged)  # one line for all its lost records
        key, shown = -1 if whole_part else record.number, self._logged.setdefault(record.part.path, set())
        if key in shown or len(shown) > LOGGED_PER_FILE:
            return  # shown in an earlier pass, or the file's quota is used up
        shown.add(key)
        if len(shown) <= LOGGED_PER_FILE:
            where = record.part.path if whole_part else describe(record.part, record.number, record.payload)
            logger.warning("%s: skipped (%s: %s)", where, bad.reason, bad.detail)
        else:
            logger.warning("%s: further problems in this file are counted (data/skipped_* scalars, end-of-run "
                           "summary), not logged", record.part.path)

    def _items(self) -> Iterator[dict]:
        """The calling worker's shard's batches from its start on; skips go to the start's counts."""
        # Resumed, worker w plays role (w + batches) % workers.
        worker = paddle.io.get_worker_info()
        num_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        self.position.check_workers(num_workers)
        shard = self.rank * num_workers + (worker_id + self.position.batches_consumed) % num_workers
        num_shards = self.world_size * num_workers
        sources = assign(self.sources, self.seed, shard, num_shards, self.shuffle)
        epoch, resume_at, restore, self.counts, self.bad_records = self.position.start_of(shard)
        skip = min(restore, default=resume_at)
        waiting: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = defaultdict(list)  # per bucket: (index, crop)
        while True:
            usable, fresh, end = 0, resume_at == 0, skip
            records = interleave(sources, self.seed, shard, epoch, skip, self.shuffle, self.shuffle_buffer_size,
                                 self.infinite)  # (an infinite stream's sources are weighted)
            for index, record in enumerate(records):
                end, replaying = index + 1, index < resume_at
                if record is SKIPPED or (replaying and index not in restore):
                    continue
                decoded = self._decode(record, (shard, epoch, index), not replaying)  # replayed: refills a bucket
                if decoded is not None:
                    usable += 1
                    waiting[decoded[0]].append((index, decoded[1]))
                    if len(waiting[decoded[0]]) == self.batch_size:
                        yield self._batch(waiting, decoded[0], (shard, epoch, index + 1))
            if usable == 0 and fresh:
                raise RuntimeError(self._no_samples_message(shard, num_shards, sources, records=end))
            for bucket in sorted(waiting) if self.flush_each_epoch else []:
                if waiting[bucket]:
                    yield self._batch(waiting, bucket, (shard, epoch, end))
            if not self.infinite:
                return
            epoch, skip, resume_at, restore = epoch + 1, 0, 0, set()

    def _batch(self, waiting: dict, bucket: tuple[int, int], where: tuple[int, int, int]) -> dict:
        """The batch of `bucket`'s waiting crops, at `where` (shard, epoch, records consumed); the rest pending."""
        batch, waiting[bucket] = waiting[bucket], []
        pending = sorted(index for samples in waiting.values() for index, _ in samples)
        pixels = np.stack([sample for _, sample in batch])
        return {"pixel_values": to_float(pixels, pixels.ndim == 5),
                "position": encode_position(*where, self.counts, pending, self.bad_records)}

    def _decode(self, record: Record, keys: tuple[int, int, int], count: bool = True):
        """(bucket, uint8 crop [H, W, C] or clip [T, H, W, C]) of a record; None if unusable (counted if `count`)."""
        payload, draws, opaque = record.payload, rng(self.seed, PER_SAMPLE, *keys), False
        try:
            if isinstance(payload, Damaged):
                corrupt = payload.reason not in (MISSING.reason, MISSING_FILE)
                raise BadImage(payload.reason, payload.detail + ("; the records before it are used" if corrupt else ""))
            # Read as a clip (--num_frames > 1): a video file's path, or a tar sample's video.
            video = None if self.num_frames == 1 else payload.video if isinstance(payload, TarSample) else (
                payload if isinstance(payload, str) and payload.lower().endswith(VIDEO_SUFFIXES) else None)
            if video is not None:
                frames = read_window(video, self.num_frames, self.frame_stride, draws, self.first_windows,
                                     self.video_image_ratio, self.min_image_size, self.max_image_pixels)
                if self.alpha:  # video carries no alpha: a 4-channel VAE's clips are opaque, counted as images are
                    frames, opaque = [frame.convert("RGBA") for frame in frames], True
            elif self.first_windows and self.num_frames > 1:
                raise BadImage("not_video", "an image (clips are evaluated on videos only)")
            else:
                encoded = image_bytes(payload, self.image_column)
                frames = [open_image(encoded, self.max_image_pixels, self.min_image_size)]
            bucket = nearest_bucket(*upright_size(frames[0]), self.buckets) if len(self.buckets) > 1 else 0
            size = self.buckets[bucket]
            if video is None:
                opaque = self.alpha and not has_alpha(frames[0])
                frames = [load_rgb(frames[0], cover=size if self.draft_decode else None, alpha=self.alpha)]
        except BadImage as bad:
            if count:
                self._log_skip(record, bad)
                part = self._part_index[record.part.path]
                self.counts.update([bad.reason, part])  # per file: end-of-run summary
                if keys[1] == 0 and not record.repeat:  # the shard's first read of it (epoch 0, a first pass)
                    note_bad(self.bad_records, part, None if record.part.kind == IMAGE else record.number)
            return None
        if opaque and count:  # an image without alpha read as opaque: a note, not a skip; the first one is logged
            self.counts.update([OPAQUE])
            if not self.opaque_logged:
                self.opaque_logged = True
                logger.info("%s: no alpha channel, read as opaque (alpha 1); further ones are counted (in training: "
                            "data/opaque_images, the end-of-run summary), not logged",
                            describe(record.part, record.number, record.payload))
        clip = frames if len(frames) > 1 else frames[0]  # a clip's frames cropped alike; one frame: an image
        return (len(frames), bucket), crop(clip, size, draws, self.random_flip, self.random_crop)

    def _no_samples_message(self, shard: int, num_shards: int, sources: list[ShardSource], records: int) -> str:
        files = sorted({segment.part.path for source in sources for segment in source.segments})
        shown = ", ".join(files[:10]) + (f" ... ({len(files)} files)" if len(files) > 10 else "")
        message = (f"{self.file_list}: shard {shard} of {num_shards} (rank {self.rank}) got no usable sample in a "
                   f"whole pass over its files: [{shown}]; skipped so far: {self.skip_stats()}")
        if records > 0:
            return message
        known = [part.records for source in self.sources for part in source.parts]
        held = (f" holds {sum(known)} records in {len(known)} part(s), fewer than" if None not in known
                else f"'s {len(known)} part(s) hold too few records for")
        return (f"{message}. It got no record at all: the data{held} the {num_shards} shards ({self.world_size} "
                f"process(es) x {num_shards // self.world_size} DataLoader worker(s) each; every shard needs at least "
                "one record). Use fewer --dataloader_num_workers or processes, or more images.")


def build_train_dataloader(file_list: str, resolution: int, batch_size: int, num_workers: int, seed: int, rank: int,
                           world_size: int, resume_state: dict | None = None, **stream_kwargs) -> paddle.io.DataLoader:
    """The infinite training DataLoader of one rank (batches of "pixel_values" and "position"); its dataset's
    `position` is the rank's resume state, to update with each batch taken."""
    stream = ImageStream(file_list, resolution, seed=seed, rank=rank, world_size=world_size, resume_state=resume_state,
                         batch_size=batch_size, num_workers=num_workers, **stream_kwargs)
    return NoHangLoader(stream, batch_size=None, num_workers=num_workers)


class _EvalShare(RaisesInMainThread):
    """This rank's records of one evaluation round, decoded: each record goes to the rank with the fewest images."""

    def __init__(self, stream: ImageStream, records: Iterator, images: list[int], rank: int) -> None:
        super().__init__()
        self.stream, self.records, self.images, self.rank = stream, records, list(images), rank
        self.read = self.usable = 0

    def _items(self) -> Iterator[dict[str, np.ndarray]]:
        for index, record in self.records:
            owner = self.images.index(min(self.images))
            self.images[owner] += 1
            self.read += 1
            decoded = self.stream._decode(record, (0, 0, index)) if owner == self.rank else None
            if decoded is not None:
                self.usable += 1
                yield {"pixel_values": to_float(decoded[1], decoded[1].ndim == 4)}


def build_eval_dataloader(path: str, resolution: int, batch_size: int, rank: int, world_size: int,
                          num_images: int | None, sample: RecordSample | None = None, *, num_frames: int = 1,
                          frame_stride: int = 1, channels: int = 3) -> Iterator[dict]:
    """This rank's evaluation batches: the first `num_images` usable images (all if None) in list order, or of
    `sample`'s random order, full size, centre-cropped, unflipped (`num_frames` > 1: each video's first window;
    `channels` 4: RGBA, as ImageStream's).
    Collective, in rounds: the next `num_images` - usable records are dealt to the ranks, which gather their usable
    counts and failure flags (a failing rank joins; the rest stop)."""
    stream = ImageStream(path, resolution, infinite=False, shuffle=False, random_crop=False, random_flip=False,
                         draft_decode=False, record_counts=False, num_frames=num_frames, frame_stride=frame_stride,
                         first_windows=True, channels=channels)  # now: a bad --data is a start-up error
    return _eval_rounds(stream, batch_size, rank, world_size, num_images, sample)


def _eval_rounds(stream: ImageStream, batch_size: int, rank: int, world_size: int, num_images: int | None,
                 sample: RecordSample | None) -> Iterator[dict]:
    sources = assign(stream.sources, stream.seed, 0, 1, shuffle=False)
    in_order = enumerate(interleave(sources, stream.seed, 0, 0, 0, False, stream.shuffle_buffer_size, False))
    take = sample.take if sample is not None else lambda wanted: itertools.islice(in_order, wanted)
    images, read = [0] * world_size, 0  # usable images per rank so far
    while True:
        wanted = None if num_images is None else num_images - sum(images)
        share = _EvalShare(stream, take(wanted), images, rank)
        done = False
        try:
            yield from NoHangLoader(share, batch_size=batch_size, drop_last=False)
            done = True
        finally:  # (on a failure this rank's own error goes on after the gather)
            rounds, gathered = [[share.usable, int(not done)]], []
            if world_size > 1:
                paddle.distributed.all_gather(gathered, paddle.to_tensor(rounds[0], dtype="int64"))
                rounds = [tensor.numpy().tolist() for tensor in gathered]
        failed = [str(r) for r, (_, bad) in enumerate(rounds) if bad]
        if failed:
            raise RuntimeError(f"stopped with rank {', '.join(failed)}, which failed in this evaluation")
        images = [held + usable for held, (usable, _) in zip(images, rounds)]
        read += share.read
        if wanted is None or share.read < wanted or sum(images) == num_images:
            break
    if sum(images) == 0:
        raise RuntimeError(stream._no_samples_message(0, 1, sources, records=read))
