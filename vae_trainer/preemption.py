"""Stopping on a scheduler's signal with a checkpoint of the step reached (docs/reliability.md, "Preemption").

Owns the process's stop request (`install`, `stop_signal`): SIGTERM, SIGINT and SIGUSR1 only note that a stop
was asked for; the step agrees on it across ranks (step.py), and `stop_after_step` then saves that step's
checkpoint and raises `Preempted` (exit PREEMPTED_EXIT_CODE, `distributed.run_and_exit`). Further signals change
nothing, except a second Ctrl-C in a single process (KeyboardInterrupt).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Dict, Optional

logger = logging.getLogger("vae_trainer")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: "try again later" (resume with --resume_from_checkpoint latest)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_installed: Optional["StopRequest"] = None  # this process's, while its handlers are installed


class Preempted(Exception):
    """A driver stopped on a signal after saving `checkpoint`."""

    def __init__(self, signal_name: str, step: int, checkpoint: str):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(f"stopped by {signal_name} after step {step}: saved {checkpoint}; the same command with "
                         "--resume_from_checkpoint latest continues exactly from there "
                         f"(exit code {PREEMPTED_EXIT_CODE})")


class StopRequest:
    """The signal handlers of a training run: `signal_name` is the first stop signal this process received."""

    def __init__(self, single_process: bool = True) -> None:
        self.signal_name: Optional[str] = None
        self.single_process = single_process
        self._previous: Dict[int, object] = {}

    def install(self) -> "StopRequest":
        """Handle SIGNALS from now on (main thread only, Python's rule; elsewhere nothing is installed)."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            logger.warning("%s received: finishing the step in flight, then saving a checkpoint and stopping "
                           "(a second Ctrl-C in a single process quits at once)", name)
        elif signum == signal.SIGINT and self.single_process:
            raise KeyboardInterrupt


def install(single_process: bool) -> StopRequest:
    """Handle SIGNALS in this process from now on (`stop_signal` tells what arrived)."""
    global _installed
    _installed = StopRequest(single_process).install()
    return _installed


def stop_signal() -> Optional[str]:
    """The name of the stop signal this process received, None if none (or no handlers are installed)."""
    return _installed.signal_name if _installed is not None else None


def stop_after_step(stop: bool, step: int, save) -> None:
    """At the end of optimizer step `step`: when some rank was signalled (`stop`, agreed by the step), `save()`
    this step's checkpoint (returning its path) and raise `Preempted`."""
    if not stop:
        return
    checkpoint = save()
    stopped = Preempted(stop_signal() or "a signal to another rank", step, checkpoint)
    logger.warning("%s", stopped)
    raise stopped
