"""The distillation student's side of models/: the TINY family (AutoencoderTiny) against diffusers 0.42.1, its export,
`student_config`, each family's `pipeline_normalisation` against the pipelines' own code or formulas, the
teacher.py helpers, and the latent-conditioned PatchGAN."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from family_parity import DiffusersBatch, assert_loaded_exactly, random_images
from test_flux2 import TINY_FLUX2
from test_wan import TINY_QWEN

from vae_trainer.models.families.dc_ae import DC_AE
from vae_trainer.models.discriminator import build_discriminator
from vae_trainer.models.families import family_for_config, family_of
from vae_trainer.models.family import Geometry, constructor_defaults
from vae_trainer.models.families.flux2 import FLUX2
from vae_trainer.models.families.kl import KL
from vae_trainer.models.families.rae import RAE
from vae_trainer.models.teacher import from_pipeline, to_pipeline
from vae_trainer.models.families.tiny import TINY, student_config
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.vae_saving import save_vae
from vae_trainer.models.families.wan import QWEN_IMAGE, WAN

# f8, 4 stages of 8 channels, 2 blocks per stage (1 in the encoder's first and the decoder's last)
STUDENT = {k: v for k, v in student_config(Geometry(8, 8, 4), width=8, depth=2).items() if k != "_class_name"}
FLUX2_BN = {**TINY_FLUX2, "batch_norm_eps": 0.3}  # an eps that matters: the test fails if it is left out
EXTREME = 50.0


def close(a, b, atol: float) -> None:
    assert np.abs(np.asarray(a) - np.asarray(b)).max() <= atol, np.abs(np.asarray(a) - np.asarray(b)).max()


def close_relative(a, b, rtol: float) -> None:
    """Within rtol of b's largest magnitude (float32 sums of different orders differ in the last bits of it)."""
    close(a, b, rtol * max(1.0, np.abs(b).max()))


def extreme_latents() -> np.ndarray:
    """Latents of +-50 (deep in the decoder's 3 * tanh(z / 3) clamp), mixed with ordinary ones."""
    latents = np.random.default_rng(1).normal(0, 1, (2, 4, 4, 4)).astype(np.float32)
    latents[0] = np.sign(latents[0]) * EXTREME
    return latents


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One diffusers process: a seeded AutoencoderTiny and its runs (ordinary and 40x images, both with a training
    step; extreme latents), a run of our export, and the FLUX.2 / Qwen-Image pipelines' own encodes."""
    root = tmp_path_factory.mktemp("tiny")
    batch, x = DiffusersBatch(root), random_images(2, 32, seed=2)
    paddle.seed(7)
    ours = TINY.build(STUDENT, "test")
    for param in ours.parameters():  # off the initialisation, biases too
        param.set_value(param + paddle.randn(param.shape) * 0.05)
    save_vae(ours, str(root / "export"))
    for name in ("tiny", "run", "big", "export_run", "flux2", "qwen"):
        (root / name).mkdir(exist_ok=True)
    out = {"x": x, "ours": ours, "root": root}
    out["tiny_folder"] = batch.make("AutoencoderTiny", root / "tiny" / "vae", STUDENT, seed=3)
    out["run"] = batch.run("AutoencoderTiny", root / "tiny" / "vae", x, root / "run", latents=extreme_latents(),
                           flags=["--train"])
    out["big"] = batch.run("AutoencoderTiny", root / "tiny" / "vae", x * 40, root / "big", flags=["--train"])
    out["export"] = batch.run("AutoencoderTiny", root / "export", x, root / "export_run", latents=extreme_latents())
    for name, class_name, config in (("flux2", "AutoencoderKLFlux2", FLUX2_BN),
                                     ("qwen", "AutoencoderKLQwenImage", TINY_QWEN)):
        folder = batch.make(class_name, root / name / "vae", config, seed=4)
        np.save(root / name / "images.npy", x)
        batch.command("pipeline_encode", folder, "--config", f'{{"class": "{class_name}"}}', "--images",
                      root / name / "images.npy", "--out", root / name / "pipeline.npy")
    batch.flush()
    return out


# ---- TINY against diffusers' AutoencoderTiny

def train_step(vae, images: np.ndarray) -> dict:
    """The trainer's reading of a step: the family's encode / decode in train mode, mse loss, gradients."""
    vae.train()
    vae.clear_gradients()
    x = paddle.to_tensor(images)
    decoded = TINY.decode(vae, TINY.encode(vae, x).mode())
    ((decoded - x) ** 2).mean().backward()
    return {"decoded": decoded.numpy(), **{name: p.grad.numpy() for name, p in vae.named_parameters()}}


