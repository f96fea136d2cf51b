"""The training objective on clips [B, C, T, H, W] (issue 43; vae_trainer/objectives/, step.py): per-frame pixel loss,
LPIPS (every frame or K drawn per clip) and 2-D discriminators, the temporal term (L1 between frame differences), the
KL per C*T*H*W, the 3-D PatchGAN (`--disc_type patchgan3d`), and decoder-only training steps of tiny Wan 2.1- and
2.2-shaped VAEs on clips and on images in one run."""

from __future__ import annotations

import os
import re

import numpy as np
import paddle
import pytest
from conftest import REPO
from test_wan_clips import build

from vae_trainer.argument_parser import parse_arguments
from vae_trainer.arguments import LossArguments, VAETrainingArguments
from vae_trainer.build import Networks, train_networks
from vae_trainer.objectives.gan import discriminator_objective, generator_loss
from vae_trainer.objectives import frames, vae_objective
from vae_trainer.objectives.reconstruction import kl_loss
from vae_trainer.objectives.clips import flicker, lpips_subset
from vae_trainer.models.trainable import VAEWithDiscriminator
from vae_trainer.models.discriminator import build_discriminator, init_discriminator_from, save_discriminator
from vae_trainer.models.recompute import enable_recompute
from vae_trainer.models.lpips import LPIPS
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.step import TrainStep, logged_images

paddle.set_device("cpu")
B, T, SIZE = 2, 5, 32


def rand(*shape, seed=0, scale=1.0):
    return paddle.to_tensor((np.random.default_rng(seed).uniform(-1, 1, shape) * scale).astype("float32"))


def objective(x, recon, lpips=None, mean=None, logvar=None, **loss_kw):
    args = LossArguments(**{"perceptual_weight": 0.0, "kl_weight": 0.0, **loss_kw})
    mean = paddle.zeros([x.shape[0], 4, 1, 1]) if mean is None else mean
    return vae_objective(x, recon, mean, logvar, paddle.zeros([]), loss_args=args, lpips=lpips, discriminator=None,
                         last_layer=None, gan_weight=0.0)


@pytest.fixture(scope="module")
def lpips():
    return LPIPS()


def test_pixel_loss_and_lpips_of_a_clip_are_the_means_of_its_frames_as_images(lpips):
    """With the low-pass mask (computed per image) and LPIPS, a wrong fold of T into the batch (a reshape without
    the transpose mixes channels and frames) gives other numbers."""
    x, recon = rand(B, 3, T, SIZE, SIZE, seed=1), rand(B, 3, T, SIZE, SIZE, seed=2, scale=0.5)
    kw = dict(pixel_loss_mask="lowpass", perceptual_weight=1.0)
    clip = objective(x, recon, lpips, **kw).logs
    per_frame = [objective(x[:, :, t], recon[:, :, t], lpips, **kw).logs for t in range(T)]
    for name in ("loss/pixel", "loss/perceptual"):
        expected = np.mean([logs[name].item() for logs in per_frame])
        assert clip[name].item() == pytest.approx(expected, rel=1e-5), name
    assert clip["loss/perceptual"].item() > 0.05 and "loss/temporal" not in clip  # the term is off by default


