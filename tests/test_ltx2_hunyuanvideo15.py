"""LTX-2's and HunyuanVideo 1.5's VAEs fine-tuned (issue 52; vae_trainer/models/families/ltx2.py, hunyuanvideo15.py):
a tiny seeded diffusers folder of each (diffusers 0.42.1 in .venv-flux2) given as --pretrained_model_name_or_path
DIR --subfolder vae, fine-tuned on images by both entry points (decoder-only with --recompute, EMA, the gentle GAN
start, accumulation; resumed exactly), with --trainable_modules, and on video clips written at test time; the export
in diffusers' own class. The networks' equality with diffusers' is tests/test_autoencoder_kl_ltx2.py's and
tests/test_autoencoder_kl_hunyuanvideo15.py's; here it is the trainer around them.

Each family once per fixture (module-scoped, parametrized by family): one diffusers process makes both sources, one
per family runs the sources and the exports. Sizes: LTX-2 is f32 (its decoder's reflect padding needs 2x2 latents:
64 px), HunyuanVideo 1.5 f16 (32 px); clips of 9 frames (LTX-2: 1 + 8k) and 5 (HunyuanVideo 1.5: 1 + 4k).
LPIPS is off (`--perceptual_weight 0`): nothing here is about it.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shutil
from dataclasses import dataclass

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, load_script, read_scalars, run_in_process
from family_parity import (DiffusersBatch, assert_loaded_exactly, folder_pixels, mean_psnr, random_images,
                           trainer_args)
from safetensors.numpy import load_file

from vae_trainer.argument_parser import parse_arguments
from vae_trainer.models.families import family_for_config, family_of
from vae_trainer.models.vae_loading import build_vae

TORCH_WEIGHTS, PADDLE_WEIGHTS = "diffusion_pytorch_model.safetensors", "diffusion_paddle_model.safetensors"


@dataclass(frozen=True)
class Case:
    class_name: str
    config: dict  # the tiny source's, every latent-scale key off its class's default
    size: int  # px: the smallest the family's factor and padding take, twice over for the held-out crops
    frames: int  # the clip length trained on
    group: int  # its temporal factor: frames one latent frame codes after the first
    latent_keys: tuple  # what defines the latent besides the encoder: buffers in its weights
    trainable: tuple  # --trainable_modules patterns (decoder-side only: the latents stay)


CASES = {
    # LTX-2's published layout, tiny: causal encoder, non-causal reflect-padded decoder, f32 x 8, patch 4.
    "ltx2": Case("AutoencoderKLLTX2Video",
                 dict(latent_channels=8, block_out_channels=[8, 16, 32, 64], decoder_block_out_channels=[8, 16, 32],
                      layers_per_block=[1, 1, 1, 1, 1], decoder_layers_per_block=[1, 1, 1, 1], decoder_causal=False,
                      scaling_factor=0.75),
                 64, 9, 8, ("latents_mean", "latents_std"), ("decoder.conv_out.*", "decoder.up_blocks.2.*")),
    # HunyuanVideo 1.5's layout, tiny: 5 blocks (f16 x 4), 32 latent channels, the published channel matching.
    "hunyuan15": Case("AutoencoderKLHunyuanVideo15",
                      dict(block_out_channels=[8, 16, 32, 64, 64], layers_per_block=1, scaling_factor=0.8),
                      32, 5, 4, (), ("decoder.conv_out.*", "decoder.up_blocks.3.*")),
}


def weights(folder, name=TORCH_WEIGHTS) -> dict:
    return load_file(os.path.join(folder, name))


def is_latent_side(case: Case, name: str) -> bool:
    return name.startswith("encoder.") or name in case.latent_keys


def video_only(folder) -> list:
    """The VideoOnlyChannels of the VAE in `folder`: what a one-frame pass never reaches (from its config alone)."""
    return build_vae(os.path.join(folder, "config.json")).video_only_weights()


def assert_latent_side_kept(case: Case, source_dir: str, out_dir: str) -> set:
    """Both weight files of `out_dir` hold the source's encoder and latent buffers bit for bit; returns the names that
    changed (none of them latent-side)."""
    source = weights(source_dir)
    for name in (TORCH_WEIGHTS, PADDLE_WEIGHTS):
        exported = weights(out_dir, name)
        assert exported.keys() == source.keys(), name
        for key in source:
            if is_latent_side(case, key):
                np.testing.assert_array_equal(exported[key], source[key], err_msg=f"{name}: {key}")
    exported = weights(out_dir)
    return {key for key in source if not np.array_equal(exported[key], source[key])}


# ---- the sources and data

@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """{family: a pipeline download whose vae/ diffusers made with seeded weights (LTX-2's latents_mean /
    latents_std buffers off 0 / 1 too)}, one diffusers process for both."""
    root = tmp_path_factory.mktemp("ltx2_hy15_sources")
    batch = DiffusersBatch(root)
    for name, case in CASES.items():
        batch.make(case.class_name, root / name / "vae", case.config, seed=3)
    batch.flush()
    return {name: str(root / name) for name in CASES}


@pytest.fixture(scope="module")
def held_out(held_out_32, tmp_path_factory) -> dict:
    """{px: a folder of 6 held-out crops of that size}: the evaluation's resize and crop leave them as they are."""
    import skimage.data
    from PIL import Image

    root = tmp_path_factory.mktemp("held_out_64")
    for k, photo in enumerate((skimage.data.coffee(), skimage.data.rocket())):
        for j in range(3):
            Image.fromarray(photo[40 + 64 * j: 104 + 64 * j, 100:164]).save(root / f"crop_{k}_{j}.png")
    return {32: held_out_32, 64: str(root)}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    """{train: 4 H.264 clips of 11 frames at 72 px (a keyframe every 6), eval: 2 clips of 9 frames at 64 px of
    other photos}, written now (scripts/make_demo_clips.py: pans and zooms)."""
    import skimage.data
    from PIL import Image

    root = tmp_path_factory.mktemp("ltx2_hy15_clips")
    for split, names in (("train_photos", ("astronaut", "chelsea", "coffee")), ("eval_photos", ("rocket", "camera"))):
        (root / split).mkdir()
        for name in names:
            Image.fromarray(getattr(skimage.data, name)()).convert("RGB").save(root / split / f"{name}.png")
    make = load_script("make_demo_clips").main
    make(["--image_dir", str(root / "train_photos"), "--output_dir", str(root / "train"), "--num_clips", "4",
          "--frames", "11", "--size", "72", "--keyframe_interval", "6", "--seed", "1"])
    make(["--image_dir", str(root / "eval_photos"), "--output_dir", str(root / "eval"), "--num_clips", "2",
          "--frames", "9", "--size", "64", "--seed", "2"])
    return {"train": str(root / "train"), "eval": str(root / "eval")}


