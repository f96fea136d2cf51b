"""CPU threads by default: the rule (pure function) and what each entry point really applies before Paddle loads."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from vae_trainer import threads
from vae_trainer.threads import (VARIABLE, WORKER_FLAGS, cgroup_cpu_quota, choose_threads, dataloader_workers,
                                 set_default_threads, usable_cpus)

ENTRY_POINTS = ["train_vae_trainer.py", "train_vae_no_trainer.py", "scripts/eval_vae.py"]
AFFINITY = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(AFFINITY) < 2, reason="needs at least 2 usable CPUs")

# Runs an entry point as __main__ with --help and reports OMP_NUM_THREADS at the moment Paddle is first
# imported (a meta-path hook sees the import before Paddle's own code runs).
PROBE = r'''
import os, runpy, sys
seen = {}
class RecordPaddleImport:
    def find_spec(self, name, path=None, target=None):
        if name == "paddle" and "at_import" not in seen:
            seen["at_import"] = os.environ.get("OMP_NUM_THREADS")
sys.meta_path.insert(0, RecordPaddleImport())
script = sys.argv[1]
sys.argv = [script, "--help", *sys.argv[2:]]
sys.path.insert(0, os.path.dirname(script))
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
print("PROBE", seen.get("at_import"), flush=True)
'''


def _env_without_threads(**extra):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("PADDLE_")}
    return {**env, "PYTHONPATH": REPO, **extra}


def threads_at_paddle_import(tmp_path, script, env, cpus=None, launcher_procs=0, extra_args=()):
    """OMP_NUM_THREADS that Paddle saw when the entry point imported it (run as a user would)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    command = [sys.executable]
    log_dir = tmp_path / f"launch_{launcher_procs}"
    if launcher_procs:
        command += ["-m", "paddle.distributed.launch", "--nproc_per_node", str(launcher_procs),
                    "--log_dir", str(log_dir)]
    command += [str(probe), os.path.join(REPO, script), *extra_args]
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                            preexec_fn=preexec)
    output = result.stdout + result.stderr
    if launcher_procs:
        output = "".join((log_dir / f"workerlog.{r}").read_text() for r in range(launcher_procs))
    values = [line.split()[1] for line in output.splitlines() if line.startswith("PROBE")]
    assert values and result.returncode == 0, output[-3000:]
    return values, output


# ---------------------------------------------------------------- the rule


def test_default_is_usable_cpus_divided_by_local_processes():
    assert choose_threads({}, cpus=16, workers=0).threads == 16
    launched = {"PADDLE_LOCAL_SIZE": "4", "PADDLE_TRAINER_ENDPOINTS": "a:1,a:2,a:3,a:4"}
    assert choose_threads(launched, cpus=16, workers=0).threads == 4
    assert choose_threads({"PADDLE_LOCAL_SIZE": "8"}, cpus=6, workers=0).threads == 1  # never 0


def test_older_launchers_are_counted_by_the_endpoints_on_this_host():
    env = {"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170,10.0.0.2:6171,10.0.0.2:6172",
           "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6171"}
    assert choose_threads(env, cpus=12, workers=0).threads == 4


def test_one_core_per_process_is_kept_for_dataloader_workers_only_when_there_are_enough():
    assert choose_threads({}, cpus=16, workers=4).threads == 15
    assert choose_threads({"PADDLE_LOCAL_SIZE": "2"}, cpus=16, workers=2).threads == 7
    assert choose_threads({}, cpus=2, workers=4).threads == 2  # a laptop keeps both cores for compute
    assert choose_threads({}, cpus=3, workers=1).threads == 3


def test_the_users_setting_always_wins():
    assert choose_threads({"OMP_NUM_THREADS": "3"}, cpus=16, workers=0).threads == 3
    assert choose_threads({"OMP_NUM_THREADS": "1"}, cpus=16, workers=0).by_user
    # Under the launcher, "1" is the user's only if the launcher itself started with it ...
    launched = {"OMP_NUM_THREADS": "1", "PADDLE_LOCAL_SIZE": "1"}
    assert choose_threads(launched, 16, 0, parent_environ={"OMP_NUM_THREADS": "1"}).threads == 1
    # ... otherwise Paddle's import inside the launcher put it there.
    assert choose_threads(launched, 16, 0, parent_environ={"PATH": "/bin"}).threads == 16
    assert choose_threads(launched, 16, 0, parent_environ=None).threads == 16
    assert choose_threads({**launched, "OMP_NUM_THREADS": "6"}, 16, 0, parent_environ={}).threads == 6


