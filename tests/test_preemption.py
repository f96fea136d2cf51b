"""Preemption (issue 22.1): a signal makes both entry points finish the step, save checkpoint-N of it, exit
PREEMPTED_EXIT_CODE; the same command with --resume_from_checkpoint latest ends with the weights of an
uninterrupted run. Under the launcher every rank stops at the same step, also when only one was signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, run_entry_point, tiny_args

from vae_trainer.preemption import PREEMPTED_EXIT_CODE

FLAGS = dict(max_steps=6, save_steps=100, use_ema="false", image_logging_steps=0)


def final_weights(output_dir: str, step: int) -> dict:
    return {k: v.numpy() for k, v in paddle.load(os.path.join(output_dir, f"checkpoint-{step}",
                                                              "model_state.pdparams")).items()}


# Runs an entry point as `python DRIVER ARGS` would, sending itself SIGNUM at the end of optimizer step AT_STEP.
SIGNAL_SELF = """
import importlib, os, sys
sys.path.insert(0, os.getcwd())
driver, at_step, signum, argv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
from vae_trainer.threads import set_default_threads
set_default_threads(argv)
from vae_trainer.distributed import run_and_exit
from vae_trainer.train_logging import TrainMonitor
original = TrainMonitor.optimizer_step_end
def end(self, step, report, images=None):
    if step == at_step:
        os.kill(os.getpid(), signum)
    return original(self, step, report, images)
TrainMonitor.optimizer_step_end = end
module = importlib.import_module(driver[:-len(".py")])
run_and_exit(lambda: module.main(argv))
"""


@pytest.mark.parametrize("driver,signum", [(DRIVERS[0], signal.SIGTERM), (DRIVERS[1], signal.SIGUSR1),
                                            (DRIVERS[1], signal.SIGINT)])
def test_a_signal_saves_the_step_reached_and_resume_latest_ends_as_an_uninterrupted_run(
        photo_filelist, tmp_path, driver, signum):
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    run_entry_point(driver, tiny_args(photo_filelist, straight, **FLAGS))
    result = subprocess.run([sys.executable, "-c", SIGNAL_SELF, driver, "3", str(int(signum)),
                             *map(str, tiny_args(photo_filelist, stopped, **FLAGS))],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr[-3000:]
    # Signalled while step 3 ended: the flag is agreed at step 4's read, step 4 finishes, checkpoint-4 is saved.
    name = signal.Signals(signum).name
    assert f"stopped by {name} after step 4" in result.stderr and "--resume_from_checkpoint latest" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p for p in os.listdir(stopped) if p.startswith("checkpoint-")) == ["checkpoint-4"]
    assert not os.path.exists(os.path.join(stopped, "vae"))  # no export of an unfinished run
    run_entry_point(driver, tiny_args(photo_filelist, stopped, resume_from_checkpoint="latest", **FLAGS))
    a, b = final_weights(straight, 6), final_weights(stopped, 6)
    for key in a:
        assert np.array_equal(a[key], b[key]), key  # (np.testing trips on 0-d arrays once ppdiffusers set np.bool)


def test_a_stop_request_counts_once_and_a_second_ctrl_c_quits_a_single_process():
    from vae_trainer.preemption import StopRequest

    request = StopRequest(single_process=True).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's repeats: nothing more
        assert request.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        request.uninstall()
    several = StopRequest(single_process=False).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # under the launcher: the save is never cut short
        assert several.signal_name == "SIGINT"
    finally:
        several.uninstall()


@pytest.mark.parametrize("driver", DRIVERS)
def test_two_ranks_stop_at_the_same_step_when_only_one_is_signalled(photo_filelist, tmp_path, driver):
    """Rank 1 alone gets SIGTERM; both ranks save checkpoint-N of one step, and the resumed run ends with the
    weights of an uninterrupted 2-process run."""
    flags = dict(max_steps=16, save_steps=4, use_ema="false", image_logging_steps=0, save_total_limit=1)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_entry_point(driver, tiny_args(photo_filelist, straight, **flags), nproc=2, log_dir=tmp_path / "l1")
    command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
               str(tmp_path / "l2"), os.path.join(REPO, driver), *map(str, tiny_args(photo_filelist, stopped, **flags))]
    launcher = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (stopped / "checkpoint-4").is_dir():
        time.sleep(0.2)
    rank_1 = _worker_of_rank(launcher.pid, 1)
    os.kill(rank_1, signal.SIGTERM)
    launcher.wait(timeout=300)
    assert launcher.returncode != 0
    checkpoints = sorted((int(p.split("-")[1]) for p in os.listdir(stopped) if p.startswith("checkpoint-")))
    step = checkpoints[-1]
    assert 4 <= step < 16
    assert {"rank_state_0.pdparams", "rank_state_1.pdparams"} <= set(os.listdir(stopped / f"checkpoint-{step}"))
    logs = {r: open(tmp_path / "l2" / f"workerlog.{r}").read() for r in (0, 1)}
    for r in (0, 1):
        assert f"after step {step}: saved" in logs[r], logs[r][-2000:]
    run_entry_point(driver, tiny_args(photo_filelist, stopped, resume_from_checkpoint="latest", **flags), nproc=2,
                    log_dir=tmp_path / "l3")
    a, b = final_weights(str(straight), 16), final_weights(str(stopped), 16)
    for key in a:
        assert np.array_equal(a[key], b[key]), key  # (np.testing trips on 0-d arrays once ppdiffusers set np.bool)


def _worker_of_rank(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's worker with PADDLE_TRAINER_ID == rank."""
    deadline = time.time() + 60
    while time.time() < deadline:
        children = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
        for pid in map(int, children):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"PADDLE_TRAINER_ID={rank}".encode() in environ:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} under the launcher {launcher_pid}")
