"""A stall is reported, not waited out (issue 22.3): --stall_timeout ends a run whose data stream hangs, or
whose rank blocks, with a report of what it was doing and STALL_EXIT_CODE (each entry point in one case)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import DRIVERS, REPO, tiny_args, write_tar
from PIL import Image

from vae_trainer.watchdog import STALL_EXIT_CODE


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_pipe_shard_that_hangs_after_some_records_ends_the_run_with_a_report(tmp_path, driver=DRIVERS[0]):
    """The shard's command prints 6 of its 40 images, then sleeps without closing: a stuck download. Before,
    the run sat there until killed; now it stops after --stall_timeout with the stacks and exit 124. (One entry
    point each: this one the Trainer's, the blocked rank below the plain loop's.)"""
    shard = write_tar(tmp_path / "shard.tar", [(f"{i:03d}.png", png(i)) for i in range(40)])
    part = sum(512 + -(-len(png(i)) // 512) * 512 for i in range(6))  # the first 6 members, whole
    listing = tmp_path / "stuck.filelist"
    listing.write_text(f"pipe:head -c {part} {shard}; sleep 600\n")
    args = tiny_args(str(listing), tmp_path / "run", max_steps=50, save_steps=100, use_ema="false",
                     image_logging_steps=0, perceptual_weight=0)  # (no LPIPS here: the runs stall, not train)
    start = time.time()
    result = subprocess.run([sys.executable, os.path.join(REPO, driver), *map(str, args), "--stall_timeout", "8"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == STALL_EXIT_CODE, result.stderr[-3000:]
    assert time.time() - start < 200
    assert "stalled: rank 0 finished nothing for 8 s" in result.stderr
    assert "now: waiting for data" in result.stderr
    # The reader's shuffle buffer waits for more records than the 6 that came: the first batch never does.
    assert "Last finished: the start" in result.stderr and "(no step yet)" in result.stderr
    assert "Thread 0x" in result.stderr or "Current thread" in result.stderr  # faulthandler's stacks


BLOCK_RANK_1 = """
import importlib, os, sys, time
sys.path.insert(0, {repo!r})
driver, argv = sys.argv[1], sys.argv[2:]
from vae_trainer.threads import set_default_threads
set_default_threads(argv)
from vae_trainer.distributed import run_and_exit
from vae_trainer.train_logging import TrainMonitor
original = TrainMonitor.optimizer_step_end
def end(self, step, report, images=None):
    if step == 2 and os.environ.get("PADDLE_TRAINER_ID") == "1":
        time.sleep(600)  # a rank that blocks (a hung file system call, a dead GPU): rank 0 waits in a collective
    return original(self, step, report, images)
TrainMonitor.optimizer_step_end = end
module = importlib.import_module(driver[:-len(".py")])
run_and_exit(lambda: module.main(argv))
"""


def test_a_rank_that_blocks_ends_the_two_process_run(photo_filelist, tmp_path, driver=DRIVERS[1]):
    worker = tmp_path / "worker.py"
    worker.write_text(BLOCK_RANK_1.format(repo=REPO))
    args = tiny_args(photo_filelist, tmp_path / "run", max_steps=20, save_steps=100, use_ema="false",
                     image_logging_steps=0, perceptual_weight=0)
    start = time.time()
    result = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
                             "--log_dir", str(tmp_path / "logs"), str(worker), driver, *map(str, args),
                             "--stall_timeout", "10"], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                            capture_output=True, text=True, timeout=400)
    assert result.returncode != 0
    assert time.time() - start < 300
    logs = "".join(open(tmp_path / "logs" / f"workerlog.{r}").read() for r in (0, 1))
    assert "stalled: rank " in logs and "finished nothing for 10 s" in logs, logs[-3000:]
    assert "Last finished: step 2" in logs or "Last finished: step 3" in logs



STUCK_AT_START = """
import importlib, os, sys, time
sys.path.insert(0, {repo!r})
rank_1 = os.environ.get("PADDLE_TRAINER_ID") == "1"
if rank_1 and {never_joins!r}:
    time.sleep(600)  # a rank that never joins (its node died): rank 0 waits to form the process group
from vae_trainer import build
from vae_trainer.distributed import run_and_exit
build_vae = build.build_vae
def stuck(*args, **kwargs):
    if rank_1:
        time.sleep(600)  # a hung mount while reading the VAE: rank 0 waits in the collective that follows
    return build_vae(*args, **kwargs)
build.build_vae = stuck
module = importlib.import_module(sys.argv[1][:-len(".py")])
run_and_exit(lambda: module.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("never_joins, reported", [
    (False, "now: starting up"),  # stuck in a collective: the watchdog's report
    (True, "in init_parallel_env"),  # the rendezvous holds Python's lock: faulthandler's stacks
])
def test_a_rank_stuck_at_start_up_is_reported(photo_filelist, tmp_path, never_joins, reported):
    """The watchdog runs from start-up on (issue 29); before, the ranks waited for each other forever."""
    worker = tmp_path / "worker.py"
    worker.write_text(STUCK_AT_START.format(repo=REPO, never_joins=never_joins))
    args = tiny_args(photo_filelist, tmp_path / "run", stall_timeout=4, perceptual_weight=0)
    result = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
                             "--log_dir", str(tmp_path / "logs"), str(worker), "train_vae_no_trainer.py",
                             *map(str, args)], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    logs = "".join(open(tmp_path / "logs" / f"workerlog.{r}").read() for r in (0, 1))
    assert reported in logs, logs[-3000:]
    assert never_joins or "stalled: rank " in logs
