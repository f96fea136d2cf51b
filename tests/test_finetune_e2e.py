"""Issue 9's "done when", from each entry point: a tiny PyTorch diffusers VAE folder made here is fine-tuned
decoder-only for a few steps; its encoder is unchanged, its scaling factor kept, and the exported folder (and
scripts/export_vae.py's export of a checkpoint) reconstructs the same in ppdiffusers and in PyTorch diffusers.
And issue 12.2: the export does no evaluation nobody asked for (counted, not timed)."""

import json
import os

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, EVAL_FLAGS, run_in_process, tiny_args, vae_weights
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
    """Decoder-only fine-tuning, GAN on from step 3, EMA, no evaluation, a checkpoint every step: one run per
    entry point."""
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(driver.split(".")[0]))
        run_in_process(driver, finetune_args(photo_filelist, output_dir, source, freeze_encoder="true",
                                             max_steps=STEPS, save_steps=1))
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
    assert stats["scaling_factor"] == MICRO["scaling_factor"] and stats["source"] == f"kept from the pretrained VAE {source}"
    assert stats["measured"] is None  # no evaluation ran, so nothing was measured at the end
    assert "no evaluation of these weights ran at the last step" in stats["note"]
    raw = json.load(open(os.path.join(runs[driver], "vae_raw", "latent_stats.json")))
    assert raw["scaling_factor"] == MICRO["scaling_factor"] and raw["weights"].startswith("the raw weights")


def torch_config(folder) -> dict:
    """The config PyTorch diffusers builds the VAE from (defaults filled in; bookkeeping keys dropped)."""
    config = diffusers().AutoencoderKL.from_pretrained(str(folder)).config
    return {k: v for k, v in config.items() if not k.startswith("_")}


def assert_loads_alike_in_both_libraries(folder, source_folder):
    """`folder` reconstructs real photos the same in ppdiffusers and in PyTorch diffusers (<= 1e-4 of the output's
    range: float32 rounding grows with it, and a decoder two steps from a fresh start returns values up to ~8), and
    PyTorch diffusers reads from it the source VAE's whole config (scaling/shift factors, force_upcast, ...)."""
    images = photos(count=4)
    in_paddle = paddle_reconstruct(AutoencoderKL.from_pretrained(str(folder)), images)
    in_torch = torch_reconstruct(diffusers().AutoencoderKL.from_pretrained(str(folder)).eval(), images)
    np.testing.assert_allclose(in_torch, in_paddle, atol=1e-4 * max(1.0, float(np.abs(in_paddle).max())))
    assert torch_config(folder) == torch_config(source_folder)


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_exported_folder_reconstructs_the_same_in_ppdiffusers_and_pytorch_diffusers(runs, source, driver):
    assert_loads_alike_in_both_libraries(os.path.join(runs[driver], "vae"), source)


def test_both_entry_points_fine_tune_to_the_same_weights(runs):
    a, b = (vae_weights(runs[d]) for d in DRIVERS)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("ema, folder", [(True, "vae"), (False, "vae_raw")])
def test_export_vae_script_writes_the_same_dual_format_folder_from_a_checkpoint(runs, tmp_path, ema, folder):
    from conftest import load_script

    run = runs[DRIVERS[1]]
    out = tmp_path / "exported"
    # the EMA is exported by default when the run kept one
    load_script("export_vae").main([os.path.join(run, f"checkpoint-{STEPS}"), str(out)] + ([] if ema else ["--no_ema"]))
    exported, final = vae_weights(str(tmp_path), "exported"), vae_weights(run, folder)
    for key in final:  # the last checkpoint holds the exported weights exactly
        np.testing.assert_array_equal(exported[key], final[key], err_msg=key)
    images = photos()
    in_torch = torch_reconstruct(diffusers().AutoencoderKL.from_pretrained(str(out)).eval(), images)
    np.testing.assert_allclose(in_torch, paddle_reconstruct(AutoencoderKL.from_pretrained(str(out)), images), atol=1e-4)
    assert json.load(open(out / "latent_stats.json"))["scaling_factor"] == MICRO["scaling_factor"]


