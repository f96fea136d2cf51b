"""Rolling back is a branch (checkpoint.set_aside_later): resuming from a checkpoint that is not the newest moves
the later ones to OUTPUT_DIR/abandoned/, where `latest`, rotation and --overwrite_output_dir's listing of
checkpoints do not count them; and a --learning_rate given on resume applies from the first resumed step.
Both entry points end to end: tests/test_train_e2e.py (the other entry point's checkpoint, resumed)."""

import json
import logging
import os

import paddle
import pytest

from vae_trainer import checkpoint as ckpt
from vae_trainer import output_dir as run_dir


def fake_run(output_dir, steps=(2, 4, 6, 8)):
    """Checkpoints (as list_checkpoints sees them) and one evaluation line per checkpoint."""
    for step in steps:
        os.makedirs(os.path.join(output_dir, f"checkpoint-{step}"), exist_ok=True)
        with open(os.path.join(output_dir, f"checkpoint-{step}", ckpt.TRAINER_STATE_NAME), "w") as f:
            json.dump({"global_step": step}, f)
    with open(os.path.join(output_dir, run_dir.EVAL_METRICS_NAME), "w") as f:
        f.writelines(json.dumps({"step": step, "metrics": {"psnr": 20.0 + step}}) + "\n" for step in steps)


def eval_steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path, caplog):
    fake_run(tmp_path)
    with caplog.at_level(logging.WARNING):
        moved = ckpt.set_aside_later(str(tmp_path), str(tmp_path / "checkpoint-4"))
    assert [step for step, _ in ckpt.list_checkpoints(str(tmp_path))] == [2, 4]
    assert ckpt.resolve_resume(str(tmp_path), "latest") == str(tmp_path / "checkpoint-4")
    (branch,) = os.listdir(tmp_path / ckpt.ABANDONED_DIR)
    assert branch.endswith("-after-checkpoint-4")
    assert moved == [str(tmp_path / ckpt.ABANDONED_DIR / branch / name) for name in ("checkpoint-6", "checkpoint-8")]
    assert all(os.path.isfile(os.path.join(path, ckpt.TRAINER_STATE_NAME)) for path in moved)  # whole, by path
    assert eval_steps(tmp_path / run_dir.EVAL_METRICS_NAME) == [2, 4]
    assert eval_steps(tmp_path / ckpt.ABANDONED_DIR / branch / run_dir.EVAL_METRICS_NAME) == [6, 8]
    assert "checkpoint-6, checkpoint-8" in caplog.text and branch in caplog.text

    # Rotation keeps the newest of the new branch only; the abandoned ones are neither counted nor deleted.
    ckpt.rotate_checkpoints(str(tmp_path), 1)
    assert [step for step, _ in ckpt.list_checkpoints(str(tmp_path))] == [4]
    assert all(os.path.isdir(path) for path in moved)


def test_resuming_the_newest_or_nothing_moves_nothing(tmp_path):
    fake_run(tmp_path)
    assert ckpt.set_aside_later(str(tmp_path), str(tmp_path / "checkpoint-8")) == []
    assert ckpt.set_aside_later(str(tmp_path), None) == []
    assert not os.path.exists(tmp_path / ckpt.ABANDONED_DIR)
    assert [step for step, _ in ckpt.list_checkpoints(str(tmp_path))] == [2, 4, 6, 8]


