"""A full disk (or quota, read-only file system, I/O error) is a message that costs nothing saved (issue 22.2).

Owns `OutOfSpace` (the one message a failed write stops a run with), `failed_write` (turns the OSError of a
checkpoint write into it, after removing what the write left), `written_atomically` (an export folder is
written beside its place, then moved in: always the previous complete export or the new one), `fsync_path` /
`fsync_tree` (what a rename must follow to survive a node crash, docs/reliability.md), and `warn_if_short` (the start-up warning when OUTPUT_DIR cannot hold the checkpoints the run will keep).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from typing import Iterator, Optional

from .user_errors import UserError

logger = logging.getLogger("vae_trainer")

# What a write meets on a full or unwritable disk: no space, quota exceeded, read-only file system, I/O error.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


class OutOfSpace(UserError):
    """A checkpoint or export could not be written; what it half-wrote is removed."""


# safetensors (the exports' weight files) reports the same failures as its own SafetensorError, naming the OS error.
_SAFETENSORS_DISK_ERRORS = tuple(f"code: {code}," for code in DISK_ERRNOS) + (
    "StorageFull", "QuotaExceeded", "ReadOnlyFilesystem")


def is_disk_error(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return error.errno in DISK_ERRNOS
    return type(error).__name__ == "SafetensorError" and any(text in str(error) for text in _SAFETENSORS_DISK_ERRORS)


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno is not None:
        return f"{os.strerror(error.errno)} ({errno.errorcode.get(error.errno, error.errno)})"
    return str(error)


def folder_bytes(path: Optional[str]) -> int:
    if not path or not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def free_bytes(path: str) -> int:
    """Free space for an unprivileged writer at `path` (or its nearest existing parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path or ".").free


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def failed_write(error: BaseException, what: str, folder: str, partial: str, needed: int,
                 last_good: Optional[str]) -> OutOfSpace:
    """Remove `partial` (what the failed write of `what` left) and describe the failure: the folder, what the
    write needs and what is free, the last good checkpoint, the command that continues."""
    shutil.rmtree(partial, ignore_errors=True)
    kept = (f"{last_good} (the last complete checkpoint) is intact" if last_good
            else "no earlier checkpoint exists")
    return OutOfSpace(
        f"writing {what} in {folder} failed: {_reason(error)}. "
        f"It needs about {gib(needed)} and {gib(free_bytes(folder))} is free; the partial {os.path.basename(partial)} "
        f"was removed. {kept}. Free space (or lower --save_total_limit), then run the same command with "
        "--resume_from_checkpoint latest to continue.")


@contextlib.contextmanager
def written_atomically(path: str) -> Iterator[str]:
    """Yield a folder to write beside `path`; when the block succeeds it replaces `path` (the previous folder is
    renamed to `.old`, the new one moved in, the old one deleted: renames on one file system). When the block
    fails on a full disk the partial folder is removed and `OutOfSpace` raised; `path` is untouched either way."""
    partial, old = path + ".tmp", path + ".old"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        yield partial
    except Exception as error:  # OSError, or safetensors' SafetensorError for the same failures
        if not is_disk_error(error):
            raise
        needed = folder_bytes(path) or folder_bytes(partial)
        raise failed_write(error, os.path.basename(path) + "/", os.path.dirname(path) or ".", partial, needed,
                           None) from None
    fsync_tree(partial)  # on the disk before the rename makes it the export
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(partial, path)
    fsync_path(os.path.dirname(path) or ".")
    shutil.rmtree(old, ignore_errors=True)


def fsync_path(path: str) -> None:
    """Flush a file's or a folder's (its entries') writes to the disk. A mount that cannot fsync a folder
    (EINVAL and the like: some FUSE and network file systems) is let pass."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if not (os.path.isdir(path) and error.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EPERM)):
            raise
    finally:
        os.close(descriptor)


def fsync_tree(folder: str) -> None:
    """fsync every file under `folder`, then the folders, deepest first."""
    for root, _, names in os.walk(folder, topdown=False):
        for name in names:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def warn_if_short(output_dir: str, checkpoint_bytes: int, kept: Optional[int]) -> None:
    """At start: warn when OUTPUT_DIR's disk cannot hold the checkpoints the run keeps (`kept`, --save_total_limit;
    one more is written before rotation deletes the oldest). Without a limit, at least two."""
    count = (kept + 1) if kept and kept > 0 else 2
    needed, free = count * checkpoint_bytes, free_bytes(output_dir)
    if free < needed:
        logger.warning("%s: %s free, but %d checkpoints of this run need about %s (%s each, estimated from the "
                       "weights, optimizer states and EMA; --save_total_limit %s keeps %s, plus the one being "
                       "written). A full disk will stop the run with its last checkpoint intact.", output_dir,
                       gib(free), count, gib(needed), gib(checkpoint_bytes), kept, kept or "all")
