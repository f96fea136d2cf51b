"""The Qwen-Image and Wan causal 3D VAEs fine-tuned on images (issue 37; vae_trainer/models/families/wan.py): diffusers folders
in, fine-tuned by both entry points (decoder-only, the whole model, --trainable_modules, from scratch with EQ-VAE / VF,
resumed exactly, 2 processes), out again into diffusers' own classes, which still run clips; the temporal weights
images never reach go out bit-identical; the start warning when the encoder trains; bad input refused. The
networks' equality with diffusers' is tests/test_autoencoder_kl_wan.py's; here it is the trainer around them.

One diffusers process (family_parity.DiffusersBatch) makes the seeded source folders, others run the exports; the run
flags (family_parity.trainer_args): a few steps at 32 px with LPIPS, the GAN from step 3, EMA, accumulation 2 and
the default gradient clipping."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, load_script, read_scalars, run_entry_point
from family_parity import (DiffusersBatch, assert_loaded_exactly, assert_resume_is_exact, folder_pixels, mean_psnr,
                           random_images, trainer_args)
from safetensors.numpy import load_file

from vae_trainer.argument_parser import parse_arguments
from vae_trainer.models.families import encoder_parameters, family_for_config, family_of
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.families.wan import QWEN_IMAGE, WAN

STATS = dict(latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 1.0])
# Qwen-Image-like (Wan 2.1's layout), tiny: both stage boundaries temporal, spatial factor 4.
TINY_QWEN = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True], **STATS)
# Wan 2.2's TI2V layout, tiny: residual stages, 2x2 patchify (12 channels in and out), a wider decoder; factor 8.
TINY_WAN22 = dict(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                  temperal_downsample=[False, True], is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                  scale_factor_temporal=2, scale_factor_spatial=8, **STATS)
SOURCES = {"qwen": ("AutoencoderKLQwenImage", TINY_QWEN), "wan22": ("AutoencoderKLWan", TINY_WAN22)}
TORCH_WEIGHTS = "diffusion_pytorch_model.safetensors"
WARNING = "its encoder is being trained on still images"


def weights(folder, name=TORCH_WEIGHTS) -> dict:
    return load_file(os.path.join(folder, name))


def video_only(folder) -> list:
    """The VideoOnlyWeight list of the VAE in `folder` (built from its config alone)."""
    return build_vae(os.path.join(folder, "config.json")).video_only_weights()


def assert_video_only_weights_kept(source: dict, exported: dict, parts) -> None:
    for part in parts:
        np.testing.assert_array_equal(part.part(exported[part.name]), part.part(source[part.name]), err_msg=part.name)


def clip(frames=5, size=32, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (1, 3, frames, size, size)).astype(np.float32)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """{name: a pipeline download whose vae/ diffusers made with seeded weights}, one diffusers process for all."""
    root = tmp_path_factory.mktemp("wan_pipelines")
    batch = DiffusersBatch(root)
    out = {name: str(root / name) for name in SOURCES}
    for name, (class_name, config) in SOURCES.items():
        batch.make(class_name, root / name / "vae", config, seed=3)
    batch.flush()
    # Wan2.2-TI2V-5B's vae/config.json holds a key diffusers 0.35 took and 0.42 ignores: a download, as it comes.
    path = root / "wan22" / "vae" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "clip_output": False}))
    return out


# ---- in

@pytest.mark.parametrize("name", list(SOURCES))
def test_a_diffusers_folder_loads_as_its_family_with_its_normalisation(pipelines, name):
    class_name, config = SOURCES[name]
    vae = build_vae(pretrained_model_name_or_path=pipelines[name], subfolder="vae")
    family = family_of(vae)
    assert family.class_name == class_name and family.geometry(vae.config).frames == 4
    assert vae.config.latents_mean == STATS["latents_mean"] and vae.config.latents_std == STATS["latents_std"]
    assert family.geometry(vae.config).factor == {"qwen": 4, "wan22": 8}[name]
    vae.eval()
    x, side = paddle.to_tensor(random_images()), 32 // family.geometry(vae.config).factor
    with paddle.no_grad():
        posterior = family.encode(vae, x)
        theirs = vae.encode(x.unsqueeze(2)).latent_dist  # the class's own encode of one-frame clips
        vae.decoder.conv_out.weight.set_value(vae.decoder.conv_out.weight * 10)  # a decode beyond [-1, 1]
        decoded = family.decode(vae, posterior.mode())
        clamped = vae.decode(posterior.mode().unsqueeze(2)).sample
    assert posterior.mean.shape == posterior.logvar.shape == [2, 4, side, side]
    np.testing.assert_array_equal(posterior.mean.numpy(), theirs.mean.numpy()[:, :, 0])
    np.testing.assert_array_equal(posterior.logvar.numpy(), theirs.logvar.numpy()[:, :, 0])
    assert np.abs(decoded.numpy()).max() > 1  # unclamped: the loss's gradients pass
    np.testing.assert_array_equal(np.clip(decoded.numpy(), -1, 1), clamped.numpy()[:, :, 0])


def test_a_wan_config_without_class_name_is_never_taken_for_flux2():
    """Without `_class_name` (every download has one), keys decide: Wan 2.2's patch_size is also FLUX.2's. Qwen-Image's
    own key is input_channels; without it its config is Wan 2.1's, the same network."""
    assert family_for_config(TINY_WAN22) is WAN and family_for_config(TINY_QWEN) is WAN
    assert family_for_config({**TINY_QWEN, "input_channels": 3}) is QWEN_IMAGE
    for name in ("wan21_vae", "wan22_vae"):
        config = json.load(open(os.path.join(REPO, "configs", f"{name}.json")))
        assert family_for_config({k: v for k, v in config.items() if k != "_class_name"}) is WAN