@pytest.mark.parametrize("run, scale", [("run", 1.0), ("big", 40.0)])
def test_tiny_forward_and_backward_equal_diffusers(made, run, scale):
    vae = build_vae(pretrained_model_name_or_path=made["tiny_folder"])
    assert family_of(vae) is TINY
    theirs = made[run]()
    assert_loaded_exactly(theirs, "AutoencoderTiny")
    vae.eval()
    with paddle.no_grad():
        latent = TINY.encode(vae, paddle.to_tensor(made["x"] * scale)).mode()
        close(latent.numpy(), theirs["latent"], 1e-4 * scale)
        close(TINY.decode(vae, latent).numpy(), theirs["decoded"], 1e-4)
        if run == "run":  # +-50 latents through the tanh clamp
            close(TINY.decode(vae, paddle.to_tensor(extreme_latents())).numpy(), theirs["decoded_latents"], 1e-4)
    ours = train_step(vae, made["x"] * scale)
    close(ours["decoded"], theirs["train_decoded"], 1e-4)
    grads = [name for name in ours if name != "decoded"]
    assert len(grads) == len([k for k in theirs if k.startswith("grad:")])
    for name in grads:
        scale_of = max(np.abs(theirs[f"grad:{name}"]).max(), 1e-3)
        close(ours[name] / scale_of, theirs[f"grad:{name}"] / scale_of, 2e-4)


def test_our_export_loads_in_diffusers_and_ppdiffusers_and_decodes_as_ours(made):
    from ppdiffusers import AutoencoderTiny

    theirs = made["export"]()
    assert_loaded_exactly(theirs, "AutoencoderTiny")
    ours, latents = made["ours"], paddle.to_tensor(extreme_latents())
    ours.eval()
    reloaded = AutoencoderTiny.from_pretrained(str(made["root"] / "export"))
    with paddle.no_grad():
        expected = TINY.decode(ours, latents).numpy()
        close_relative(theirs["decoded_latents"], expected, 1e-5)
        close(TINY.decode(reloaded, latents).numpy(), expected, 0.0)
        close_relative(theirs["latent"], TINY.encode(ours, paddle.to_tensor(made["x"])).mode().numpy(), 1e-5)
    assert reloaded.config.scaling_factor == 1.0 and TINY.normalisation.origin and not KL.normalisation.origin


def test_a_tiny_config_is_read_by_its_keys_before_dc_ae_and_refuses_what_it_cannot_build():
    assert family_for_config(STUDENT) is TINY and family_for_config({"encoder_block_out_channels": [8]}) is DC_AE
    with_newer = {**STUDENT, "upsample_fn": "nearest", "shift_factor": 0.0, "block_out_channels": [8] * 4}
    assert family_of(TINY.build(with_newer, "here")) is TINY  # a diffusers 0.42.1 folder's config
    with pytest.raises(ValueError, match="here: upsample_fn 'bilinear'"):
        TINY.build({**STUDENT, "upsample_fn": "bilinear"}, "here")
    with pytest.raises(ValueError, match="no tiled"):
        TINY.tiled(TINY.build(STUDENT, "here"), 64)


def test_geometry_and_the_layers_training_reads():
    vae = TINY.build(STUDENT, "here")
    assert TINY.geometry(STUDENT) == Geometry(8, 8, 4, "2 ** (encoder stages - 1)", deterministic=True,
                                              rgba_refusal=TINY.geometry(STUDENT).rgba_refusal)
    with paddle.no_grad():
        latent = TINY.encode(vae, paddle.zeros([1, 3, 32, 32])).mode()
        assert latent.shape == [1, 4, 4, 4] and TINY.decode(vae, latent).shape == [1, 3, 32, 32]
    assert TINY.last_layers(vae)[0].shape == [3, 8, 3, 3] and TINY.last_layers(vae)[1].shape == [4, 8, 3, 3]
    segments = TINY.recompute_segments(vae)
    assert len(segments) == 7 + 7 and all(type(layer).__name__ == "AutoencoderTinyBlock" for _, layer in segments)