def test_lpips_on_k_frames_per_clip_is_drawn_from_seed_step_and_micro_batch(lpips):
    shape = [3, 3, 9, SIZE, SIZE]
    rows = lpips_subset(0, 10, 1, shape, 2)
    assert np.array_equal(rows, lpips_subset(0, 10, 1, shape, 2))  # both drivers, a resume
    assert len({tuple(lpips_subset(seed, step, micro, shape, 2)) for seed in (0, 1) for step in (10, 11)
                for micro in (0, 1)}) > 4
    for clip in range(3):  # K distinct frames of each clip, as rows of frames(x)
        own = rows[(rows >= clip * 9) & (rows < (clip + 1) * 9)]
        assert len(own) == 2 and len(set(own)) == 2
    assert lpips_subset(0, 10, 1, shape, 0) is None and lpips_subset(0, 10, 1, shape, 9) is None
    assert lpips_subset(0, 10, 1, [3, 3, SIZE, SIZE], 2) is None  # an image batch: every image
    x, recon = rand(B, 3, T, SIZE, SIZE, seed=1), rand(B, 3, T, SIZE, SIZE, seed=2, scale=0.5)
    rows = lpips_subset(0, 3, 0, x.shape, 2)
    args = LossArguments(perceptual_weight=1.0, kl_weight=0.0)
    logs = vae_objective(x, recon, paddle.zeros([B, 4]), None, paddle.zeros([]), loss_args=args, lpips=lpips,
                         discriminator=None, last_layer=None, gan_weight=0.0, lpips_rows=rows).logs
    per_row = lpips(frames(x)[rows.tolist()], frames(recon)[rows.tolist()])
    assert logs["loss/perceptual"].item() == pytest.approx(per_row.mean().item(), rel=1e-5)
    assert logs["loss/perceptual"].item() != pytest.approx(lpips(frames(x), frames(recon)).mean().item(), rel=1e-3)


def test_the_temporal_term_on_known_pairs():
    x = rand(B, 3, T, 8, 8, seed=3)
    offset = rand(1, 3, 1, 8, 8, seed=4)  # a constant error per pixel over time: no flicker
    assert flicker(x, x + offset).mean().item() == pytest.approx(0.0, abs=1e-7)
    ramp = paddle.arange(T, dtype="float32").reshape([1, 1, T, 1, 1]) * 0.1  # frame t is off by 0.1 t: 0.1 each
    assert flicker(x, x + ramp).mean().item() == pytest.approx(0.1, rel=1e-5)
    recon = rand(B, 3, T, 8, 8, seed=5)
    dx, dr = np.diff(x.numpy(), axis=2), np.diff(recon.numpy(), axis=2)
    assert flicker(x, recon).mean().item() == pytest.approx(np.abs(dx - dr).mean(), rel=1e-6)


@pytest.mark.parametrize("balancing", ["none", "gradnorm"])
def test_the_temporal_term_is_a_reconstruction_head_in_the_nll(balancing):
    """Its gradient enters at the reconstruction: W * d mean|dx - dr| / d recon, by hand; in the nll the adaptive
    GAN weight compares with; under gradnorm a head of norm W; nothing on an image batch."""
    x, recon, weight = rand(B, 3, T, 8, 8, seed=3), rand(B, 3, T, 8, 8, seed=5), 0.7
    kw = dict(pixel_weight=0.0, temporal_loss_weight=weight, loss_balancing=balancing)
    loss = objective(x, recon, **kw)
    sign = np.sign(np.diff(x.numpy(), axis=2) - np.diff(recon.numpy(), axis=2))
    grad = np.zeros(x.shape, "float32")
    grad[:, :, :-1] += sign
    grad[:, :, 1:] -= sign
    grad /= sign.size
    assert loss.logs["loss/temporal"].item() == pytest.approx(flicker(x, recon).mean().item(), rel=1e-6)
    if balancing == "none":
        assert loss.logs["loss/nll"].item() == pytest.approx(weight * loss.logs["loss/temporal"].item(), rel=1e-6)
        np.testing.assert_allclose(loss.recon_grad.numpy(), weight * grad, rtol=1e-5, atol=1e-9)
    else:  # per sample: the head's gradient rescaled to norm W / B
        norms = np.sqrt((grad ** 2).reshape(B, -1).sum(1)).reshape(B, 1, 1, 1, 1)
        np.testing.assert_allclose(loss.recon_grad.numpy(), grad / norms * weight / B, rtol=1e-4, atol=1e-9)
    image = objective(x[:, :, 0], recon[:, :, 0], **kw)
    assert "loss/temporal" not in image.logs and float(np.abs(image.recon_grad.numpy()).max()) == 0.0


