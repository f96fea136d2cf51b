"""Stopping on a scheduler's signal with a checkpoint at the step reached (preemption, issues 22.1 and 29.1).

Owns the process's stop request (`install`, `stop_signal`: the signal handlers), `Preempted` (how a driver
says it stopped), `PREEMPTED_EXIT_CODE` and `stop_after_step` (what both drivers do after each optimizer step).

SIGTERM (what SLURM, Kubernetes and `paddle.distributed.launch` send before killing a job), SIGINT (Ctrl-C)
and SIGUSR1 (SLURM's `--signal=USR1@120` warning) only note that a stop was asked for: the step in flight
finishes. The training entry points install the handlers for the whole process (`distributed.run_and_exit`),
and their data-loader workers ignore these signals (data/loader.py), so a signal to every process of the
job (the launcher's `killpg`, SLURM's scancel) is a stop request too. Every rank must stop at the same step,
while the signal may reach the ranks at different moments, or only some of them: the step folds "this rank
was signalled" into the few numbers it already sums over the ranks and reads once per optimizer step
(step.py `_read_checks`), so every rank learns at the same step that some rank was signalled, with no extra
host sync. The drivers then save `checkpoint-N` of that step (the checkpoint a periodic save writes:
rotation and `--resume_from_checkpoint latest` see it), log why and how to continue, and raise `Preempted`;
the entry point exits with PREEMPTED_EXIT_CODE. A signal during an evaluation or a save is acted on at the
next step's read, after that work finished; one during the final save or export lets it finish, and the
run then exits PREEMPTED_EXIT_CODE on every rank (`run_and_exit` agrees on it).

Further signals change nothing (the launcher sends SIGTERM up to three times, 0.2 s apart), so the save is
never cut short; but in a single process a second Ctrl-C quits at once (KeyboardInterrupt, exit 130): the
last complete checkpoint stays intact, since saves are atomic.
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
                         f"--resume_from_checkpoint latest continues exactly from there (exit code {PREEMPTED_EXIT_CODE})")


class StopRequest:
    """The signal handlers of a training run; `received` is this process's (the step agrees across ranks)."""

    def __init__(self, single_process: bool = True) -> None:
        self.signal_name: Optional[str] = None
        self.single_process = single_process
        self._previous: Dict[int, object] = {}

    @property
    def received(self) -> bool:
        return self.signal_name is not None

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
    """At the end of optimizer step `step` (after logging, evaluation and a periodic save): when some rank
    was signalled (`stop`: agreed by the step, `StepReport.stop`), `save()` the checkpoint of this step (it returns its path) and raise `Preempted`."""
    if not stop:
        return
    checkpoint = save()
    stopped = Preempted(stop_signal() or "a signal to another rank", step, checkpoint)
    logger.warning("%s", stopped)
    raise stopped
