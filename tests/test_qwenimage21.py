"""Qwen-Image 2.1's VAE (AutoencoderKLQwenImage21: RGBA, 4 channels in and out) fine-tuned end to end (issue 52,
part 3): a seeded diffusers folder in; the whole model fine-tuned by both entry points (the same numbers) on RGBA PNGs
written here from the demo photos with a synthetic alpha (scripts/make_demo_rgba.py), out again into diffusers' own
class, which reconstructs better than the untrained model in its own measure (PSNR on [0, 1] over RGBA), and whose
alpha PSNR is eval_vae.py's; the decoder alone (--freeze_encoder: encoder and latents bit for bit) on RGB LAION part
files, read as opaque and counted. The network's equality with diffusers' is
tests/test_autoencoder_kl_qwenimage21.py's; the reader, metrics and views alone: tests/test_rgba.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import DRIVERS, REPO, load_script, read_scalars, run_entry_point, run_in_process
from family_parity import DiffusersBatch, assert_loaded_exactly, mean_psnr, trainer_args
from PIL import Image
from safetensors.numpy import load_file

CLASS = "AutoencoderKLQwenImage21"
STATS = dict(latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 1.0])
# The published layout, narrow: residual stages, a wider decoder, one temporal stage, RGBA, factor 4.
TINY = dict(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
            temperal_downsample=[False, True], scale_factor_spatial=4, **STATS)
TORCH_WEIGHTS = "diffusion_pytorch_model.safetensors"


def rgba_folder_pixels(folder: str) -> np.ndarray:
    """The RGBA images of `folder` in name order, NCHW on [-1, 1]."""
    names = sorted(os.listdir(folder))
    return np.stack([np.asarray(Image.open(os.path.join(folder, name)).convert("RGBA"), np.float32) / 127.5 - 1
                     for name in names]).transpose(0, 3, 1, 2)


def alpha_psnr(decoded: np.ndarray, pixels: np.ndarray) -> float:
    """alpha_psnr's definition (evaluation.py) on diffusers' clamped decode: the alpha channel, MSE floored at 1e-10."""
    recon, target = (np.clip(decoded[:, 3], -1, 1) + 1) / 2, (pixels[:, 3] + 1) / 2
    mse = np.maximum(((recon - target) ** 2).reshape(len(pixels), -1).mean(axis=1), 1e-10)
    return float((10 * np.log10(1 / mse)).mean())


@pytest.fixture(scope="module")
def rgba_data(tmp_path_factory) -> dict:
    """16 RGBA PNGs of 48 px to train on and 6 of 32 px held out (the evaluation leaves them as they are)."""
    root, make = tmp_path_factory.mktemp("rgba"), load_script("make_demo_rgba")
    for name, count, size, photos in (("train", 16, 48, "train"), ("held_out", 6, 32, "eval")):
        make.main(["--image_dir", os.path.join(REPO, "data", "demo", photos), "--output_dir", str(root / name),
                   "--num_images", str(count), "--size", str(size)])
    return {name: str(root / name) for name in ("train", "held_out")}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A pipeline download whose vae/ diffusers made with seeded weights."""
    root = tmp_path_factory.mktemp("qwenimage21")
    batch = DiffusersBatch(root)
    batch.make(CLASS, root / "pipeline" / "vae", TINY, seed=3)
    batch.flush()
    return str(root / "pipeline")


@pytest.fixture(scope="module")
def fine_tuned(source, rgba_data, tmp_path_factory) -> dict:
    """Both drivers: the whole model fine-tuned on the RGBA PNGs for 8 steps, evaluated at steps 4 and 8: {driver:
    output dir}. (The whole model: from a random frozen encoder, whose latents say little of alpha, a decoder alone
    learns too slowly for a test.)"""
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(f"q21_{driver.split('.')[0]}"))
        run_in_process(driver, trainer_args(rgba_data["train"], output_dir, pretrained_model_name_or_path=source,
                                             subfolder="vae", max_steps=8, save_steps=4, eval_steps=4,
                                             eval_num_images=6, eval_file_list=rgba_data["held_out"]))
        out[driver] = output_dir
    return out


@pytest.fixture(scope="module")
def decoder_only(source, photo_filelist, tmp_path_factory) -> tuple:
    """The decoder fine-tuned (--freeze_encoder) on RGB JPEGs of LAION part files, read as opaque images: (output
    dir, the run's stderr)."""
    output_dir = str(tmp_path_factory.mktemp("q21_decoder_only"))
    result = run_entry_point(DRIVERS[0], trainer_args(photo_filelist, output_dir, pretrained_model_name_or_path=source,
                                                      subfolder="vae", freeze_encoder="true"))
    return output_dir, result.stderr


@pytest.fixture(scope="module")
def in_diffusers(source, fine_tuned, decoder_only, rgba_data, tmp_path_factory) -> dict:
    """diffusers' class on the held-out images (one-frame clips): {"source" | "fine_tuned" | "decoder_only": its
    outputs}."""
    work = tmp_path_factory.mktemp("q21_diffusers")
    x = rgba_folder_pixels(rgba_data["held_out"])[:, :, None]
    folders = {"source": os.path.join(source, "vae"), "fine_tuned": os.path.join(fine_tuned[DRIVERS[1]], "vae"),
               "decoder_only": os.path.join(decoder_only[0], "vae")}
    batch = DiffusersBatch(work)
    results = {}
    for name, folder in folders.items():
        os.makedirs(work / name)
        results[name] = batch.run(CLASS, folder, x, work / name)
    batch.flush()
    return {name: result() for name, result in results.items()}


def weights(folder) -> dict:
    return load_file(os.path.join(folder, TORCH_WEIGHTS))


