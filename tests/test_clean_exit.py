"""How a process of a run ends (distributed.run_and_exit) and the stress script that counts unclean exits.

A finished multi-process run must exit 0 every time (issue: rank 0 died with SIGABRT after its last line,
about one run in twenty). The race itself cannot be forced in a test; benchmarks/clean_exits.py measures it
(docs/benchmarks.md "Clean exits"). These tests pin what the fix must keep: the exit status of every path,
Python's exit functions and buffered output still run/flushed although the process ends with os._exit, and
the stress script's counting.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import clean_exits  # noqa: E402

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    sys.path.insert(0, {repo!r})
    import paddle.distributed as dist
    from vae_trainer.distributed import run_and_exit, world_size

    OUT = {out!r}
    MODE = {mode!r}

    def main():
        if world_size() > 1:
            dist.init_parallel_env()
        rank = dist.get_rank() if dist.is_initialized() else 0
        atexit.register(lambda: open(os.path.join(OUT, f"atexit_{{rank}}"), "w").write("ran"))
        sys.stdout.write(f"last line of rank {{rank}}")  # no newline: only a flush gets it out
        if MODE == "message":
            sys.exit("error: a message for the user")
        if MODE == "code":
            sys.exit(3)
        if MODE == "raise":
            raise RuntimeError("a bug")
        if MODE == "interrupt":
            raise KeyboardInterrupt

    run_and_exit(main)
""")


def _write_script(tmp_path, mode):
    path = tmp_path / f"exit_{mode}.py"  # (not code.py: a stdlib module name)
    path.write_text(SCRIPT.format(repo=REPO, out=str(tmp_path), mode=mode))
    return path


@pytest.mark.parametrize("mode, status, stderr_has", [
    ("ok", 0, None), ("message", 1, "error: a message for the user"), ("code", 3, None),
    ("raise", 1, "RuntimeError: a bug"), ("interrupt", 130, "KeyboardInterrupt"),
])
def test_one_process_exits_with_the_status_of_its_exit_path(tmp_path, mode, status, stderr_has):
    done = subprocess.run([sys.executable, str(_write_script(tmp_path, mode))], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout.endswith("last line of rank 0")
    if stderr_has:
        assert stderr_has in done.stderr
    assert (tmp_path / "atexit_0").read_text() == "ran"


@pytest.mark.parametrize("mode, status", [("ok", 0), ("message", 1)])
def test_two_processes_run_exit_functions_flush_output_and_exit_with_their_status(tmp_path, mode, status):
    """Under the launcher the process ends with os._exit: Python's exit functions must still have run on
    every rank and the unterminated last line reached the log; a user error still fails the job."""
    log_dir = tmp_path / "logs"
    command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
               str(log_dir), str(_write_script(tmp_path, mode))]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == (status == 0), done.stdout[-3000:] + done.stderr[-3000:]
    logs = {rank: (log_dir / f"workerlog.{rank}").read_text() for rank in (0, 1)}
    # On an error path the launcher ends the other rank as soon as one fails: under load that can be before
    # the other rank printed anything, so there the ranks that reported are checked (at least one must).
    ranks = (0, 1) if mode == "ok" else [r for r in (0, 1) if "error: a message for the user" in logs[r]]
    assert ranks, logs
    for rank in ranks:
        assert f"last line of rank {rank}" in logs[rank]
        if mode == "ok":
            assert (tmp_path / f"atexit_{rank}").read_text() == "ran"


LAUNCHER_FAILURE = """LAUNCH INFO 2026-11-25 01:38:06,665 Pod failed
LAUNCH ERROR 2026-11-25 01:38:06,665 Container failed !!!
Container rank 0 status failed cmd ['/x/python', '-u', 'train_vae_no_trainer.py'] code -6 log /x/workerlog.0
LAUNCH INFO 2026-11-25 01:38:06,666 ------------------------- ERROR LOG DETAIL -------------------------
Container rank 1 status failed cmd ['/x/python', '-u', 'train_vae_no_trainer.py'] code 2 log /x/workerlog.1
"""


def test_the_stress_script_reads_which_rank_ended_how():
    assert clean_exits.failed_ranks(LAUNCHER_FAILURE) == {0: "signal SIGABRT", 1: "exit 2"}
    assert clean_exits.failed_ranks("LAUNCH INFO Pod completed\nLAUNCH INFO Exit code 0\n") == {}
    assert clean_exits.describe_code(-9) == "signal SIGKILL"
    no_code = "Container rank 0 status failed cmd ['python']\nContainer rank 1 status failed cmd ['python'] code 2\n"
    assert clean_exits.failed_ranks(no_code) == {0: "unknown", 1: "exit 2"}  # never the next rank's code


def test_the_stress_script_counts_failed_launches(tmp_path):
    """Two launches of a command whose rank 1 exits 3: both counted, with the rank and its status."""
    script = tmp_path / "rank1_fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ.get('PADDLE_TRAINER_ID') == '1' else 0)\n")
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "clean_exits.py"), "--runs", "2",
                           "--work_dir", str(tmp_path / "runs"), "--", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 runs, 2 non-zero exits" in done.stdout
    assert "2 x rank 1: exit 3" in done.stdout
    assert done.stdout.rstrip().endswith("0 passed, 2 failed")
    assert sorted(os.listdir(tmp_path / "runs")) == ["run_0000", "run_0001"]  # failed runs are kept


def test_a_hung_launch_is_counted_and_ended_with_its_workers(tmp_path):
    """A run past --timeout counts as hung, and its workers do not outlive it (they would load later runs)."""
    marker = f"hangs_{os.getpid()}"
    script = tmp_path / f"{marker}.py"
    script.write_text("import time\ntime.sleep(600)\n")
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "clean_exits.py"), "--runs", "1",
                           "--timeout", "20", "--work_dir", str(tmp_path / "runs"), "--", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert "1 x hung (timeout)" in done.stdout, done.stdout + done.stderr
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert left == []
