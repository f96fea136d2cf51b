"""Checkpoints a node crash cannot corrupt, and resuming on another topology (issue 29, items 4 and 5):
fsync before the rename, a manifest that `latest` and explicit resumes verify, the current device's RNG only,
a resume with another number of ranks. Crash safety against a killed process: tests/test_crash_safety.py."""

import logging
import os
import random
import shutil

import numpy as np
import paddle
import pytest
from conftest import run_in_process, tiny_args

from test_crash_safety import _State

from vae_trainer import checkpoint as ckpt
from vae_trainer.disk import written_atomically


def save(output_dir, step, rank_state=None, **options) -> str:
    return ckpt.save_checkpoint(str(output_dir), step, model=paddle.nn.Linear(2, 2),
                                stateful={"optimizer.pdopt": _State(step)}, trainer_state=_State(step),
                                rank_state=rank_state if rank_state is not None else {"rng": ckpt.rng_state()},
                                **options)


def test_latest_skips_an_incomplete_checkpoint_and_an_explicit_path_to_it_is_refused(tmp_path, caplog):
    paddle.set_device("cpu")
    legacy, missing, truncated = (save(tmp_path, step) for step in (1, 2, 3))
    os.remove(os.path.join(legacy, ckpt.MANIFEST_NAME))  # saved by an earlier version: still resumes
    with open(os.path.join(truncated, ckpt.MODEL_NAME), "r+b") as f:
        f.truncate(10)  # a node crash before the data reached the disk
    with caplog.at_level(logging.WARNING):
        assert ckpt.resolve_resume(str(tmp_path), "latest") == missing
    assert "checkpoint-3" in caplog.text and ckpt.MODEL_NAME in caplog.text
    with pytest.raises(FileNotFoundError, match=r"checkpoint-3: not a complete checkpoint.*model_state.pdparams"):
        ckpt.resolve_resume(str(tmp_path), truncated)

    os.remove(os.path.join(missing, "rank_state_0.pdparams"))
    assert ckpt.resolve_resume(str(tmp_path), "latest") == legacy
    with pytest.raises(FileNotFoundError, match="rank_state_0.pdparams is missing"):
        ckpt.resolve_resume(str(tmp_path), missing)
    assert ckpt.resolve_resume(str(tmp_path), legacy) == legacy
    ckpt.rotate_checkpoints(str(tmp_path), 1)  # the newest complete one counts: nothing to delete
    assert [step for step, _ in ckpt.list_checkpoints(str(tmp_path), complete=False)] == [1, 2, 3]

    # A legacy rank state (paddle.get_rng_state()'s list) still restores the random streams.
    state = ckpt.load_rank_state(legacy)
    state["rng"]["paddle"] = paddle.get_rng_state()
    draws = paddle.rand([3]).numpy()
    ckpt.set_rng_state(state["rng"])
    np.testing.assert_array_equal(paddle.rand([3]).numpy(), draws)


def test_manifest_names_every_file_and_its_size(tmp_path):
    paddle.set_device("cpu")
    path = save(tmp_path, 1, configs={ckpt.VAE_CONFIG_NAME: {"a": 1}})
    manifest = ckpt.read_json(os.path.join(path, ckpt.MANIFEST_NAME))
    assert manifest["files"] == {name: os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)
                                 if name != ckpt.MANIFEST_NAME}
    assert len(manifest["files"]) == 5


def test_files_then_folder_then_parent_are_fsynced(tmp_path, monkeypatch):
    paddle.set_device("cpu")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    path = save(tmp_path, 1)
    tmp = path + ".tmp"
    files = [p for p in synced if os.path.dirname(p) == tmp]
    assert sorted(os.path.basename(p) for p in files) == sorted(os.listdir(path))
    assert synced[-2:] == [tmp, str(tmp_path)]  # the folder before its rename, the parent after it

    synced.clear()
    with written_atomically(str(tmp_path / "vae")) as partial:
        os.makedirs(os.path.join(partial, "sub"))
        open(os.path.join(partial, "sub", "weights.bin"), "wb").close()
    assert synced == [os.path.join(partial, "sub", "weights.bin"), os.path.join(partial, "sub"), partial, str(tmp_path)]


