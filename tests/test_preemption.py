"""Preemption (issue 22.1): a signal makes both entry points finish the step, save checkpoint-N of it, exit
PREEMPTED_EXIT_CODE; the same command with --resume_from_checkpoint latest ends with the weights of an
uninterrupted run. Under the launcher every rank stops at the same step, also when only one was signalled."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, run_entry_point, run_in_process, tiny_args

from vae_trainer.distributed import PREEMPTED_EXIT_CODE, SIGNALS

HANDLERS = {signum: signal.getsignal(signum) for signum in SIGNALS}  # before any `install_stop_handlers` here

# No LPIPS in these runs (--perceptual_weight 0): its VGG16 is most of a tiny step's time on CPU, and it holds no
# state a stop or a resume could lose (the exact resume of runs with it is test_train_e2e's, test_alignment's).
FLAGS = dict(max_steps=6, save_steps=100, use_ema="false", image_logging_steps=0, perceptual_weight=0)


def final_weights(output_dir: str, step: int) -> dict:
    return {k: v.numpy() for k, v in paddle.load(os.path.join(output_dir, f"checkpoint-{step}",
                                                              "model_state.pdparams")).items()}


# Runs an entry point as `python DRIVER ARGS` would (also under the launcher), sending itself SIGNUM at the end of
# optimizer step AT (a number) or as the final export writes the VAE (AT = "export"); under the launcher only
# the rank RANK (default: every rank) signals itself.
SIGNAL_SELF = """
import importlib, os, sys
sys.path.insert(0, {repo!r})
driver, at, signum, argv = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
from vae_trainer.threads import set_default_threads
set_default_threads(argv)
from vae_trainer import final_save
from vae_trainer.distributed import run_and_exit
from vae_trainer.train_logging import TrainMonitor
me = os.environ.get("SIGNAL_RANK") in (None, os.environ.get("PADDLE_TRAINER_ID", "0"))
original, save_vae = TrainMonitor.optimizer_step_end, final_save.save_vae
def end(self, step, report, images=None):
    if me and str(step) == at:
        os.kill(os.getpid(), signum)
    return original(self, step, report, images)
def export(*args, **kwargs):
    if me and at == "export":
        os.kill(os.getpid(), signum)
    return save_vae(*args, **kwargs)
TrainMonitor.optimizer_step_end, final_save.save_vae = end, export
module = importlib.import_module(driver[:-len(".py")])
run_and_exit(lambda: module.main(argv), stop_signals=True)
"""


def signal_self_script(tmp_path) -> str:
    path = tmp_path / "signal_self.py"
    path.write_text(SIGNAL_SELF.format(repo=REPO))
    return str(path)


# (SIGINT is the same handler: test_a_stop_request_counts_once_and_a_second_ctrl_c_quits_a_single_process)
@pytest.mark.parametrize("driver,signum", [(DRIVERS[0], signal.SIGTERM), (DRIVERS[1], signal.SIGUSR1)])
def test_a_signal_saves_the_step_reached_and_resume_latest_ends_as_an_uninterrupted_run(
        photo_filelist, tmp_path, driver, signum):
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    run_in_process(driver, tiny_args(photo_filelist, straight, **FLAGS))  # the uninterrupted reference
    uninstall()  # (the run's signal handlers, installed in this process)
    result = subprocess.run([sys.executable, signal_self_script(tmp_path), driver, "3", str(int(signum)),
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


def uninstall() -> None:
    """Restore the handlers `distributed.install_stop_handlers` replaced and forget the stop request."""
    from vae_trainer import distributed

    for signum, handler in HANDLERS.items():
        signal.signal(signum, handler)
    distributed._received = None


def test_a_stop_request_counts_once_and_a_second_ctrl_c_quits_a_single_process():
    from vae_trainer import distributed

    distributed.install_stop_handlers(single_process=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's repeats: nothing more
        assert distributed.stop_signal() == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        uninstall()
    distributed.install_stop_handlers(single_process=False)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # under the launcher: the save is never cut short
        assert distributed.stop_signal() == "SIGINT"
    finally:
        uninstall()
    assert distributed.stop_signal() is None


# ---- under the launcher, 2 ranks, 2 data workers each: signals as schedulers send them (issue 29.1)

TWO_RANK_FLAGS = dict(max_steps=16, save_steps=4, use_ema="false", image_logging_steps=0, save_total_limit=1,
                      dataloader_num_workers=2, stall_timeout=300, perceptual_weight=0)


@pytest.fixture(scope="module")
def straight_two_ranks(photo_filelist, tmp_path_factory):
    """The final weights of an uninterrupted 2-process run, made once, by the plain loop: both entry points train to
    the same numbers (test_train_e2e), so each one's resumed run must end with these weights."""
    out = tmp_path_factory.mktemp("straight")
    run_entry_point(DRIVERS[1], tiny_args(photo_filelist, out / "run", **TWO_RANK_FLAGS), nproc=2,
                    log_dir=out / "logs")
    return final_weights(str(out / "run"), 16)


