"""Crash safety of checkpoints: SIGKILL in the middle of a save, resume from the newest complete one, rotation."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, run_entry_point, run_in_process, tiny_args, vae_weights

from vae_trainer import checkpoint as ckpt

MAX_STEPS = 5


def crash_args(file_list, output_dir, **overrides):
    """A model big enough (vae_tiny, 64 px) that a save takes a while, and a save after every step."""
    settings = {"vae_config_file": "configs/vae_tiny.json", "resolution": 64, "per_device_train_batch_size": 1,
                "max_steps": MAX_STEPS, "save_steps": 1, "image_logging_steps": 0, **overrides}
    return tiny_args(file_list, output_dir, **settings)


def save_in_progress(output_dir: str):
    """Step N of a `checkpoint-N.tmp` that already holds files and is newer than a complete checkpoint, else None."""
    complete = [step for step, _ in ckpt.list_checkpoints(output_dir)]
    names = os.listdir(output_dir) if os.path.isdir(output_dir) and complete else []
    pending = [int(n[len("checkpoint-"):-len(".tmp")]) for n in names if n.startswith("checkpoint-") and n.endswith(".tmp")]
    for step in sorted(pending, reverse=True):
        try:
            if step > max(complete) and os.listdir(ckpt.checkpoint_path(output_dir, step) + ".tmp"):
                return step  # files are being written into it
        except FileNotFoundError:  # renamed to checkpoint-N just now
            pass
    return None


def kill_during_save(driver: str, args, output_dir: str, log_path: str, attempts: int = 4, timeout: float = 60) -> int:
    """Run `driver` and SIGKILL its process group while a checkpoint is being written; return that step.

    The save can finish between seeing `.tmp` and the kill landing; then the run is started over.
    """
    for _ in range(attempts):
        shutil.rmtree(output_dir, ignore_errors=True)
        with open(log_path, "w") as log:
            process = subprocess.Popen([sys.executable, os.path.join(REPO, driver), *map(str, args)], cwd=REPO,
                                       env={**os.environ, "PYTHONPATH": REPO}, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        deadline, step = time.monotonic() + timeout, None
        try:
            while step is None and process.poll() is None and time.monotonic() < deadline:
                step = save_in_progress(output_dir)
                time.sleep(0.001)
        finally:
            stop(process)
        if step is not None and os.path.isdir(ckpt.checkpoint_path(output_dir, step) + ".tmp"):
            return step
    pytest.fail(f"never caught {driver} in the middle of a save:\n" + open(log_path).read()[-3000:])


def stop(process: subprocess.Popen) -> None:
    """SIGKILL the whole process group (the launcher's children too, if any)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
    process.wait()


def assert_checkpoint_loads(path: str, step: int, model: paddle.nn.Layer) -> None:
    """Every file of the checkpoint reads back; the weights fit the model and match the recorded fingerprint."""
    from vae_trainer.distributed import parameter_fingerprint

    with open(os.path.join(path, ckpt.TRAINER_STATE_NAME)) as f:
        assert json.load(f)["global_step"] == step
    for name in os.listdir(path):
        if name.endswith((".pdparams", ".pdopt")):
            assert paddle.load(os.path.join(path, name)), name
    ckpt.load_model_state(path, model)  # raises on missing or unexpected keys
    rank_state = ckpt.load_rank_state(path)
    np.testing.assert_array_equal(parameter_fingerprint(model), rank_state["parameter_fingerprint"])


def build_model(args):
    from vae_trainer.argument_parser import parse_arguments
    from vae_trainer.build import build_networks

    model_args, _, loss_args, training_args = parse_arguments([*map(str, args), "--perceptual_weight", "0"])
    return build_networks(model_args, loss_args, training_args).model


def test_sigkill_during_save_then_resume_latest(photo_filelist, tmp_path, driver=DRIVERS[1]):
    """One entry point: both save through checkpoint.save_checkpoint, and resume each other's checkpoints to
    the same numbers (tests/test_train_e2e.py)."""
    paddle.set_device("cpu")
    output_dir = str(tmp_path / "out")
    args = crash_args(photo_filelist, output_dir)
    killed_step = kill_during_save(driver, args, output_dir, str(tmp_path / "killed.log"))

    # The half-written checkpoint is invisible: `latest` is the newest complete one, and all complete ones load.
    assert [step for step, _ in ckpt.list_checkpoints(output_dir)] == list(range(1, killed_step))
    assert ckpt.resolve_resume(output_dir, "latest") == ckpt.checkpoint_path(output_dir, killed_step - 1)
    model = build_model(args)
    for step, path in ckpt.list_checkpoints(output_dir):
        assert_checkpoint_loads(path, step, model)

    # A leftover file in the stale .tmp must not survive into the re-saved checkpoint.
    stale = ckpt.checkpoint_path(output_dir, killed_step) + ".tmp"
    open(os.path.join(stale, "leftover.bin"), "w").close()
    run_entry_point(driver, crash_args(photo_filelist, output_dir, resume_from_checkpoint="latest"))

    names = os.listdir(output_dir)
    assert not [n for n in names if n.endswith((".tmp", ".old"))], names
    assert [step for step, _ in ckpt.list_checkpoints(output_dir)] == list(range(1, MAX_STEPS + 1))
    resaved = ckpt.checkpoint_path(output_dir, killed_step)
    assert "leftover.bin" not in os.listdir(resaved)
    assert_checkpoint_loads(resaved, killed_step, model)

    # The run picked up where the complete checkpoint left off: same weights as a run never killed.
    straight = str(tmp_path / "straight")
    run_in_process(driver, crash_args(photo_filelist, straight))
    resumed_weights, straight_weights = vae_weights(output_dir), vae_weights(straight)
    for name, value in straight_weights.items():
        np.testing.assert_array_equal(resumed_weights[name], value, err_msg=name)


# ---- rotation and `latest`, on folders made by hand


def fake_checkpoint(output_dir, step: int, complete: bool = True, suffix: str = "") -> str:
    path = ckpt.checkpoint_path(str(output_dir), step) + suffix
    os.makedirs(path)
    if complete:
        with open(os.path.join(path, ckpt.TRAINER_STATE_NAME), "w") as f:
            json.dump({"global_step": step}, f)
    return path


def steps_on_disk(output_dir) -> list:
    return [step for step, _ in ckpt.list_checkpoints(str(output_dir))]


def test_latest_never_picks_unfinished_folders(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 3)
    fake_checkpoint(tmp_path, 10, suffix=".tmp")  # killed mid-save, even with its trainer_state already written
    fake_checkpoint(tmp_path, 11, suffix=".old")  # killed mid-deletion
    fake_checkpoint(tmp_path, 12, complete=False)  # no trainer_state.json: not a checkpoint
    assert steps_on_disk(tmp_path) == [2, 3]  # numeric order, not string order
    assert ckpt.resolve_resume(str(tmp_path), "latest") == ckpt.checkpoint_path(str(tmp_path), 3)
    with pytest.raises(FileNotFoundError):
        ckpt.resolve_resume(str(tmp_path), ckpt.checkpoint_path(str(tmp_path), 10) + ".tmp")
    assert ckpt.resolve_resume(str(tmp_path / "empty"), "latest") is None


def test_rotation_keeps_the_newest_and_the_kept_one(tmp_path):
    for step in (2, 4, 6, 8, 10):
        fake_checkpoint(tmp_path, step)
    ckpt.rotate_checkpoints(str(tmp_path), 2, keep=ckpt.checkpoint_path(str(tmp_path), 4))
    assert steps_on_disk(tmp_path) == [4, 8, 10]
    ckpt.rotate_checkpoints(str(tmp_path), 2)
    assert steps_on_disk(tmp_path) == [8, 10]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-8"]  # nothing half-deleted left behind
    ckpt.rotate_checkpoints(str(tmp_path), None)
    ckpt.rotate_checkpoints(str(tmp_path), 0)
    assert steps_on_disk(tmp_path) == [8, 10]


def test_rotation_keeps_the_kept_one_named_through_a_link(tmp_path):
    # A resumed run's best checkpoint, saved as OUTPUT_DIR spelled through a symlink (e.g. /scratch -> /data/scratch).
    run = tmp_path / "run"
    run.mkdir()
    for step in (2, 4, 6, 8):
        fake_checkpoint(run, step)
    (tmp_path / "link").symlink_to(run)
    ckpt.rotate_checkpoints(str(run), 1, keep=ckpt.checkpoint_path(str(tmp_path / "link"), 2))
    assert steps_on_disk(run) == [2, 8]


class _State:
    """Stands in for optimizers and the TrainerState: what save_checkpoint calls on them."""

    def __init__(self, step):
        self.step = step

    def state_dict(self):
        return {"step": paddle.to_tensor([self.step])}

    def save_to_json(self, path):
        with open(path, "w") as f:
            json.dump({"global_step": self.step}, f)


def test_save_checkpoint_rotates_and_cleans_up_interrupted_folders(tmp_path):
    paddle.set_device("cpu")
    output_dir = str(tmp_path)
    model = paddle.nn.Linear(2, 2)
    stale_tmp = fake_checkpoint(tmp_path, 7, suffix=".tmp")
    stale_old = fake_checkpoint(tmp_path, 1, suffix=".old")
    for step in range(1, 6):
        ckpt.save_checkpoint(output_dir, step, model=model, stateful={"optimizer.pdopt": _State(step)},
                             trainer_state=_State(step), rank_state={"step": step}, save_total_limit=2)
    assert not os.path.exists(stale_tmp) and not os.path.exists(stale_old)
    assert sorted(os.listdir(output_dir)) == ["checkpoint-4", "checkpoint-5"]
    saved = paddle.load(os.path.join(output_dir, "checkpoint-5", "optimizer.pdopt"))
    assert saved["step"].item() == 5
    assert paddle.load(os.path.join(output_dir, "checkpoint-4", "rank_state_0.pdparams"))["step"] == 4

    # Saving a step again replaces the folder as a whole: nothing of the old one survives.
    open(os.path.join(output_dir, "checkpoint-5", "from_before.bin"), "w").close()
    ckpt.save_checkpoint(output_dir, 5, model=model, stateful={}, trainer_state=_State(5), rank_state={})
    assert sorted(os.listdir(os.path.join(output_dir, "checkpoint-5"))) == [
        ckpt.MANIFEST_NAME, ckpt.MODEL_NAME, "rank_state_0.pdparams", ckpt.TRAINER_STATE_NAME]


def test_rank_state_restores_every_random_stream(tmp_path):
    """RNG states survive save and load (numpy's uint32 key included), so a resumed run draws the same numbers."""
    import random

    paddle.set_device("cpu")
    paddle.seed(1), np.random.seed(2), random.seed(3)
    model = paddle.nn.Linear(2, 2)
    path = ckpt.save_checkpoint(str(tmp_path), 1, model=model, stateful={}, trainer_state=_State(1),
                                rank_state={"rng": ckpt.rng_state()})
    draws = [paddle.rand([4]).numpy(), np.random.rand(4), random.random()]
    ckpt.set_rng_state(ckpt.load_rank_state(path)["rng"])
    again = [paddle.rand([4]).numpy(), np.random.rand(4), random.random()]
    np.testing.assert_array_equal(draws[0], again[0])
    np.testing.assert_array_equal(draws[1], again[1])
    assert draws[2] == again[2]
    assert paddle.load(os.path.join(path, "rank_state_0.pdparams"))["rng"]  # plain paddle.load works too
