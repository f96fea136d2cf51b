"""Tests of vae_trainer.data.loader: no DataLoader worker outlives its use - after a data error, at the end
of a run (before the export), and when the main process is killed. Processes are listed from /proc."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import paddle
import pytest
from conftest import DRIVERS, REPO, run_in_process, tiny_args
from test_dataset import id_parts, time_limit, write_filelist

from vae_trainer.data.dataset import build_train_dataloader

paddle.set_device("cpu")
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="lists processes from /proc (Linux)")


def _stat(pid):
    """(state, parent pid) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def alive(pid) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie has exited


def live_children(parent) -> set:
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[1] == parent and stat[0] not in ("Z", "X"):
                found.add(int(name))
    return found


def wait_until(condition, seconds=60):
    """Poll a liveness condition (never a speed target): False if it still fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.parametrize("num_workers", [1, 2])
def test_no_worker_outlives_a_data_error(tmp_path, num_workers):
    """The error is raised while the traceback still refers to the iteration: its workers must be gone already."""
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 2, 4))
    before = live_children(os.getpid())
    loader = build_train_dataloader(file_list, 32, 2, num_workers, 0, 0, 1, image_column=7)  # past the last column
    with time_limit(120), pytest.raises(RuntimeError, match="got no usable sample") as raised:
        next(iter(loader))
    assert raised.traceback  # (kept alive on purpose)
    assert live_children(os.getpid()) - before == set()


@pytest.mark.parametrize("driver", DRIVERS)
def test_no_worker_is_left_when_the_run_exports(photo_filelist, tmp_path, monkeypatch, driver):
    """At the end of a run the loader's workers are stopped before the export (which can take long and needs
    the memory), and none remains after the entry point returns."""
    from vae_trainer import loop as module  # both drivers export through loop.Run.export

    real_export, seen = module.save_final_models, {}
    before = live_children(os.getpid())

    def save_final_models(*args, **kwargs):
        seen["children"] = live_children(os.getpid()) - before
        return real_export(*args, **kwargs)

    monkeypatch.setattr(module, "save_final_models", save_final_models)
    run_in_process(driver, tiny_args(photo_filelist, tmp_path / "out", max_steps=2, save_steps=2, perceptual_weight=0,
                                     use_ema="false", image_logging_steps=0, dataloader_num_workers=2))
    assert seen == {"children": set()}
    assert live_children(os.getpid()) - before == set()


_KILLED = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from vae_trainer.data.dataset import build_train_dataloader

    print("STARTED", flush=True)
    next(iter(build_train_dataloader(sys.argv[2], 32, 2, 2, 0, 0, 1)))  # 2 workers, each blocked reading the pipe
    """
)


def test_workers_die_with_a_killed_main_process(tmp_path):
    """SIGKILL of the main process while both workers are blocked reading a `pipe:` source that never writes
    (Paddle's own watchdog only looks between batches): the workers must not live on."""
    script = tmp_path / "main.py"
    script.write_text(_KILLED)
    main = subprocess.Popen([sys.executable, str(script), REPO, "pipe:sleep 300"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    workers, commands = set(), set()
    try:
        assert main.stdout.readline().strip() == "STARTED"
        # Both workers are reading: each has started its pipe command (a shell or the sleep itself).
        assert wait_until(lambda: len(live_children(main.pid)) == 2 and all(
            live_children(worker) for worker in live_children(main.pid)))
        workers = live_children(main.pid)
        commands = set().union(*(live_children(worker) for worker in workers))
        os.kill(main.pid, signal.SIGKILL)
        main.wait()
        assert wait_until(lambda: not any(alive(worker) for worker in workers)), "DataLoader workers outlived main"
    finally:  # leave nothing behind, whatever happened
        for pid in {main.pid} | workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in commands:  # each command leads its own process group (the shell and what it started)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_workers_fork_with_the_parents_objects_frozen(tmp_path, monkeypatch):
    """A worker's garbage collector must never destroy what it inherited: a Paddle object in an inherited
    garbage cycle can hold a condition variable the parent's threads waited on, and destroying it in the
    child waits forever (seen: both workers hung at their first log line). The parent collects first and
    freezes the rest for the fork (NoHangLoader.__iter__), and unfreezes its own objects after."""
    import gc

    from vae_trainer.data import loader as loader_module

    seen = tmp_path / "frozen_in_workers"
    real = loader_module._start_worker

    def probe(parent_pid, *args):
        real(parent_pid, *args)
        with open(seen, "a") as handle:
            handle.write(f"{gc.get_freeze_count()}\n")

    monkeypatch.setattr(loader_module, "_start_worker", probe)
    file_list = write_filelist(tmp_path / "x.filelist", id_parts(tmp_path, 2, 4))
    loader = build_train_dataloader(file_list, 32, 2, 2, 0, 0, 1)
    with time_limit(120):
        batches = iter(loader)
        next(batches)
    batches.close()
    frozen = [int(line) for line in seen.read_text().split()]
    assert len(frozen) == 2 and min(frozen) > 1000, frozen  # each worker: everything it inherited
    assert gc.get_freeze_count() == 0  # the parent's objects are collectable again