def test_resuming_a_checkpoint_from_elsewhere_sets_all_of_the_folders_checkpoints_aside(tmp_path, caplog):
    """An abandoned branch's checkpoint (or another run's) resumed into OUT: OUT's own checkpoints belong to
    another branch, all of them; left in place, the new run's checkpoint-10 would sit beside them and `latest`
    and rotation would mix the branches again."""
    out = tmp_path / "out"
    fake_run(out)
    first = os.path.dirname(ckpt.set_aside_later(str(out), str(out / "checkpoint-4"))[0])
    fake_run(out, steps=(2, 4, 6))  # the new branch went on to checkpoint-6 (and evaluated at 2, 4, 6)
    with caplog.at_level(logging.WARNING):
        moved = ckpt.set_aside_later(str(out), os.path.join(first, "checkpoint-8"))  # back to the old branch
    assert ckpt.list_checkpoints(str(out)) == [] and ckpt.resolve_resume(str(out), "latest") is None
    second = os.path.dirname(moved[0])
    assert second != first and second.endswith("-before-resuming-checkpoint-8")
    assert [os.path.basename(path) for path in moved] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert eval_steps(os.path.join(second, run_dir.EVAL_METRICS_NAME)) == [2, 4, 6]
    assert eval_steps(out / run_dir.EVAL_METRICS_NAME) == []
    assert "checkpoint-2, checkpoint-4, checkpoint-6" in caplog.text

    other = tmp_path / "other"  # another run's folder: the same
    fake_run(other, steps=(3,))
    fake_run(out, steps=(5,))
    moved = ckpt.set_aside_later(str(out), str(other / "checkpoint-3"))
    assert [os.path.basename(path) for path in moved] == ["checkpoint-5"] and ckpt.list_checkpoints(str(out)) == []
    assert ckpt.list_checkpoints(str(other)) == [(3, str(other / "checkpoint-3"))]  # the resumed one stays put


def test_two_rollbacks_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(ckpt, "time", SimpleNamespace(strftime=lambda *args: "20250101-000000"))  # one second
    fake_run(tmp_path)
    first = ckpt.set_aside_later(str(tmp_path), str(tmp_path / "checkpoint-4"))
    fake_run(tmp_path, steps=(6,))  # the new branch's checkpoint-6, abandoned in turn
    second = ckpt.set_aside_later(str(tmp_path), str(tmp_path / "checkpoint-4"))
    assert sorted(os.listdir(tmp_path / ckpt.ABANDONED_DIR)) == ["20250101-000000-after-checkpoint-4",
                                                                 "20250101-000000-after-checkpoint-4-2"]
    assert os.path.dirname(first[0]).endswith("-4") and os.path.dirname(second[0]).endswith("-4-2")
    assert all(os.path.isfile(os.path.join(path, ckpt.TRAINER_STATE_NAME)) for path in first + second)


def test_an_unreadable_evaluation_line_stays_where_it_is(tmp_path):
    """A run killed while appending to eval_metrics.jsonl leaves a half-written last line: setting the later
    checkpoints aside must not stop on it (rank 0 would raise before the barrier while the others wait)."""
    fake_run(tmp_path)
    with open(tmp_path / run_dir.EVAL_METRICS_NAME, "a") as f:
        f.write('{"step": 9, "metr')
    moved = ckpt.set_aside_later(str(tmp_path), str(tmp_path / "checkpoint-4"))
    lines = (tmp_path / run_dir.EVAL_METRICS_NAME).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[:-1]] == [2, 4] and lines[-1] == '{"step": 9, "metr'
    assert eval_steps(os.path.join(os.path.dirname(moved[0]), run_dir.EVAL_METRICS_NAME)) == [6, 8]


def test_overwrite_deletes_abandoned_branches_too(tmp_path):
    """They are our run's files: starting over removes them with the rest."""
    fake_run(tmp_path)
    ckpt.set_aside_later(str(tmp_path), str(tmp_path / "checkpoint-2"))

    class Args:
        output_dir, logging_dir, resume_from_checkpoint, overwrite_output_dir = str(tmp_path), None, None, True

    run_dir.prepare_output_dir(Args())
    assert os.listdir(tmp_path) == []


def test_a_learning_rate_given_on_resume_applies_from_the_first_resumed_step(tmp_path):
    """Paddle's scheduler state holds the rate of the next step (`last_lr`), computed from the saved run's peak
    rate: without a recompute the first step after a rollback with a lower --learning_rate used the old rate."""
    from types import SimpleNamespace

    from vae_trainer.optim import build_scheduler

    args = SimpleNamespace(warmup_steps=0, warmup_ratio=0.0, lr_scheduler_type="linear", num_cycles=0.5,
                           lr_end=1e-7, power=1.0)
    saved = build_scheduler(args, 1e-3, 8)
    for _ in range(4):
        saved.step()
    paddle.save(saved.state_dict(), str(tmp_path / "scheduler.pdparams"))
    same, lower = build_scheduler(args, 1e-3, 8), build_scheduler(args, 1e-4, 8)
    ckpt.load_stateful(str(tmp_path), {"scheduler.pdparams": same})
    assert same.last_lr == saved.last_lr  # unchanged flags: bit for bit the saved rate (exact resume)
    ckpt.load_stateful(str(tmp_path), {"scheduler.pdparams": lower})
    assert lower.last_lr == pytest.approx(saved.last_lr / 10)