def test_both_drivers_fine_tune_rgba_to_the_same_numbers(fine_tuned):
    from visualdl import LogReader

    trainer, loop = (fine_tuned[driver] for driver in DRIVERS)
    for tag in ("loss/total", "loss/pixel", "loss/perceptual", "loss/kl", "loss/discriminator", "eval/psnr",
                "eval/alpha_psnr", "eval/ssim", "eval/lpips"):
        a, b = read_scalars(os.path.join(trainer, "logs"), tag), read_scalars(os.path.join(loop, "logs"), tag)
        assert a and a == pytest.approx(b, rel=1e-6), tag
    for folder in ("vae", "vae_raw"):
        wa, wb = weights(os.path.join(trainer, folder)), weights(os.path.join(loop, folder))
        assert wa.keys() == wb.keys()
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    logs = os.path.join(trainer, "logs")
    tags = LogReader(file_path=os.path.join(logs, next(f for f in os.listdir(logs) if f.startswith("vdlrecords"))))
    assert "data/opaque_images" not in tags.get_tags()["scalar"]  # every image had its alpha
    assert json.load(open(os.path.join(trainer, "discriminator", "config.json")))["in_channels"] == 4  # sees alpha
    record = [json.loads(line) for line in open(os.path.join(trainer, "eval_metrics.jsonl"))][-1]
    assert "alpha_psnr" in record["protocol"] and "mid-grey" in record["protocol"]["channels"]


def test_the_export_loads_in_diffusers_and_reconstructs_better_than_the_untrained_model(in_diffusers, rgba_data):
    x = rgba_folder_pixels(rgba_data["held_out"])
    for result in in_diffusers.values():
        assert_loaded_exactly(result, CLASS)
    before, after = (mean_psnr(in_diffusers[name]["decoded"][:, :, 0], x) for name in ("source", "fine_tuned"))
    assert in_diffusers["fine_tuned"]["decoded"].shape == (6, 4, 1, 32, 32)
    assert after > before + 2.0, (before, after)  # PSNR on [0, 1] over RGBA, diffusers' clamped decode


def test_eval_vae_reports_alpha_psnr_as_diffusers_decodes(fine_tuned, in_diffusers, rgba_data, tmp_path, capsys):
    from vae_trainer.evaluation import CHECKER_LEVELS, CHECKER_SQUARE

    out = tmp_path / "eval"
    result = load_script("eval_vae").main(["--vae", os.path.join(fine_tuned[DRIVERS[1]], "vae"), "--data",
                                           rgba_data["held_out"], "--resolution", "32", "--num_images", "6",
                                           "--output_dir", str(out)])
    table = capsys.readouterr().out.split("\n\n")[-1]
    assert "alpha_psnr" in table and "lpips" in table
    x, decoded = rgba_folder_pixels(rgba_data["held_out"]), in_diffusers["fine_tuned"]["decoded"][:, :, 0]
    assert result.metrics["psnr"] == pytest.approx(mean_psnr(decoded, x), abs=1e-3)
    assert result.metrics["alpha_psnr"] == pytest.approx(alpha_psnr(decoded, x), abs=1e-3)
    assert result.metrics["alpha_psnr"] != pytest.approx(result.metrics["psnr"], abs=0.1)
    grid = np.asarray(Image.open(out / "reconstructions.png"))
    row, column = np.argwhere(x[0, 3] == -1.0)[0]  # a transparent pixel of the first image
    board = CHECKER_LEVELS[(row // CHECKER_SQUARE + column // CHECKER_SQUARE) % 2]
    assert grid.shape[2] == 3 and (grid[row, column] == round((board + 1) * 127.5)).all()  # on the checkerboard


def test_rgb_laion_parts_are_opaque_images_counted_and_freeze_encoder_keeps_the_latents(decoder_only, source,
                                                                                       in_diffusers):
    """The decoder on RGB JPEGs: every image read as opaque, 4 per step, counted in data/opaque_images and the
    end-of-run summary, logged once, nothing skipped; the encoder, and so the latents, bit for bit the source's."""
    output_dir, stderr = decoder_only
    assert read_scalars(os.path.join(output_dir, "logs"), "data/opaque_images") == {1: 4, 2: 8, 3: 12, 4: 16}
    assert stderr.count("no alpha channel, read as opaque (alpha 1)") == 1
    assert "data: 16 training images had no alpha channel and were read as opaque" in stderr
    assert "data: no training record was skipped" in stderr
    source_weights = weights(os.path.join(source, "vae"))
    for folder in ("vae", "vae_raw"):
        exported = weights(os.path.join(output_dir, folder))
        assert exported.keys() == source_weights.keys()
        changed = {name for name in source_weights if not np.array_equal(exported[name], source_weights[name])}
        assert changed and all(name.startswith(("decoder.", "post_quant_conv.")) for name in changed)
    for key in ("mean", "logvar"):  # the latents of the held-out RGBA images, in diffusers
        np.testing.assert_array_equal(in_diffusers["decoder_only"][key], in_diffusers["source"][key], err_msg=key)
    assert not np.array_equal(in_diffusers["fine_tuned"]["mean"], in_diffusers["source"]["mean"])  # (it can tell)
    config = json.load(open(os.path.join(output_dir, "vae", "config.json")))
    assert config["_class_name"] == CLASS and {k: config[k] for k in STATS} == STATS  # its normalisation kept


def test_an_rgba_teacher_is_refused_for_distillation(source):
    from vae_trainer.models.teacher import load_teacher

    with pytest.raises(ValueError, match=f"--teacher {source}: a {CLASS} of RGBA images"):
        load_teacher(source, "vae")