def test_the_kl_of_a_clip_is_per_pixel_value_of_the_clip():
    x = rand(B, 3, T, SIZE, SIZE, seed=1)
    mean, logvar = rand(B, 4, 3, 8, 8, seed=6), rand(B, 4, 3, 8, 8, seed=7, scale=0.5)
    kl = objective(x, x, mean=mean, logvar=logvar).logs["loss/kl"].item()
    assert kl == pytest.approx(kl_loss(mean, logvar).mean().item() / (3 * T * SIZE * SIZE), rel=1e-6)


def test_patchgan3d_scores_clips_and_one_frame_batches():
    paddle.seed(0)
    disc = build_discriminator("patchgan3d", "group", num_layers=2, base_channels=8)
    clip = rand(B, 3, T, SIZE, SIZE, seed=1)
    logits = disc(clip)
    assert logits.shape == [B, 1, T, 6, 6] and disc(clip[:, :, 0]).shape == [B, 1, 1, 6, 6]
    changed = clip.numpy().copy()
    changed[:, :, 2] = 0.0  # frame 2 reaches logits of frames 1-3 through the temporal kernel (3 per layer: 1-4)
    moved = np.abs(disc(paddle.to_tensor(changed)).numpy() - logits.numpy()).max(axis=(0, 1, 3, 4))
    assert (moved > 0).all() and moved[2] == moved.max()
    # A 2-D discriminator scores a clip's frames as a batch of images.
    flat = build_discriminator("patch", "group", num_layers=2, base_channels=8)
    recon = rand(B, 3, T, SIZE, SIZE, seed=2)
    _, logs = discriminator_objective(flat, clip, recon, LossArguments())
    assert logs["gan/logits_real"].item() == pytest.approx(flat(frames(clip)).mean().item(), rel=1e-6)


@pytest.mark.parametrize("disc_type,freeze_encoder,clamped", [("patchgan3d", True, False), ("patch", False, True)])
def test_the_gan_gradient_reaches_the_vae_through_the_adaptive_weight(disc_type, freeze_encoder, clamped):
    """The weight is ||dnll/dW|| / ||dgan/dW|| at the decoder's last layer W (computed here by hand), and
    d_weight * the generator loss's gradient joins the nll's at the reconstruction. Through the Wan port's clip
    decoder, paddle.grad to W alone raises (its chunks' joined backward node): the latent is an input too."""
    vae, x = build("wan21"), rand(1, 3, T, SIZE, SIZE, seed=1)
    paddle.seed(0)
    disc = build_discriminator(disc_type, "group", num_layers=2, base_channels=8)
    model = VAEWithDiscriminator(vae, disc, freeze_encoder=freeze_encoder)
    recon, mean, logvar, z = model(x, sample_posterior=False, return_latent=True)
    last = model.family.last_layers(vae)[0]
    args = LossArguments(perceptual_weight=0.0, kl_weight=0.0, temporal_loss_weight=0.5)
    loss = vae_objective(x, recon, mean, logvar, paddle.zeros([]), loss_args=args, lpips=None, discriminator=disc,
                         last_layer=last, gan_weight=0.5, latent=z)
    x_hat = recon.detach()
    x_hat.stop_gradient = False
    nll = (x - x_hat).abs().mean() + 0.5 * flicker(x, x_hat).mean()
    gan = generator_loss(disc(x_hat if disc_type == "patchgan3d" else frames(x_hat)))
    nll_grad, gan_grad = paddle.grad(nll, x_hat)[0], paddle.grad(gan, x_hat)[0]
    at_w = [paddle.grad(recon, [last, z], grad_outputs=g, retain_graph=True)[0] for g in (nll_grad, gan_grad)]
    ratio = paddle.linalg.norm(at_w[0]).item() / (paddle.linalg.norm(at_w[1]).item() + 1e-4)
    weight = min(ratio, 1e4 / (3 * SIZE * SIZE))  # LDM's bound in our units: per pixel value of a frame
    assert (ratio > weight) == clamped
    assert loss.logs["gan/adaptive_weight"].item() == pytest.approx(0.5 * weight, rel=1e-4)
    expected = nll_grad.numpy() + 0.5 * weight * gan_grad.numpy()
    np.testing.assert_allclose(loss.recon_grad.numpy(), expected, rtol=1e-4, atol=1e-8)
    assert np.abs(gan_grad.numpy()).max() > 0


