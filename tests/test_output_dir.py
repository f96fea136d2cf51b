"""A second run never eats the first (output_dir.prepare_output_dir): refused without a choice, cleared with
--overwrite_output_dir, left alone with --resume_from_checkpoint; decided once by rank 0. Clearing deletes
only what our runs wrote: never a user's file, never another run's logs, whatever --logging_dir is."""

import json
import os

import pytest
from conftest import DRIVERS, run_entry_point, run_in_process, tiny_args
from test_distributed import as_rank_1  # noqa: F401 (a fixture)

from vae_trainer import checkpoint as ckpt
from vae_trainer import output_dir as run_dir


class Args:
    def __init__(self, output_dir, logging_dir=None, resume=None, overwrite=False):
        self.output_dir, self.resume_from_checkpoint, self.overwrite_output_dir = str(output_dir), resume, overwrite
        self.logging_dir = str(logging_dir or os.path.join(output_dir, "logs"))


def write_record(output_dir, logging_dir, name="vdlrecords.1.log"):
    """A VisualDL record file as a run in output_dir writes it (and notes it, as TrainMonitor does)."""
    os.makedirs(logging_dir, exist_ok=True)
    path = os.path.join(logging_dir, name)
    open(path, "w").close()
    run_dir.note_log_file(str(output_dir), path)
    return path


def earlier_run(output_dir, logging_dir=None):
    """Folders and files an earlier run leaves: checkpoints (one unfinished), exports, evaluations, VisualDL logs."""
    for step in (2, 4):
        os.makedirs(os.path.join(output_dir, f"checkpoint-{step}"))
        with open(os.path.join(output_dir, f"checkpoint-{step}", ckpt.TRAINER_STATE_NAME), "w") as f:
            json.dump({"global_step": step}, f)
    os.makedirs(os.path.join(output_dir, "checkpoint-6.tmp"))
    for name in ("vae", "vae_raw", "discriminator"):
        os.makedirs(os.path.join(output_dir, name))
    with open(os.path.join(output_dir, "eval_metrics.jsonl"), "w") as f:  # its evaluations
        f.write('{"step": 2, "metrics": {"psnr": 20.0}}\n')
    write_record(output_dir, logging_dir or os.path.join(output_dir, "logs"))
    os.makedirs(os.path.join(output_dir, "launch_logs"))  # the launcher's, being written by this very launch
    open(os.path.join(output_dir, "notes.txt"), "w").close()  # the user's