@pytest.fixture(scope="module", params=list(CASES))
def family(request) -> str:
    return request.param


# ---- images, both entry points

@pytest.fixture(scope="module")
def image_runs(family, sources, photo_filelist, held_out, tmp_path_factory) -> dict:
    """{driver: output dir} of a decoder-only fine-tune on images with --recompute, evaluated at steps 2 and 4 (the
    GAN from step 3, ramped over 2 steps; EMA, accumulation 2); "resumed": the loop from the Trainer's checkpoint-2."""
    case, out = CASES[family], {}

    def flags(output_dir, **more):
        return trainer_args(photo_filelist, output_dir, pretrained_model_name_or_path=sources[family],
                            subfolder="vae", freeze_encoder="true", resolution=case.size, recompute="true",
                            perceptual_weight=0, disc_weight_warmup_steps=2, eval_file_list=held_out[case.size],
                            eval_steps=2, eval_num_images=6, **more)

    for driver in DRIVERS:
        out[driver] = str(tmp_path_factory.mktemp(f"{family}_{driver.split('.')[0]}"))
        run_in_process(driver, flags(out[driver]))
    resumed = tmp_path_factory.mktemp(f"{family}_resumed")
    shutil.copytree(os.path.join(out[DRIVERS[0]], "checkpoint-2"), resumed / "checkpoint-2")
    run_in_process(DRIVERS[1], flags(str(resumed), resume_from_checkpoint="latest"))
    out["resumed"] = str(resumed)
    return out


def test_both_entry_points_fine_tune_images_to_the_same_numbers_and_resume_exactly(image_runs):
    trainer, loop = image_runs[DRIVERS[0]], image_runs[DRIVERS[1]]
    for tag in ("loss/total", "loss/pixel", "loss/kl", "loss/generator", "loss/discriminator", "gan/adaptive_weight",
                "eval/psnr", "eval/ssim"):
        a, b = read_scalars(os.path.join(trainer, "logs"), tag), read_scalars(os.path.join(loop, "logs"), tag)
        assert a and a == pytest.approx(b, rel=1e-6), tag
    for other in (loop, image_runs["resumed"]):
        for folder in ("vae", "vae_raw"):
            wa, wb = weights(os.path.join(trainer, folder)), weights(os.path.join(other, folder))
            assert wa.keys() == wb.keys()
            for name in wa:
                np.testing.assert_array_equal(wa[name], wb[name], err_msg=f"{other}/{folder}: {name}")