def test_a_fresh_decoder_outputs_about_mid_grey_and_every_layer_learns_from_the_first_step():
    """Issue 53: a fresh student (PyTorch's initialisation, the output bias at mid-grey) decodes within a few
    hundredths of grey on average, and its output conv's weights are not zero: zero weights left every earlier
    layer without a gradient at the first step, and Adam's first steps then overshot (a pooled MSE of 29 at step 4,
    lr 1e-3)."""
    paddle.seed(0)
    latents = paddle.randn([2, 4, 4, 4])
    assert np.abs(TINY.decode(TINY.build(STUDENT, "here"), latents).numpy()).mean() > 1  # Paddle's: ~5.7 off grey
    vae = TINY.build(STUDENT, "here", fresh=True)
    decoded = TINY.decode(vae, latents)
    assert np.abs(decoded.numpy()).mean() < 0.1 and abs(decoded.numpy().mean()) < 0.05
    ((decoded - 0.5) ** 2).mean().backward()
    first = next(layer for layer in vae.decoder.layers if isinstance(layer, paddle.nn.Conv2D))
    assert np.abs(first.weight.grad.numpy()).max() > 0 and np.abs(TINY.last_layers(vae)[0].grad.numpy()).max() > 0


# ---- student_config

def test_student_config_at_f8_width_64_depth_3_is_taesds():
    config = student_config(Geometry(8, 8, 4))
    assert config["num_encoder_blocks"] == [1, 3, 3, 3] and config["num_decoder_blocks"] == [3, 3, 3, 1]
    assert config["encoder_block_out_channels"] == config["decoder_block_out_channels"] == [64] * 4
    taesd = {k: v for k, v in constructor_defaults(TINY).items() if k not in ("force_upcast",)}
    assert {k: (list(v) if isinstance(v, tuple) else v) for k, v in taesd.items()} == \
        {k: config[k] for k in taesd}  # ppdiffusers' defaults are TAESD's
    assert config["_class_name"] == "AutoencoderTiny" and config["scaling_factor"] == 1.0


@pytest.mark.parametrize("factor, channels, stages", [(16, 16, 5), (32, 32, 6), (8, 32, 4), (2, 4, 2)])
def test_student_config_follows_the_teachers_geometry(factor, channels, stages):
    config = student_config(Geometry(factor, factor, channels), width=8, depth=1)
    assert len(config["num_encoder_blocks"]) == len(config["num_decoder_blocks"]) == stages
    assert config["latent_channels"] == channels
    geometry = TINY.geometry(config)
    assert geometry == Geometry(factor, factor, channels, geometry.rule, deterministic=True,
                                rgba_refusal=geometry.rgba_refusal)


@pytest.mark.parametrize("geometry, message", [
    (Geometry(14, 14, 768, "patch 14", output_size=224), "fixed 224 px"),
    (Geometry(12, 12, 4), "power of two"), (Geometry(1, 1, 4), "power of two"),
    (Geometry(8, 16, 4), "decoder upsamples by 16")])
def test_student_config_refuses_what_a_tiny_autoencoder_cannot_be(geometry, message):
    with pytest.raises(ValueError, match=message):
        student_config(geometry)


def test_student_config_refuses_rae_and_rae_has_no_pipeline_normalisation():
    from test_rae import TINY_RAE

    with pytest.raises(ValueError, match="fixed"):
        student_config(RAE.geometry(TINY_RAE))
    with pytest.raises(ValueError, match="AutoencoderRAE: .*fixed size"):
        RAE.normalisation.pipeline(RAE.build(TINY_RAE, "t"))


# ---- pipeline_normalisation: what the pipelines decode from / encode to

def pipeline_latents(family, vae, images: np.ndarray) -> np.ndarray:
    with paddle.no_grad():
        z = family.encode(vae.eval(), paddle.to_tensor(images)).mode()
        mean, std = family.normalisation.pipeline(vae)
        out = to_pipeline(z, mean, std)
        close(from_pipeline(out, mean, std).numpy(), z.numpy(), 1e-5)  # the inverse
    return out.numpy()


@pytest.mark.parametrize("name, family", [("flux2", FLUX2), ("qwen", QWEN_IMAGE)])
def test_pipeline_normalisation_is_the_pipelines_own_encode(made, name, family):
    """Flux2Pipeline._encode_vae_image (patchify, (x - running_mean) / sqrt(running_var + eps)), un-patchified by its
    _unpatchify_latents; QwenImageEditPipeline._encode_vae_image ((z - latents_mean) / latents_std): their code."""
    vae = build_vae(pretrained_model_name_or_path=str(made["root"] / name), subfolder="vae")
    assert family_of(vae) is family
    mean, std = family.normalisation.pipeline(vae)
    assert mean.dtype == std.dtype == np.float32 and mean.shape == std.shape
    if family is FLUX2:
        assert mean.shape == (4, 2, 2) and np.abs(mean).min() > 0  # non-trivial statistics
    theirs = np.load(made["root"] / name / "pipeline.npy")
    close(pipeline_latents(family, vae, made["x"]), theirs, 1e-4)