def test_refused_without_a_choice_and_nothing_is_touched(tmp_path):
    earlier_run(tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(FileExistsError) as refused:
        run_dir.prepare_output_dir(Args(tmp_path))
    message = str(refused.value)
    assert "--resume_from_checkpoint latest" in message and "--overwrite_output_dir" in message
    assert "checkpoint-2" in message and "checkpoint-4" in message
    assert sorted(os.listdir(tmp_path)) == before


def test_overwrite_clears_checkpoints_exports_and_logs_only(tmp_path):
    earlier_run(tmp_path)
    run_dir.prepare_output_dir(Args(tmp_path, overwrite=True))
    assert sorted(os.listdir(tmp_path)) == ["launch_logs", "notes.txt"]  # logs/ was ours and is empty: gone


def test_overwrite_keeps_a_users_files_when_the_log_folder_is_the_output_folder(tmp_path):
    """--logging_dir == --output_dir: the old code deleted the whole folder, the user's files with it."""
    out = tmp_path / "out"
    earlier_run(out, logging_dir=str(out))
    (out / "my_dataset").mkdir()
    (out / "my_dataset" / "img.png").write_bytes(b"the user's")
    (out / "vdlrecords.99.log").write_bytes(b"a record file no run of this folder noted")
    run_dir.prepare_output_dir(Args(out, logging_dir=out, overwrite=True))
    assert sorted(os.listdir(out)) == ["launch_logs", "my_dataset", "notes.txt", "vdlrecords.99.log"]
    assert (out / "my_dataset" / "img.png").read_bytes() == b"the user's"


def test_overwrite_keeps_another_runs_records_in_a_shared_log_folder(tmp_path):
    """A --logging_dir outside --output_dir, shared with another run: only our own record file goes."""
    shared_logs = tmp_path / "all_runs"
    earlier_run(tmp_path / "out", logging_dir=str(shared_logs))
    other = write_record(tmp_path / "other_out", shared_logs, name="vdlrecords.2.log")
    open(shared_logs / "other_run.txt", "w").close()
    run_dir.prepare_output_dir(Args(tmp_path / "out", logging_dir=shared_logs, overwrite=True))
    assert sorted(os.listdir(shared_logs)) == ["other_run.txt", os.path.basename(other)]
    assert os.path.isfile(tmp_path / "other_out" / run_dir.LOG_FILES_NAME)  # the other run's list is its own


def test_an_edited_log_list_deletes_no_other_file(tmp_path):
    earlier_run(tmp_path)
    with open(tmp_path / run_dir.LOG_FILES_NAME, "a") as f:
        f.write("notes.txt\n../outside.txt\n")
    (tmp_path.parent / "outside.txt").write_text("keep")
    run_dir.prepare_output_dir(Args(tmp_path, overwrite=True))
    assert sorted(os.listdir(tmp_path)) == ["launch_logs", "notes.txt"]
    assert (tmp_path.parent / "outside.txt").read_text() == "keep"


def test_resume_and_empty_folders_start_without_question(tmp_path):
    earlier_run(tmp_path)
    before = sorted(os.listdir(tmp_path))
    run_dir.prepare_output_dir(Args(tmp_path, resume="latest"))
    assert sorted(os.listdir(tmp_path)) == before
    run_dir.prepare_output_dir(Args(tmp_path / "new"))  # does not exist yet
    only_logs = tmp_path / "crashed_before_first_save"
    os.makedirs(only_logs / "logs")
    run_dir.prepare_output_dir(Args(only_logs))


def _input_cases(out):
    """(flag, path as the user gives it, path the message names) of inputs inside what clearing deletes."""
    os.symlink(out / "discriminator", out.parent / "disc_link")
    part = out / "checkpoint-2" / "part-0.gz"  # a part file a user parked in a checkpoint folder
    part.write_bytes(b"")
    (out.parent / "mine.filelist").write_text(f"{part}\n")
    os.symlink(out / "checkpoint-2", out.parent / "parked")  # a part reached through a symlinked folder
    (out.parent / "linked.filelist").write_text(f"{out.parent / 'parked' / 'part-0.gz'}\n")
    return [
        ("--pretrained_model_name_or_path", "out/vae/", "out/vae"),  # relative, trailing slash
        ("--init_from_ckpt", str(out / "checkpoint-4" / "model_state.pdparams"), "checkpoint-4"),
        ("--discriminator_path", str(out.parent / "disc_link"), "discriminator"),  # a symlink into OUT
        ("--file_list", str(out.parent / "mine.filelist"), str(part)),  # a part the list names
        ("--file_list", str(out.parent / "linked.filelist"), "checkpoint-2"),
        ("--eval_file_list", str(out / "vae"), "vae"),
    ]


def test_overwrite_refuses_before_deleting_what_the_run_reads(tmp_path, monkeypatch):
    """Issue 17.2: `--pretrained_model_name_or_path OUT/vae --output_dir OUT --overwrite_output_dir` deleted
    OUT/vae, then failed "No pretrained VAE". Now every input inside what clearing deletes is refused first."""
    out = tmp_path / "out"
    earlier_run(str(out))
    monkeypatch.chdir(tmp_path)
    for flag, given, named in _input_cases(out):
        before = snapshot(out)
        with pytest.raises(FileExistsError) as refused:
            run_dir.prepare_output_dir(Args(out, overwrite=True), {flag: given})
        message = str(refused.value)
        assert f"{flag} {given}" in message and named in message and "Nothing was deleted" in message, message
        assert "--resume_from_checkpoint latest" in message and "cp -r" in message
        assert snapshot(out) == before, flag


def test_overwrite_clears_when_the_inputs_are_elsewhere(tmp_path):
    out = tmp_path / "out"
    earlier_run(str(out))
    (out / "my_parts").mkdir()  # the user's own data inside OUTPUT_DIR is never deleted, so may be read
    (out / "my_parts" / "part-0.gz").write_bytes(b"")
    (out / "my.filelist").write_text("my_parts/part-0.gz\n")
    reads = {"--pretrained_model_name_or_path": str(tmp_path / "vae"), "--file_list": str(out / "my.filelist"),
             "--eval_file_list": "pipe:cat out/vae/x.tar", "--init_from_ckpt": None}
    run_dir.prepare_output_dir(Args(out, overwrite=True), reads)
    assert sorted(os.listdir(out)) == ["launch_logs", "my.filelist", "my_parts", "notes.txt"]


def test_run_inputs_name_the_pretrained_subfolder_and_not_a_resumed_checkpoint():
    """A resumed run never clears its folder (prepare_output_dir returns first), so the resumed checkpoint is
    not among the inputs to protect."""
    from types import SimpleNamespace

    model = SimpleNamespace(pretrained_model_name_or_path="OUT", subfolder="vae", vae_config_file=None,
                            init_from_ckpt=None, discriminator_path=None, lpips_weights=None)
    data = SimpleNamespace(file_list="a.filelist", eval_file_list=None, inception_weights=None)
    reads = run_dir.run_inputs(model, data)
    assert reads["--pretrained_model_name_or_path"] == os.path.join("OUT", "vae")
    assert "--resume_from_checkpoint" not in reads and reads["--file_list"] == "a.filelist"


@pytest.mark.parametrize("rank_0_refuses", [True, False])
def test_rank_1_takes_rank_zeros_decision_and_deletes_nothing(as_rank_1, tmp_path, monkeypatch, rank_0_refuses):
    """This process as rank 1 of 2 (the collectives simulated: test_distributed.py); the real two-process
    agreement is proven by tests/test_rank_failure.py."""
    earlier_run(tmp_path)
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(run_dir, "check_shared", lambda output_dir: None)  # its own test: test_distributed.py
    as_rank_1.failure = (FileExistsError, "--output_dir holds an earlier run") if rank_0_refuses else None
    if rank_0_refuses:  # rank 1 alone would see nothing to protect: only rank 0's view counts
        with pytest.raises(FileExistsError, match="rank 0: .*earlier run"):
            run_dir.prepare_output_dir(Args(tmp_path))
    else:
        run_dir.prepare_output_dir(Args(tmp_path, overwrite=True))
    assert sorted(os.listdir(tmp_path)) == before  # rank 0 alone deletes


# ---------------------------------------------------------------- both entry points, for real
def run_args(file_list, output_dir, **overrides):
    return tiny_args(file_list, output_dir, perceptual_weight=0, use_ema="false", image_logging_steps=0,
                     save_steps=1, **overrides)


def snapshot(output_dir):
    """Every path under output_dir with its modification time."""
    found = {}
    for root, _, files in os.walk(output_dir):
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, output_dir)] = os.stat(path).st_mtime_ns
    return found