def test_decoder_only_keeps_the_encoder_latent_buffers_and_what_images_never_train(family, image_runs, sources):
    case, source_dir = CASES[family], os.path.join(sources[family], "vae")
    output_dir = image_runs[DRIVERS[1]]
    source, parts = weights(source_dir), video_only(source_dir)
    assert parts and all(part.name.startswith("decoder.") for part in parts)
    for folder in ("vae", "vae_raw"):
        changed = assert_latent_side_kept(case, source_dir, os.path.join(output_dir, folder))
        assert changed and all(name.startswith("decoder.") for name in changed)
        exported = weights(os.path.join(output_dir, folder))
        for part in parts:  # one frame leaves them an exactly zero gradient: AdamW, clipping and the EMA keep them
            np.testing.assert_array_equal(part.part(exported[part.name]), part.part(source[part.name]), part.name)
    config = json.load(open(os.path.join(output_dir, "vae", "config.json")))
    stats = json.load(open(os.path.join(output_dir, "vae", "latent_stats.json")))
    assert config["_class_name"] == case.class_name and config["scaling_factor"] == case.config["scaling_factor"]
    assert "kept from the pretrained VAE" in stats["source"]
    if case.latent_keys:  # LTX-2: the buffers' values, with the config's factor beside them
        held = stats["latent_normalisation"]
        assert held["scaling_factor"] == case.config["scaling_factor"]
        for key in case.latent_keys:
            np.testing.assert_array_equal(np.float32(held[key]), source[key], err_msg=key)
    else:
        assert stats["scaling_factor"] == case.config["scaling_factor"]


def test_the_ema_export_lags_the_raw_weights(family, image_runs, sources):
    """--use_ema: vae/ holds the average (ppdiffusers' EMAModel, its decay warming up from 0.2), nearer the source
    than the raw weights in vae_raw/; the frozen side the same in both."""
    source = weights(os.path.join(sources[family], "vae"))
    ema, raw = (weights(os.path.join(image_runs[DRIVERS[0]], folder)) for folder in ("vae", "vae_raw"))
    decoder = [name for name in source if name.startswith("decoder.")]
    distance = lambda w: math.sqrt(sum(float(((w[n] - source[n]) ** 2).sum()) for n in decoder))  # noqa: E731
    assert 0 < distance(ema) < distance(raw) and not all(np.array_equal(ema[n], raw[n]) for n in decoder)
    assert all(np.array_equal(ema[n], raw[n]) for n in source if n.startswith("encoder."))


def test_the_gan_enters_at_disc_start_with_its_adaptive_weight(image_runs):
    """--disc_start 2: neither network's GAN loss before step 3; the adaptive weight (at the family's decoder
    conv_out) finite and positive from then (its ramp: test_trainable_modules_..., without the adaptive factor)."""
    logs = os.path.join(image_runs[DRIVERS[1]], "logs")
    assert sorted(read_scalars(logs, "loss/generator")) == sorted(read_scalars(logs, "loss/discriminator")) == [3, 4]
    assert all(0 < value < 1e4 for value in read_scalars(logs, "gan/adaptive_weight").values())


