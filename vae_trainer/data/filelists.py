"""What ``--file_list`` names, resolved into weighted sources of parts; never reads image data.

A **source** is one sampling unit with a weight; it is a list of **parts**, and a part holds
**records** (one image each). Three kinds of part:

* ``lines``: a LAION-style part file, gzip or plain text, one record per line (read by
  :mod:`vae_trainer.data.records`);
* ``tar``: a WebDataset tar shard, a local ``.tar``/``.tar.gz``/``.tgz`` or a ``pipe:COMMAND``
  whose standard output is a tar; one record per sample (members sharing a key);
* ``image``: one image file of a folder, one record.

What a name is (``--file_list``, or an entry of a ``.filelist.list``), in this order:

1. a folder: every image file under it, recursive, sorted by relative path (:func:`image_files`);
2. a tar spec: starts with ``pipe:``, or ends in a tar suffix; brace patterns such as
   ``shards/{00000..00999}.tar`` are expanded (``braceexpand``, as WebDataset does);
3. a ``.filelist.list``: one line per source, ``NAME [weight]`` (weight optional, default 1.0, a
   finite float > 0; NAME is a ``.filelist``, a folder or a tar spec without whitespace). A name
   not ending in ``.filelist.list`` or ``.filelist`` is judged by its first entry: a second
   (weight) field, or a path ending in ``.filelist``, makes it a list of filelists;
4. otherwise a ``.filelist``: one part per line, the whole stripped line being its path (so paths
   and ``pipe:`` commands may contain spaces). A tar spec line expands to its shards, an image file
   is an ``image`` part, anything else a ``lines`` part.

Blank lines and lines starting with ``#`` are ignored; relative paths resolve against the folder
of the list that names them. Local parts must exist (checked with one ``stat`` each, never
opened); ``pipe:`` commands are run only when read.

Record counts (for equal shares per shard, see :mod:`vae_trainer.data.sharding`): an image part
holds one record. For a ``.filelist``, the counts come from ``<filelist>.counts`` if present,
written by ``scripts/write_filelist.py``: ``NAME<TAB>records<TAB>bytes`` per part, NAME as in the
filelist. If any part is missing from it or its size changed, the source is read without counts
(and a warning says so). A tar pattern given directly has no counts.
"""

from __future__ import annotations

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
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
PIPE_PREFIX = "pipe:"
LINES, TAR, IMAGE = "lines", "tar", "image"


@dataclass(frozen=True)
class Part:
    """One part: a file path (or ``pipe:`` command), its kind, and its record count if known."""

    path: str
    kind: str
    records: int | None = None


@dataclass
class Source:
    """One weighted source: its resolved name (filelist, folder or tar spec) and its parts."""

    name: str
    weight: float
    parts: list[Part] = field(default_factory=list)

    @property
    def counted(self) -> bool:
        """True if every part's record count is known."""
        return all(part.records is not None for part in self.parts)


# ----------------------------------------------------------------------------------- names


def _entries(list_file: str) -> list[tuple[int, str]]:
    """(1-based line number, stripped text) of each non-blank, non-comment line of `list_file`."""
    if not os.path.isfile(list_file):
        raise FileNotFoundError(f"{list_file}: file list not found")
    with open(list_file, encoding="utf-8") as handle:
        lines = [(number, line.strip()) for number, line in enumerate(handle, start=1)]
    return [(number, text) for number, text in lines if text and not text.startswith("#")]


def _resolve(path: str, list_file: str | None) -> str:
    """`path` as named in `list_file`, made absolute relative to that file's folder (pipes unchanged)."""
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
    if name.startswith(PIPE_PREFIX):
        return True
    return all(expanded.lower().endswith(TAR_SUFFIXES) for expanded in _expand(name))


def image_suffixes() -> set[str]:
    """File suffixes PIL can open (lower case, with the dot)."""
    Image.init()
    return {suffix for suffix, format_name in Image.registered_extensions().items() if format_name in Image.OPEN}


def image_files(root: str) -> list[Path]:
    """Every image file under `root` (recursive, hidden files skipped), sorted by relative path."""
    suffixes, base = image_suffixes(), Path(root)
    found = (
        path for path in base.rglob("*")
        if path.suffix.lower() in suffixes and not path.name.startswith(".") and path.is_file()
    )
    return sorted(found, key=lambda path: path.relative_to(base).as_posix())


def is_filelist_list(file_list: str) -> bool:
    """True if `file_list` is a list of filelists, False if it is a single filelist (see module doc)."""
    if file_list.endswith(FILELIST_LIST_SUFFIX):
        return True
    if file_list.endswith(FILELIST_SUFFIX):
        return False
    entries = _entries(file_list)
    if not entries:
        return False
    fields = entries[0][1].split()
    return len(fields) > 1 or fields[0].endswith(FILELIST_SUFFIX)


# --------------------------------------------------------------------------------- sources


def _checked_size(path: str, named_at: str) -> int | None:
    """The size of a local part (one stat, raising if it is missing); None for a ``pipe:`` command."""
    if path.startswith(PIPE_PREFIX):
        return None
    try:
        info = os.stat(path)
    except OSError:
        raise FileNotFoundError(f"{path}: not found (named at {named_at})") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not a file (named at {named_at})")
    return info.st_size


