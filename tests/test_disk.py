"""A full disk is a message and costs nothing saved (issue 22.2): on a real small file system (tmpfs), a
checkpoint that does not fit stops the run with one message, the partial folder removed and the last
checkpoint intact; the same command with --resume_from_checkpoint latest continues once there is room.
Exports are written beside their place and moved in."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
from conftest import DRIVERS, REPO, REQUIRE_TEST_EXTRAS, tiny_args

from vae_trainer.disk import OutOfSpace, written_atomically


@pytest.fixture
def small_disk(tmp_path):
    """A 1.6 MB tmpfs: room for one checkpoint of the micro VAE (about 1 MB) and part of a second."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        message = f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): needs root"
        if os.environ.get(REQUIRE_TEST_EXTRAS) == "1":
            raise RuntimeError(message)
        pytest.skip(message)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def run(driver, args):
    return subprocess.run([sys.executable, os.path.join(REPO, driver), *map(str, args)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=600)


def test_a_full_disk_stops_with_a_message_the_last_checkpoint_intact_and_resume_continues(
        small_disk, tmp_path, photo_filelist, driver=DRIVERS[0]):
    """One entry point: both save through checkpoint.save_checkpoint (the plain loop's full-disk save under the
    launcher: tests/test_rank_failure.py)."""
    output_dir = small_disk / "run"
    args = tiny_args(photo_filelist, output_dir, max_steps=4, save_steps=2, logging_dir=tmp_path / "logs")
    result = run(driver, args)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: writing checkpoint-4 in ") and "No space left on device" in message
    assert "checkpoint-2 (the last complete checkpoint) is intact" in message
    assert "--resume_from_checkpoint latest" in message and "free" in message
    assert "need about" in result.stderr  # the start-up warning: this disk cannot hold the run's checkpoints
    assert sorted(os.listdir(output_dir)) == ["checkpoint-2", "visualdl_records.txt"]  # checkpoint-4.tmp removed
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    resumed = run(driver, tiny_args(photo_filelist, output_dir, max_steps=4, save_steps=2,
                                    logging_dir=tmp_path / "logs2", resume_from_checkpoint="latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {"checkpoint-2", "checkpoint-4", "vae", "vae_raw", "discriminator"} <= set(os.listdir(output_dir))


def test_an_export_that_fails_leaves_the_previous_one_whole(tmp_path):
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text("previous")
    with pytest.raises(OutOfSpace, match="No space left on device"):
        with written_atomically(str(folder)) as partial:
            os.makedirs(partial)
            open(os.path.join(partial, "config.json"), "w").write("new, half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert sorted(os.listdir(tmp_path)) == ["vae"] and (folder / "config.json").read_text() == "previous"
    with written_atomically(str(folder)) as partial:
        os.makedirs(partial)
        open(os.path.join(partial, "config.json"), "w").write("new")
    assert sorted(os.listdir(tmp_path)) == ["vae"] and (folder / "config.json").read_text() == "new"


def test_an_error_that_is_not_about_the_disk_is_not_disguised(tmp_path):
    with pytest.raises(PermissionError):
        with written_atomically(str(tmp_path / "vae")):
            raise PermissionError(errno.EACCES, "denied")