def test_rng_state_holds_the_cpu_and_the_current_devices_generator_only(monkeypatch):
    paddle.set_device("cpu")
    assert list(ckpt.rng_state()["paddle"]) == ["cpu"]

    class FakeGenerator:
        def __init__(self, device):
            self.device, self.state = device, None

        def get_state(self):
            return f"state of {self.device}"

        def set_state(self, state):
            made.append((self.device, state))

    made = []
    monkeypatch.setattr(paddle.device, "get_device", lambda: "gpu:3")
    monkeypatch.setattr(paddle.framework.random, "Generator", FakeGenerator)
    saved = ckpt.rng_state()
    assert saved["paddle"] == {"cpu": "state of cpu", "gpu": "state of gpu:3"}
    monkeypatch.setattr(paddle.device, "get_device", lambda: "gpu:0")  # resumed on another GPU
    ckpt.set_rng_state(saved)
    assert made == [("cpu", "state of cpu"), ("gpu:0", "state of gpu:3")]


def _two_rank_checkpoint(output_dir) -> str:
    """A checkpoint as 2 ranks save it: each rank's RNG, data positions counted for world size 2."""
    path = None
    for r in (0, 1):
        random.seed(r)
        state = {"rng": ckpt.rng_state(), "data": {"world_size": 2, "positions": {str(r): [0, 5]}}}
        path = path or save(output_dir, 4, rank_state=state)
        paddle.save(state, os.path.join(path, f"rank_state_{r}.pdparams"))
    ckpt.write_manifest(path, ranks=2)
    return path


@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 3), (2, 3)])
def test_a_resume_with_another_number_of_ranks_restarts_the_data_and_warns(tmp_path, monkeypatch, caplog, rank,
                                                                           world_size):
    paddle.set_device("cpu")
    path = _two_rank_checkpoint(tmp_path)
    monkeypatch.setattr(ckpt, "rank", lambda: rank)
    monkeypatch.setattr(ckpt, "world_size", lambda: world_size)
    with caplog.at_level(logging.WARNING):
        state = ckpt.load_rank_state(path)
    assert state["data"] is None  # counted in the 2-rank order: the stream starts again
    if rank < 2:
        saved = paddle.load(os.path.join(path, f"rank_state_{rank}.pdparams"), return_numpy=True)
        assert state["rng"]["python"] == saved["rng"]["python"]
    else:  # no state of its own: seeded, not a copy of another rank's streams
        ckpt.set_rng_state(state["rng"])
        draw = random.random()
        for r in (0, 1):
            ckpt.set_rng_state(paddle.load(os.path.join(path, f"rank_state_{r}.pdparams"), return_numpy=True)["rng"])
            assert random.random() != draw
    warned = [r.getMessage() for r in caplog.records if "saved by 2 ranks" in r.getMessage()]
    assert len(warned) == (rank == 0) and (not warned or "data stream starts again" in warned[0])


def test_a_two_rank_checkpoint_resumes_in_one_process(photo_filelist, tmp_path, caplog):
    out = str(tmp_path / "run")
    args = tiny_args(photo_filelist, out, max_steps=2, save_steps=2, image_logging_steps=0, use_ema="false")
    with paddle.utils.unique_name.guard():  # each run names its parameters (and their optimizer states) afresh
        run_in_process("train_vae_no_trainer.py", args)
    path = os.path.join(out, "checkpoint-2")
    state = paddle.load(os.path.join(path, "rank_state_0.pdparams"), return_numpy=True)
    state["data"]["world_size"] = 2  # as rank 0 of 2 saves it; rank 1's file beside it
    paddle.save(state, os.path.join(path, "rank_state_0.pdparams"))
    shutil.copy(os.path.join(path, "rank_state_0.pdparams"), os.path.join(path, "rank_state_1.pdparams"))
    ckpt.write_manifest(path, ranks=2)
    with caplog.at_level(logging.WARNING), paddle.utils.unique_name.guard():
        run_in_process("train_vae_trainer.py", tiny_args(photo_filelist, out, max_steps=3, save_steps=3, use_ema="false",
                                                         image_logging_steps=0, resume_from_checkpoint="latest"))
    assert "saved by 2 ranks, this run has 1" in caplog.text
    assert ckpt.read_json(os.path.join(ckpt.resolve_resume(out, "latest"), ckpt.TRAINER_STATE_NAME))["global_step"] == 3