def test_the_adaptive_weight_on_clips_is_the_same_under_recompute():
    """--recompute re-runs each chunk's decoder pass in the backward; the adaptive weight's gradients (taken with
    the latent as an input) and the VAE's are those of the one-shot pass."""
    x, results = rand(1, 3, T, SIZE, SIZE, seed=1), []
    for recompute in (False, True):
        vae = build("wan21")
        if recompute:
            enable_recompute(vae)
        paddle.seed(0)
        disc = build_discriminator("patchgan3d", "group", num_layers=2, base_channels=8)
        model = VAEWithDiscriminator(vae, disc, freeze_encoder=True)
        recon, mean, logvar, z = model(x, sample_posterior=False, return_latent=True)
        loss = vae_objective(x, recon, mean, logvar, paddle.zeros([]), loss_args=LossArguments(perceptual_weight=0.0),
                             lpips=None, discriminator=disc, last_layer=model.family.last_layers(vae)[0],
                             gan_weight=0.5, latent=z)
        loss.backward(recon)
        results.append([loss.logs["gan/adaptive_weight"].numpy()] +
                       [p.grad.numpy() for p in vae.parameters() if not p.stop_gradient])
    assert all(np.array_equal(a, b) for a, b in zip(*results)) and len(results[0]) > 10


def test_a_patchgan3d_is_saved_and_read_back_by_discriminator_path(tmp_path):
    config = {"disc_type": "patchgan3d", "norm": "batch", "num_layers": 2, "base_channels": 8}
    paddle.seed(0)
    saved = build_discriminator(**config)
    save_discriminator(saved, config, str(tmp_path))
    paddle.seed(1)
    loaded = build_discriminator(**config)
    init_discriminator_from(loaded, config, str(tmp_path))
    clip = rand(B, 3, T, SIZE, SIZE, seed=1)
    saved.eval(), loaded.eval()
    assert np.array_equal(saved(clip).numpy(), loaded(clip).numpy())
    with pytest.raises(ValueError, match="--disc_num_layers 2 .this run: 3."):
        init_discriminator_from(build_discriminator(**{**config, "num_layers": 3}), {**config, "num_layers": 3},
                                str(tmp_path))


