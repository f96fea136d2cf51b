"""Paddle's DataLoader around our streams, made safe: errors reach the main thread from any number of
workers, and worker processes never outlive their use.

Errors never hang
    Any exception in a stream (a :class:`RaisesInMainThread`) stops training with its message. In a
    worker process Paddle would only report "Blocking queue is killed", so the stream sends the error,
    pickled, as a last item and :class:`NoHangLoader` raises it. With ``num_workers=0`` Paddle runs the
    stream in a reader thread that dies on an exception without waking the main thread, so the stream
    stores the error there and ends, and :class:`NoHangLoader` raises it in the main thread.

Workers end with their iteration
    When an iteration ends for any reason (a data error, the training loop closing it at the end of the
    run, the last reference dropped) :class:`NoHangLoader` shuts Paddle's iterator down at once: the
    workers finish the batch they are on and exit, and are joined (one still blocked in a read after a
    few seconds is killed). It does not wait for the garbage collector, which would keep them (and their
    prefetched batches) alive as long as a traceback or a driver still refers to the iterator. If the
    main process dies without shutting down (SIGKILL, a crash), the kernel kills its workers (Linux
    ``PR_SET_PDEATHSIG``, set as each worker starts): Paddle's own check of the parent runs only between
    batches, so a worker blocked in a read (a stalled ``pipe:`` command) would otherwise live on. A
    ``pipe:`` command itself runs in its own session; it ends when it next writes to its dead reader.

Workers ignore the stop signals
    A scheduler stops a job by signalling all its processes at once: the launcher's ``killpg`` of each rank's
    process group, SLURM's scancel. Paddle's main process treats a worker killed by a signal as fatal, which
    would end the rank before it saves (preemption.py). So workers ignore SIGTERM / SIGINT / SIGUSR1 from
    their first instruction on (the signals are blocked across the fork, ignored, then unblocked in the
    worker); their parent stops them when its iteration ends, and the kernel when it dies.
"""

from __future__ import annotations

import contextlib
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

from ..preemption import SIGNALS

_FAILURE = "data_error"  # key of the item a failing worker sends instead of a batch
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_STOP_SECONDS = 5.0  # how long a worker may take to finish its batch when asked to stop


class RaisesInMainThread(paddle.io.IterableDataset):
    """An iterable dataset whose errors reach the main thread as themselves (module doc).

    Subclasses implement `_items`. In a worker process the error is sent as a last item
    ``{"data_error": bytes}``, so workers need ``batch_size=None`` (the items are whole batches).
    """

    failure: BaseException | None = None

    def _items(self) -> Iterator:
        raise NotImplementedError

    def __iter__(self) -> Iterator:
        return self._guarded(self._items(), paddle.io.get_worker_info())

    def _guarded(self, items: Iterator, worker) -> Iterator:
        # Paddle calls iter() in the main thread but iterates in its reader thread: decide when it fails.
        self.failure = None
        try:
            yield from items
        except Exception as error:
            if worker is not None:
                # (Paddle drops an item without any array, so one tiny array goes along.)
                yield {_FAILURE: _pickled(error, f"in DataLoader worker {worker.id}"), "carrier": np.zeros(1)}
            elif threading.current_thread() is threading.main_thread():
                raise
            else:
                self.failure = error  # NoHangLoader raises it in the main thread


def _pickled(error: Exception, where: str) -> bytes:
    error.add_note(f"(raised {where}:\n{''.join(traceback.format_exception(error))})")
    try:
        return pickle.dumps(error)
    except Exception:  # an exception that does not pickle still gets its message across
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))


def _start_worker(parent_pid: int, worker_id: int) -> None:
    """Worker start (worker_init_fn): ignore the stop signals, be killed by the kernel when the main process
    dies (module doc)."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # (blocked by the parent across the fork)
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the main process died before the line above
        os._exit(1)


class NoHangLoader(paddle.io.DataLoader):
    """paddle.io.DataLoader that raises its dataset's errors in the main thread, from any worker count, and
    shuts its workers down when an iteration ends (module doc)."""

    def __len__(self) -> int:
        raise TypeError("a streaming DataLoader has no length")  # (Paddle's ValueError breaks list(loader))

    def __iter__(self):
        self.dataset.failure = None
        self.worker_init_fn = functools.partial(_start_worker, os.getpid())  # the process that iterates
        with _no_inherited_garbage(self.num_workers), _stop_signals_blocked(self.num_workers):
            batches = super().__iter__()  # (forks the workers)
        try:
            for batch in batches:
                if isinstance(batch, dict) and _FAILURE in batch:
                    raise pickle.loads(batch[_FAILURE])
                yield batch
            if self.dataset.failure is not None:
                raise self.dataset.failure
        finally:
            _shut_down(batches)


@contextlib.contextmanager
def _no_inherited_garbage(num_workers: int):
    """Fork the workers with no garbage to inherit, and none of the parent's objects for their collector.

    A worker is a fork of the main process, with only the forking thread. Had it inherited a garbage cycle
    holding a Paddle object (e.g. a traceback kept from an earlier error, with a blocking queue in a
    frame), its first garbage collection would destroy that object's condition variable while the parent's
    threads that waited on it do not exist in the child: `pthread_cond_destroy` then waits forever (seen:
    both workers of a test blocked in the collector at their first log line). So the parent collects its
    garbage first, where destroying it is safe, and freezes what remains for the fork (`gc.freeze`,
    Python's advice for forking servers, which also spares the workers' copy-on-write pages); the parent
    unfreezes its own objects once the workers exist."""
    if num_workers <= 0:
        yield
        return
    frozen_before = gc.get_freeze_count()  # (someone else's freeze stays: unfreezing is all or nothing)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


@contextlib.contextmanager
def _stop_signals_blocked(num_workers: int):
    """Fork the workers with the stop signals blocked, so that none reaches a worker before it ignores them; a
    signal to the parent meanwhile waits and is handled once they are unblocked here."""
    if num_workers <= 0:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _shut_down(batches) -> None:
    """Stop Paddle's iterator now: what it does when garbage-collected (module doc), with a bound on the wait.

    (Paddle's iterator internals, as of the 3.3.1 the Makefile installs.) Each worker is asked to stop and joined
    for up to `_STOP_SECONDS`; one still blocked in a read after that (a stalled ``pipe:``) is killed, so
    that ending an iteration can never hang.
    """
    workers = list(getattr(batches, "_workers", []))
    if workers:
        batches._try_shutdown_all(_STOP_SECONDS)
    else:
        batches._try_shutdown_all()  # the single-process reader thread
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
