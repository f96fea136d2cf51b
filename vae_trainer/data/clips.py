"""Video files to training clips with PyAV: a window of `num_frames` frames `frame_stride` apart, decoded from the
keyframe before it (images.crop crops its frames alike); an unusable file raises :class:`BadImage` (not_video,
too_short, truncated, too_small, too_large). The rules are in docs/data.md ("Clips")."""

import io
from fractions import Fraction

import av
import numpy as np
from PIL import Image

from .images import BadImage, check_size


def read_window(source: str | bytes, num_frames: int, stride: int, rng: np.random.Generator, first: bool = False,
                single_ratio: float = 0.0, min_size: int = 1, max_pixels: int = 2**62) -> list[Image.Image]:
    """The frames of one window of a video file (a path or its bytes): from frame 0 if `first`, else at a random
    start; with probability `single_ratio` one random frame instead. Draws from `rng` in that order."""
    try:
        container = av.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    except FileNotFoundError:
        raise BadImage("missing_file", f"video file not found: {source}") from None
    except (av.FFmpegError, OSError, ValueError) as error:
        raise BadImage("not_video", str(error)) from None
    with container:
        if not container.streams.video:
            raise BadImage("not_video", "no video stream")
        stream = container.streams.video[0]
        check_size(stream.codec_context.width, stream.codec_context.height, max_pixels, min_size)
        rate = stream.average_rate or stream.guessed_rate or Fraction(25)
        count, known = stream.frames, stream.frames > 0
        if not known:  # (webm, mkv: the header has a duration, not a frame count)
            seconds = (stream.duration * stream.time_base if stream.duration
                       else (container.duration or 0) / av.time_base)
            count = int(round(seconds * rate))
        if not count:  # no duration either (written to a pipe: a recorder, ffmpeg to stdout): count its packets
            count = sum(1 for packet in container.demux(stream) if packet.size)
            container.seek(stream.start_time or 0, stream=stream, backward=True)
        single = single_ratio > 0 and rng.random() < single_ratio
        span = 1 if single else (num_frames - 1) * stride + 1
        if count < span:
            raise BadImage("too_short", f"{count} frames{'' if known else ' (estimated)'}, the window needs {span}")
        start = 0 if first else int(rng.integers(0, count - span + 1))
        step, needed = (1, 1) if single else (stride, num_frames)
        frames, last = _decode(container, stream, rate, start, span, step)
        if len(frames) < needed and last >= 0 and not known:  # the estimate was too high:
            start = last + 1 - span  # the window that ends at the last frame
            if start < 0:
                raise BadImage("too_short", f"{last + 1} frames, the window needs {span}")
            frames, last = _decode(container, stream, rate, start, span, step)
        if len(frames) < needed:
            raise BadImage("truncated", f"frames end at {last + 1} of {count}{'' if known else ' (estimated)'}, "
                                        f"the window needs {start}..{start + span - 1}")
        return frames


def _decode(container, stream, rate: Fraction, start: int, span: int, stride: int) -> tuple[list[Image.Image], int]:
    """Frames start, start + stride, ... < start + span, and the index of the last frame decoded (-1: none)."""
    origin = stream.start_time or 0
    # From the keyframe at or before `start`; from the first frame if that overshoots it (or for a window at 0).
    targets = (origin + int(Fraction(start) / rate / stream.time_base), origin) if start > 0 else (None,)
    for attempt, target in enumerate(targets):
        frames, index = [], None
        try:
            if target is not None:
                container.seek(target, stream=stream, backward=True)
            for frame in container.decode(stream):
                # The first frame's index from its time, then one by one (a variable rate does not leave gaps).
                if index is None and frame.pts is not None:
                    index = round((frame.pts - origin) * stream.time_base * rate)
                else:
                    index = (-1 if index is None else index) + 1
                if index > start and not frames and attempt == 0 and start > 0:
                    break  # (the keyframe found lies past `start`: a container that seeks by decode time; rare)
                if index >= start and (index - start) % stride == 0:
                    frames.append(frame.to_image())
                if index >= start + span - 1:
                    return frames, index
        except av.FFmpegError as error:
            raise BadImage("truncated", f"after frame {index}: {error}") from None
        if frames or attempt == len(targets) - 1:  # (the last attempt always returns)
            return frames, -1 if index is None else index