# ---- fine-tuned by both entry points, decoder only

def decoder_only_flags(pipelines, held_out_32) -> dict:
    """A decoder-only fine-tune of the Qwen-Image download with --recompute, evaluated (tiled) at steps 2 and 4."""
    return dict(pretrained_model_name_or_path=pipelines["qwen"], subfolder="vae", freeze_encoder="true",
                eval_file_list=held_out_32, eval_steps=2, eval_num_images=6, recompute="true", eval_tiled="true",
                eval_tile_size=16)


@pytest.fixture(scope="module")
def decoder_only(pipelines, photo_filelist, held_out_32, tmp_path_factory) -> dict:
    """Both drivers, decoder_only_flags: {driver: (output dir, stderr)}."""
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(f"wan_{driver.split('.')[0]}"))
        result = run_entry_point(driver, trainer_args(photo_filelist, output_dir,
                                                      **decoder_only_flags(pipelines, held_out_32)))
        out[driver] = (output_dir, result.stderr)
    return out


@pytest.fixture(scope="module")
def exports_in_diffusers(decoder_only, held_out_32, tmp_path_factory) -> dict:
    """One diffusers process: {"clips": diffusers' AutoencoderKLQwenImage on the Trainer's export, of random images
    as one-frame clips and of a 5-frame clip (outputs "clip5_..."), "eval": on the loop's export, of the held-out
    images as one-frame clips}."""
    root = tmp_path_factory.mktemp("wan_exports_in_diffusers")
    batch = DiffusersBatch(root)
    for name in ("clips", "eval"):
        os.makedirs(root / name)
    clips = batch.run("AutoencoderKLQwenImage", os.path.join(decoder_only[DRIVERS[0]][0], "vae"),
                      random_images(seed=4)[:, :, None], root / "clips", more_images={"clip5": clip()})
    held_out = batch.run("AutoencoderKLQwenImage", os.path.join(decoder_only[DRIVERS[1]][0], "vae"),
                         folder_pixels(held_out_32)[:, :, None], root / "eval")
    batch.flush()
    return {"clips": clips(), "eval": held_out()}


