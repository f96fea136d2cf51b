"""One rank's failure ends every rank at once, with the real reason (issue 29, item 2), and a node-local
--output_dir is refused at start (item 3). Two processes under the launcher, and two "nodes" on loopback
(two launchers, tests/test_multinode.py); the failure is a full disk injected into rank 1's part of a
checkpoint save. --stall_timeout is 600 s, so a stall report cannot be what ends a run."""

import os
import re
import subprocess
import sys
import textwrap
import time

from conftest import DRIVERS, REPO, tiny_args
from test_multinode import NODES, free_port, launch_node, node_logs

# Runs a driver with paddle.save failing on rank 1 for checkpoint-4 (a full disk), noting when it failed.
INJECT = textwrap.dedent("""
    import errno, importlib, os, sys, time
    sys.path.insert(0, {repo!r})
    import paddle
    from vae_trainer.distributed import run_and_exit

    real_save = paddle.save
    def save(obj, path, *args, **kwargs):
        if os.environ.get("PADDLE_TRAINER_ID") == "1" and "checkpoint-4.tmp" in str(path):
            open({marker!r}, "w").write(str(time.time()))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(obj, path, *args, **kwargs)
    paddle.save = save
    module = importlib.import_module(sys.argv[1][:-len(".py")])
    run_and_exit(lambda: module.main(sys.argv[2:]))
""")


def failing_run(tmp_path, photo_filelist, driver, workers):
    """(script args, output dir, marker file) of a 4-step run whose checkpoint-4 fails on rank 1."""
    marker = tmp_path / "failed_at"
    (tmp_path / "inject.py").write_text(INJECT.format(repo=REPO, marker=str(marker)))
    output_dir = tmp_path / "out"
    args = tiny_args(photo_filelist, output_dir, dataloader_num_workers=workers, use_ema="false",
                     image_logging_steps=0, stall_timeout=600, perceptual_weight=0)  # (LPIPS: nothing to save)
    return [str(tmp_path / "inject.py"), driver, *map(str, args)], output_dir, marker


def assert_ended_with_the_reason(logs, output_dir, marker, ended):
    for log in logs:  # every rank names the failing rank and its reason
        assert re.search(r"saving checkpoint-4 failed on rank 1: .*No space left on device", log), log[-3000:]
    assert ended - float(marker.read_text()) < 30  # seconds, not --stall_timeout's 600
    assert {"model_state.pdparams", "trainer_state.json", "rank_state_0.pdparams", "rank_state_1.pdparams"} <= set(
        os.listdir(output_dir / "checkpoint-2"))
    assert not [name for name in os.listdir(output_dir) if name.startswith("checkpoint-4")]  # nor .tmp


def test_a_failed_save_on_one_rank_ends_both_ranks_at_once_with_its_reason(photo_filelist, tmp_path,
                                                                          driver=DRIVERS[1]):
    """The plain loop under the launcher; the Trainer's entry point on two nodes below."""
    script_args, output_dir, marker = failing_run(tmp_path, photo_filelist, driver, workers=2)
    log_dir = tmp_path / "logs"
    done = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
                           str(log_dir), *script_args], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=300)
    ended = time.time()
    assert done.returncode != 0
    logs = [(log_dir / f"workerlog.{r}").read_text() for r in (0, 1)]
    assert_ended_with_the_reason(logs, output_dir, marker, ended)
    assert "error: saving checkpoint-4 failed on rank 1" in logs[1]  # still one `error:` line, no traceback
    assert "Traceback" not in logs[1]


def run_nodes(script_args_of, log_root, timeout=90):
    """Launch NODES single-process nodes (script args per node); their exit codes and when the last one ended."""
    master = f"127.0.0.1:{free_port()}"
    log_dirs = [os.path.join(log_root, f"node{r}") for r in range(NODES)]
    nodes = [launch_node(r, master, script_args_of(r), log_dirs[r]) for r in reversed(range(NODES))]
    try:
        codes = [node.wait(timeout=timeout) for node in nodes]
    except subprocess.TimeoutExpired:
        codes = None
    ended = time.time()
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, 9)
            node.wait()
    assert codes is not None, f"two-node run hung:{node_logs(log_dirs)}"
    return codes, ended, [node_logs([d]) for d in log_dirs]


def test_a_failed_save_on_one_node_ends_both_nodes_at_once_with_its_reason(photo_filelist, tmp_path):
    script_args, output_dir, marker = failing_run(tmp_path, photo_filelist, "train_vae_trainer.py", workers=0)
    codes, ended, logs = run_nodes(lambda node: script_args, str(tmp_path / "launch"))
    assert all(code != 0 for code in codes), codes
    assert_ended_with_the_reason(logs, output_dir, marker, ended)


def test_an_output_dir_that_the_nodes_do_not_share_is_refused_at_start(photo_filelist, tmp_path):
    def script_args(node):  # the same flags, except that each node writes into a folder of its own
        args = tiny_args(photo_filelist, tmp_path / f"node{node}_out", stall_timeout=600, perceptual_weight=0)
        return [os.path.join(REPO, "train_vae_no_trainer.py"), *map(str, args)]

    codes, _, logs = run_nodes(script_args, str(tmp_path / "launch"))
    assert all(code != 0 for code in codes), codes
    for log in logs:
        assert re.search(r"error: .*rank 1.*not shared.*shared file system", log), log[-3000:]
    assert os.listdir(tmp_path / "node0_out") == []  # nothing written, the check's file removed
