"""Issue 42.3: what a source folder holds and training did not change goes out bit for bit, in every family. Each
family's source is made by diffusers 0.42.1 with every weight moved off its initialisation, every buffer (RAE's
encoder_mean / encoder_std, FLUX.2's bn statistics and counter, DC-AE's batch_norm stage) and every latent-scale key
off its class's default; it is fine-tuned for 2 steps at 32 px decoder-only (--freeze_encoder) and with
--trainable_modules (an encoder-side layer among them where the encoder can train), each mode on the other entry
point (RAE, whose buffers the export once wrote from ImageNet's defaults, on both). Both exported weight files and
config.json are compared with the source: only what trained may differ.
"""

from __future__ import annotations

import fnmatch
import json
import os

import numpy as np
import pytest
from conftest import DRIVERS, run_in_process
from family_parity import DiffusersBatch, trainer_args
from safetensors.numpy import load_file, save_file
from test_dc_ae import TINY_DC
from test_flux2 import TINY_FLUX2
from test_rae import TINY_RAE
from test_wan import TINY_QWEN, TINY_WAN22
from torch_vae import MICRO

from vae_trainer.models.vae_loading import build_vae

TORCH_WEIGHTS, PADDLE_WEIGHTS = "diffusion_pytorch_model.safetensors", "diffusion_paddle_model.safetensors"
LATENT_STATS = dict(latents_mean=[0.3, -0.1, 0.2, -0.4], latents_std=[1.4, 0.6, 2.1, 0.9])
# {name: (class, config whose scale keys differ from the class's defaults, --trainable_modules)}
FAMILIES = {
    "kl": ("AutoencoderKL", dict(MICRO, scaling_factor=0.2345, shift_factor=0.0609, **LATENT_STATS),
           ["decoder.conv_out.*", "quant_conv.*"]),
    "flux2": ("AutoencoderKLFlux2", dict(TINY_FLUX2, batch_norm_eps=3e-4, batch_norm_momentum=0.2),
              ["decoder.conv_out.*", "quant_conv.*"]),
    "dc_ae": ("AutoencoderDC", dict(TINY_DC, scaling_factor=0.3711), ["decoder.conv_out.*", "encoder.conv_out.*"]),
    "rae": ("AutoencoderRAE", dict(TINY_RAE, scaling_factor=0.85), ["decoder.decoder_pred.*"]),
    "qwen": ("AutoencoderKLQwenImage", dict(TINY_QWEN, **LATENT_STATS), ["decoder.conv_out.*", "quant_conv.*"]),
    "wan21": ("AutoencoderKLWan", dict(TINY_QWEN, scale_factor_spatial=4, **LATENT_STATS),
              ["decoder.conv_out.*", "quant_conv.*"]),
    "wan22": ("AutoencoderKLWan", dict(TINY_WAN22, **LATENT_STATS), ["decoder.conv_out.*", "quant_conv.*"]),
}
# Buffers set off the class's defaults in the source's file (its config left as made: the file is what loads).
BUFFERS = {"rae": {"encoder_mean": [0.5, 0.4, 0.3], "encoder_std": [0.2, 0.3, 0.25]},
           "flux2": {"bn.num_batches_tracked": 7}, "dc_ae": {"decoder.up_blocks.0.1.norm.num_batches_tracked": 5}}
DECODER_SIDE = ["decoder.*", "post_quant_conv.*"]  # what --freeze_encoder leaves training
# (family, mode, driver): each family once per mode, the modes on different drivers; RAE on both in both.
RUNS = [(name, mode, DRIVERS[(index + (mode == "trainable_modules")) % 2])
        for index, name in enumerate(FAMILIES) for mode in ("freeze_encoder", "trainable_modules")]
RUNS += [("rae", mode, driver) for mode in ("freeze_encoder", "trainable_modules") for driver in DRIVERS
         if ("rae", mode, driver) not in RUNS]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """{family: its diffusers folder}: one diffusers process makes them all; the buffers are then set in the files."""
    root = tmp_path_factory.mktemp("untrained_sources")
    batch = DiffusersBatch(root)
    folders = {name: batch.make(class_name, root / name, config, seed=4)
               for name, (class_name, config, _) in FAMILIES.items()}
    batch.flush()
    for name, buffers in BUFFERS.items():
        path = os.path.join(folders[name], TORCH_WEIGHTS)
        state = load_file(path)
        for key, value in buffers.items():
            state[key] = np.asarray(value, state[key].dtype).reshape(state[key].shape)
        save_file(state, path, metadata={"format": "pt"})
    return folders


@pytest.fixture(scope="module")
def exports(sources, photo_filelist, tmp_path_factory) -> dict:
    """{(family, mode, driver): output dir} of 2 steps (EMA on, no LPIPS, no GAN) from each family's source."""
    out = {}
    for name, mode, driver in RUNS:
        output_dir = str(tmp_path_factory.mktemp(f"{name}_{mode}"))
        flags = trainer_args(photo_filelist, output_dir, pretrained_model_name_or_path=sources[name], max_steps=2,
                             save_steps=2, gradient_accumulation_steps=1, disc_start=None, disc_base_channels=None,
                             perceptual_weight=0, report_to="none")
        run_in_process(driver, flags + (["--freeze_encoder", "true"] if mode == "freeze_encoder" else
                                         ["--trainable_modules", *FAMILIES[name][2]]))
        out[name, mode, driver] = output_dir
    return out


def changed(source: dict, exported: dict) -> set:
    assert exported.keys() == source.keys()
    for key in source:
        assert exported[key].shape == source[key].shape and exported[key].dtype == source[key].dtype, key
    return {key for key in source if not np.array_equal(exported[key], source[key])}


def trained(names, patterns) -> set:
    return {name for name in names if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)}


@pytest.mark.parametrize("name,mode,driver", RUNS, ids=["-".join((n, m, d.split(".")[0][10:])) for n, m, d in RUNS])
def test_what_did_not_train_goes_out_bit_for_bit(sources, exports, name, mode, driver):
    patterns = DECODER_SIDE if mode == "freeze_encoder" else FAMILIES[name][2]
    source_config = json.load(open(os.path.join(sources[name], "config.json")))
    source = load_file(os.path.join(sources[name], TORCH_WEIGHTS))
    paddle_source = {key: value.numpy() for key, value in build_vae(
        pretrained_model_name_or_path=sources[name]).state_dict().items()}
    for folder in ("vae", "vae_raw"):  # the EMA's weights and the raw ones
        vae_dir = os.path.join(exports[name, mode, driver], folder)
        moved = changed(source, load_file(os.path.join(vae_dir, TORCH_WEIGHTS)))
        assert moved and moved <= trained(source, patterns), sorted(moved - trained(source, patterns))
        paddle_exported = {key: value.reshape(paddle_source[key].shape) for key, value in
                           load_file(os.path.join(vae_dir, PADDLE_WEIGHTS)).items()}
        moved = changed(paddle_source, paddle_exported)
        assert moved and moved <= trained(paddle_source, patterns), sorted(moved - trained(paddle_source, patterns))
        config = json.load(open(os.path.join(vae_dir, "config.json")))
        for key, value in source_config.items():
            assert key.startswith("_") or config[key] == value, (key, config[key], value)
        assert not {key for key in config if not key.startswith("_")} - set(source_config)