def test_both_drivers_fine_tune_to_the_same_numbers(decoder_only):
    trainer, loop = (decoder_only[driver][0] for driver in DRIVERS)
    for tag in ("loss/total", "loss/pixel", "loss/perceptual", "loss/kl", "loss/discriminator", "eval/psnr",
                "eval/lpips"):
        a, b = read_scalars(os.path.join(trainer, "logs"), tag), read_scalars(os.path.join(loop, "logs"), tag)
        assert a and a == pytest.approx(b, rel=1e-6), tag
    for folder in ("vae", "vae_raw"):
        wa, wb = weights(os.path.join(trainer, folder)), weights(os.path.join(loop, folder))
        assert wa.keys() == wb.keys()
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


def test_decoder_only_keeps_encoder_temporal_weights_and_normalisation(decoder_only, pipelines):
    source_dir = os.path.join(pipelines["qwen"], "vae")
    source = weights(source_dir)
    output_dir, stderr = decoder_only[DRIVERS[1]]
    assert WARNING not in stderr  # the encoder is frozen: nothing to warn about
    for folder in ("vae", "vae_raw"):
        exported = weights(os.path.join(output_dir, folder))
        assert exported.keys() == source.keys()
        changed = {name for name in source if not np.array_equal(exported[name], source[name])}
        assert changed and all(name.startswith(("decoder.", "post_quant_conv.")) for name in changed)
        assert_video_only_weights_kept(source, exported, video_only(source_dir))
    config = json.load(open(os.path.join(output_dir, "vae", "config.json")))
    stats = json.load(open(os.path.join(output_dir, "vae", "latent_stats.json")))
    assert config["_class_name"] == "AutoencoderKLQwenImage" and "scaling_factor" not in config
    assert {k: config[k] for k in STATS} == STATS == {k: stats["latent_normalisation"][k] for k in STATS}
    assert stats["source"].startswith("the latent normalisation (latents_mean / latents_std) kept from the pretrained")
    protocol = [json.loads(line) for line in open(os.path.join(output_dir, "eval_metrics.jsonl"))][-1]["protocol"]
    assert protocol["tiling"].startswith("tiled (--eval_tiled)") and "AutoencoderKLQwenImage tiled_encode" in \
        protocol["tiling"]


def test_the_export_loads_in_diffusers_and_still_runs_clips(decoder_only, exports_in_diffusers):
    """diffusers' own class loads the export with nothing missing or unexpected, and encodes and decodes images and a
    5-frame clip (through its causal cache) as our class does with the same folder."""
    vae_dir = os.path.join(decoder_only[DRIVERS[0]][0], "vae")
    x, video = random_images(seed=4)[:, :, None], clip()
    theirs = exports_in_diffusers["clips"]
    assert_loaded_exactly(theirs, "AutoencoderKLQwenImage")
    ours = build_vae(pretrained_model_name_or_path=vae_dir)
    ours.eval()
    for prefix, pixels in (("", x), ("clip5_", video)):
        with paddle.no_grad():
            posterior = ours.encode(paddle.to_tensor(pixels)).latent_dist
            decoded = ours.decode(posterior.mode()).sample.numpy()
        np.testing.assert_allclose(posterior.mean.numpy(), theirs[prefix + "mean"], rtol=0, atol=1e-4)
        np.testing.assert_allclose(posterior.logvar.numpy(), theirs[prefix + "logvar"], rtol=0, atol=1e-4)
        np.testing.assert_allclose(decoded, theirs[prefix + "decoded"], rtol=0, atol=1e-4)
    assert theirs["clip5_decoded"].shape == (1, 3, 5, 32, 32) and theirs["clip5_mean"].shape[2] == 2


