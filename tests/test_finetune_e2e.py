"""Issue 9's "done when", from each entry point: a tiny PyTorch diffusers VAE folder made here is fine-tuned
decoder-only for a few steps; its encoder is unchanged, its scaling factor kept, and the exported folder (and
scripts/export_vae.py's export of a checkpoint) reconstructs the same in ppdiffusers and in PyTorch diffusers.
And issue 12.2: the export does no evaluation nobody asked for (counted, not timed)."""

import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, EVAL_FLAGS, REPO, run_entry_point, run_in_process, tiny_args, vae_weights
from ppdiffusers import AutoencoderKL
from torch_vae import MICRO, diffusers, make_torch_vae, paddle_reconstruct, photos, torch_reconstruct

import vae_trainer.evaluation as evaluation
from vae_trainer.models.vae_loading import build_vae

STEPS = 3


def finetune_args(file_list, output_dir, pretrained, **overrides):
    """tiny_args, but fine-tuning `pretrained` instead of training configs/vae_micro.json from scratch."""
    args = [str(a) for a in tiny_args(file_list, output_dir, pretrained_model_name_or_path=pretrained, **overrides)]
    at = args.index("--vae_config_file")
    return args[:at] + args[at + 2:]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A PyTorch diffusers VAE folder (seeded non-default weights, SDXL's scaling factor 0.13025)."""
    diffusers()
    folder = tmp_path_factory.mktemp("pytorch_vae")
    make_torch_vae(MICRO, seed=8).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def runs(source, photo_filelist, tmp_path_factory):
    """Decoder-only fine-tuning, GAN on from step 3, EMA, no evaluation: one run per entry point."""
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(driver.split(".")[0]))
        run_entry_point(driver, finetune_args(photo_filelist, output_dir, source, freeze_encoder="true",
                                              max_steps=STEPS, save_steps=STEPS))
        out[driver] = output_dir
    return out


def encode(vae, images):
    vae.eval()
    posterior = vae.encode(paddle.to_tensor(images)).latent_dist
    return np.stack([posterior.mean.numpy(), posterior.std.numpy()])


@pytest.mark.parametrize("driver", DRIVERS)
def test_decoder_only_fine_tuning_keeps_the_encoder_and_the_scaling_factor(runs, source, driver):
    original = build_vae(pretrained_model_name_or_path=source).state_dict()
    images = photos()
    for folder in ("vae", "vae_raw"):  # EMA and raw weights
        exported = vae_weights(runs[driver], folder)
        encoder_keys = [k for k in exported if k.startswith(("encoder.", "quant_conv."))]
        for key in encoder_keys:
            np.testing.assert_array_equal(exported[key], original[key].numpy(), err_msg=f"{folder}: {key}")
        assert any(not np.array_equal(exported[k], original[k].numpy()) for k in exported if k.startswith("decoder."))
        vae = AutoencoderKL.from_pretrained(os.path.join(runs[driver], folder))
        np.testing.assert_array_equal(encode(vae, images), encode(build_vae(pretrained_model_name_or_path=source), images))
        assert vae.config.scaling_factor == MICRO["scaling_factor"]
    stats = json.load(open(os.path.join(runs[driver], "vae", "latent_stats.json")))
    assert stats["scaling_factor"] == MICRO["scaling_factor"] and stats["source"] == "kept from the VAE's config"
    assert stats["measured"] is None  # no evaluation ran, so nothing was measured at the end
    assert "no evaluation of these weights ran at the last step" in stats["note"]
    raw = json.load(open(os.path.join(runs[driver], "vae_raw", "latent_stats.json")))
    assert raw["scaling_factor"] == MICRO["scaling_factor"] and raw["weights"].startswith("the raw weights")


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_exported_folder_reconstructs_the_same_in_ppdiffusers_and_pytorch_diffusers(runs, driver):
    folder = os.path.join(runs[driver], "vae")
    images = photos(count=4)
    in_paddle = paddle_reconstruct(AutoencoderKL.from_pretrained(folder), images)
    in_torch = torch_reconstruct(diffusers().AutoencoderKL.from_pretrained(folder).eval(), images)
    np.testing.assert_allclose(in_torch, in_paddle, atol=1e-4)


