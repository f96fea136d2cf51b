"""The records of one part (LAION part file, WebDataset tar or ``pipe:``, image file), streamed one at a time and
numbered so a resumed run passes over records unread; damage ends a part with one :class:`Damaged` marker."""

import gzip
import os
import signal
import subprocess
import tarfile
import zlib
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

from .filelists import CLIP_TAR, LINES, PIPE_PREFIX, TAR, VIDEO_SUFFIXES, Part
from .images import BadImage, decode_base64

GZIP_MAGIC = b"\x1f\x8b"
TAR_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")  # by preference
TAR_VIDEO_EXTENSIONS = tuple(suffix[1:] for suffix in VIDEO_SUFFIXES)
MISSING_FILE = "missing_file"
_READ_SIZE = 1 << 20


@dataclass(frozen=True)
class TarSample:
    key: str
    image: bytes | None  # None: no image member
    video: bytes | None = None  # its video member (read as a clip with --num_frames > 1)


@dataclass(frozen=True)
class Damaged:
    reason: str
    detail: str


MISSING = Damaged("missing", "the part holds fewer records than its .counts file says")
Payload = Union[bytes, TarSample, str, Damaged]  # a line, a tar sample, an image file's path, damage


def open_part(path: str) -> BinaryIO:
    """Open a local part for reading (the one place parts are opened; tests count the calls)."""
    return open(path, "rb", buffering=_READ_SIZE)


def _line_records(path: str, start: int) -> Iterator[Payload | None]:
    """The lines of a gzip (multi-member too) or plain part; None before `start`."""
    try:
        with open_part(path) as raw:
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if raw.peek(2)[:2] == GZIP_MAGIC else raw
            for number, line in enumerate(stream):
                yield line.rstrip(b"\r\n") if number >= start else None
    except FileNotFoundError:
        yield Damaged(MISSING_FILE, f"part file not found: {path}")
    except EOFError:
        yield Damaged("corrupt_gzip", "truncated gzip stream")
    except (zlib.error, gzip.BadGzipFile, OSError) as error:
        yield Damaged("corrupt_gzip", f"corrupt gzip data ({error})")


def _tar_members(tar: tarfile.TarFile, start: int, videos: bool) -> Iterator[TarSample | None]:
    """Samples (runs of members sharing a key) of a tar stream; unread: those before `start`, videos unless `videos`."""
    number, key, image, rank, video = -1, None, None, len(TAR_IMAGE_EXTENSIONS), None
    for member in tar:
        tar.members = []  # stream mode would otherwise keep every header
        # WebDataset's key runs up to the first dot of the base name; ``__*__`` is metadata.
        folder, _, base = member.name.rpartition("/")
        if not member.isreg() or base.startswith("__") or "." not in base:
            continue
        stem, _, extension = base.partition(".")
        member_key, extension = (f"{folder}/{stem}" if folder else stem), extension.lower()
        if member_key != key:
            if key is not None:
                yield TarSample(key, image, video) if number >= start else None
            number, key, image, rank, video = number + 1, member_key, None, len(TAR_IMAGE_EXTENSIONS), None
        if number >= start and extension in TAR_IMAGE_EXTENSIONS[:rank]:
            image, rank = tar.extractfile(member).read(), TAR_IMAGE_EXTENSIONS.index(extension)
        elif videos and number >= start and extension in TAR_VIDEO_EXTENSIONS and video is None:
            video = tar.extractfile(member).read()
    if key is not None:
        yield TarSample(key, image, video) if number >= start else None


def _tar_records(path: str, start: int, videos: bool = False) -> Iterator[Payload | None]:
    """The samples of a local tar or a ``pipe:`` command's output (a failed exit status damages the part); a command
    still running when the reader stops is killed with its process group."""
    command = path[len(PIPE_PREFIX):] if path.startswith(PIPE_PREFIX) else None
    process = None
    try:
        if command is not None:
            process = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, bufsize=_READ_SIZE,
                                       start_new_session=True)
        with process.stdout if process else open_part(path) as stream:
            with tarfile.open(fileobj=stream, mode="r|*") as tar:
                yield from _tar_members(tar, start, videos)
            while process and stream.read(_READ_SIZE):  # the tar's end padding, so the writer can finish
                pass
        status = process.wait() if process else 0
    except FileNotFoundError:
        yield Damaged(MISSING_FILE, f"part file not found: {path}")
        return
    except (tarfile.TarError, EOFError, OSError, zlib.error) as error:
        yield Damaged("corrupt_tar", f"unreadable tar ({error})")
        return
    finally:
        if process is not None and process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if status != 0:
        yield Damaged("corrupt_tar", f"command {command!r} exited with status {status}")


def iterate_records(part: Part, start: int = 0) -> Iterator[Payload | None]:
    """Every record of `part` in order: None for those before `start` (not read), then the payloads."""
    if part.kind == LINES:
        return _line_records(part.path, start)
    if part.kind in (TAR, CLIP_TAR):
        return _tar_records(part.path, start, part.kind == CLIP_TAR)
    return iter([part.path if start == 0 else None])


def image_bytes(payload: Payload, image_column: int) -> bytes:
    """The encoded image of one record, or :class:`BadImage` (columns, base64, no_image, unreadable)."""
    if isinstance(payload, bytes):
        columns = payload.split(b"\t", image_column + 1)
        if len(columns) <= image_column:
            raise BadImage("columns", f"{len(columns)} columns, image expected in column {image_column}")
        return decode_base64(columns[image_column])
    if isinstance(payload, TarSample):
        if payload.image is None:
            raise BadImage("no_image", f"sample {payload.key} has no {'/'.join(TAR_IMAGE_EXTENSIONS)} member")
        return payload.image
    try:
        return Path(payload).read_bytes()
    except FileNotFoundError:
        raise BadImage(MISSING_FILE, f"image file not found: {payload}") from None
    except OSError as error:
        raise BadImage("unreadable", str(error)) from None


def describe(part: Part, number: int, payload: Payload) -> str:
    """file:line, shard:key or the image path."""
    if isinstance(payload, TarSample):
        return f"{part.path}:{payload.key}"
    return part.path if isinstance(payload, str) else f"{part.path}:{number + 1}"