def test_dataloader_workers_are_read_from_the_command_line_or_a_json_of_flags(tmp_path):
    assert dataloader_workers(["--max_steps", "3", "--dataloader_num_workers", "4"]) == 4
    assert dataloader_workers(["--dataloader_num_workers=2"]) == 2
    assert dataloader_workers(["--max_steps", "3"]) == 0
    assert dataloader_workers(["--num_workers", "5"]) == 5  # the reference trainer's spelling
    assert dataloader_workers(["--num_workers", "5", "--dataloader_num_workers", "1"]) == 1  # the last one wins
    flags = tmp_path / "flags.json"
    flags.write_text(json.dumps({"dataloader_num_workers": 3, "max_steps": 1}))
    assert dataloader_workers([str(flags)]) == 3


def test_every_spelling_of_the_workers_flag_is_read():
    from vae_trainer.arguments import ALIASES

    assert set(WORKER_FLAGS) == {"dataloader_num_workers", *ALIASES.get("dataloader_num_workers", ())}


def test_a_cgroup_cpu_quota_caps_the_usable_cpus(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker --cpus 1.5
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    assert usable_cpus(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    assert usable_cpus(str(tmp_path)) == len(AFFINITY)
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(v1)) == 4.0


# ---------------------------------------------------------------- what the entry points apply


@needs_two_cpus
@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_entry_point_sets_all_usable_cpus_before_paddle_is_imported(tmp_path, script):
    values, output = threads_at_paddle_import(tmp_path, script, _env_without_threads())
    assert values == [str(len(AFFINITY))]
    assert f"OMP_NUM_THREADS={len(AFFINITY)} ({len(AFFINITY)} usable CPUs" in output  # the choice is logged


@needs_two_cpus
def test_the_default_follows_the_cpu_affinity_and_keeps_the_users_setting(monkeypatch, capsys):
    """set_default_threads in-process (the entry points' call before Paddle loads: the test above)."""
    monkeypatch.delitem(sys.modules, "paddle", raising=False)  # as before Paddle's import; restored afterwards
    monkeypatch.setattr(threads, "import_paddle_quietly", lambda: None)  # (the entry points' next step)
    for name in [VARIABLE, *(k for k in os.environ if k.startswith("PADDLE_"))]:
        monkeypatch.delenv(name, raising=False)
    os.sched_setaffinity(0, {AFFINITY[0]})
    try:
        assert set_default_threads([]).threads == 1 and os.environ[VARIABLE] == "1"
    finally:
        os.sched_setaffinity(0, AFFINITY)
    monkeypatch.setenv(VARIABLE, "3")
    assert set_default_threads([]).by_user and os.environ[VARIABLE] == "3"
    assert "as set by the user" in capsys.readouterr().err


@needs_two_cpus
def test_launcher_workers_get_their_share_not_the_launchers_paddle_default(tmp_path):
    # The launcher imports Paddle (OMP_NUM_THREADS=1) before it starts its one worker per node.
    values, _ = threads_at_paddle_import(tmp_path, "train_vae_trainer.py", _env_without_threads(), launcher_procs=1)
    assert values == [str(len(AFFINITY))]
    if len(AFFINITY) >= 4:  # with 2 CPUs the share (1) would not differ from Paddle's default
        values, _ = threads_at_paddle_import(tmp_path, "train_vae_trainer.py", _env_without_threads(), launcher_procs=2)
        assert values == [str(len(AFFINITY) // 2)] * 2
    user_one = tmp_path / "user"
    user_one.mkdir()
    values, _ = threads_at_paddle_import(user_one, "train_vae_trainer.py", _env_without_threads(OMP_NUM_THREADS="1"),
                                         launcher_procs=1)
    assert values == ["1"]