def pan(frames_: int, shift: int, seed: int) -> np.ndarray:
    """A smooth random image panned `shift` px per frame: [3, T, SIZE, SIZE] in [-1, 1]."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(-1, 1, (3, 8, 8 + frames_ * shift // 4 + 2)).astype("float32")
    big = paddle.nn.functional.interpolate(paddle.to_tensor(coarse[None]), scale_factor=4, mode="bilinear")[0].numpy()
    return np.stack([big[:, :SIZE, t * shift:t * shift + SIZE] for t in range(frames_)], axis=1)


def clips(seeds) -> paddle.Tensor:
    return paddle.to_tensor(np.stack([pan(T, 1, seed) for seed in seeds]))


@pytest.mark.parametrize("name,disc_type", [("wan21", "patch"), ("wan22", "patchgan3d")])
def test_decoder_only_steps_on_clips_improve_held_out_clips_and_keep_the_latents(name, disc_type, tmp_path):
    build(name).save_pretrained(str(tmp_path / "vae"))
    paddle.seed(0)
    vae = build_vae(None, str(tmp_path / "vae"))
    disc = build_discriminator(disc_type, "group", num_layers=2, base_channels=8)
    model = VAEWithDiscriminator(vae, disc, freeze_encoder=True)
    loss_args = LossArguments(perceptual_weight=0.1, lpips_num_frames=2, temporal_loss_weight=0.5, disc_start=0,
                              disc_weight_warmup_steps=0)
    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=10, report_to=[], learning_rate=3e-3, seed=5)
    lpips_inputs = []

    def lpips(a, b):  # a stand-in for LPIPS that records what it was given
        lpips_inputs.append(a.shape)
        return (a - b).abs().mean(axis=[1, 2, 3])

    step = TrainStep(Networks(model, lpips, {}), loss_args, args, train_networks(model, loss_args, args))
    held_out = clips([100, 101])
    encoder = {k: p.numpy().copy() for k, p in vae.named_parameters() if p.stop_gradient}
    assert encoder and all(k.startswith(("encoder.", "quant_conv.")) for k in encoder)

    def held_out_error():
        with paddle.no_grad():
            model.eval()
            recon, latents, _ = model(held_out, sample_posterior=False)
        return (recon - held_out).abs().mean().item(), latents.numpy()

    before, latents = held_out_error()
    for global_step in range(6):
        batch = clips([global_step % 2])
        logs = step.forward_backward(batch, global_step, 0)
        assert {"loss/temporal", "loss/generator", "loss/discriminator"} <= set(logs)
        assert lpips_inputs[-1] == [2, 3, SIZE, SIZE]  # --lpips_num_frames 2 of the clip's 5
        posterior = model.encode(batch)  # the frozen encoder's: the step's own
        expected = kl_loss(posterior.mean, posterior.logvar).mean().item() / (3 * T * SIZE * SIZE)
        assert logs["loss/kl"].item() == pytest.approx(expected, rel=1e-5)
        step.optimizer_step(global_step)
    after, latents_after = held_out_error()
    assert after < 0.9 * before, (before, after)
    assert np.array_equal(latents, latents_after)
    assert all(np.array_equal(p.numpy(), encoder[k]) for k, p in vae.named_parameters() if k in encoder)
    inputs, recons = logged_images(step)  # clips stay clips for the image logging
    assert inputs.shape == recons.shape == [1, 3, T, SIZE, SIZE]
    # An image batch (--video_image_ratio) in the same run: per-frame terms only, the 3-D D takes it as T = 1.
    images = clips([7])[:, :, 0]
    logs = step.forward_backward(images, 6, 0)
    assert "loss/temporal" not in logs and step.last_images[1].shape == [1, 3, SIZE, SIZE]
    assert np.isfinite(logs["loss/total"].item()) and "loss/discriminator" in logs
    assert not step.optimizer_step(6)[1]


@pytest.mark.parametrize("flags,message", [
    (["--disc_type", "patchgan3d"], "--disc_type patchgan3d: it applies to clips, and every sample is one frame"),
    (["--num_frames", "5", "--video_image_ratio", "1", "--disc_type", "patchgan3d"],
     "a 3-D discriminator of them is a 2-D one"),
    (["--lpips_num_frames", "2"], "--lpips_num_frames 2: it applies to clips"),
    (["--num_frames", "5", "--lpips_num_frames", "6"], "--lpips_num_frames 6: it is a number of frames per clip"),
    (["--num_frames", "5", "--lpips_num_frames", "2", "--perceptual_weight", "0"],
     "--lpips_num_frames 2: --perceptual_weight 0 turns LPIPS off"),
])
def test_clip_flags_that_cannot_work_are_refused(flags, message, tmp_path):
    argv = ["--file_list", "x", "--vae_config_file", os.path.join(REPO, "configs", "wan21_vae.json"),
            "--max_steps", "1", "--output_dir", str(tmp_path), "--resolution", "64"] + flags
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_arguments(argv)
    if "--num_frames" in flags:  # the same run without the refused flag is taken
        parse_arguments(argv[:argv.index(flags[-2])] + argv[argv.index(flags[-2]) + 2:])