def test_the_export_loads_in_diffusers_with_the_same_latents_and_reconstructs_better(family, image_runs, sources,
                                                                                    held_out, tmp_path, capsys):
    """diffusers' own class loads vae/ with nothing missing or unexpected, gives the source's latents bit for bit,
    and reconstructs the held-out images clearly better (its PSNR on [0, 1]), as scripts/eval_vae.py says; one image
    per input (diffusers' HunyuanVideo 1.5 attention fails on a batch above 1)."""
    case, vae_dir = CASES[family], os.path.join(image_runs[DRIVERS[0]], "vae")
    x = folder_pixels(held_out[case.size])[:, :, None]  # one-frame clips
    more = {f"image{k}": x[k:k + 1] for k in range(1, len(x))}
    batch, results = DiffusersBatch(tmp_path), {}
    for name, folder in (("source", os.path.join(sources[family], "vae")), ("export", vae_dir)):
        os.makedirs(tmp_path / name)
        results[name] = batch.run(case.class_name, folder, x[:1], tmp_path / name, more_images=more)
    batch.flush()
    theirs = {name: result() for name, result in results.items()}
    assert_loaded_exactly(theirs["export"], case.class_name)
    keys = [""] + [f"{name}_" for name in more]
    decoded, means = ({name: np.concatenate([theirs[name][key + part] for key in keys]) for name in theirs}
                      for part in ("decoded", "mean"))
    np.testing.assert_array_equal(means["export"], means["source"])  # the latents, in diffusers
    psnr = {name: mean_psnr(decoded[name][:, :, 0], x[:, :, 0]) for name in theirs}
    assert psnr["export"] > psnr["source"] + 1.0, psnr
    result = load_script("eval_vae").main(["--vae", vae_dir, "--data", held_out[case.size], "--resolution",
                                           str(case.size), "--num_images", "6", "--output_dir",
                                           str(tmp_path / "eval"), "--skip_lpips"])
    assert "scaling_factor" in capsys.readouterr().out.split("\n\n")[-1]
    assert result.metrics["psnr"] == pytest.approx(psnr["export"], abs=1e-3)


# ---- the family's parts, in this process

