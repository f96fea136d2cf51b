"""EQ-VAE's equivariance objective (vae_trainer/objectives/equivariance.py, the step): the transforms' math, the draws,
the transformed objective, both entry points, exact resume, two ranks, and the flags' refusals."""

import os
import shutil

import numpy as np
import paddle
import pytest
from PIL import Image
from conftest import DRIVERS, import_test_extra, read_scalars, run_entry_point, run_in_process, tiny_args

from vae_trainer.step import logged_images
from vae_trainer.argument_parser import parse_arguments
from vae_trainer.objectives.equivariance import (MIN_SCALED_SIDE, Transform, draw, equivariance_pairs,
                                      parse_transforms, resize, scaled_size)

FACTORS = (4, 8)
LATENT_SIZES = [(8, 8), (7, 5), (3, 9), (2, 2), (5, 1), (32, 17)]
SCALES = (0.25, 0.3, 0.5, 0.61, 0.99)


def blocks(latent: np.ndarray, factor: int) -> np.ndarray:
    """An image made of the latent's values in factor x factor blocks (a latent / image pair with a known map)."""
    return latent.repeat(factor, axis=2).repeat(factor, axis=3)


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("height,width", LATENT_SIZES)
def test_scale_keeps_both_sizes_exact_multiples_and_resamples_like_pil_bilinear(height, width, factor):
    rng = np.random.default_rng(height * 31 + width)
    latent = rng.standard_normal((2, 4, height, width)).astype("float32")
    images = blocks(rng.standard_normal((2, 3, height, width)).astype("float32"), factor)
    for scale in SCALES:
        transform = Transform("scale", scale=scale)
        z = transform(paddle.to_tensor(latent), (height, width), images.shape[2:])
        x = transform(paddle.to_tensor(images), (height, width), images.shape[2:])
        floor = -(-MIN_SCALED_SIDE // factor)  # the fewest latent samples of a scorable image
        expected = tuple(n if n - 1 < floor else max(floor, min(n - 1, round(scale * n))) for n in (height, width))
        assert tuple(z.shape) == (2, 4, *expected)
        assert tuple(x.shape) == (2, 3, expected[0] * factor, expected[1] * factor)  # exact multiples of F
        assert all(side >= MIN_SCALED_SIDE or side == n * factor for side, n in zip(x.shape[2:], (height, width)))
        for ours, source in ((z, latent), (x, images)):
            np.testing.assert_allclose(ours.numpy(), pil_resized(source, tuple(ours.shape[2:])), atol=2e-5)


def pil_resized(array: np.ndarray, size) -> np.ndarray:
    """PIL's antialiased BILINEAR resize of every [H, W] plane (the reference; PyTorch's antialias=True agrees
    but where an output side is 1)."""
    planes = [np.asarray(Image.fromarray(plane, mode="F").resize(size[::-1], Image.BILINEAR))
              for plane in array.reshape(-1, *array.shape[2:])]
    return np.stack(planes).reshape(*array.shape[:2], *size)


def test_resampling_matches_torch_antialias_where_no_side_is_one():
    torch = import_test_extra("torch", "PyTorch's antialiased bilinear, a second reference")
    x = np.random.default_rng(1).standard_normal((1, 2, 37, 23)).astype("float32")
    theirs = torch.nn.functional.interpolate(torch.from_numpy(x), size=(11, 7), mode="bilinear", antialias=True,
                                             align_corners=False)
    np.testing.assert_allclose(resize(paddle.to_tensor(x), (11, 7)).numpy(), theirs.numpy(), atol=2e-6)


def test_a_scale_always_shrinks_and_a_constant_stays_constant():
    assert [scaled_size(n, 0.99) for n in (1, 2, 3, 64)] == [1, 1, 2, 63]
    assert [scaled_size(n, 0.25) for n in (1, 2, 3, 64)] == [1, 1, 1, 16]
    assert [scaled_size(n, 0.25, minimum=3) for n in (2, 3, 4, 64)] == [2, 3, 3, 16]  # never below 3 when it can
    constant = paddle.full([1, 3, 24, 40], 0.37)
    assert np.abs(resize(constant, (7, 13)).numpy() - 0.37).max() < 1e-6  # the weights sum to 1


def test_a_scale_keeps_the_latent_sides_the_decoder_takes():
    """LTX-2's reflect-padded decoder takes latent sides of 2 at least (Geometry.min_latent_side): a scale drawn for
    it never goes below, where a 1x1 latent would fail its decode at that step."""
    from test_autoencoder_kl_ltx2 import CONFIGS

    from vae_trainer.models.families import family_for_config

    config = {**CONFIGS["noncausal"], "decoder_spatial_padding_mode": "reflect"}
    family = family_for_config({"_class_name": "AutoencoderKLLTX2Video", **config})
    min_side = family.geometry(config).min_latent_side
    assert min_side == 2
    latent = paddle.randn([1, config["latent_channels"], 4, 4])
    assert Transform("scale", scale=0.25)(latent, (4, 4), (128, 128)).shape[2:] == [1, 1]  # without the bound
    bounded = Transform("scale", scale=0.25, min_side=min_side)(latent, (4, 4), (128, 128))
    assert bounded.shape[2:] == [2, 2]
    vae = family.build({"_class_name": "AutoencoderKLLTX2Video", **config}, "test")
    vae.eval()
    with paddle.no_grad():
        assert family.decode(vae, bounded.unsqueeze(2)).shape[-2:] == [64, 64]
    drawn = {draw(0, step, 0, 1.0, 0.25, ("scale",), min_side).latent_size(4, 4, (32, 32)) for step in range(50)}
    assert min(min(size) for size in drawn) == 2


@pytest.mark.parametrize("turns", [1, 2, 3])
def test_rotation_turns_latent_and_image_together(turns):
    rng = np.random.default_rng(turns)
    latent = rng.standard_normal((1, 4, 3, 5)).astype("float32")
    images = blocks(latent[:, :3], 8)
    transform = Transform("rotate", quarter_turns=turns)
    z = transform(paddle.to_tensor(latent), (3, 5), images.shape[2:])
    x = transform(paddle.to_tensor(images), (3, 5), images.shape[2:])
    np.testing.assert_array_equal(z.numpy(), np.rot90(latent, turns, axes=(2, 3)))
    np.testing.assert_array_equal(x.numpy(), np.rot90(images, turns, axes=(2, 3)))
    np.testing.assert_array_equal(x.numpy(), blocks(z.numpy()[:, :3], 8))  # the pair still corresponds


def test_the_halved_pair_of_the_diagnostics_follows_a_super_resolving_decoder():
    """The image's size follows the decoder (H / h per axis), not the encoder: with odd latents too."""
    latent, images = paddle.zeros([1, 4, 7, 5]), paddle.zeros([1, 3, 7 * 16, 5 * 16])
    z, x = equivariance_pairs(lambda half: half, images, latent)["scale_equivariance_psnr"]
    assert tuple(z.shape[2:]) == (3, 2) and tuple(x.shape[2:]) == (48, 32)


def test_draws_depend_on_seed_step_and_micro_batch_only():
    kinds = ("scale", "rotate")
    draws = [draw(3, step, micro, 0.5, 0.25, kinds) for step in range(400) for micro in range(2)]
    assert draws == [draw(3, step, micro, 0.5, 0.25, kinds) for step in range(400) for micro in range(2)]
    assert draws != [draw(4, step, micro, 0.5, 0.25, kinds) for step in range(400) for micro in range(2)]
    used = [d for d in draws if d is not None]
    assert 0.44 < len(used) / len(draws) < 0.56
    assert {d.kind for d in used} == set(kinds)
    assert {d.quarter_turns for d in used if d.kind == "rotate"} == {1, 2, 3}
    assert all(0.25 <= d.scale < 1 for d in used if d.kind == "scale")
    assert all(draw(3, s, 0, 0.0, 0.25, kinds) is None for s in range(50))
    assert all(draw(3, s, 0, 1.0, 0.5, ("rotate",)).kind == "rotate" for s in range(50))


def _micro_step(tmp_path, prob, use_ema="false"):
    """A TrainStep on the micro VAE (posterior mode, no LPIPS, no GAN) and one micro-batch's logs."""
    from vae_trainer.build import build_networks, build_optimization

    flags = tiny_args("unused", tmp_path, perceptual_weight=0, disc_start=100, use_ema=use_ema,
                      equivariance_prob=prob, sample_posterior="false", seed=5)
    model_args, _, loss_args, args = parse_arguments([str(flag) for flag in flags])
    networks = build_networks(model_args, loss_args, args)
    step = build_optimization(networks, loss_args, args)
    x = paddle.to_tensor(np.random.default_rng(0).uniform(-1, 1, (2, 3, 32, 32)).astype("float32"))
    return step, networks.model, x, step.forward_backward(x, 6, 0)


def test_the_step_compares_decode_of_the_transformed_latent_with_the_transformed_image(tmp_path):
    step, model, x, logs = _micro_step(tmp_path, prob=1.0)
    transform = draw(5, 6, 0, 1.0, 0.25, parse_transforms("scale,rotate"))
    model.eval()  # (the micro VAE has no dropout or batch statistics: the same numbers)
    with paddle.no_grad():
        posterior = model.vae.encode(x).latent_dist
        z = posterior.mode()
        recon = model.vae.decode(transform(z, z.shape[2:], x.shape[2:])).sample
        target = transform(x, z.shape[2:], x.shape[2:])
        plain_recon = model.vae.decode(z).sample
    assert tuple(recon.shape) == tuple(target.shape)
    assert float(logs["loss/pixel"]) == pytest.approx(float((recon - target).abs().mean()), rel=1e-5)
    assert abs(float(logs["loss/pixel"]) - float((plain_recon - x).abs().mean())) > 1e-4  # not the plain term
    # The KL is the clean posterior's, normalised by the clean image's pixels (as without the transform).
    plain_logs = _micro_step(tmp_path / "plain", prob=0.0)[3]
    assert float(logs["loss/kl"]) == pytest.approx(float(plain_logs["loss/kl"]), rel=1e-6)


def test_logged_images_pair_up_after_a_transformed_micro_batch(tmp_path):
    """Without EMA the grid shows the compared pair (tau(x), decode(tau(z))); with EMA the EMA weights'
    reconstruction of the clean images, never of tau(x) (which --input_size would resize)."""
    for use_ema in ("false", "true"):
        step, _, x, _ = _micro_step(tmp_path / use_ema, prob=1.0, use_ema=use_ema)
        inputs, recons = logged_images(step)
        assert tuple(inputs.shape) == tuple(recons.shape)
        if use_ema == "true":
            assert np.array_equal(inputs.numpy(), x.numpy())
        else:
            assert tuple(inputs.shape) != tuple(x.shape) or not np.array_equal(inputs.numpy(), x.numpy())


def _eq_args(photo_filelist, output_dir, **overrides):
    """4 steps of 2 micro-batches (the draws depend on both), every micro-batch transformed."""
    flags = {**dict(max_steps=4, save_steps=2, perceptual_weight=0, use_ema="false", image_logging_steps=0,
                    gradient_accumulation_steps=2, equivariance_prob=1.0, equivariance_min_scale=0.3), **overrides}
    return tiny_args(photo_filelist, output_dir, **flags)


@pytest.fixture(scope="module")
def equivariant_runs(photo_filelist, tmp_path_factory):
    """{driver: output dir} of 4 steps with every micro-batch transformed (the GAN from step 2)."""
    runs = {driver: tmp_path_factory.mktemp(driver[:-3]) / "out" for driver in DRIVERS}
    for driver, output_dir in runs.items():
        run_in_process(driver, _eq_args(photo_filelist, output_dir))
    return runs


def _weights(folder):
    return {k: v.numpy() for k, v in paddle.load(str(folder / "model_state.pdparams")).items()}


def test_both_entry_points_give_the_same_losses_and_weights(equivariant_runs):
    trainer, loop = (equivariant_runs[driver] for driver in DRIVERS)
    for tag in ("loss/pixel", "loss/kl", "loss/discriminator"):
        ours, theirs = read_scalars(str(trainer / "logs"), tag), read_scalars(str(loop / "logs"), tag)
        assert ours and ours == theirs, tag
    a, b = _weights(trainer / "checkpoint-4"), _weights(loop / "checkpoint-4")
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_resume_is_exact_across_transformed_steps(equivariant_runs, photo_filelist, tmp_path):
    """Steps 3 and 4 (transformed) after a resume from checkpoint-2 give the uninterrupted run's weights."""
    straight = equivariant_runs[DRIVERS[1]]
    resumed = tmp_path / "out"
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    run_in_process(DRIVERS[1], _eq_args(photo_filelist, resumed, resume_from_checkpoint="latest"))
    a, b = _weights(straight / "checkpoint-4"), _weights(resumed / "checkpoint-4")
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_two_ranks_keep_identical_weights(photo_filelist, tmp_path):
    """Every rank draws the same transform; the ranks' weights stay identical (checked at each save, and here)."""
    output_dir = tmp_path / "out"
    run_entry_point(DRIVERS[1], _eq_args(photo_filelist, output_dir, max_steps=2), nproc=2, log_dir=tmp_path / "launch")
    states = [paddle.load(str(output_dir / "checkpoint-2" / f"rank_state_{r}.pdparams")) for r in (0, 1)]
    assert states[0]["parameter_fingerprint"].size > 0
    np.testing.assert_array_equal(states[0]["parameter_fingerprint"], states[1]["parameter_fingerprint"])
    assert os.path.isdir(output_dir / "vae")


BASE = ["--file_list", "x", "--vae_config_file", "configs/vae_micro.json", "--max_steps", "2"]


@pytest.mark.parametrize("flags,message", [
    (["--equivariance_prob", "0.5", "--freeze_encoder", "true", "--pretrained_model_name_or_path", "v"],
     "latent space belongs to the encoder"),
    (["--equivariance_prob", "1.5"], "probability in"),
    (["--equivariance_prob", "0.5", "--equivariance_min_scale", "1"], "smallest downscale factor"),
    (["--equivariance_prob", "0.5", "--equivariance_transforms", "scale,flip"], "comma-separated list"),
    (["--equivariance_min_scale", "0.5"], "--equivariance_prob, which is 0"),
    (["--equivariance_transforms", "rotate"], "--equivariance_prob, which is 0"),
    (["--equivariance_prob", "0.5", "--equivariance_transforms", "rotate", "--equivariance_min_scale", "0.5"],
     "leaves out"),
])
def test_refusals(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_arguments(BASE + flags)


def test_accepted_spellings():
    flags = ["--equivariance_prob", "0.5", "--equivariance_transforms", " rotate ,scale"]
    _, _, loss_args, _ = parse_arguments(BASE + flags)
    assert parse_transforms(loss_args.equivariance_transforms) == ("rotate", "scale")
    parse_arguments(BASE + ["--equivariance_prob", "0"])  # 0 means off: never refused
