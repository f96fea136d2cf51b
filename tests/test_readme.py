"""The newcomer's path: what the README tells a user to run does what it says (README, Makefile, run scripts)."""

import os
import re
import shlex
import shutil
import subprocess

import pytest
from conftest import REPO

from vae_trainer.arguments import parse_arguments

README = open(os.path.join(REPO, "README.md")).read()


def bash_commands(text: str):
    """The commands of the README's ```bash blocks, continuation lines joined, comments dropped."""
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split(" #")[0].strip()
            if command and not command.startswith("#"):
                yield command


def test_readme_says_to_activate_the_environment_before_its_first_python_command():
    commands = list(bash_commands(README))
    first_python = next(i for i, c in enumerate(commands) if re.search(r"(^|\s)python\s", c))
    assert any(c == "source .venv/bin/activate" for c in commands[:first_python])


def test_every_readme_training_command_parses_and_evaluates_when_given_held_out_images():
    found = 0
    for command in bash_commands(README):
        if not re.match(r"python train_vae_(no_)?trainer\.py ", command):
            continue
        _, data_args, _, args = parse_arguments(shlex.split(command)[2:])
        if data_args.eval_file_list:
            assert args.eval_steps and args.eval_steps > 0, command  # else it never evaluates
        found += 1
    assert found >= 2


def common_args(device: str) -> list:
    """The flags scripts/_common.sh gives the entry points for DEVICE=device."""
    env = {k: v for k, v in os.environ.items() if k not in ("VAE_CONFIG", "RESOLUTION", "MAX_STEPS", "NUM_WORKERS")}
    printed = subprocess.run(["bash", "-c", 'source scripts/_common.sh && printf "%s\\n" "${COMMON_ARGS[@]}"'],
                             cwd=REPO, env={**env, "DEVICE": device}, capture_output=True, text=True, check=True)
    words = printed.stdout.split("\n")
    return dict(zip(words[::2], words[1::2]))


def test_run_scripts_train_the_tiny_model_on_cpu_and_the_sd_vae_on_gpus():
    cpu, gpu = common_args("cpu"), common_args("gpu")
    assert (cpu["--vae_config_file"], cpu["--resolution"]) == ("configs/vae_tiny.json", "64")
    assert (gpu["--vae_config_file"], gpu["--resolution"]) == ("configs/sd_vae.json", "256")
    assert int(cpu["--max_steps"]) <= 1000 < int(gpu["--max_steps"])


def test_readme_gives_each_node_its_rank():
    """Both ways of launching two nodes: the launcher's --rank, and the run scripts' NODE_RANK."""
    for marker, rank in (("--nnodes", r"--rank (\d+)"), ("NNODES=", r"NODE_RANK=(\d+)")):
        lines = [c for c in bash_commands(README) if marker in c]
        ranks = [re.search(rank, line) for line in lines]
        assert lines and all(ranks), lines
        assert sorted(int(r.group(1)) for r in ranks) == [0, 1], lines


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_switches_the_paddle_wheel_and_never_keeps_both(tmp_path):
    """`make setup PADDLE=...` after a CPU setup must install the GPU wheel (removing the CPU one), and back."""
    for name in ("Makefile", "requirements.txt", "requirements-test.txt", "constraints.txt"):
        shutil.copy(os.path.join(REPO, name), tmp_path)
    shutil.copytree(os.path.join(REPO, "scripts"), tmp_path / "scripts")

    def dry_run(*variables):
        return subprocess.run(["make", "-n", "setup", *variables], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout

    fresh = dry_run()
    assert 'install "paddlepaddle==3.3.1"' in fresh and "uninstall -y paddlepaddle-gpu" in fresh
    # What the CPU setup leaves behind (make -n ran nothing).
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / "weights").mkdir()
    (tmp_path / "data" / "demo").mkdir(parents=True)
    for made in (".venv/bin/python", ".venv/.installed-paddlepaddle__3.3.1", "weights/lpips_vgg16.pdparams",
                 "data/demo/.done"):
        (tmp_path / made).touch()
    assert "pip" not in dry_run()  # set up: nothing to do

    gpu = dry_run("PADDLE=paddlepaddle-gpu==3.3.1")
    assert "uninstall -y paddlepaddle\n" in gpu and 'install "paddlepaddle-gpu==3.3.1"' in gpu
    assert gpu.index("uninstall") < gpu.index("install \"paddlepaddle-gpu")
    assert "convert_lpips_weights" not in gpu and "prepare_demo_data" not in gpu  # only the wheel changes


def test_where_things_are_lists_every_module():
    """The README's file map names every module of the package (a new or renamed module must be added)."""
    block = README.split("## Where things are", 1)[1].split("```", 2)[1]
    package = os.path.join(REPO, "vae_trainer")
    modules = [os.path.relpath(os.path.join(root, name), package) for root, _, names in os.walk(package)
               for name in names if name.endswith(".py") and name != "__init__.py"]
    assert len(modules) > 20
    missing = [m for m in modules if not re.search(rf"(^|[\s/,]){re.escape(os.path.basename(m))}\b", block, re.M)]
    assert missing == []
