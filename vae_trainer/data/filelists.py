"""Parsing of LAION-style filelists into resolved lists of part files.

Three file kinds are involved:

* ``*.filelist.list``: one line per filelist, ``path/to/x.filelist [weight]``. The weight is
  optional (default 1.0) and must be a finite float > 0. Paths may not contain whitespace.
* ``*.filelist``: one part-file path per line (the whole stripped line is the path).
* part files: read by :mod:`vae_trainer.data.dataset`, never opened here except to check they exist.

In both list kinds, blank lines and lines starting with ``#`` are ignored, and relative paths
resolve against the folder of the file that names them.

What ``--file_list`` is, is decided as follows (:func:`is_filelist_list`):

1. a name ending in ``.filelist.list`` is a list of filelists; a name ending in ``.filelist`` is a
   single filelist (read as one source of weight 1);
2. any other name is judged by its first entry: if that entry has a second (weight) field, or its
   path ends in ``.filelist``, the file is a list of filelists; otherwise a single filelist.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

FILELIST_LIST_SUFFIX = ".filelist.list"
FILELIST_SUFFIX = ".filelist"


@dataclass
class PartSource:
    """One filelist: its resolved path, its sampling weight and its resolved part files."""

    filelist: str
    weight: float
    parts: list[str] = field(default_factory=list)


def _entries(list_file: str) -> list[tuple[int, str]]:
    """(1-based line number, stripped text) of each non-blank, non-comment line of `list_file`."""
    if not os.path.isfile(list_file):
        raise FileNotFoundError(f"{list_file}: file list not found")
    with open(list_file, encoding="utf-8") as handle:
        lines = [(number, line.strip()) for number, line in enumerate(handle, start=1)]
    return [(number, text) for number, text in lines if text and not text.startswith("#")]


def _resolve(path: str, list_file: str) -> str:
    """`path` as named in `list_file`, made absolute relative to that file's folder."""
    path = os.path.expanduser(path)
    if not os.path.isabs(path):
        path = os.path.join(os.path.dirname(os.path.abspath(list_file)), path)
    return os.path.normpath(path)


def _require_file(path: str, list_file: str, line_number: int) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (named at {list_file}:{line_number})")


def _parse_weight(text: str, list_file: str, line_number: int) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"{list_file}:{line_number}: weight must be a finite number > 0, got {text!r}")
    return weight


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


def read_filelist(filelist: str, weight: float = 1.0) -> PartSource:
    """Read one ``.filelist``; every named part file must exist."""
    parts = []
    for line_number, text in _entries(filelist):
        part = _resolve(text, filelist)
        _require_file(part, filelist, line_number)
        parts.append(part)
    return PartSource(filelist=os.path.normpath(os.path.abspath(filelist)), weight=weight, parts=parts)


def read_sources(file_list: str) -> list[PartSource]:
    """All sources named by `file_list` (a ``.filelist.list`` or a single ``.filelist``), resolved.

    Raises FileNotFoundError naming the missing path and the list file:line that named it, and
    ValueError with file:line for a malformed line or a bad weight.
    """
    if not is_filelist_list(file_list):
        return [read_filelist(file_list)]
    sources = []
    for line_number, text in _entries(file_list):
        fields = text.split()
        if len(fields) > 2:
            raise ValueError(f"{file_list}:{line_number}: expected 'path [weight]', got {text!r}")
        weight = _parse_weight(fields[1], file_list, line_number) if len(fields) == 2 else 1.0
        filelist = _resolve(fields[0], file_list)
        _require_file(filelist, file_list, line_number)
        sources.append(read_filelist(filelist, weight))
    return sources