def test_the_export_reconstructs_in_diffusers_as_eval_vae_says(decoder_only, held_out_32, exports_in_diffusers,
                                                              tmp_path, capsys):
    vae_dir = os.path.join(decoder_only[DRIVERS[1]][0], "vae")
    result = load_script("eval_vae").main(["--vae", vae_dir, "--data", held_out_32, "--resolution", "32",
                                           "--num_images", "6", "--output_dir", str(tmp_path / "eval"),
                                           "--skip_lpips"])
    table = capsys.readouterr().out.split("\n\n")[-1]
    assert "latent_std" in table and "scaling_factor" not in table  # latents_mean / latents_std, not a scale
    x = folder_pixels(held_out_32)
    theirs = exports_in_diffusers["eval"]  # of x as one-frame clips
    assert result.metrics["psnr"] == pytest.approx(mean_psnr(theirs["decoded"][:, :, 0], x), abs=1e-3)


# ---- the whole model, and parts of it

def test_training_the_encoder_warns_once_and_keeps_the_temporal_weights(pipelines, photo_filelist, tmp_path):
    """Wan 2.2, encoder and decoder trained with fp16 loss scaling: the start warning once; encoder weights move, its
    (and the decoder's) video-only weights do not; the normalisation is kept."""
    source_dir = os.path.join(pipelines["wan22"], "vae")
    output_dir = str(tmp_path / "whole")
    result = run_entry_point(DRIVERS[0], trainer_args(photo_filelist, output_dir, fp16="true",
                                                      pretrained_model_name_or_path=source_dir))
    assert result.stderr.count(WARNING) == 1 and "AutoencoderKLWan: its encoder" in result.stderr
    assert "a diffusion model was trained on them" in result.stderr
    source, parts = weights(source_dir), video_only(source_dir)
    assert {part.name.split(".")[0] for part in parts} == {"encoder", "decoder"}
    for folder in ("vae", "vae_raw"):
        exported = weights(os.path.join(output_dir, folder))
        assert not np.array_equal(exported["encoder.conv_in.weight"], source["encoder.conv_in.weight"])
        assert_video_only_weights_kept(source, exported, parts)
    config = json.load(open(os.path.join(output_dir, "vae", "config.json")))
    assert {k: config[k] for k in STATS} == STATS and config["patch_size"] == 2


def test_trainable_modules_train_those_alone(pipelines, photo_filelist, tmp_path):
    source_dir = os.path.join(pipelines["qwen"], "vae")
    output_dir = str(tmp_path / "head")
    flags = trainer_args(photo_filelist, output_dir, pretrained_model_name_or_path=source_dir, use_ema="false",
                         ema_decay=None)
    result = run_entry_point(DRIVERS[1], flags + ["--trainable_modules", "decoder.norm_out.*", "decoder.conv_out.*"])
    assert WARNING not in result.stderr
    source, exported = weights(source_dir), weights(os.path.join(output_dir, "vae"))
    changed = {name for name in source if not np.array_equal(exported[name], source[name])}
    assert changed == {"decoder.norm_out.gamma", "decoder.conv_out.weight", "decoder.conv_out.bias"}
    assert_video_only_weights_kept(source, exported, video_only(source_dir))


def test_from_scratch_with_eq_vae_vf_and_bf16_measures_the_normalisation_per_channel(photo_filelist, tmp_path):
    from test_alignment import tiny_dinov2

    config = tmp_path / "wan22.json"
    config.write_text(json.dumps({"_class_name": "AutoencoderKLWan", **TINY_WAN22}))
    output_dir = str(tmp_path / "scratch")
    result = run_entry_point(DRIVERS[1], trainer_args(
        photo_filelist, output_dir, vae_config_file=config, equivariance_prob=0.5, bf16="true", recompute="true",
        vf_model_path=tiny_dinov2(tmp_path / "dino.safetensors")))
    # From scratch no diffusion model sits on these latents: the warning says what images leave untrained instead.
    assert result.stderr.count(WARNING) == 1 and "latents of clips of more than one frame are not" in result.stderr
    assert "a diffusion model was trained on them" not in result.stderr
    stats = json.load(open(os.path.join(output_dir, "vae", "latent_stats.json")))
    exported = json.load(open(os.path.join(output_dir, "vae", "config.json")))
    assert stats["source"].startswith("measured on") and len(exported["latents_mean"]) == 4
    # Of the posterior modes, what the pipelines normalise: the samples' std also holds the posterior variance.
    assert exported["latents_mean"] == stats["measured"]["mode_mean"] != STATS["latents_mean"]
    assert exported["latents_std"] == stats["measured"]["mode_std"]
    assert all(mode < sample for mode, sample in zip(exported["latents_std"], stats["measured"]["latent_std"]))
    assert read_scalars(os.path.join(output_dir, "logs"), "train/vf_loss")


