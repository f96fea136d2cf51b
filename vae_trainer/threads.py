"""CPU threads: the entry points set `OMP_NUM_THREADS` before Paddle's import (which sets 1) unless the user did
(docs/launching.md, "CPU threads"). Imports Paddle only once the variable is set, without Paddle's warning about it."""

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Mapping, NamedTuple, Optional, Sequence

import psutil  # (visualdl's dependency)

VARIABLE = "OMP_NUM_THREADS"
_CORES_BEFORE_RESERVING = 4  # with workers and this many cores per process, one is left to decode
_LAUNCHER_VARIABLES = ("PADDLE_LOCAL_SIZE", "PADDLE_TRAINER_ENDPOINTS")
# Printed by Paddle's import whenever OMP_NUM_THREADS > 1, which this module chooses on purpose (and says so).
PADDLE_THREAD_WARNING = ("WARNING: OMP_NUM_THREADS set to", "PLEASE USE OMP_NUM_THREADS WISELY")
# The flag and its reference-trainer alias (vae_trainer.arguments.ALIASES; a test keeps them in step).
WORKER_FLAGS = ("dataloader_num_workers", "num_workers")


class ThreadChoice(NamedTuple):
    threads: int
    by_user: bool
    description: str  # the line logged at start


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on (affinity), capped by a cgroup CPU quota; at least 1."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(count, math.floor(quota)) if quota else count)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> Optional[float]:
    """CPUs' worth of time the cgroup may use (v2 `cpu.max`, or the v1 CFS quota); None if unlimited."""
    v2 = _read(os.path.join(root, "cpu.max"))
    if v2 is not None:
        quota, period = (v2.split() + ["", ""])[:2]
    else:
        quota, period = (_read(os.path.join(root, "cpu", f"cpu.cfs_{name}_us")) for name in ("quota", "period"))
    if not (quota and period and quota.isdigit() and period.isdigit()) or int(period) == 0:
        return None  # "max" / "-1": no quota
    return int(quota) / int(period)


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def dataloader_workers(argv: Sequence[str]) -> int:
    """`--dataloader_num_workers` (or its alias) from the command line or a single .json of flags; default 0."""
    if len(argv) == 1 and argv[0].endswith(".json"):
        try:
            flags = json.loads(Path(argv[0]).read_text())
            return int(next((flags[name] for name in WORKER_FLAGS if name in flags), 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return 0
    workers = 0
    for item, following in zip(argv, [*argv[1:], ""]):  # the last occurrence wins, as in argparse
        flag, equals, value = item.partition("=")
        if flag.startswith("--") and flag[2:] in WORKER_FLAGS:
            value = value if equals else following
            workers = int(value) if value.isdigit() else 0
    return workers


def choose_threads(environ: Mapping[str, str], cpus: int, workers: int,
                   parent_environ: Optional[Mapping[str, str]] = None) -> ThreadChoice:
    """The thread count for this process (pure). Under a launcher, whose Paddle import sets "1" before the
    workers start, a "1" is the user's only if the launcher's own environment (`parent_environ`) had it."""
    value = environ.get(VARIABLE)
    launcher_one = value == "1" and any(name in environ for name in _LAUNCHER_VARIABLES)
    if value is not None and (not launcher_one or VARIABLE in (parent_environ or {})):
        threads = int(value) if value.isdigit() else 1  # Paddle reads junk as 1
        return ThreadChoice(threads, True, f"CPU threads: {VARIABLE}={threads}, as set by the user")
    host = environ.get("PADDLE_CURRENT_ENDPOINT", "").rsplit(":", 1)[0]  # processes on this node: an older launcher
    endpoints = [e for e in environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]  # names all endpoints
    processes = max(1, sum(e.rsplit(":", 1)[0] == host for e in endpoints)) if host else 1
    if environ.get("PADDLE_LOCAL_SIZE", "").isdigit():
        processes = max(1, int(environ["PADDLE_LOCAL_SIZE"]))
    per_process = max(1, cpus // processes)
    threads = max(1, per_process - (1 if workers > 0 and per_process >= _CORES_BEFORE_RESERVING else 0))
    return ThreadChoice(threads, False, f"CPU threads: {VARIABLE}={threads} ({cpus} usable CPUs, {processes} "
                        f"process(es) on this node, {workers} dataloader worker(s) per process); set {VARIABLE} "
                        "to choose")


def set_default_threads(argv: Sequence[str]) -> Optional[ThreadChoice]:
    """Set OMP_NUM_THREADS unless the user did and log the choice on stderr; None once Paddle is imported."""
    if "paddle" in sys.modules:
        return None
    try:  # the environment the parent process (a launcher) started with
        parent = psutil.Process(os.getppid()).environ()
    except psutil.Error:
        parent = None
    choice = choose_threads(os.environ, usable_cpus(), dataloader_workers(argv), parent)
    if not choice.by_user:
        os.environ[VARIABLE] = str(choice.threads)
    print(choice.description, file=sys.stderr, flush=True)
    import_paddle_quietly()
    return choice


class _WithoutThreadWarning:
    """`stream`, less PADDLE_THREAD_WARNING's lines (print writes a line's text and its newline separately)."""

    def __init__(self, stream) -> None:
        self.stream, self.dropping = stream, False

    def write(self, text: str) -> int:
        drop = text.startswith(PADDLE_THREAD_WARNING) or (self.dropping and text == "\n")
        self.dropping = drop and text != "\n"
        return len(text) if drop else self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def import_paddle_quietly() -> None:
    """Import Paddle without PADDLE_THREAD_WARNING. (A stream made during the import, a logging handler's, keeps
    the filter, which passes every other line on.)"""
    with contextlib.redirect_stderr(_WithoutThreadWarning(sys.stderr)):
        import paddle  # noqa: F401
