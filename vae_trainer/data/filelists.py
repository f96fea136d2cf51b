"""What ``--file_list`` names, resolved into weighted sources of parts with their record counts if known; the
accepted forms are in docs/data.md ("What --file_list takes", "Record counts")."""

import csv
import functools
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from braceexpand import UnbalancedBracesError, braceexpand
from PIL import Image

logger = logging.getLogger("vae_trainer.data")

FILELIST_LIST_SUFFIX = ".filelist.list"
FILELIST_SUFFIX = ".filelist"
COUNTS_SUFFIX = ".counts"
CSV_SUFFIX = ".csv"  # a filelist as a table: the path in the first column
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
PIPE_PREFIX = "pipe:"
LINES, TAR, IMAGE = "lines", "tar", "image"  # a LAION part file, a WebDataset shard, one image (or video) file
CLIP_TAR = "clip_tar"  # a WebDataset shard whose video members are read too (--num_frames > 1)
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov", ".m4v")  # read as clips with --num_frames > 1


@dataclass(frozen=True)
class Part:
    path: str
    kind: str
    records: int | None = None
    # bytes of a local part when listed, for the .counts staleness check (None: a ``pipe:`` command's); not part of
    # what a part is (its equality, hash and repr)
    size: int | None = field(default=None, compare=False, repr=False)


@dataclass
class Source:
    name: str
    weight: float
    parts: list[Part] = field(default_factory=list)

    @property
    def counted(self) -> bool:
        return all(part.records is not None for part in self.parts)


def _entries(list_file: str) -> list[tuple[int, str]]:
    if not os.path.isfile(list_file):
        raise FileNotFoundError(f"{list_file}: file list not found")
    table = list_file.lower().endswith(CSV_SUFFIX)  # paths in the first column (quoted cells may span lines)
    with open(list_file, encoding="utf-8-sig" if table else "utf-8", newline="" if table else None) as handle:
        rows = csv.reader(handle) if table else ([line] for line in handle)
        lines = [(getattr(rows, "line_num", number), row[0].strip() if row else "")
                 for number, row in enumerate(rows, start=1)]
    entries = [(number, text) for number, text in lines if text and not text.startswith("#")]
    first = entries[0][1] if table and entries else ""
    header = first and not Path(first).suffix and not os.path.exists(_resolve(first, list_file))  # e.g. "path"
    return entries[1:] if header else entries


def _resolve(path: str, list_file: str | None) -> str:
    """`path` made absolute relative to the folder of the list that names it (``pipe:`` commands unchanged)."""
    if path.startswith(PIPE_PREFIX):
        return path
    path = os.path.expanduser(path)
    if not os.path.isabs(path) and list_file is not None:
        path = os.path.join(os.path.dirname(os.path.abspath(list_file)), path)
    return os.path.normpath(os.path.abspath(path))


def _expand(spec: str) -> list[str]:
    try:
        return list(braceexpand(spec))
    except UnbalancedBracesError:
        return [spec]


def is_tar_spec(name: str) -> bool:
    """A ``pipe:`` command, or a path/brace pattern whose names all end in a tar suffix."""
    return name.startswith(PIPE_PREFIX) or all(path.lower().endswith(TAR_SUFFIXES) for path in _expand(name))


@functools.cache
def image_suffixes() -> set[str]:
    Image.init()
    return {suffix for suffix, format_name in Image.registered_extensions().items() if format_name in Image.OPEN}


def is_filelist_list(file_list: str) -> bool:
    """True for a list of filelists: by its suffix, else by its first entry (a weight, or a ``.filelist``)."""
    if file_list.lower().endswith((FILELIST_LIST_SUFFIX, FILELIST_SUFFIX, CSV_SUFFIX)):
        return file_list.endswith(FILELIST_LIST_SUFFIX)
    entries = _entries(file_list)
    fields = entries[0][1].split() if entries else [""]
    return len(fields) > 1 or fields[0].endswith(FILELIST_SUFFIX)


def _part(path: str, named_at: str, videos: bool) -> Part:
    """The part at `path`, of the kind its name says, with its size: of a local part one stat, raising if it is
    missing; None for a ``pipe:`` command."""
    size = None
    if not path.startswith(PIPE_PREFIX):
        if not os.path.isfile(path):
            why = "not a file" if os.path.exists(path) else "not found"
            raise FileNotFoundError(f"{path}: {why} (named at {named_at})")
        size = os.path.getsize(path)
    if path.startswith(PIPE_PREFIX) or path.lower().endswith(TAR_SUFFIXES):
        return Part(path, CLIP_TAR if videos else TAR, size=size)
    is_image = Path(path).suffix.lower() in image_suffixes() or videos and path.lower().endswith(VIDEO_SUFFIXES)
    return Part(path, IMAGE, 1, size) if is_image else Part(path, LINES, size=size)


