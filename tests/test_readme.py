"""The newcomer's path: what the README and docs/ tell a user to run does what they say (README, docs/*.md,
Makefile, run scripts)."""

import argparse
import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from vae_trainer.argument_parser import parse_arguments

README = open(os.path.join(REPO, "README.md")).read()
# Every page a user reads, by its path from the repository root: README.md, then docs/*.md.
PAGES = {"README.md": README, **{os.path.relpath(path, REPO): open(path).read()
                                 for path in sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))}}


def code_blocks(text: str, name: str = "README.md"):
    """(language, body) of every fenced block of page `name`, read line by line as markdown does. A fence line
    that neither opens (```lang) nor closes (``` alone) a block fails: markdown would render the rest of the
    page as code."""
    language, body, opened_at = None, [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("```"):
            if opened_at is not None:
                body.append(line)
            continue
        fence = line.strip()
        if opened_at is None:
            assert re.fullmatch(r"```[\w+-]*", fence), f"{name}:{number}: not an opening fence: {line!r}"
            language, body, opened_at = fence[3:], [], number
        else:
            assert fence == "```", (f"{name}:{number}: a closing fence is ``` alone (block opened at line "
                                    f"{opened_at}): {line!r}")
            yield language, "\n".join(body)
            opened_at = None
    assert opened_at is None, f"{name}:{opened_at}: code block never closed"


def bash_commands(text: str, name: str = "README.md"):
    """The commands of a page's ```bash blocks, continuation lines joined, comments dropped."""
    for language, block in code_blocks(text, name):
        if language != "bash":
            continue
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split(" #")[0].strip()
            if command and not command.startswith("#"):
                yield command


def all_bash_commands():
    """(page, command) of the README and of every docs/ page."""
    for name, text in PAGES.items():
        for command in bash_commands(text, name):
            yield name, command


def test_the_pages_are_the_readme_and_the_docs():
    assert {"README.md", "docs/data.md", "docs/fine-tuning.md", "docs/launching.md", "docs/measuring.md",
            "docs/reliability.md", "docs/techniques.md", "docs/benchmarks.md", "docs/training.md"} <= set(PAGES)


def test_code_fences_open_and_close_in_pairs():
    blocks = [block for name, text in PAGES.items() for block in code_blocks(text, name)]
    assert len(blocks) >= 15 and sum(language == "bash" for language, _ in blocks) >= 10
    assert sum(language == "bash" for language, _ in code_blocks(README)) >= 5


def test_a_fence_with_text_after_it_is_caught():
    """The fence bug this guards against: "``` Tested as two" does not close a block."""
    with pytest.raises(AssertionError, match="README.md:3"):
        list(code_blocks("```bash\nmake\n``` Tested as two\ntext\n```bash\nls\n```\n"))
    with pytest.raises(AssertionError, match="docs/data.md:2: code block never closed"):
        list(code_blocks("text\n```bash\nls\n", "docs/data.md"))


def test_readme_fits_in_250_lines():
    """The README is the newcomer's page; everything else lives in docs/."""
    assert len(README.splitlines()) <= 250


def test_every_docs_page_starts_with_its_title_and_what_it_is_for():
    for name, text in PAGES.items():
        if name == "README.md":
            continue
        lines = text.splitlines()
        assert re.fullmatch(r"# \S.*", lines[0]), f"{name}:1: a page starts with its `# ` title"
        assert lines[1] == "" and (lines[2][:1].isalnum() or lines[2][:1] in "`*"), \
            f"{name}:3: after the title, a paragraph saying what the page is for"
        assert len(" ".join(lines[2:lines.index("", 2)]).split()) >= 12, f"{name}:3: say what the page is for"


def heading_anchors(text: str) -> set:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped, spaces to -,
    a repeated anchor numbered (-1, -2, ...)."""
    anchors, text = set(), re.sub(r"```.*?```", "", text, flags=re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        numbered, n = anchor, 0
        while numbered in anchors:
            n += 1
            numbered = f"{anchor}-{n}"
        anchors.add(numbered)
    return anchors


def test_heading_anchors_are_githubs():
    assert heading_anchors("# Title\n## Large images: the batch and `--eval_tiled`\n## FLUX.2 / ERNIE (X)\n"
                           "## Title\n```\n# not a heading\n```\n") == {
        "title", "large-images-the-batch-and---eval_tiled", "flux2--ernie-x", "title-1"}


def test_every_relative_link_points_to_an_existing_file_and_heading():
    """[text](path#anchor) links of the README and docs/: the file exists, and so does the heading."""
    links = 0
    for name, text in PAGES.items():
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue  # http(s):, mailto:
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
            assert os.path.exists(os.path.join(REPO, file)), f"{name}: link to a missing file: {target}"
            if anchor and file.endswith(".md"):
                assert anchor in heading_anchors(open(os.path.join(REPO, file)).read()), \
                    f"{name}: link to a missing heading: {target}"
            links += 1
    assert links >= 30


def test_every_file_of_the_repository_that_a_page_names_exists():
    """Paths such as `scripts/eval_vae.py`, `vae_trainer/final_save.py`, `tests/test_disk.py::test_x`: a moved
    or renamed file must be renamed in the pages too. A file removed after a settled comparison may be named on a
    line that pins the commit it is still in (`git checkout <commit> && python benchmarks/...`, "at commit
    <commit>"; docs/benchmarks.md): it must exist there."""
    named = 0
    for name, text in PAGES.items():
        for line in text.splitlines():
            pinned = re.findall(r"\b(?:checkout|commit) ([0-9a-f]{7,40})\b", line)
            for path in re.findall(r"(?<![\w/.-])((?:scripts|benchmarks|vae_trainer|configs|tests)/[\w/.-]*\w\.(?:py|sh|json))",
                                   line):
                if not os.path.isfile(os.path.join(REPO, path)):
                    assert pinned, f"{name}: names a missing file: {path}"
                    if shutil.which("git") and os.path.exists(os.path.join(REPO, ".git")):
                        found = subprocess.run(["git", "cat-file", "-e", f"{pinned[0]}:{path}"], cwd=REPO,
                                               capture_output=True)
                        assert found.returncode == 0, f"{name}: {path} is not at the pinned commit {pinned[0]}"
                named += 1
    assert named >= 50


class _Parsed(Exception):
    """Raised instead of running a script once its parser has read the flags."""

    def __init__(self, unknown):
        super().__init__(unknown)
        self.unknown = unknown


def python_commands(text: str, name: str = "README.md"):
    """(command, script, its flags) of every `python ...` command of a page's ```bash blocks (VAR=value prefixes
    skipped; `python -m paddle.distributed.launch ... SCRIPT flags` gives SCRIPT; other modules, e.g. pip, are
    not scripts)."""
    for command in bash_commands(text, name):
        if not re.search(r"(^|\s)python\s", command):
            continue
        words = shlex.split(command)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words.pop(0)
        if not words or words[0] != "python":
            continue
        words = words[1:]
        if words[:2] == ["-m", "paddle.distributed.launch"]:
            words = words[next(i for i, word in enumerate(words) if word.endswith(".py")):]
        elif words[0] == "-m":
            continue
        yield command, words[0], words[1:]


def parse_only(script: str, flags) -> None:
    """Run `script`'s main() up to its argument parser, which reads `flags` (argparse errors exit); stop there."""
    path = os.path.join(REPO, script)
    spec = importlib.util.spec_from_file_location(f"readme_{os.path.basename(script)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses defined in a script look their module up)
    original = argparse.ArgumentParser.parse_known_args

    def parse_and_stop(parser, args=None, namespace=None):
        raise _Parsed(original(parser, args, namespace)[1])

    sys.path.insert(0, os.path.dirname(path))  # as `python SCRIPT` does: the script's folder (benchmarks/harness.py)
    argparse.ArgumentParser.parse_known_args = parse_and_stop
    try:
        spec.loader.exec_module(module)
        module.main(list(flags))
    except _Parsed as parsed:
        assert parsed.unknown == [], f"{script}: unknown arguments {parsed.unknown}"
        return
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.path.remove(os.path.dirname(path))
    raise AssertionError(f"{script}: main() finished without parsing its arguments")


def test_every_python_command_names_a_script_and_only_flags_its_parser_accepts(capsys):
    """As pasted from the README or a docs page: an existing script, no placeholders ([--optional], ...), flags
    its parser knows."""
    commands = [(name, *command) for name, text in PAGES.items() for command in python_commands(text, name)]
    assert {script for _, _, script, _ in commands} >= {"train_vae_trainer.py", "scripts/eval_vae.py",
                                                        "scripts/convert_inception_weights.py",
                                                        "scripts/export_vae.py", "scripts/make_parts.py",
                                                        "scripts/write_filelist.py"}
    for name, command, script, flags in commands:
        assert os.path.isfile(os.path.join(REPO, script)), f"{name}: not a file: {command}"
        placeholders = [word for word in flags if word.startswith("[") or word.endswith("]") or word == "..."]
        assert not placeholders, f"{name}: not a command to paste: {placeholders} in {command}"
        try:
            parse_only(script, flags)
        except SystemExit:
            raise AssertionError(f"{name}: {command}\n{capsys.readouterr().err}") from None


def test_a_bracketed_optional_flag_is_caught():
    [(_, script, flags)] = python_commands("```bash\npython scripts/eval_vae.py --vae v --data d --output_dir o "
                                           "[--inception_weights w]\n```\n")
    assert script == "scripts/eval_vae.py" and flags[-2:] == ["[--inception_weights", "w]"]
    with pytest.raises(AssertionError, match=r"unknown arguments \['\[--inception_weights', 'w\]'\]"):
        parse_only(script, flags)
    with pytest.raises(AssertionError, match="unknown arguments"):  # a flag the script does not have
        parse_only("train_vae_no_trainer.py", ["--file_list", "x", "--max_steps", "1", "--no_such_flag", "1"])
    with pytest.raises(SystemExit):  # a value the flag does not take
        parse_only("train_vae_no_trainer.py", ["--file_list", "x", "--max_steps", "1", "--device", "cuda"])


def test_readme_says_to_activate_the_environment_before_its_first_python_command():
    commands = list(bash_commands(README))
    first_python = next(i for i, c in enumerate(commands) if re.search(r"(^|\s)python\s", c))
    assert any(c == "source .venv/bin/activate" for c in commands[:first_python])


def test_every_training_command_parses_and_evaluates_when_given_held_out_images():
    found = 0
    for name, command in all_bash_commands():
        if not re.match(r"python train_vae_(no_)?trainer\.py ", command):
            continue
        _, data_args, _, args = parse_arguments(shlex.split(command)[2:])
        if data_args.eval_file_list:
            assert args.eval_steps and args.eval_steps > 0, f"{name}: {command}"  # else it never evaluates
        found += 1
    assert found >= 3


RUN_SCRIPT = re.compile(r"((?:[A-Z_][A-Z0-9_]*=\S+ +)*)bash scripts/(run_(single|multi)_(no_)?trainer)\.sh\b(.*)")


def run_script_argv(environment: dict, flags) -> list:
    """The flags a run script passes its entry point for these environment variables and extra flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("VAE_CONFIG", "RESOLUTION", "MAX_STEPS", "NUM_WORKERS",
                                                           "DEVICE", "FILE_LIST", "OUTPUT_DIR", "BATCH_SIZE")}
    printed = subprocess.run(["bash", "-c", 'source scripts/_common.sh && drop_vae_config_unless_asked "$@" 2>/dev/null; '
                              'printf "%s\\n" "${COMMON_ARGS[@]}" --device "$DEVICE" "$@"', "_", *flags],
                             cwd=REPO, env={**env, **environment}, capture_output=True, text=True, check=True)
    return printed.stdout.splitlines()


def test_every_run_script_command_sets_variables_the_scripts_read_and_flags_the_entry_point_accepts(capsys):
    """`VAR=value ... bash scripts/run_*.sh FLAGS` as the pages show it: each VAR is one the scripts read (a
    misspelt one would be ignored), and the entry point's parser takes what the script passes it."""
    scripts = open(os.path.join(REPO, "scripts", "_common.sh")).read()
    known = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", scripts)) | {"OMP_NUM_THREADS"}  # (read by the entry points)
    found = 0
    for name, command in all_bash_commands():
        match = RUN_SCRIPT.fullmatch(command)
        if not match:
            continue
        environment = dict(word.split("=", 1) for word in shlex.split(match.group(1)))
        assert set(environment) <= known, f"{name}: variables the scripts do not read: {set(environment) - known}"
        entry_point = "train_vae_no_trainer.py" if match.group(4) else "train_vae_trainer.py"
        argv = run_script_argv(environment, shlex.split(match.group(5)))
        try:
            parse_only(entry_point, argv)
        except SystemExit:
            raise AssertionError(f"{name}: {command}\n{capsys.readouterr().err}") from None
        _, data_args, _, args = parse_arguments(argv)
        if data_args.eval_file_list:
            assert args.eval_steps and args.eval_steps > 0, f"{name}: {command}"
        found += 1
    assert found >= 8


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


def test_run_scripts_leave_the_loss_to_the_recipe_and_the_family():
    """The scripts state no loss weight: --recipe balanced keeps its own (disc_weight 0.1, no KL), and the flags they
    give a deterministic family (DC-AE), which refuses a KL weight, parse."""
    _, _, loss_args, _ = parse_arguments(run_script_argv({"DEVICE": "cpu"}, ["--recipe", "balanced"]))
    assert (loss_args.disc_weight, loss_args.kl_weight) == (0.1, 0.0)
    dc_ae = os.path.join(REPO, "configs", "dc_ae_f32c32_sana.json")
    model_args, _, _, _ = parse_arguments(run_script_argv({"DEVICE": "cpu", "VAE_CONFIG": dc_ae}, []))
    assert model_args.vae_config_file == dc_ae


def test_each_node_is_given_its_rank():
    """Both ways of launching two nodes, wherever a page shows them (the README, docs/launching.md): the
    launcher's --rank, and the run scripts' NODE_RANK."""
    for marker, rank in (("--nnodes", r"--rank (\d+)"), ("NNODES=", r"NODE_RANK=(\d+)")):
        shown_in = set()
        for name, text in PAGES.items():
            lines = [c for c in bash_commands(text, name) if marker in c]
            if not lines:
                continue
            ranks = [re.search(rank, line) for line in lines]
            assert all(ranks), lines
            assert sorted(int(r.group(1)) for r in ranks) == [0, 1], f"{name}: {lines}"
            shown_in.add(name)
        assert shown_in & {"README.md", "docs/launching.md"}, marker


def make_dry_run(folder, *variables) -> str:
    return subprocess.run(["make", "-n", "setup", *variables], cwd=folder, capture_output=True, text=True,
                          check=True).stdout


def made_stamp(dry_run: str) -> str:
    """The Paddle stamp file `make setup` would write (its last line: printf 'SPEC' > STAMP)."""
    return re.search(r"> (\S+)\n", dry_run).group(1)


@pytest.fixture
def makefile_copy(tmp_path):
    """The Makefile and what it reads, in an empty folder (make -n runs nothing)."""
    for name in ("Makefile", "requirements.txt", "requirements-test.txt", "constraints.txt"):
        shutil.copy(os.path.join(REPO, name), tmp_path)
    shutil.copytree(os.path.join(REPO, "scripts"), tmp_path / "scripts")
    return tmp_path


def set_up_as(folder, dry_run: str) -> None:
    """Leave what that `make setup` leaves: the venv's python, its Paddle stamp, the weights and demo data."""
    for made in (".venv/bin/python", made_stamp(dry_run), "weights/lpips_vgg16.pdparams", "data/demo/.done"):
        os.makedirs(os.path.dirname(folder / made), exist_ok=True)
        (folder / made).touch()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_switches_the_paddle_wheel_and_never_keeps_both(makefile_copy):
    """`make setup PADDLE=...` after a CPU setup must install the GPU wheel (removing the CPU one), and back."""
    fresh = make_dry_run(makefile_copy)
    assert 'install "paddlepaddle==3.3.1"' in fresh and "uninstall -y paddlepaddle-gpu" in fresh
    set_up_as(makefile_copy, fresh)
    assert "pip" not in make_dry_run(makefile_copy)  # set up: nothing to do

    gpu = make_dry_run(makefile_copy, "PADDLE=paddlepaddle-gpu==3.3.1")
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


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_after_a_gpu_setup_switches_back_to_the_cpu_wheel(makefile_copy):
    gpu = make_dry_run(makefile_copy, "PADDLE=paddlepaddle-gpu==3.3.1")
    set_up_as(makefile_copy, gpu)
    assert "pip" not in make_dry_run(makefile_copy, "PADDLE=paddlepaddle-gpu==3.3.1")
    back = make_dry_run(makefile_copy)
    assert "uninstall -y paddlepaddle-gpu\n" in back and 'install "paddlepaddle==3.3.1"' in back
    assert "rm -f .venv/.installed .venv/.installed-*" in back  # the GPU stamp goes with the GPU wheel


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_takes_a_wheel_url_as_paddle(makefile_copy):
    """A wheel's URL (Paddle's install docs give them) as PADDLE: its ':' must not end up in a make target."""
    url = "https://example.invalid/3.3.1/paddlepaddle_gpu-3.3.1-cp311-cp311-linux_x86_64.whl"
    from_url = make_dry_run(makefile_copy, f"PADDLE={url}")
    assert f'install "{url}"' in from_url and "uninstall -y paddlepaddle paddlepaddle-gpu" in from_url
    set_up_as(makefile_copy, from_url)
    assert "pip" not in make_dry_run(makefile_copy, f"PADDLE={url}")
    assert 'install "paddlepaddle==3.3.1"' in make_dry_run(makefile_copy)