def test_an_evaluation_after_a_killed_runs_half_written_line_still_records(tmp_path):
    """A run killed while another tool appended to eval_metrics.jsonl leaves a half line: the next evaluation
    keeps the readable earlier lines, drops the broken tail and adds its own, instead of raising."""
    import json
    from types import SimpleNamespace

    from vae_trainer.evaluation import TrainingEvaluator

    path = tmp_path / "eval_metrics.jsonl"
    path.write_text(json.dumps({"step": 2, "psnr": 1.0}) + "\n" + json.dumps({"step": 6, "psnr": 3.0}) + "\n"
                    + '{"step": 8, "ps')
    evaluator = TrainingEvaluator.__new__(TrainingEvaluator)  # only _append_record's state
    evaluator.args = SimpleNamespace(output_dir=str(tmp_path))
    evaluator._append_record({"step": 4, "psnr": 2.0})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 4]


def record_fsyncs_and_renames(monkeypatch):
    """os.fsync and os.replace, recorded in order by path (a descriptor's path read from /proc). A real crash cannot
    be simulated here: what is checked is that the file and both folders are fsynced, in the order durability needs."""
    events, fsync, replace = [], os.fsync, os.replace

    def recorded_fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        return fsync(descriptor)

    def recorded_replace(source, target):
        events.append(("rename", os.path.realpath(source), os.path.realpath(os.path.dirname(target)) + "/"
                       + os.path.basename(target)))
        return replace(source, target)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return events


def assert_renames_durable(events):
    """A renamed file was fsynced before its rename; after it, both folders the rename touched were fsynced."""
    renames = [(index, event) for index, event in enumerate(events) if event[0] == "rename"]
    assert renames
    for index, (_, source, target) in renames:
        later = {event[1] for event in events[index:] if event[0] == "fsync"}
        assert {os.path.dirname(source), os.path.dirname(target)} <= later, (source, target, events)
        if not os.path.isdir(target):
            assert ("fsync", source) in events[:index], (source, events)


def test_eval_metrics_jsonl_is_fsynced_with_its_folder(tmp_path, monkeypatch):
    """Issue 38.2: rewritten through a temporary file and os.replace without fsync, eval_metrics.jsonl could be
    empty after a node crash (the best-model choice and the evaluation history lost)."""
    from types import SimpleNamespace

    from vae_trainer.evaluation import TrainingEvaluator

    fake_run(tmp_path)
    events = record_fsyncs_and_renames(monkeypatch)
    evaluator = TrainingEvaluator.__new__(TrainingEvaluator)  # only _append_record's state
    evaluator.args = SimpleNamespace(output_dir=str(tmp_path))
    evaluator._append_record({"step": 5, "psnr": 2.0})
    path = os.path.realpath(tmp_path / run_dir.EVAL_METRICS_NAME)
    assert events == [("fsync", path + ".tmp"), ("rename", path + ".tmp", path), ("fsync", os.path.dirname(path))]
    assert eval_steps(path) == [2, 4, 5]


def test_a_rollback_is_fsynced_before_training_goes_on(tmp_path, monkeypatch):
    """Issue 38.3: the renames that set the later checkpoints aside were not fsynced; after a crash they could come
    back, and `latest` would resume the branch the user rolled back from."""
    fake_run(tmp_path)
    events = record_fsyncs_and_renames(monkeypatch)
    moved = ckpt.set_aside_later(str(tmp_path), str(tmp_path / "checkpoint-4"))
    branch = os.path.realpath(os.path.dirname(moved[0]))
    assert_renames_durable(events)
    synced = {event[1] for event in events if event[0] == "fsync"}
    # The new folders' entries too (abandoned/ in OUTPUT_DIR, the branch in abandoned/), and the moved evaluations.
    assert {branch, os.path.dirname(branch), os.path.realpath(tmp_path)} <= synced
    assert os.path.join(branch, run_dir.EVAL_METRICS_NAME) in {event[2] for event in events if event[0] == "rename"}