@pytest.mark.parametrize("driver", DRIVERS)
def test_both_entry_points_refuse_an_earlier_run_or_deleting_an_input_before_writing(photo_filelist, tmp_path,
                                                                                     driver):
    earlier_run(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as refused:
        run_in_process(driver, run_args(photo_filelist, tmp_path, max_steps=1))
    message = str(refused.value.code)  # one `error:` line (SystemExit's message), no traceback
    assert message.startswith("error:") and "--resume_from_checkpoint" in message
    assert "--overwrite_output_dir" in message
    from_export = run_args(photo_filelist, tmp_path, max_steps=1, overwrite_output_dir="true",
                           pretrained_model_name_or_path=os.path.join(tmp_path, "vae") + os.sep)
    with pytest.raises(SystemExit) as refused:
        run_in_process(driver, from_export)
    assert "--overwrite_output_dir would delete" in str(refused.value.code)
    assert "--pretrained_model_name_or_path" in str(refused.value.code)
    assert snapshot(tmp_path) == before


def test_overwrite_starts_clean_after_a_real_run(photo_filelist, tmp_path):
    """One entry point end to end (both entry points' refusals: above, in-process)."""
    driver = DRIVERS[1]
    output_dir = str(tmp_path / "out")
    run_entry_point(driver, run_args(photo_filelist, output_dir, max_steps=2))
    first = snapshot(output_dir)
    assert "checkpoint-2/trainer_state.json" in first and any(p.startswith("logs/vdlrecords") for p in first)

    # A shorter new run: the old checkpoint-2 would otherwise survive and win `latest`; --report_to none
    # writes no logs, so no log folder may remain either.
    run_entry_point(driver, run_args(photo_filelist, output_dir, max_steps=1, overwrite_output_dir="true",
                                     report_to="none"))
    assert [step for step, _ in ckpt.list_checkpoints(output_dir)] == [1]
    assert not os.path.exists(os.path.join(output_dir, "logs"))
    assert ckpt.resolve_resume(output_dir, "latest").endswith("checkpoint-1")
    second = snapshot(output_dir)
    assert all(second[path] > first.get(path, 0) for path in second)  # all of it is the new run's