def test_resume_is_exact(pipelines, decoder_only, photo_filelist, held_out_32, tmp_path):
    """The decoder-only fine-tune (recomputed, evaluated tiled at steps 2 and 4), stopped at step 2 and resumed by the
    Trainer, ends as the loop's run of it straight through."""
    assert_resume_is_exact(photo_filelist, tmp_path, straight=decoder_only[DRIVERS[1]][0], in_process=True,
                           **decoder_only_flags(pipelines, held_out_32))


def test_two_processes_fine_tune_and_keep_the_temporal_weights(pipelines, photo_filelist, tmp_path):
    source_dir = os.path.join(pipelines["wan22"], "vae")
    output_dir = tmp_path / "two"
    flags = trainer_args(photo_filelist, str(output_dir), pretrained_model_name_or_path=source_dir, max_steps=2)
    run_entry_point(DRIVERS[1], flags, nproc=2, log_dir=tmp_path / "launch")
    logs = [(tmp_path / "launch" / f"workerlog.{rank}").read_text() for rank in range(2)]
    assert [log.count(WARNING) for log in logs] == [1, 0]  # the encoder trains: said once per job, by rank 0
    exported = weights(output_dir / "vae")
    assert not np.array_equal(exported["decoder.conv_in.weight"], weights(source_dir)["decoder.conv_in.weight"])
    assert_video_only_weights_kept(weights(source_dir), exported, video_only(source_dir))
    assert json.load(open(output_dir / "vae" / "config.json"))["_class_name"] == "AutoencoderKLWan"


# ---- the family's parts

@pytest.mark.parametrize("decay", [0.0, 0.01])
def test_only_weight_decay_would_move_the_taps_images_never_train(pipelines, decay):
    """Why --weight_decay is refused here: one frame gives the earlier-frame taps an exactly zero gradient, which
    AdamW turns into no update, and decay alone would shrink them."""
    vae = build_vae(pretrained_model_name_or_path=pipelines["qwen"], subfolder="vae")
    parts = [part for part in vae.video_only_weights() if part.taps]
    params = dict(vae.named_parameters())
    before = {part.name: part.part(params[part.name].numpy()).copy() for part in parts}
    live_tap = params["decoder.conv_in.weight"].numpy()[:, :, 2].copy()
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=vae.parameters(), weight_decay=decay)
    x = paddle.to_tensor(random_images())
    (QWEN_IMAGE.decode(vae, QWEN_IMAGE.encode(vae, x).sample()) - x).square().mean().backward()
    optimizer.step()
    kept = [np.array_equal(part.part(params[part.name].numpy()), before[part.name]) for part in parts]
    assert all(kept) if decay == 0 else not any(kept)
    assert not np.array_equal(params["decoder.conv_in.weight"].numpy()[:, :, 2], live_tap)  # the current frame's


