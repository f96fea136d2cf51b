"""Both entry points on the new sources: an image folder with aspect-ratio buckets, accumulation, a loader
worker and exact resume; WebDataset tar shards and their exact resume; skip counts in VisualDL; data errors
that stop the run."""

import base64
import gzip
import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import (DRIVERS, REPO, _photos, read_scalars, run_entry_point, run_in_process, tiny_args, vae_weights,
                      write_tar)
from PIL import Image

BUCKETS = dict(aspect_ratio_buckets="true", gradient_accumulation_steps=2, dataloader_num_workers=1)


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    """12 crops of real photos at 2:1, 1:1 and 1:2 (JPEG and PNG, nested) and one broken file."""
    root = tmp_path_factory.mktemp("folder")
    (root / "nested").mkdir()
    rng = np.random.default_rng(0)
    photos = _photos()
    for k in range(12):
        photo = photos[k % len(photos)]
        width, height = [(96, 48), (64, 64), (40, 80)][k % 3]
        y, x = rng.integers(0, photo.shape[0] - height), rng.integers(0, photo.shape[1] - width)
        name = root / ("nested" if k % 4 == 0 else ".") / f"img{k:02d}.{'jpg' if k % 2 else 'png'}"
        Image.fromarray(photo[y : y + height, x : x + width]).save(name)
    (root / "broken.jpg").write_bytes(b"not a jpeg")
    return str(root)


@pytest.fixture(scope="module")
def bucket_runs(photo_folder, tmp_path_factory):
    """One 4-step run per driver: folder source, buckets, 2 micro-batches, 1 loader worker."""
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(driver.split(".")[0]))
        result = run_entry_point(driver, tiny_args(photo_folder, output_dir, **BUCKETS))
        out[driver] = output_dir
        out[driver + ":output"] = result.stdout + result.stderr
    return out


def test_bucketed_folder_runs_agree_across_drivers_and_count_skips(bucket_runs, photo_folder):
    logs = [os.path.join(bucket_runs[driver], "logs") for driver in DRIVERS]
    for tag in ("loss/total", "loss/pixel", "loss/discriminator"):
        a, b = read_scalars(logs[0], tag), read_scalars(logs[1], tag)
        assert a and a == pytest.approx(b, rel=1e-6), tag
        assert all(np.isfinite(list(a.values())))
    for log in logs:
        skipped = read_scalars(log, "data/skipped_not_image")
        assert sorted(skipped) == [1, 2, 3, 4]
        values = [skipped[step] for step in sorted(skipped)]
        assert values == sorted(values) and values[-1] >= 1  # cumulative; the broken file was met
        assert set(read_scalars(log, "data/skipped_truncated").values()) == {0.0}
    for driver in DRIVERS:  # the end-of-run summary, with the last logged count
        final = int(read_scalars(os.path.join(bucket_runs[driver], "logs"), "data/skipped_not_image")[4])
        assert f"data: {final} training records skipped (all ranks, resumed runs included): {{'not_image': {final}}}" \
            in bucket_runs[driver + ":output"]
        # ... naming the file, counted in the loader worker and carried to the summary by the batches' positions
        # (one bad record however often read; an image file has no line number)
        assert f"the first bad line or tar sample numbers):\n         1  {final:>8}  " \
               f"{os.path.join(photo_folder, 'broken.jpg')}\n" in bucket_runs[driver + ":output"]


