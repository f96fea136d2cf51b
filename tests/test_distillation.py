"""Distilling a tiny autoencoder from a teacher VAE, end to end (issue 44): a FLUX.1-style teacher (scaling and shift
factors) made by diffusers 0.42.1 with seeded weights, a student following its geometry, both entry points on the same
flags, teacher latents cached and on the fly, resume, the export in diffusers' and ppdiffusers' AutoencoderTiny, and
scripts/eval_vae.py --teacher before and after. The student family's parity with diffusers and each family's latent
convention are tests/test_tiny.py's."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import DRIVERS, load_script, read_scalars, run_entry_point
from family_parity import DiffusersBatch, assert_loaded_exactly, folder_pixels, trainer_args

TEACHER = {**json.load(open("configs/vae_micro.json")), "scaling_factor": 0.5, "shift_factor": 0.2}
TEACHER.pop("_class_name")
EXACT = ("loss/total", "loss/pixel", "loss/latent_distill", "loss/generator", "loss/discriminator", "eval/psnr",
         "eval/latent_mse", "eval/psnr_vs_teacher", "eval/teacher_psnr")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A pipeline folder whose vae/ is a tiny AutoencoderKL made by diffusers, with FLUX.1's kind of scale."""
    root = tmp_path_factory.mktemp("teacher")
    batch = DiffusersBatch(root)
    batch.make("AutoencoderKL", root / "vae", TEACHER, seed=4)
    batch.flush()
    return str(root)


def distill_args(data: str, held_out: str, teacher: str, output_dir, **overrides) -> list[str]:
    """The tiny recipe (the defaults) on a student of width 8, depth 1: 6 steps at 32 px, evaluated every 3."""
    flags = dict(teacher_model_name_or_path=teacher, teacher_subfolder="vae", student_width=8, student_depth=1,
                 max_steps=6, save_steps=3, eval_file_list=held_out, eval_steps=3, eval_num_images=4,
                 image_logging_steps=3, disc_start=None, learning_rate=3e-3)
    return trainer_args(data, output_dir, **{**flags, **overrides})


@pytest.fixture(scope="module")
def runs(photo_filelist, held_out_32, teacher, tmp_path_factory) -> dict:
    """{trainer: on the fly, loop: with a cold cache, resumed: the loop resumed at step 3 from the trainer's
    checkpoint with the warm cache, cache: the cache folder}."""
    out, cache = {}, str(tmp_path_factory.mktemp("teacher_cache"))
    out["trainer"] = str(tmp_path_factory.mktemp("distil_trainer"))
    run_entry_point(DRIVERS[0], distill_args(photo_filelist, held_out_32, teacher, out["trainer"]))
    out["loop"] = str(tmp_path_factory.mktemp("distil_loop"))
    run_entry_point(DRIVERS[1], distill_args(photo_filelist, held_out_32, teacher, out["loop"],
                                             cache_teacher_latents=cache))
    out["cached_files"] = sorted(os.path.join(d, f) for d, _, files in os.walk(cache) for f in files)
    resumed = tmp_path_factory.mktemp("distil_resumed")
    shutil.copytree(os.path.join(out["trainer"], "checkpoint-3"), resumed / "checkpoint-3")
    run_entry_point(DRIVERS[1], distill_args(photo_filelist, held_out_32, teacher, str(resumed),
                                             cache_teacher_latents=cache, resume_from_checkpoint="latest"))
    out["resumed"], out["cache"] = str(resumed), cache
    return out


def torch_weights(folder) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "vae", "diffusion_pytorch_model.safetensors"))


def test_both_drivers_distil_to_the_same_numbers_cached_or_not_and_resume_exactly(runs):
    trainer, loop = os.path.join(runs["trainer"], "logs"), os.path.join(runs["loop"], "logs")
    for tag in EXACT:
        a, b = read_scalars(trainer, tag), read_scalars(loop, tag)
        assert a and a == pytest.approx(b, rel=1e-6), tag
    # The cache holds one latent per distinct training and held-out crop seen, of this teacher only.
    assert runs["cached_files"] and all(f.endswith(".npy") for f in runs["cached_files"])
    assert len({os.path.dirname(f) for f in runs["cached_files"]}) == 1
    reference = torch_weights(runs["trainer"])
    for other in ("loop", "resumed"):
        weights = torch_weights(runs[other])
        assert weights.keys() == reference.keys()
        for name in reference:
            np.testing.assert_array_equal(weights[name], reference[name], err_msg=f"{other}: {name}")