def test_recompute_gives_the_same_gradients_and_leaves_the_last_layer_out(pipelines):
    from vae_trainer.models.recompute import enable_recompute

    grads = []
    for recompute in (False, True):
        vae = build_vae(pretrained_model_name_or_path=pipelines["wan22"], subfolder="vae")
        if recompute:
            names = enable_recompute(vae)
            assert "decoder.mid_block" in names and not any("conv_out" in name for name in names)
        x = paddle.to_tensor(random_images())
        posterior = WAN.encode(vae, x)
        (WAN.decode(vae, posterior.mean) - x).square().mean().backward()
        grads.append({name: p.grad.numpy() for name, p in vae.named_parameters() if p.grad is not None})
        if recompute:  # really recomputed: every block re-ran its forward in the backward; an image is no clip
            calls = {name: layer.forward.calls for name, layer in WAN.recompute_segments(vae)}
            assert all(count > 0 for name, count in calls.items() if not name.endswith(".chunk"))
            assert calls["encoder.chunk"] == calls["decoder.chunk"] == 0
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 50
    for name in grads[0]:
        np.testing.assert_allclose(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert WAN.last_layers(vae)[0] is vae.decoder.conv_out.weight
    assert WAN.last_layers(vae)[1] is vae.quant_conv.weight
    expected = vae.encoder.parameters() + vae.quant_conv.parameters()  # the layers at its encoder_prefixes
    assert [id(p) for p in encoder_parameters(vae)] == [id(p) for p in expected]


def test_posterior_std_is_what_the_export_posterior_has(pipelines, tmp_path):
    """--posterior_std S: the export's quant_conv gives every latent the std S (training ignored the encoder's)."""
    from vae_trainer.models.vae_saving import save_vae

    vae = build_vae(pretrained_model_name_or_path=pipelines["wan22"], subfolder="vae")
    before = vae.state_dict()["quant_conv.weight"].numpy().copy()
    save_vae(vae, str(tmp_path / "vae"), posterior_std=0.5)
    np.testing.assert_array_equal(vae.state_dict()["quant_conv.weight"].numpy(), before)  # the network is unchanged
    exported = build_vae(pretrained_model_name_or_path=str(tmp_path / "vae"))
    with paddle.no_grad():
        posterior = WAN.encode(exported, paddle.to_tensor(random_images()))
    assert np.abs(posterior.std.numpy() - 0.5).max() < 1e-6


def test_eval_tiling_uses_the_class_tiles_and_restores_the_model(pipelines):
    vae = build_vae(pretrained_model_name_or_path=pipelines["qwen"], subfolder="vae")
    vae.eval()
    x = paddle.to_tensor(random_images(1, 64))
    with paddle.no_grad():
        whole = QWEN_IMAGE.encode(vae, x).mean.numpy()
        with QWEN_IMAGE.tiled(vae, 32):
            tiled = QWEN_IMAGE.encode(vae, x).mean.numpy()
            assert (vae.tile_sample_min_height, vae.tile_sample_stride_height) == (32, 24)
        assert not vae.use_tiling and vae.tile_sample_min_height == 256  # restored
        vae.enable_tiling(32, 32, 24, 24)
        reference = vae.encode(x.unsqueeze(2)).latent_dist.mean.numpy()[:, :, 0]
    np.testing.assert_array_equal(tiled, reference)
    assert np.abs(tiled - whole).max() > 1e-4  # really tiled


# ---- refused

def config_file(tmp_path, config, class_name="AutoencoderKLWan") -> str:
    path = tmp_path / "vae.json"
    path.write_text(json.dumps({"_class_name": class_name, **config}))
    return str(path)


@pytest.mark.parametrize("config,flags,message", [
    ("wan22_vae", ["--resolution", "40"], "--resolution 40 must be a multiple of the VAE's downsampling factor 16 "
     "(2 ** (len(dim_mult) - 1) x patch_size, "),
    ("qwen_image_vae", ["--resolution", "36"], "--resolution 36 must be a multiple of the VAE's downsampling factor 8 "
     "(2 ** (len(dim_mult) - 1), "),
    ("wan21_vae", ["--weight_decay", "0.01", "--init_from_ckpt", "x"],
     "--weight_decay 0.01: it would shrink the loaded temporal weights"),
    ("qwen_image_vae", ["--bf16", "true", "--fp16_opt_level", "O2", "--init_from_ckpt", "x"],
     "--fp16_opt_level O2: O2 keeps the weights in half precision"),
])
def test_bad_flags_are_refused_at_parse_time(config, flags, message, tmp_path):
    argv = ["--file_list", "x", "--vae_config_file", os.path.join(REPO, "configs", f"{config}.json"),
            "--max_steps", "1", "--output_dir", str(tmp_path), "--resolution", "64"] + flags
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_arguments(argv)


def test_from_scratch_weight_decay_is_taken(tmp_path):
    """A fresh video VAE has no temporal weights to keep: weight decay (also the discriminator's) is accepted."""
    parse_arguments(["--file_list", "x", "--vae_config_file", os.path.join(REPO, "configs", "wan21_vae.json"),
                     "--max_steps", "1", "--output_dir", str(tmp_path), "--resolution", "64", "--weight_decay", "0.01"])


def test_a_number_for_scaling_factor_is_refused(pipelines):
    from types import SimpleNamespace

    from vae_trainer.models.latent_scale import scaling_factor_mode

    vae = build_vae(pretrained_model_name_or_path=pipelines["qwen"], subfolder="vae")
    flags = dict(scaling_factor="0.5", ignore_keys=None, init_from_ckpt=None, pretrained_model_name_or_path="x")
    with pytest.raises(ValueError, match=r"--scaling_factor 0\.5: AutoencoderKLQwenImage has no scaling_factor"):
        scaling_factor_mode(SimpleNamespace(**flags), vae)
    with pytest.raises(ValueError, match="--scaling_factor measure with a frozen encoder"):
        scaling_factor_mode(SimpleNamespace(**{**flags, "scaling_factor": "measure"}), vae, encoder_frozen=True)


def test_configs_and_weights_that_do_not_fit_are_one_error_each(pipelines, tmp_path):
    folder = tmp_path / "vae"
    shutil.copytree(os.path.join(pipelines["wan22"], "vae"), folder)
    config = json.load(open(folder / "config.json"))
    (folder / "config.json").write_text(json.dumps({**config, "temporal_compression": 4}))
    with pytest.raises(ValueError, match=rf"{folder}/config\.json: AutoencoderKLWan config key\(s\) "
                                         "temporal_compression are not known"):
        build_vae(pretrained_model_name_or_path=str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "z_dim": 8}))
    with pytest.raises(ValueError, match=r"latents_mean has 4 values for z_dim 8"):
        build_vae(pretrained_model_name_or_path=str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "decoder_base_dim": 16}))
    with pytest.raises(ValueError, match=r"other shapes than this VAE's, e\.g\. .*decoder\."):
        build_vae(pretrained_model_name_or_path=str(folder))
    with pytest.raises(ValueError, match="the architecture downsamples by 8 .* spatial factor 16"):
        build_vae(config_file(tmp_path, {**TINY_WAN22, "scale_factor_spatial": 16}))


def test_a_newer_release_config_key_is_one_error_line_in_both_entry_points(pipelines, photo_filelist, tmp_path):
    folder = tmp_path / "vae"
    shutil.copytree(os.path.join(pipelines["qwen"], "vae"), folder)
    config = json.load(open(folder / "config.json"))
    (folder / "config.json").write_text(json.dumps({**config, "use_framewise_encoding": True}))
    for driver in DRIVERS:
        command = [sys.executable, driver, "--file_list", photo_filelist, "--pretrained_model_name_or_path",
                   str(folder), "--resolution", "32", "--max_steps", "1", "--output_dir", str(tmp_path / driver),
                   "--device", "cpu"]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode != 0 and len(lines) == 1, (driver, result.stderr[-2000:])
        assert f"{folder}/config.json" in lines[0] and "use_framewise_encoding are not known" in lines[0]
        assert "Traceback" not in result.stderr and not os.path.isdir(tmp_path / driver / "checkpoint-1")