def test_both_entry_points_fine_tune_to_the_same_weights(runs):
    a, b = (vae_weights(runs[d]) for d in DRIVERS)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("ema, folder", [(True, "vae"), (False, "vae_raw")])
def test_export_vae_script_writes_the_same_dual_format_folder_from_a_checkpoint(runs, tmp_path, ema, folder):
    run = runs[DRIVERS[1]]
    out = tmp_path / "exported"
    command = [sys.executable, os.path.join(REPO, "scripts", "export_vae.py"), os.path.join(run, f"checkpoint-{STEPS}"),
               str(out)] + (["--ema"] if ema else [])
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    exported, final = vae_weights(str(tmp_path), "exported"), vae_weights(run, folder)
    for key in final:  # the last checkpoint holds the exported weights exactly
        np.testing.assert_array_equal(exported[key], final[key], err_msg=key)
    images = photos()
    in_torch = torch_reconstruct(diffusers().AutoencoderKL.from_pretrained(str(out)).eval(), images)
    np.testing.assert_allclose(in_torch, paddle_reconstruct(AutoencoderKL.from_pretrained(str(out)), images), atol=1e-4)
    assert json.load(open(out / "latent_stats.json"))["scaling_factor"] == MICRO["scaling_factor"]


# ---- issue 12.2: count the evaluation calls of in-process runs

@pytest.fixture
def calls(monkeypatch):
    """Counts of full evaluations (decoder, LPIPS, rFID) and encoder-only latent passes."""
    counted = {"evaluate_vae": 0, "measure_latents": 0}
    for name in counted:
        original = getattr(evaluation, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counted[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(evaluation, name, counting)
    return counted


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_12_step_fine_tuning_run_without_evaluation_evaluates_nothing_at_the_end(
        driver, calls, source, photo_filelist, tmp_path):
    run_in_process(driver, finetune_args(photo_filelist, tmp_path / "out", source, max_steps=12, save_steps=12,
                                         image_logging_steps=0, report_to="none"))
    assert calls == {"evaluate_vae": 0, "measure_latents": 0}
    assert AutoencoderKL.load_config(str(tmp_path / "out" / "vae"))["scaling_factor"] == MICRO["scaling_factor"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_run_from_scratch_without_evaluation_measures_with_the_encoder_only(driver, calls, photo_filelist, tmp_path):
    run_in_process(driver, tiny_args(photo_filelist, tmp_path / "out", max_steps=4, save_steps=4, image_logging_steps=0,
                                     report_to="none", latent_stats_num_images=20))
    # One encoder-only pass per exported latent space: vae/ (EMA weights) and vae_raw/ (the raw weights).
    assert calls == {"evaluate_vae": 0, "measure_latents": 2}
    for folder in ("vae", "vae_raw"):
        stats = json.load(open(tmp_path / "out" / folder / "latent_stats.json"))
        assert stats["source"] == f"measured on an encoder-only pass over 20 images of {photo_filelist}"
        assert AutoencoderKL.load_config(str(tmp_path / "out" / folder))["scaling_factor"] == stats["scaling_factor"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_export_reuses_the_last_evaluation_of_the_same_weights(driver, calls, photo_filelist, held_out_folder,
                                                                   tmp_path):
    run_in_process(driver, tiny_args(photo_filelist, tmp_path / "out", max_steps=4, save_steps=4, image_logging_steps=0,
                                     report_to="none", **EVAL_FLAGS(held_out_folder)))
    # Evaluations at steps 2 and 4 (EMA weights); at the end only the raw weights (vae_raw/) need a pass.
    assert calls == {"evaluate_vae": 2, "measure_latents": 1}
    history = json.load(open(tmp_path / "out" / "checkpoint-4" / "trainer_state.json"))["log_history"]
    suggested = [h["eval/suggested_scaling_factor"] for h in history if h.get("step") == 4 and "eval/psnr" in h]
    assert AutoencoderKL.load_config(str(tmp_path / "out" / "vae"))["scaling_factor"] == pytest.approx(suggested[0])
    stats = json.load(open(tmp_path / "out" / "vae" / "latent_stats.json"))
    assert stats["source"] == "measured on the evaluation at step 4"