def test_export_vae_script_exports_the_ema_of_an_early_checkpoint(runs, source, tmp_path, capsys):
    """checkpoint-1 of a 3-step run, with and without --ema. After one step ppdiffusers' EMAModel holds
    d * initial + (1 - d) * raw weights, with its warm-up decay d = min(2 / 11, --ema_decay): an export of
    the final EMA, of the raw weights or of another checkpoint's EMA would not match."""
    from conftest import load_script

    checkpoint = os.path.join(runs[DRIVERS[0]], "checkpoint-1")
    export_vae = load_script("export_vae")
    export_vae.main([checkpoint, str(tmp_path / "raw"), "--no_ema"])
    assert "--no_ema (the checkpoint also holds EMA weights" in capsys.readouterr().out
    export_vae.main([checkpoint, str(tmp_path / "ema")])  # by default: the EMA the checkpoint holds, as vae/
    assert "as the run's vae/ does; --no_ema exports the raw ones" in capsys.readouterr().out
    export_vae.main([checkpoint, str(tmp_path / "ema_flag"), "--ema"])  # still accepted
    export_vae.main(["--ema", "false", checkpoint, str(tmp_path / "raw_flag")])  # the training flags' spelling
    initial = {k: v.numpy() for k, v in build_vae(pretrained_model_name_or_path=source).state_dict().items()}
    raw, ema = vae_weights(str(tmp_path), "raw"), vae_weights(str(tmp_path), "ema")
    for same, folder in ((ema, "ema_flag"), (raw, "raw_flag")):
        for key, value in vae_weights(str(tmp_path), folder).items():
            np.testing.assert_array_equal(value, same[key], err_msg=f"{folder}: {key}")
    decay = 2 / 11
    for key, value in ema.items():
        expected = initial[key] - (1 - decay) * (initial[key] - raw[key])
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7, err_msg=key)
    assert any(not np.allclose(ema[k], raw[k]) for k in ema if k.startswith("decoder."))
    final = vae_weights(runs[DRIVERS[0]], "vae")
    assert any(not np.allclose(ema[k], final[k]) for k in ema if k.startswith("decoder."))
    assert_loads_alike_in_both_libraries(tmp_path / "ema", source)


# ---- a FLUX-style VAE (16 latent channels, shift_factor, no quant_conv / post_quant_conv) with the reference
# trainer's recipe: --ignore_keys decoder. (a fresh decoder) and --freeze_encoder

FLUX_LIKE = dict(MICRO, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
                 shift_factor=0.1159, force_upcast=True, sample_size=1024,
                 latents_mean=[0.01 * c for c in range(16)], latents_std=[1.0 + 0.1 * c for c in range(16)])


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_flux_style_vae_fine_tunes_with_a_fresh_decoder_and_keeps_both_factors(driver, photo_filelist, tmp_path):
    folder = tmp_path / "flux_vae"
    make_torch_vae(FLUX_LIKE, seed=9).save_pretrained(str(folder))
    out = tmp_path / "out"
    run_in_process(driver, finetune_args(photo_filelist, out, folder, freeze_encoder="true", ignore_keys="decoder.",
                                         max_steps=2, save_steps=2, image_logging_steps=0, report_to="none"))
    original = {k: v.numpy() for k, v in build_vae(pretrained_model_name_or_path=str(folder)).state_dict().items()}
    assert not any(k.startswith(("quant_conv.", "post_quant_conv.")) for k in original)
    for exported_folder in ("vae", "vae_raw"):
        exported = vae_weights(str(out), exported_folder)
        assert exported.keys() == original.keys()
        for key in (k for k in exported if k.startswith("encoder.")):  # frozen: bit-identical
            np.testing.assert_array_equal(exported[key], original[key], err_msg=key)
        # Not loaded (--ignore_keys): two steps at lr 1e-3 move a weight by at most ~2e-3 from where it started; a
        # fresh initialisation is some 0.05 away from the source's weights.
        moved = exported["decoder.conv_in.weight"] - original["decoder.conv_in.weight"]
        assert np.abs(moved).mean() > 0.02
        stats = json.load(open(out / exported_folder / "latent_stats.json"))
        assert (stats["scaling_factor"], stats["shift_factor"]) == (0.3611, 0.1159)
        assert stats["source"] == f"kept from the pretrained VAE {folder}"
        assert_loads_alike_in_both_libraries(out / exported_folder, folder)  # both factors, force_upcast, ...
    config = AutoencoderKL.load_config(str(out / "vae"))
    assert (config["scaling_factor"], config["shift_factor"], config["latents_std"]) == (
        0.3611, 0.1159, FLUX_LIKE["latents_std"])


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
        # Of the training images: a seeded random sample of all 48 (a sorted list's first ones would be biased).
        assert stats["source"] == (f"measured on an encoder-only pass over a random sample (seed 7) of 20 of the 48 "
                                   f"images of {photo_filelist}")
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


def test_trainable_modules_train_only_what_they_name_in_sd_s_vae_too(source, photo_filelist, tmp_path):
    """--trainable_modules on an AutoencoderKL (issue 35): the decoder's last conv and the encoder's quant_conv
    train, with the GAN's adaptive weight at that conv; every other weight goes out as the PyTorch folder holds it."""
    from safetensors.numpy import load_file

    output_dir = str(tmp_path / "out")
    run_in_process(DRIVERS[0], finetune_args(photo_filelist, output_dir, source, use_ema="false", max_steps=STEPS)
                   + ["--trainable_modules", "decoder.conv_out.*", "quant_conv.*"])
    before = load_file(os.path.join(source, "diffusion_pytorch_model.safetensors"))
    after = load_file(os.path.join(output_dir, "vae", "diffusion_pytorch_model.safetensors"))
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    assert changed == {"decoder.conv_out.weight", "decoder.conv_out.bias", "quant_conv.weight", "quant_conv.bias"}