def tar_parts(spec: str, named_at: str) -> list[Part]:
    """The shards of a resolved tar spec (brace pattern expanded; local shards must exist)."""
    parts = []
    for path in _expand(spec):
        _checked_size(path, named_at)
        parts.append(Part(path, TAR))
    return parts


def folder_source(folder: str, weight: float = 1.0) -> Source:
    files = image_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no image files found")
    return Source(os.path.abspath(folder), weight, [Part(str(path), IMAGE, 1) for path in files])


def _part_kind(path: str) -> str:
    if path.startswith(PIPE_PREFIX) or path.lower().endswith(TAR_SUFFIXES):
        return TAR
    return IMAGE if Path(path).suffix.lower() in image_suffixes() else LINES


def counts_path(filelist: str) -> str:
    return filelist + COUNTS_SUFFIX


def read_counts(filelist: str) -> dict[str, tuple[int, int | None]]:
    """{resolved part path: (records, bytes or None)} from ``<filelist>.counts`` ({} if absent)."""
    path = counts_path(filelist)
    if not os.path.isfile(path):
        return {}
    counts = {}
    for line_number, text in _entries(path):
        fields = text.rsplit("\t", 2)
        if len(fields) != 3 or not fields[1].isdigit():
            raise ValueError(f"{path}:{line_number}: expected 'NAME<TAB>records<TAB>bytes', got {text!r}")
        size = int(fields[2]) if fields[2].isdigit() else None
        counts[_resolve(fields[0], filelist)] = (int(fields[1]), size)
    return counts


def read_filelist(filelist: str, weight: float = 1.0, counts: bool = True) -> Source:
    """Read one ``.filelist``; every named local part must exist. `counts`: apply its ``.counts`` file."""
    filelist = os.path.normpath(os.path.abspath(filelist))
    parts: list[Part] = []
    sizes: list[int | None] = []
    for line_number, text in _entries(filelist):
        for name in _expand(text) if is_tar_spec(text) else [text]:
            path = _resolve(name, filelist)
            sizes.append(_checked_size(path, f"{filelist}:{line_number}"))
            parts.append(Part(path, _part_kind(path)))
    return Source(filelist, weight, _with_counts(filelist, parts, sizes) if counts else parts)


def _with_counts(filelist: str, parts: list[Part], sizes: list[int | None]) -> list[Part]:
    """`parts` with their record counts from the counts file, if it covers all of them unchanged."""
    counts = read_counts(filelist)
    if not counts:
        if sum(part.kind != IMAGE for part in parts) > 1:
            logger.warning(
                "%s: no %s file, so shards get whole parts and images in shards with fewer records are "
                "shown more often; write it with: python scripts/write_filelist.py --count %s",
                filelist, COUNTS_SUFFIX, filelist,
            )
        return [Part(p.path, p.kind, 1) if p.kind == IMAGE else p for p in parts]
    counted = []
    for part, size in zip(parts, sizes):
        records, counted_size = counts.get(part.path, (None, None))
        if part.kind == IMAGE:
            records = 1
        elif records is None or (size is not None and counted_size is not None and size != counted_size):
            why = "is not listed" if records is None else f"has {size} bytes, not {counted_size}"
            logger.warning(
                "%s: %s %s; reading the source without counts (re-run scripts/write_filelist.py --count %s)",
                counts_path(filelist), part.path, why, filelist,
            )
            return [Part(p.path, p.kind, 1 if p.kind == IMAGE else None) for p in parts]
        counted.append(Part(part.path, part.kind, records))
    return counted


def _parse_weight(text: str, list_file: str, line_number: int) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"{list_file}:{line_number}: weight must be a finite number > 0, got {text!r}")
    return weight


def _source(name: str, weight: float, named_at: str, list_file: str | None, counts: bool = True) -> Source:
    """One source from a name that is a folder, a tar spec or a ``.filelist``."""
    if is_tar_spec(name):
        spec = _resolve(name, list_file)
        return Source(spec, weight, tar_parts(spec, named_at))
    path = _resolve(name, list_file)
    if os.path.isdir(path):
        return folder_source(path, weight)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (named at {named_at})")
    return read_filelist(path, weight, counts)


def read_sources(file_list: str, counts: bool = True) -> list[Source]:
    """All sources named by `file_list` (see the module doc), resolved; `counts`: apply ``.counts`` files.

    Raises FileNotFoundError naming the missing path and the list file:line that named it, and
    ValueError with file:line for a malformed line or a bad weight.
    """
    if os.path.isdir(file_list) or is_tar_spec(file_list):
        return [_source(file_list, 1.0, "--file_list", None, counts)]
    if not is_filelist_list(file_list):
        return [read_filelist(file_list, counts=counts)]
    sources = []
    for line_number, text in _entries(file_list):
        fields = text.split()
        if len(fields) > 2:
            raise ValueError(f"{file_list}:{line_number}: expected 'path [weight]', got {text!r}")
        weight = _parse_weight(fields[1], file_list, line_number) if len(fields) == 2 else 1.0
        sources.append(_source(fields[0], weight, f"{file_list}:{line_number}", file_list, counts))
    return sources