def check_resume_from_step_2(driver, straight, source, resumed, skip_tag, run=run_entry_point, **flags):
    """Resume `straight`'s checkpoint-2 in a fresh folder (`run`: run_entry_point, or run_in_process for a run
    without loader workers): the logged numbers of the later steps and the final weights must be those of the
    uninterrupted run."""
    os.makedirs(resumed)
    shutil.copytree(os.path.join(straight, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    run(driver, tiny_args(source, resumed, resume_from_checkpoint="latest", **flags))
    later = list(range(3, flags.get("max_steps", 4) + 1))
    for tag in ("loss/total", "loss/discriminator", skip_tag):
        a = read_scalars(os.path.join(straight, "logs"), tag)
        b = read_scalars(os.path.join(resumed, "logs"), tag)
        assert sorted(b) == later and [a[s] for s in later] == [b[s] for s in later], tag
    wa, wb = vae_weights(straight), vae_weights(resumed)
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


def test_bucketed_folder_resume_is_exact(bucket_runs, photo_folder, tmp_path):
    """One entry point: the pending samples are the stream's; both drivers resume alike (test_train_e2e)."""
    driver = DRIVERS[0]
    check_resume_from_step_2(driver, bucket_runs[driver], photo_folder, str(tmp_path / "resumed"),
                             "data/skipped_not_image", **BUCKETS)


def test_bucketing_under_two_ranks_steps_together_in_sync(photo_folder, tmp_path):
    """Two ranks fill their buckets independently (shapes may differ in a step); they stay in sync."""
    output_dir = tmp_path / "out"
    run_entry_point(DRIVERS[1], tiny_args(photo_folder, output_dir, max_steps=3, save_steps=3, image_logging_steps=0,
                                          **BUCKETS), nproc=2, log_dir=tmp_path / "launch")
    import paddle

    states = [paddle.load(str(output_dir / "checkpoint-3" / f"rank_state_{r}.pdparams")) for r in (0, 1)]
    np.testing.assert_array_equal(states[0]["parameter_fingerprint"], states[1]["parameter_fingerprint"])
    assert sorted(read_scalars(str(output_dir / "logs"), "loss/total")) == [1, 2, 3]
    assert all(state["data"]["batches_consumed"] == 6 for state in states)  # 3 steps x 2 micro-batches each


@pytest.fixture(scope="module")
def tar_shards(tmp_path_factory):
    """3 WebDataset shards of JPEG crops of real photos with captions; one sample without an image."""
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(1)
    photos = _photos()
    for shard in range(3):
        members = []
        for k in range(6):
            photo = photos[(shard + k) % len(photos)]
            size = int(rng.integers(48, 96))
            y, x = rng.integers(0, photo.shape[0] - size), rng.integers(0, photo.shape[1] - size)
            buffer = io.BytesIO()
            Image.fromarray(photo[y : y + size, x : x + size]).save(buffer, "JPEG", quality=90)
            if not (shard == 1 and k == 2):  # that sample has a caption only
                members.append((f"{shard:05d}{k:04d}.jpg", buffer.getvalue()))
            members.append((f"{shard:05d}{k:04d}.txt", b"a photo"))
        write_tar(root / f"{shard:05d}.tar", members)
    return str(root / "{00000..00002}.tar")


TAR_RUN = dict(max_steps=3, save_steps=2, image_logging_steps=0, per_device_train_batch_size=6, use_ema="false")


@pytest.fixture(scope="module")
def tar_runs(tar_shards, tmp_path_factory):
    """One 3-step run on the tar shards, checkpoints at steps 2 and 3 (one entry point: the data path is shared,
    and the drivers are proven equal elsewhere)."""
    output_dir = str(tmp_path_factory.mktemp("tar_run"))
    run_in_process(DRIVERS[1], tiny_args(tar_shards, output_dir, **TAR_RUN))
    return {DRIVERS[1]: output_dir}


def test_webdataset_shards_train(tar_runs):
    output_dir = tar_runs[DRIVERS[1]]
    logs = os.path.join(output_dir, "logs")
    assert sorted(read_scalars(logs, "loss/total")) == [1, 2, 3]
    assert read_scalars(logs, "data/skipped_no_image")[3] == 1  # 18 samples > one pass over the 17 good ones
    assert os.path.isdir(os.path.join(output_dir, "vae"))


def test_webdataset_resume_is_exact(tar_runs, tar_shards, tmp_path):
    """Resumed mid-pass (12 of 18 samples read; the tars have no counts, so the stream reads its way back), with
    the GAN starting at the resumed step."""
    check_resume_from_step_2(DRIVERS[1], tar_runs[DRIVERS[1]], tar_shards, str(tmp_path / "resumed"),
                             "data/skipped_no_image", run=run_in_process, **TAR_RUN)


def _run_failing(args, nproc=1, log_dir=None, timeout=600):
    """Run an entry point that must fail; a hang fails the test through the timeout instead of blocking CI."""
    command = [sys.executable]
    if nproc > 1:
        command += ["-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir", str(log_dir)]
    command += [os.path.join(REPO, "train_vae_no_trainer.py"), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    logs = ""
    if log_dir is not None and os.path.isdir(log_dir):
        logs = "".join(open(os.path.join(log_dir, name)).read() for name in sorted(os.listdir(log_dir)))
    return result.returncode, result.stdout + result.stderr + logs


def test_data_error_stops_the_run_with_its_message(photo_filelist, tmp_path):
    """--image_column past the last column, default 0 workers: the run used to print the error and hang."""
    code, output = _run_failing(tiny_args(photo_filelist, tmp_path / "out", image_column=9))
    assert code != 0
    assert "got no usable sample" in output and "'columns': 48" in output  # all 48 lines, one pass


def test_data_error_on_one_rank_stops_both(tmp_path):
    """Two ranks, one line of data: rank 1's shard is empty, it fails; rank 0 must not wait for it forever."""
    photo = _photos()[0][:64, :64]
    buffer = io.BytesIO()
    Image.fromarray(photo).save(buffer, "PNG")
    (tmp_path / "one.gz").write_bytes(gzip.compress(b"c\t-\t" + base64.b64encode(buffer.getvalue()) + b"\n"))
    (tmp_path / "one.filelist").write_text("one.gz\n")
    code, output = _run_failing(tiny_args(str(tmp_path / "one.filelist"), tmp_path / "out", max_steps=3),
                                nproc=2, log_dir=tmp_path / "launch")
    assert code != 0
    assert "shard 1 of 2 (rank 1) got no usable sample" in output


def test_resume_with_another_seed_is_refused_in_one_line(tar_runs, tar_shards, tmp_path):
    """The data position counts records in the order --seed made: another seed would resume elsewhere."""
    resumed = tmp_path / "resumed"
    shutil.copytree(os.path.join(tar_runs[DRIVERS[1]], "checkpoint-2"), resumed / "checkpoint-2")
    code, output = _run_failing(tiny_args(tar_shards, resumed, resume_from_checkpoint="latest", **{**TAR_RUN, "seed": 8}))
    assert code != 0 and "Traceback" not in output
    assert "error: the checkpoint's data position was saved with --seed 7 (this run: 8)" in output
