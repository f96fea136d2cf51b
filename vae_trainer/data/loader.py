"""Paddle's DataLoader made safe: errors reach the main thread with any number of workers, workers end with their
iteration or the main process and ignore a scheduler's stop signals (docs/reliability.md)."""

import ctypes
import functools
import gc
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Iterator

import numpy as np
import paddle

from ..distributed import SIGNALS

_FAILURE = "data_error"  # key of the item a failing worker sends instead of a batch
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_STOP_SECONDS = 5.0  # how long a worker may take to finish its batch when asked to stop


class RaisesInMainThread(paddle.io.IterableDataset):
    """An iterable dataset (subclasses implement `_items`) whose error reaches the main thread: a worker sends it as
    a last item (so workers need ``batch_size=None``); Paddle's reader thread (0 workers) stores it instead."""

    failure: BaseException | None = None

    def __iter__(self) -> Iterator:
        # (Paddle calls iter() in the main thread but iterates in its reader thread or a worker process.)
        try:
            yield from self._items()
        except Exception as error:
            worker = paddle.io.get_worker_info()
            if worker is not None:
                trace = "".join(traceback.format_exception(error))
                error.add_note(f"(raised in DataLoader worker {worker.id}:\n{trace})")
                try:
                    pickled = pickle.dumps(error)
                except Exception:  # an exception that does not pickle still gets its message across
                    pickled = pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))
                # (Paddle drops an item without any array, so one tiny array goes along.)
                yield {_FAILURE: pickled, "carrier": np.zeros(1)}
            elif threading.current_thread() is threading.main_thread():
                raise
            else:
                self.failure = error  # NoHangLoader raises it in the main thread


def _start_worker(parent_pid: int, worker_id: int) -> None:
    """worker_init_fn: ignore the stop signals (blocked across the fork), die with the main process (Linux)."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the main process died before the line above
        os._exit(1)


class NoHangLoader(paddle.io.DataLoader):
    """A DataLoader that raises its dataset's errors in the main thread and ends its workers with the iteration."""

    def __len__(self) -> int:
        raise TypeError("a streaming DataLoader has no length")  # (Paddle's ValueError breaks list(loader))

    def __iter__(self):
        self.dataset.failure = None
        self.worker_init_fn = functools.partial(_start_worker, os.getpid())  # the process that iterates
        if self.num_workers <= 0:
            batches = super().__iter__()
        else:  # Paddle's iterator, its workers forked with the stop signals blocked (none reaches a worker before it
            # ignores them) and the parent's objects frozen: a worker collecting an inherited Paddle object would hang.
            frozen_before = gc.get_freeze_count()  # (someone else's freeze stays: unfreezing is all or nothing)
            gc.collect()
            gc.freeze()
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            try:
                batches = super().__iter__()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
                if not frozen_before:
                    gc.unfreeze()
        try:
            for batch in batches:
                if isinstance(batch, dict) and _FAILURE in batch:
                    raise pickle.loads(batch[_FAILURE])
                yield batch
            if self.dataset.failure is not None:
                raise self.dataset.failure
        finally:  # Paddle's iterator stopped now (internals of 3.3.1); a worker blocked after _STOP_SECONDS is killed
            workers = list(getattr(batches, "_workers", []))
            if workers:
                batches._try_shutdown_all(_STOP_SECONDS)
            else:
                batches._try_shutdown_all()  # the single-process reader thread
            for worker in workers:
                if worker.is_alive():
                    worker.kill()
                    worker.join()