def test_recompute_gives_the_same_gradients_on_images_and_clips(family, sources):
    from vae_trainer.models.recompute import enable_recompute

    case = CASES[family]
    inputs = (paddle.to_tensor(random_images(2, case.size)),
              paddle.to_tensor(np.random.default_rng(2).uniform(-1, 1, (1, 3, case.frames, case.size, case.size))
                               .astype(np.float32)))
    for x in inputs:
        grads, losses = [], []
        for recompute in (False, True):
            vae = build_vae(pretrained_model_name_or_path=sources[family], subfolder="vae")
            names = enable_recompute(vae) if recompute else []
            assert not any("conv_out" in name for name in names)
            fam = family_of(vae)
            loss = (fam.decode(vae, fam.encode(vae, x).mode()) - x).abs().mean()
            loss.backward()
            losses.append(loss.item())
            grads.append({name: p.grad.numpy() for name, p in vae.named_parameters() if p.grad is not None})
            if recompute:  # really recomputed: every segment re-ran its forward
                assert all(layer.forward.calls > 0 for _, layer in fam.recompute_segments(vae))
        assert losses[0] == losses[1] and grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
        for name in grads[0]:
            np.testing.assert_allclose(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_only_clips_reach_the_video_only_weights(family, sources):
    """Why a decoder-only run on images leaves them bit for bit (and why --weight_decay is refused there): one
    frame gives those output channels of the temporal upsamplers an exactly zero gradient, a clip does not."""
    case = CASES[family]
    vae = build_vae(pretrained_model_name_or_path=sources[family], subfolder="vae")
    fam, params, parts = family_of(vae), dict(vae.named_parameters()), vae.video_only_weights()
    for frames in (1, case.frames):
        vae.clear_gradients()
        x = np.random.default_rng(frames).uniform(-1, 1, (1, 3, frames, case.size, case.size)).astype(np.float32)
        x = paddle.to_tensor(x[:, :, 0] if frames == 1 else x)
        (fam.decode(vae, fam.encode(vae, x).mode()) - x).square().mean().backward()
        reached = [np.abs(part.part(params[part.name].grad.numpy())).max() > 0 for part in parts]
        assert not any(reached) if frames == 1 else all(reached), frames


def test_posterior_std_is_refused_before_training_where_no_export_can_hold_it(sources):
    """HunyuanVideo 1.5's encoder adds a channel-mean shortcut to its moments: refused when the model is put
    together (it once failed at the export, after the whole run); LTX-2's conv makes its log-variance alone."""
    from vae_trainer.models.trainable import VAEWithDiscriminator

    vae = build_vae(pretrained_model_name_or_path=sources["hunyuan15"], subfolder="vae")
    with pytest.raises(ValueError, match="--posterior_std 0.5: AutoencoderKLHunyuanVideo15's encoder adds"):
        VAEWithDiscriminator(vae, paddle.nn.Identity(), posterior_std=0.5)
    VAEWithDiscriminator(build_vae(pretrained_model_name_or_path=sources["ltx2"], subfolder="vae"),
                         paddle.nn.Identity(), posterior_std=0.5)


def test_a_number_for_scaling_factor_is_refused_where_the_weights_hold_the_statistics(sources):
    """LTX-2's latents are normalised by its buffers (measured or kept, never given); its config's scaling_factor is
    kept beside them, and the refusal says so (not "has no scaling_factor", FLUX.2's)."""
    from types import SimpleNamespace

    from vae_trainer.models.latent_scale import scaling_factor_mode

    vae = build_vae(pretrained_model_name_or_path=sources["ltx2"], subfolder="vae")
    flags = SimpleNamespace(scaling_factor="0.5", ignore_keys=None, init_from_ckpt=None,
                            pretrained_model_name_or_path="x")
    with pytest.raises(ValueError, match=r"--scaling_factor 0\.5: AutoencoderKLLTX2Video its scaling_factor is its "
                                         r"config's, kept; .* latents_mean / latents_std buffers"):
        scaling_factor_mode(flags, vae)


# ---- --trainable_modules

@pytest.fixture(scope="module")
def trainable_run(family, sources, photo_filelist, tmp_path_factory) -> str:
    """2 steps training the decoder-side parameters the patterns match, the GAN from step 1 ramped over 2 steps
    with a constant (not adaptive) weight 0.5."""
    output_dir = str(tmp_path_factory.mktemp(f"{family}_trainable"))
    flags = trainer_args(photo_filelist, output_dir, pretrained_model_name_or_path=sources[family], subfolder="vae",
                         resolution=CASES[family].size, perceptual_weight=0, max_steps=2, save_steps=0,
                         gradient_accumulation_steps=1, use_ema=None, ema_decay=None, disc_start=0,
                         disc_weight_warmup_steps=2, disc_weight=0.5, adaptive_disc_weight="false")
    run_in_process(DRIVERS[1], flags + ["--trainable_modules", *CASES[family].trainable])
    return output_dir


def test_trainable_modules_train_those_alone_and_the_gan_ramps_in(family, trainable_run, sources):
    case, source_dir = CASES[family], os.path.join(sources[family], "vae")
    changed = assert_latent_side_kept(case, source_dir, os.path.join(trainable_run, "vae"))
    matched = {name for name in weights(source_dir) if any(fnmatch.fnmatch(name, p) for p in case.trainable)}
    assert matched and changed == matched
    source, exported = weights(source_dir), weights(os.path.join(trainable_run, "vae"))
    for part in video_only(source_dir):  # the rows images never reach, of matched weights too
        np.testing.assert_array_equal(part.part(exported[part.name]), part.part(source[part.name]), part.name)
    # The GAN weight that reached the loss: half of --disc_weight at the first step, all of it at the second.
    assert read_scalars(os.path.join(trainable_run, "logs"), "gan/adaptive_weight") == {1: 0.25, 2: 0.5}


# ---- clips

@pytest.fixture(scope="module")
def clip_run(family, sources, clips, tmp_path_factory) -> str:
    """Decoder-only on clips of the family's length (--num_frames 9 / 5), the temporal term, the GAN from step 2,
    evaluated on the held-out clips at step 3."""
    case = CASES[family]
    output_dir = str(tmp_path_factory.mktemp(f"{family}_clips"))
    run_in_process(DRIVERS[0], trainer_args(
        clips["train"], output_dir, pretrained_model_name_or_path=sources[family], subfolder="vae",
        freeze_encoder="true", resolution=case.size, num_frames=case.frames, temporal_loss_weight=0.5,
        perceptual_weight=0, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=3, disc_start=1,
        use_ema=None, ema_decay=None, save_steps=0, eval_file_list=clips["eval"], eval_steps=3, eval_num_images=2))
    return output_dir


def test_clips_train_the_decoder_s_temporal_weights_and_leave_the_latents(family, clip_run, sources):
    case, source_dir = CASES[family], os.path.join(sources[family], "vae")
    changed = assert_latent_side_kept(case, source_dir, os.path.join(clip_run, "vae"))
    assert changed and all(name.startswith("decoder.") for name in changed)
    before, after = weights(source_dir), weights(os.path.join(clip_run, "vae"))
    for part in video_only(source_dir):  # what images never reach, clips do
        assert not np.array_equal(part.part(after[part.name]), part.part(before[part.name])), part.name
    assert sorted(read_scalars(os.path.join(clip_run, "logs"), "loss/temporal")) == [1, 2, 3]


def test_clip_evaluation_reports_flicker_and_the_family_s_frame_positions(family, clip_run):
    """psnr_position_0..k, k the family's temporal factor: frame 0, then the place in each latent frame's group
    (LTX-2's of 8, not 4), each the mean PSNR of those frames."""
    case = CASES[family]
    record = [json.loads(line) for line in open(os.path.join(clip_run, "eval_metrics.jsonl"))][-1]
    metrics = record["metrics"]
    positions = {name for name in metrics if name.startswith("psnr_position_")}
    assert positions == {f"psnr_position_{p}" for p in range(case.group + 1)}
    assert record["num_images"] == 2 and 0 < metrics["flicker"] < 1
    # With T = 1 + k each later place holds one frame per clip: the mean of the places weighted by their frames
    # is the mean PSNR over every frame.
    assert np.mean([metrics[name] for name in positions]) == pytest.approx(metrics["psnr"], abs=1e-4)
    assert "groups of k frames" in record["protocol"][f"psnr_position_{case.group}"]


# ---- refused, and the published configs

@pytest.mark.parametrize("config,flags,message", [
    ("ltx2_vae", ["--num_frames", "5"], "--num_frames 5: AutoencoderKLLTX2Video's causal layout codes the first frame "
     "alone, then groups of 8: it takes 1 + 8k frames (9, 17, 25, 33)"),
    ("ltx2_vae", ["--resolution", "48"], "--resolution 48 must be a multiple of the VAE's downsampling factor 32"),
    ("ltx2_vae", ["--resolution", "32"], "--resolution 32 gives latents below 2x2, the smallest "
     "AutoencoderKLLTX2Video takes"),
    ("hunyuanvideo15_vae", ["--num_frames", "7"], "--num_frames 7: AutoencoderKLHunyuanVideo15's causal layout codes "
     "the first frame alone, then groups of 4: it takes 1 + 4k frames (5, 9, 13, 17)"),
    ("hunyuanvideo15_vae", ["--resolution", "40"], "--resolution 40 must be a multiple of the VAE's downsampling "
     "factor 16 (spatial_compression_ratio, "),
])
def test_what_the_family_cannot_take_is_refused_at_parse_time(config, flags, message, tmp_path):
    argv = ["--file_list", "x", "--vae_config_file", os.path.join(REPO, "configs", f"{config}.json"),
            "--max_steps", "1", "--output_dir", str(tmp_path), "--resolution", "64"] + flags
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_arguments(argv)


def test_a_download_s_lengths_are_refused_from_its_own_config(family, sources, tmp_path):
    case = CASES[family]
    argv = ["--file_list", "x", "--pretrained_model_name_or_path", sources[family], "--subfolder", "vae",
            "--max_steps", "1", "--output_dir", str(tmp_path), "--resolution", str(case.size)]
    parse_arguments(argv + ["--num_frames", str(case.frames)])
    lengths = ", ".join(str(1 + case.group * n) for n in range(1, 5))
    with pytest.raises(ValueError, match=re.escape(f"it takes 1 + {case.group}k frames ({lengths})")):
        parse_arguments(argv + ["--num_frames", str(case.frames + 2)])


@pytest.mark.parametrize("name,class_name,factor,frames,channels,latents", [
    ("ltx2_vae", "AutoencoderKLLTX2Video", 32, 8, 3, 128),
    ("hunyuanvideo15_vae", "AutoencoderKLHunyuanVideo15", 16, 4, 3, 32),
    ("qwen_image21_vae", "AutoencoderKLQwenImage21", 16, 0, 4, 64),
])
def test_the_published_configs_are_their_family_s(name, class_name, factor, frames, channels, latents):
    """configs/*.json: diffusers 0.42.1's defaults, LTX-2's with the published non-causal decoder and its stated
    32 / 8 ratios; every key known to our class, the family and its geometry read from the file alone."""
    from vae_trainer.models.family import check_config_keys

    config = json.load(open(os.path.join(REPO, "configs", f"{name}.json")))
    fam = family_for_config(config)
    check_config_keys(config, fam, name)
    geometry = fam.geometry(config)
    assert (fam.class_name, geometry.factor, geometry.decoder_factor) == (class_name, factor, factor)
    assert (geometry.frames, geometry.channels, geometry.latent_channels) == (frames, channels, latents)
    if name == "ltx2_vae":
        assert config["decoder_causal"] is False and geometry.min_latent_side == 2
    # Without `_class_name` (hand-written configs) the keys decide: LTX-2's patch_size is also FLUX.2's.
    assert family_for_config({k: v for k, v in config.items() if k != "_class_name"}) is fam
