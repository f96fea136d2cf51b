"""Multi-node data parallel over loopback: two `paddle.distributed.launch` processes act as two nodes.

Each node is launched as a user would on two machines (`--nnodes 2 --rank R --master IP:PORT
--nproc_per_node 1`), with identical training flags and a shared output dir, here on one machine.
"""

import os
import signal
import socket
import subprocess
import sys

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, read_scalars, tiny_args

NODES = 2
TIMEOUT = 240  # seconds for one two-node run; a hang (e.g. a node that never joins) fails instead of blocking


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_node(node_rank: int, master: str, script_args, log_dir: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "paddle.distributed.launch", "--nnodes", str(NODES), "--rank", str(node_rank),
               "--master", master, "--nproc_per_node", "1", "--log_dir", log_dir, *map(str, script_args)]
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "launcher.out"), "w") as out:
        return subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def node_logs(log_dirs) -> str:
    text = ""
    for log_dir in log_dirs:
        for name in sorted(os.listdir(log_dir)):
            if name == "launcher.out" or name.startswith("workerlog"):
                text += f"\n--- {log_dir}/{name}\n" + open(os.path.join(log_dir, name)).read()[-3000:]
    return text


def run_two_nodes(driver: str, args, log_root: str) -> list:
    """Start node 1 first (it waits for the master), then node 0; return each node's log dir."""
    master = f"127.0.0.1:{free_port()}"
    log_dirs = [os.path.join(log_root, f"node{r}") for r in range(NODES)]
    script_args = [os.path.join(REPO, driver), *args]
    nodes = [launch_node(r, master, script_args, log_dirs[r]) for r in reversed(range(NODES))]
    try:
        codes = [node.wait(timeout=TIMEOUT) for node in nodes]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for node in nodes:  # the launcher's workers are in its process group
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    if codes != [0] * NODES:
        pytest.fail(f"two-node {driver} run {'hung' if codes is None else f'exited with {codes}'}:{node_logs(log_dirs)}")
    return log_dirs


def launch_env(log_dir: str) -> dict:
    """The environment paddle.distributed.launch gave the node's worker."""
    with open(os.path.join(log_dir, "envlog.0")) as f:
        return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)


@pytest.fixture(scope="module")
def two_node_runs(photo_filelist, tmp_path_factory):
    """Per driver: (output dir, node log dirs) of a 3-step run on two single-process nodes."""
    runs = {}
    for driver in DRIVERS:
        root = tmp_path_factory.mktemp(driver.split(".")[0])
        output_dir = str(root / "out")
        # (no LPIPS: it has no weight, random stream or state to keep in sync across the nodes)
        args = tiny_args(photo_filelist, output_dir, max_steps=3, save_steps=3, image_logging_steps=0,
                         perceptual_weight=0)
        runs[driver] = output_dir, run_two_nodes(driver, args, str(root / "launch"))
    return runs


def rank_states(output_dir: str) -> list:
    return [paddle.load(os.path.join(output_dir, "checkpoint-3", f"rank_state_{r}.pdparams"), return_numpy=True)
            for r in range(NODES)]


@pytest.mark.parametrize("driver", DRIVERS)
def test_two_nodes_form_one_job_stay_in_sync_and_read_different_data(two_node_runs, driver):
    output_dir, log_dirs = two_node_runs[driver]
    envs = [launch_env(d) for d in log_dirs]
    assert [e["PADDLE_TRAINER_ID"] for e in envs] == ["0", "1"]  # --rank R made node R hold global rank R
    assert all(e["PADDLE_NNODES"] == "2" and e["PADDLE_TRAINERS_NUM"] == "2" for e in envs)
    assert envs[0]["PADDLE_TRAINER_ENDPOINTS"] == envs[1]["PADDLE_TRAINER_ENDPOINTS"]

    states = rank_states(output_dir)
    np.testing.assert_array_equal(states[0]["parameter_fingerprint"], states[1]["parameter_fingerprint"])
    assert read_scalars(os.path.join(output_dir, "logs"), "loss/discriminator")  # the GAN ran (disc_start 2)
    shards = [set(s["data"]["positions"]) for s in states]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    assert not np.array_equal(states[0]["rng"]["numpy"][1], states[1]["rng"]["numpy"][1])

    from ppdiffusers import AutoencoderKL

    assert AutoencoderKL.from_pretrained(os.path.join(output_dir, "vae")).config.latent_channels == 4


def test_both_drivers_train_the_same_weights_on_two_nodes(two_node_runs):
    fingerprints = [rank_states(two_node_runs[d][0])[0]["parameter_fingerprint"] for d in DRIVERS]
    np.testing.assert_allclose(fingerprints[0], fingerprints[1], rtol=1e-6)
    losses = [read_scalars(os.path.join(two_node_runs[d][0], "logs"), "loss/total") for d in DRIVERS]
    assert sorted(losses[0]) == sorted(losses[1]) == [1, 2, 3]
    np.testing.assert_allclose([losses[0][s] for s in (1, 2, 3)], [losses[1][s] for s in (1, 2, 3)], rtol=1e-6)
