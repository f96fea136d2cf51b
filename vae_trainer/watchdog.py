"""The stall watchdog (--stall_timeout, docs/reliability.md): when nothing finished (`beat`) for the timeout, a
thread logs what the process was `doing` and all stacks, kills its children and exits with STALL_EXIT_CODE."""

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

import psutil  # (visualdl's dependency)

logger = logging.getLogger("vae_trainer")

STALL_EXIT_CODE = 124  # as coreutils' `timeout`: the run was ended because it stopped making progress
DEFAULT_STALL_TIMEOUT = 1800  # seconds: PyTorch's default collective timeout; above any save or SD eval batch


class _Watchdog(threading.Thread):
    def __init__(self, timeout: float, rank: int, activity: str) -> None:
        super().__init__(name="stall-watchdog", daemon=True)
        self.timeout, self.rank, self.activity, self.stopped = timeout, rank, activity, threading.Event()
        self.last_time, self.last_wall, self.last_done = time.monotonic(), time.time(), "the start"
        self.last_step: Optional[int] = None

    def run(self) -> None:
        while time.monotonic() - self.last_time <= self.timeout:
            if self.stopped.wait(min(max(self.timeout / 4.0, 0.05), 10.0)):
                return
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.last_wall))
        step = f"step {self.last_step}" if self.last_step is not None else "no step yet"
        message = (f"stalled: rank {self.rank} finished nothing for {self.timeout:g} s (--stall_timeout). Last "
                   f"finished: {self.last_done} at {since} ({step}); now: {self.activity}. Stacks of all threads "
                   f"follow; exiting with {STALL_EXIT_CODE} so that the launcher stops the other ranks and the job can "
                   "be requeued (--resume_from_checkpoint latest continues from the last checkpoint).")
        logger.error("%s", message)
        for handler in logging.getLogger().handlers + logger.handlers:
            handler.flush()
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        own_group = os.getpgrp()
        for child in psutil.Process().children(recursive=True):  # a hung `pipe:` command (own group), loader workers
            with contextlib.suppress(OSError):
                group = os.getpgid(child.pid)
                if group != own_group:
                    os.killpg(group, signal.SIGKILL)
                else:
                    os.kill(child.pid, signal.SIGKILL)
        os._exit(STALL_EXIT_CODE)


_current: Optional[_Watchdog] = None


def start(timeout: Optional[float], rank: int = 0, activity: Optional[str] = None) -> None:
    """Watch this process from now on (`timeout` None or 0: off), busy with `activity` (default: the first batch)."""
    global _current
    stop()
    if not timeout or timeout <= 0:
        return
    _current = _Watchdog(float(timeout), rank, activity or "starting: waiting for the first batch")
    _current.start()
    if not activity:
        logger.info("stall watchdog: a rank that finishes no step, evaluation batch or save for %g s ends the run "
                    "(--stall_timeout; 0 turns it off)", timeout)


def stop() -> None:
    global _current
    if _current is not None:
        _current.stopped.set()
        _current = None


def beat(done: str, step: Optional[int] = None) -> None:
    """Something finished (`done`, e.g. "step 12", "an evaluation batch", "saving checkpoint-12")."""
    if _current is not None:
        _current.last_time, _current.last_wall, _current.last_done = time.monotonic(), time.time(), done
        _current.last_step = _current.last_step if step is None else step


def doing(activity: str) -> None:
    """What this process is busy with from now on, said if it stalls."""
    if _current is not None:
        _current.activity = activity
