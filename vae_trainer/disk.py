"""Full disks (no space, quota, read-only, I/O error: `OutOfSpace`); durable, atomic writes (docs/reliability.md)."""

import contextlib
import errno
import logging
import os
import shutil
from typing import Any, Iterator, Optional

import numpy as np
import paddle

from .user_errors import UserError

logger = logging.getLogger("vae_trainer")

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


def folder_bytes(path: Optional[str]) -> int:
    """Bytes of the files in folder `path` (0 if there is none)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path or "") for name in names)


def free_bytes(path: str) -> int:
    """Free space for an unprivileged writer at `path` (or its nearest existing parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path or ".").free


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def failed_write(error: BaseException, what: str, folder: str, partial: str, needed: int,
                 last_good: Optional[str]) -> OutOfSpace:
    """Remove `partial`, left by the failed write of `what`: an error saying what it needs, what is free, what next."""
    shutil.rmtree(partial, ignore_errors=True)
    kept = f"{last_good} (the last complete checkpoint) is intact" if last_good else "no earlier checkpoint exists"
    reason = str(error)
    if isinstance(error, OSError) and error.errno is not None:
        reason = f"{os.strerror(error.errno)} ({errno.errorcode.get(error.errno, error.errno)})"
    return OutOfSpace(
        f"writing {what} in {folder} failed: {reason}. "
        f"It needs about {gib(needed)} and {gib(free_bytes(folder))} is free; the partial {os.path.basename(partial)} "
        f"was removed. {kept}. Free space (or lower --save_total_limit), then run the same command with "
        "--resume_from_checkpoint latest to continue.")


@contextlib.contextmanager
def written_atomically(path: str) -> Iterator[str]:
    """Yield `path`.tmp to write, which replaces `path` (fsynced) when the block succeeds; a full disk: `OutOfSpace`."""
    partial = path + ".tmp"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        yield partial
    except Exception as error:  # OSError, or safetensors' SafetensorError for the same failures
        if not is_disk_error(error):
            raise
        raise failed_write(error, os.path.basename(path) + "/", os.path.dirname(path) or ".", partial,
                           folder_bytes(path) or folder_bytes(partial), None) from None
    for root, folders, names in os.walk(partial, topdown=False):  # on the disk before the rename makes it the export
        for name in names + folders:
            fsync_path(os.path.join(root, name))
    publish_folder(partial, path)


def publish_folder(partial: str, path: str) -> None:
    """fsync the folder `partial` (its files are) and rename it to `path`. An existing `path` is renamed aside
    first and deleted only once the new one is in place: a kill leaves one of the two complete, never neither."""
    fsync_path(partial)
    shutil.rmtree(path + ".old", ignore_errors=True)
    if os.path.isdir(path):
        os.replace(path, path + ".old")
    os.replace(partial, path)
    fsync_path(os.path.dirname(path) or ".")
    shutil.rmtree(path + ".old", ignore_errors=True)


def delete_folder(path: str) -> None:
    """Rename first (atomic), then delete: a kill leaves a `.old` folder, never a half-deleted one."""
    shutil.rmtree(path + ".old", ignore_errors=True)
    os.replace(path, path + ".old")
    shutil.rmtree(path + ".old", ignore_errors=True)


def replace_file(path: str, text: str) -> None:
    """Write `text` to `path` durably (a fsynced .tmp renamed over it): a crash leaves the old content or the new."""
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    fsync_path(path + ".tmp")
    os.replace(path + ".tmp", path)
    fsync_path(os.path.dirname(path) or ".")


def fsync_path(path: str) -> None:
    """fsync a file or a folder (its entries); a mount that cannot fsync a folder (some FUSE, NFS) is let pass."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if not (os.path.isdir(path) and error.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EPERM)):
            raise
    finally:
        os.close(descriptor)


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors and arrays in a (nested) state dict: about what saving it writes."""
    return sum(int(np.prod(v.shape)) * v.element_size() if isinstance(v, paddle.Tensor) else v.nbytes
               for v in paddle.utils.flatten(state) if isinstance(v, (paddle.Tensor, np.ndarray)))


def warn_if_short(output_dir: str, model: paddle.nn.Layer, ema: Any, kept: Optional[int]) -> None:
    """Warn when OUTPUT_DIR cannot hold the `kept` (--save_total_limit) checkpoints plus the one being written, each
    sized before the optimizers hold state: weights, two AdamW moments, the trained weights' EMA."""
    trainable = sum(int(np.prod(p.shape)) * 4 for p in model.parameters() if not p.stop_gradient)
    each = tensor_bytes(model.state_dict()) + 2 * trainable + (tensor_bytes(ema.shadow_params) if ema else 0)
    count = (kept + 1) if kept and kept > 0 else 2
    needed, free = count * each, free_bytes(output_dir)
    if free < needed:
        logger.warning("%s: %s free, but %d checkpoints of this run need about %s (%s each, estimated from the "
                       "weights, optimizer states and EMA; --save_total_limit %s keeps %s, plus the one being "
                       "written). A full disk will stop the run with its last checkpoint intact.", output_dir,
                       gib(free), count, gib(needed), gib(each), kept, kept or "all")