def test_kl_pipeline_normalisation_is_the_sd_flux_and_sdxl_rules():
    """diffusers 0.42.1: pipeline_stable_diffusion_xl.py 1276-1287 decodes latents * latents_std / scaling_factor +
    latents_mean when the config has both (else latents / scaling_factor); pipeline_flux.py 962: latents /
    scaling_factor + shift_factor."""
    base = dict(block_out_channels=[8], down_block_types=["DownEncoderBlock2D"], up_block_types=["UpDecoderBlock2D"],
                latent_channels=4, norm_num_groups=4, layers_per_block=1)
    z = np.random.default_rng(0).normal(size=(1, 4, 3, 5)).astype(np.float32)
    cases = [({"scaling_factor": 0.18215}, z * 0.18215),
             ({"scaling_factor": 0.3611, "shift_factor": 0.1159}, (z - 0.1159) * 0.3611),
             ({"scaling_factor": 0.5, "latents_mean": [0.1, -0.2, 0.3, 0.4], "latents_std": [2.0, 0.5, 1.5, 3.0]},
              (z - np.array([0.1, -0.2, 0.3, 0.4]).reshape(4, 1, 1)) * 0.5
              / np.array([2.0, 0.5, 1.5, 3.0]).reshape(4, 1, 1))]
    for config, expected in cases:
        vae = KL.build({**base, **config}, "here")
        close(to_pipeline(paddle.to_tensor(z), *KL.normalisation.pipeline(vae)).numpy(), expected, 1e-6)


def test_dc_ae_and_wan_pipeline_normalisation_are_sanas_and_wans_rules():
    """pipeline_sana.py 961 decodes latents / scaling_factor; pipeline_wan.py 664-672 decodes latents * latents_std
    + latents_mean (latents_std there being 1 / the config's)."""
    from test_dc_ae import TINY_DC
    from test_wan import STATS, TINY_WAN22

    z = np.random.default_rng(0).normal(size=(1, 8, 3, 5)).astype(np.float32)
    dc = DC_AE.build(TINY_DC, "here")
    close(to_pipeline(paddle.to_tensor(z), *DC_AE.normalisation.pipeline(dc)).numpy(), z * 0.41407, 1e-6)
    wan = WAN.build(TINY_WAN22, "here")
    mean, std = (np.array(STATS[k], np.float32).reshape(4, 1, 1) for k in ("latents_mean", "latents_std"))
    close(to_pipeline(paddle.to_tensor(z[:, :4]), *WAN.normalisation.pipeline(wan)).numpy(), (z[:, :4] - mean) / std,
          1e-6)
    with paddle.no_grad():  # the shapes fit what encode returns for images: NCHW
        assert WAN.encode(wan, paddle.zeros([1, 3, 16, 16])).mode().ndim == 4


def test_to_pipeline_tiles_a_pattern_with_its_period():
    z = paddle.zeros([1, 2, 3, 5])
    mean = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    out = to_pipeline(z, mean, np.ones_like(mean)).numpy()
    assert out[0, 1, 2, 4] == -mean[1, 0, 0] and out[0, 0, 1, 3] == -mean[0, 1, 1] and out[0, 1, 0, 1] == -mean[1, 0, 1]


# ---- the latent-conditioned PatchGAN

def test_a_conditioned_patchgan_scores_images_with_their_latents():
    paddle.seed(0)
    disc = build_discriminator("patch", "group", 2, 8, condition_channels=4)
    images = paddle.randn([2, 3, 32, 32])
    images.stop_gradient = False
    latents = paddle.randn([2, 4, 4, 4])
    logits = disc(images, latents)
    assert logits.shape == [2, 1, 6, 6] and disc.main[0].weight.shape[1] == 7
    assert np.abs(disc(images, latents * 0).numpy() - logits.numpy()).max() > 1e-3
    logits.mean().backward()
    assert np.abs(images.grad.numpy()).max() > 0
    with pytest.raises(ValueError, match="takes 4 condition channels, given none"):
        disc(images)
    with pytest.raises(ValueError, match="only the PatchGANs"):
        build_discriminator("vgg", condition_channels=4)