def test_the_cache_is_read_back(runs, teacher, photo_filelist, held_out_32, tmp_path):
    """Doubled cached latents change the run: it decoded what the cache held, not the teacher's fresh latents."""
    cache = tmp_path / "cache"
    shutil.copytree(runs["cache"], cache)
    for folder, _, files in os.walk(cache):
        for name in files:
            path = os.path.join(folder, name)
            np.save(path, 2.0 * np.load(path))
    out = tmp_path / "out"
    run_entry_point(DRIVERS[1], distill_args(photo_filelist, held_out_32, teacher, str(out), max_steps=1,
                                             eval_steps=None, eval_file_list=None, eval_num_images=None,
                                             image_logging_steps=0, cache_teacher_latents=str(cache)))
    first = read_scalars(os.path.join(out, "logs"), "loss/latent_distill")[1]
    assert first != pytest.approx(read_scalars(os.path.join(runs["trainer"], "logs"), "loss/latent_distill")[1])


def test_the_student_follows_the_teacher_s_geometry_and_loads_in_both_libraries(runs, teacher, held_out_32,
                                                                                  tmp_path):
    from ppdiffusers import AutoencoderTiny

    folder = os.path.join(runs["loop"], "vae")
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["_class_name"] == "AutoencoderTiny" and config["latent_channels"] == TEACHER["latent_channels"]
    assert config["scaling_factor"] == 1.0 and len(config["encoder_block_out_channels"]) == 2  # factor 2
    images = folder_pixels(held_out_32)[:2]
    ours = AutoencoderTiny.from_pretrained(folder)
    ours.eval()
    import paddle

    with paddle.no_grad():
        latents = ours.encode(paddle.to_tensor(images)).latents.numpy()
        decoded = ours.decode(paddle.to_tensor(latents)).sample.numpy()
    batch = DiffusersBatch(tmp_path)
    result = batch.run("AutoencoderTiny", folder, images, tmp_path, latents=latents)
    batch.flush()
    theirs = result()
    assert_loaded_exactly(theirs, "AutoencoderTiny")
    np.testing.assert_allclose(theirs["decoded_latents"], decoded, atol=2e-5)


def test_distillation_improves_the_student_and_eval_vae_measures_it_beside_the_teacher(runs, teacher, held_out_32,
                                                                                      tmp_path):
    """eval_vae.py --teacher on the untrained student (the run's architecture, fresh weights) and on the export: the
    student's decode of the teacher's latents gets closer to the images and its encoder to the teacher's latents."""
    evaluate = load_script("eval_vae").main
    untrained = tmp_path / "untrained.json"
    untrained.write_text(open(os.path.join(runs["loop"], "vae", "config.json")).read())
    common = ["--teacher", teacher, "--teacher_subfolder", "vae", "--data", held_out_32, "--resolution", "32",
              "--num_images", "4", "--skip_lpips"]
    before = evaluate(["--vae", str(untrained), "--output_dir", str(tmp_path / "before"), *common]).metrics
    after = evaluate(["--vae", os.path.join(runs["loop"], "vae"), "--output_dir", str(tmp_path / "after"),
                      *common]).metrics
    assert after["psnr"] > before["psnr"] + 1.0
    assert after["latent_mse"] < 0.5 * before["latent_mse"]
    assert after["teacher_psnr"] == pytest.approx(before["teacher_psnr"])  # the same teacher, the same images
    record = json.load(open(tmp_path / "after" / "metrics.json"))
    assert {"psnr_vs_teacher", "ssim_vs_teacher", "latent_mse", "decode_ms", "teacher_decode_ms"} <= set(
        record["metrics"]) and "teacher's" in record["protocol"]["latents"]
    # The in-training evaluation measured the same numbers at the end.
    final = json.loads(open(os.path.join(runs["loop"], "eval_metrics.jsonl")).read().splitlines()[-1])
    assert final["metrics"]["latent_mse"] == pytest.approx(after["latent_mse"], rel=1e-4)