def _children(pid: int) -> list:
    listed = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in listed]


def _tree(pid: int) -> list:
    """`pid` and every process below it (the launcher, its ranks, their data-loader workers)."""
    return [pid] + [p for child in _children(pid) for p in _tree(child)]


def _rank_pid(launcher_pid: int, rank: int) -> int:
    for pid in _children(launcher_pid):
        with contextlib.suppress(OSError):
            if f"PADDLE_TRAINER_ID={rank}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} under the launcher {launcher_pid}")


@pytest.mark.parametrize("driver,target,signum", [
    (DRIVERS[0], "the launcher", signal.SIGTERM),            # what a scheduler's stop of the launcher does
    (DRIVERS[1], "every process", signal.SIGTERM),           # scancel: the ranks' data workers too
    (DRIVERS[0], "rank 1", signal.SIGUSR1),                  # one rank only: the other stops at the same step
    (DRIVERS[1], "every process of run_multi", signal.SIGUSR1),  # SLURM's --signal=USR1@120 on the run script
])
def test_a_signal_to_the_launched_job_saves_one_step_on_every_rank_and_resumes_exactly(
        photo_filelist, tmp_path, straight_two_ranks, driver, target, signum):
    """Before (issue 29.1), with data workers on, the launcher's killpg killed them too and Paddle's main process
    died of "DataLoader process ... killed by signal: Terminated" without saving. Now every rank saves
    checkpoint-N of one step and exits 75; `latest` then ends with the uninterrupted run's weights."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    args = [*map(str, tiny_args(photo_filelist, run, **TWO_RANK_FLAGS))]
    env = {**os.environ, "PYTHONPATH": REPO}
    if target.endswith("run_multi"):
        script = "run_multi_trainer.sh" if driver == DRIVERS[0] else "run_multi_no_trainer.sh"
        env.update(DEVICE="cpu", NPROC="2", OUTPUT_DIR=str(run))
        command, logs = ["bash", f"scripts/{script}", *args], run / "launch_logs"
    else:
        command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
                   str(logs), os.path.join(REPO, driver), *args]
    launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoint-4").is_dir() and launcher.poll() is None:
        time.sleep(0.1)
    if target == "rank 1":
        targets = [_rank_pid(launcher.pid, 1)]
    else:
        targets = _tree(launcher.pid) if target.startswith("every process") else [launcher.pid]
        assert len(_tree(launcher.pid)) >= 7  # the launcher, 2 ranks and their 4 data workers are running
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    launcher.wait(timeout=300)
    assert launcher.returncode != 0
    step = max(int(p.split("-")[1]) for p in os.listdir(run) if p.startswith("checkpoint-"))
    assert 4 <= step < 16
    assert {"rank_state_0.pdparams", "rank_state_1.pdparams"} <= set(os.listdir(run / f"checkpoint-{step}"))
    for r in (0, 1):
        log = open(logs / f"workerlog.{r}").read()
        assert f"after step {step}: saved" in log and "exit code 75" in log, log[-3000:]
        assert "DataLoader process" not in log and "Traceback" not in log, log[-3000:]
    if target.endswith("run_multi"):
        return  # (its defaults add loss weights; exact resume is shown by the other cases)
    run_entry_point(driver, tiny_args(photo_filelist, run, resume_from_checkpoint="latest", **TWO_RANK_FLAGS),
                    nproc=2, log_dir=tmp_path / "resumed")
    expected, resumed = straight_two_ranks, final_weights(str(run), 16)
    for key in expected:
        assert np.array_equal(expected[key], resumed[key]), key  # (np.testing trips on 0-d arrays: np.bool)


def test_a_signal_during_the_final_export_lets_it_finish_and_every_rank_exits_75(photo_filelist, tmp_path):
    """Before, the handlers were gone once the last step was saved: the signal killed the rank mid-export (and the
    launcher killed the others 30 s later). Rank 0 alone is signalled while it writes the VAE."""
    result = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "logs"),
         signal_self_script(tmp_path), DRIVERS[1], "export", str(int(signal.SIGTERM)),
         *map(str, tiny_args(photo_filelist, tmp_path / "run", max_steps=2, use_ema="false", image_logging_steps=0,
                             dataloader_num_workers=2, perceptual_weight=0))],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, "SIGNAL_RANK": "0"}, capture_output=True, text=True,
        timeout=300)
    logs = [open(tmp_path / "logs" / f"workerlog.{r}").read() for r in (0, 1)]
    assert result.returncode == PREEMPTED_EXIT_CODE, logs[0][-3000:]
    assert "SIGTERM arrived during the final save or export" in logs[0]
    assert "a signal to another rank arrived during the final save or export" in logs[1]
    assert os.path.isfile(tmp_path / "run" / "vae" / "config.json")  # the export finished
    assert os.path.isdir(tmp_path / "run" / "checkpoint-2")
