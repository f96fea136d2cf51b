"""Stopping on a scheduler's signal with a checkpoint of the step reached (docs/reliability.md, "Preemption"):
a signal only notes a stop request; after the step (`loop.Run.after_step`) the driver saves and raises `Preempted`."""

import logging
import signal
import threading
from typing import Optional

logger = logging.getLogger("vae_trainer")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: "try again later" (resume with --resume_from_checkpoint latest)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_received: Optional[str] = None  # the first stop signal since `install`


class Preempted(Exception):
    """A driver stopped on a signal after saving a checkpoint (exit PREEMPTED_EXIT_CODE)."""


def install(single_process: bool) -> None:
    """Handle SIGNALS from now on (main thread only, Python's rule; elsewhere nothing is installed)."""
    global _received
    _received = None

    def handle(signum: int, frame) -> None:
        global _received
        if _received is None:
            _received = signal.Signals(signum).name
            logger.warning("%s received: finishing the step in flight, then saving a checkpoint and stopping "
                           "(a second Ctrl-C in a single process quits at once)", _received)
        elif signum == signal.SIGINT and single_process:
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, handle)


def stop_signal() -> Optional[str]:
    """The name of the stop signal this process received, None if none (or no handlers are installed)."""
    return _received

