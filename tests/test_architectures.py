"""Issue 17.4: the published architectures (configs/sd_vae.json, sdxl_vae.json, flux_vae.json) fine-tune,
evaluate and export through the entry points, with --recompute, LPIPS and the discriminator on.

Cheap by design: each architecture runs once, the entry points alternate between them (both are covered),
at 32 px, batch 1, one step with the discriminator on from the start, in-process (no second interpreter start-up). The source is a diffusers folder of
that shape saved by ppdiffusers `save_pretrained(..., to_diffusers=True)` from seeded random weights, given
as --pretrained_model_name_or_path without a config file, as a user fine-tuning a published VAE does.
"""

import json
import os

import numpy as np
import paddle
import pytest
from conftest import read_scalars, run_in_process, tiny_args
from ppdiffusers import AutoencoderKL

import vae_trainer.models.recompute as vae_module
from vae_trainer.models.families import family_of
from vae_trainer.models.vae_loading import build_vae

STEPS = 1
# (config, entry point, what the export's config must say); the entry points alternate.
ARCHITECTURES = [
    ("configs/sd_vae.json", "train_vae_no_trainer.py",
     {"latent_channels": 4, "scaling_factor": 0.18215, "shift_factor": None, "use_quant_conv": True}),
    ("configs/sdxl_vae.json", "train_vae_trainer.py",
     {"latent_channels": 4, "scaling_factor": 0.13025, "shift_factor": None, "use_quant_conv": True}),
    ("configs/flux_vae.json", "train_vae_no_trainer.py",
     {"latent_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
      "use_post_quant_conv": False}),
]


def test_the_configs_are_the_published_architectures():
    for config, _, expected in ARCHITECTURES:
        with open(config) as handle:
            c = json.load(handle)
        assert c["block_out_channels"] == [128, 256, 512, 512] and c["layers_per_block"] == 2, config
        assert c["down_block_types"] == ["DownEncoderBlock2D"] * 4 and c["up_block_types"] == ["UpDecoderBlock2D"] * 4
        assert c["norm_num_groups"] == 32 and c["act_fn"] == "silu"
        for key, value in expected.items():
            assert c.get(key, True if key.startswith("use_") else None) == value, (config, key)


@pytest.mark.parametrize("config,driver,expected", ARCHITECTURES, ids=["sd", "sdxl", "flux"])
def test_a_published_architecture_fine_tunes_evaluates_and_exports_with_recompute(
        config, driver, expected, photo_filelist, held_out_folder, tmp_path, monkeypatch):
    paddle.seed(5)
    source = build_vae(config)
    source.save_pretrained(str(tmp_path / "source"), to_diffusers=True)
    assert os.path.isfile(tmp_path / "source" / "diffusion_pytorch_model.safetensors")
    before = {k: v.numpy() for k, v in source.state_dict().items()}
    segments = len(family_of(source).recompute_segments(source))
    del source

    recomputed = []  # every segment forward that ran under Paddle's recompute
    original = vae_module.recompute
    monkeypatch.setattr(vae_module, "recompute", lambda f, *a, **k: recomputed.append(1) or original(f, *a, **k))
    output_dir = tmp_path / "out"
    args = [str(a) for a in tiny_args(
        photo_filelist, output_dir, pretrained_model_name_or_path=tmp_path / "source", recompute="true",
        max_steps=STEPS, per_device_train_batch_size=1, disc_start=0, save_steps=0, image_logging_steps=0,
        use_ema="false", eval_file_list=held_out_folder, eval_steps=STEPS, eval_num_images=2)]
    at = args.index("--vae_config_file")
    run_in_process(driver, args[:at] + args[at + 2:])  # the architecture comes from the folder alone

    # --recompute: each resnet / attention / sampler of the encoder and decoder, once per training forward
    # (evaluation and the export's latent statistics build no graph, so they recompute nothing).
    assert segments == 32  # encoder 4x2 resnets + 3 downsamplers + mid 3; decoder 4x3 resnets + 3 upsamplers + mid 3
    assert len(recomputed) == STEPS * segments
    logs = str(output_dir / "logs")
    losses = read_scalars(logs, "loss/total")
    assert sorted(losses) == [1] and np.isfinite(losses[1])
    assert read_scalars(logs, "loss/perceptual")[1] > 0  # LPIPS on
    assert read_scalars(logs, "gan/adaptive_weight")[1] > 0  # the GAN term, with its adaptive weight, is on
    assert np.isfinite(read_scalars(logs, "loss/discriminator")[1])  # and the discriminator trained
    psnr = read_scalars(logs, "eval/psnr")
    assert sorted(psnr) == [STEPS] and np.isfinite(psnr[STEPS])

    exported = AutoencoderKL.from_pretrained(str(output_dir / "vae"))
    for key, value in {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, **expected}.items():
        assert exported.config[key] == value or list(exported.config[key]) == value, key
    weights = {k: v.numpy() for k, v in exported.state_dict().items()}
    assert set(weights) == set(before)  # same parameter names: no quant convs in FLUX, nothing renamed
    assert any(not np.array_equal(weights[k], before[k]) for k in weights if k.startswith("decoder."))