def read_filelist(filelist: str, weight: float = 1.0, counts: bool = True, videos: bool = False) -> Source:
    """Read one ``.filelist``; every named local part must exist. `counts`: apply its ``.counts`` file; `videos`: a
    video file is a one-record part, as an image file."""
    filelist = os.path.normpath(os.path.abspath(filelist))
    parts = [_part(_resolve(name, filelist), f"{filelist}:{line_number}", videos)
             for line_number, text in _entries(filelist) for name in (_expand(text) if is_tar_spec(text) else [text])]
    return Source(filelist, weight, _with_counts(filelist, parts) if counts else parts)


def _with_counts(filelist: str, parts: list[Part]) -> list[Part]:
    """`parts` with their record counts, if ``<filelist>.counts`` covers all of them unchanged."""
    path, counts = filelist + COUNTS_SUFFIX, {}
    for line_number, text in _entries(path) if os.path.isfile(path) else []:
        fields = text.rsplit("\t", 2)
        if len(fields) != 3 or not fields[1].isdigit():
            raise ValueError(f"{path}:{line_number}: expected 'NAME<TAB>records<TAB>bytes', got {text!r}")
        counts[_resolve(fields[0], filelist)] = (int(fields[1]), int(fields[2]) if fields[2].isdigit() else None)
    if not counts and sum(part.kind != IMAGE for part in parts) > 1:
        logger.warning("%s: no %s file, so shards get whole parts and images in shards with fewer records are "
                       "shown more often; write it with: python scripts/write_filelist.py --count %s",
                       filelist, COUNTS_SUFFIX, filelist)
    if not counts:
        return parts
    counted = []
    for part in parts:
        records, counted_size = counts.get(part.path, (None, None))
        stale = part.size is not None and counted_size is not None and part.size != counted_size
        if part.kind != IMAGE and (records is None or stale):
            why = "is not listed" if records is None else f"has {part.size} bytes, not {counted_size}"
            logger.warning("%s: %s %s; reading the source without counts (re-run scripts/write_filelist.py "
                           "--count %s)", path, part.path, why, filelist)
            return parts
        counted.append(part if part.kind == IMAGE else Part(part.path, part.kind, records))
    return counted


def _source(name: str, weight: float, named_at: str, list_file: str | None, counts: bool, videos: bool) -> Source:
    path = _resolve(name, list_file)
    if is_tar_spec(name):  # (every name a tar's or a command's: tar parts)
        return Source(path, weight, [_part(shard, named_at, videos) for shard in _expand(path)])
    if os.path.isdir(path):  # every image (and video) file under it, recursive, hidden ones skipped, by relative path
        suffixes, base = image_suffixes() | (set(VIDEO_SUFFIXES) if videos else set()), Path(path)
        files = sorted((file for file in base.rglob("*")
                        if file.suffix.lower() in suffixes and not file.name.startswith(".") and file.is_file()),
                       key=lambda file: file.relative_to(base).as_posix())
        if not files:
            raise FileNotFoundError(f"{path}: no image {'or video ' if videos else ''}files found")
        return Source(path, weight, [Part(str(file), IMAGE, 1) for file in files])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (named at {named_at})")
    return read_filelist(path, weight, counts, videos)


def read_sources(file_list: str, counts: bool = True, videos: bool = False) -> list[Source]:
    """All sources named by `file_list` (`videos`: video files too, --num_frames > 1); errors name the path and the
    list file:line that named it."""
    if os.path.isdir(file_list) or is_tar_spec(file_list) or not is_filelist_list(file_list):
        return [_source(file_list, 1.0, "--file_list", None, counts, videos)]
    sources = []
    for line_number, text in _entries(file_list):
        fields, named_at = text.split(), f"{file_list}:{line_number}"
        if len(fields) > 2:
            raise ValueError(f"{named_at}: expected 'path [weight]', got {text!r}")
        try:
            weight = float(fields[1]) if len(fields) == 2 else 1.0
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{named_at}: weight must be a finite number > 0, got {fields[1]!r}")
        sources.append(_source(fields[0], weight, named_at, file_list, counts, videos))
    return sources
