"""The shared training step: one VAE forward, clean discriminator gradients, GAN switch, accumulation."""

import copy

import numpy as np
import paddle
import pytest

from vae_trainer.arguments import LossArguments, VAETrainingArguments
from vae_trainer.losses import discriminator_objective
from vae_trainer.models.autoencoder_gan import VAEWithDiscriminator
from vae_trainer.models.discriminator import build_discriminator
from vae_trainer.models.vae import build_vae
from vae_trainer.optim import build_disc_optimizer, build_vae_optimizer
from vae_trainer.step import NonFiniteError, TrainStep

paddle.set_device("cpu")
MICRO = "configs/vae_micro.json"


def make_model(learn_logvar=False, seed=0):
    paddle.seed(seed)
    vae = build_vae(MICRO)
    disc = build_discriminator(norm="group", num_layers=2, base_channels=8)
    return VAEWithDiscriminator(vae, disc, learn_logvar=learn_logvar)


def make_args(tmp_path, **kw):
    return VAETrainingArguments(output_dir=str(tmp_path), max_steps=10, report_to=[], **kw)


def make_step(model, tmp_path, accumulation=1, max_nonfinite=5, learning_rate=1e-4, **loss_kw):
    loss_kw = {"perceptual_weight": 0.0, "disc_start": 0, **loss_kw}
    loss_args = LossArguments(**loss_kw)
    args = make_args(tmp_path, learning_rate=learning_rate)
    vae_opt, _ = build_vae_optimizer(args, model)
    disc_opt, disc_sched = build_disc_optimizer(args, model, loss_args.disc_start)
    return TrainStep(model, None, loss_args, vae_opt, disc_opt, disc_sched, accumulation,
                     max_consecutive_nonfinite=max_nonfinite)


def images(n=2, seed=0, size=32):
    return paddle.to_tensor(np.random.default_rng(seed).uniform(-1, 1, (n, 3, size, size)).astype("float32"))


def count_calls(layer):
    calls = []
    layer.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_one_vae_forward_per_step_even_with_gan(tmp_path):
    model = make_model()
    step = make_step(model, tmp_path)
    enc, dec = count_calls(model.vae.encoder), count_calls(model.vae.decoder)
    logs = step(images(), global_step=0, last_micro_step=True)
    assert len(enc) == 1 and len(dec) == 1
    assert "loss/generator" in logs and "loss/discriminator" in logs and "gan/adaptive_weight" in logs


def test_discriminator_gradient_is_exactly_its_own_loss_gradient(tmp_path):
    """The generator pass must not leak gradients into the discriminator."""
    model = make_model()
    reference = copy.deepcopy(model)
    step = make_step(model, tmp_path)
    x = images()
    paddle.seed(5)
    step(x, global_step=0, last_micro_step=False)  # no optimizer step, gradients stay in .grad
    paddle.seed(5)  # same posterior sample
    recon, _, _ = reference(x)
    d_loss, _ = discriminator_objective(reference.discriminator, x, recon, "hinge")
    d_loss.backward()
    for p, q in zip(model.discriminator.parameters(), reference.discriminator.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_gan_is_off_before_disc_start(tmp_path):
    model = make_model()
    step = make_step(model, tmp_path, disc_start=5)
    before = [p.numpy().copy() for p in model.discriminator.parameters()]
    logs = step(images(), global_step=4, last_micro_step=True)
    assert "loss/generator" not in logs and "gan/adaptive_weight" not in logs
    assert all(p.grad is None for p in model.discriminator.parameters())
    for p, b in zip(model.discriminator.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), b)
    logs = step(images(), global_step=5, last_micro_step=True)
    assert "loss/generator" in logs
    assert any(not np.array_equal(p.numpy(), b) for p, b in zip(model.discriminator.parameters(), before))


def test_learnable_logvar_is_optimized(tmp_path):
    for learn in (True, False):
        model = make_model(learn_logvar=learn)
        step = make_step(model, tmp_path, disc_weight=0.0, learning_rate=1e-2)
        step(images(), global_step=0, last_micro_step=True)
        step.vae_optimizer.step()
        assert (model.logvar.item() != 0.0) == learn


def test_accumulated_micro_batches_give_the_full_batch_gradient(tmp_path):
    """k micro-batches of b = one batch of k*b for the non-adversarial loss (posterior mean, no GAN)."""
    x = images(n=4)
    grads = []
    for accumulation in (1, 2):
        model = make_model()
        step = make_step(model, tmp_path, accumulation, disc_weight=0.0, sample_posterior=False, kl_weight=1e-3)
        chunks = paddle.split(x, accumulation)
        for i, chunk in enumerate(chunks):
            step(chunk, global_step=0, last_micro_step=i == accumulation - 1)
        grads.append([p.grad.numpy() for p in model.vae.parameters()])
    for full, accumulated in zip(*grads):
        np.testing.assert_allclose(accumulated, full, rtol=1e-4, atol=1e-7)


def test_nonfinite_step_is_skipped_for_both_networks_then_stops(tmp_path):
    model = make_model()
    step = make_step(model, tmp_path, max_nonfinite=2)
    weights = [p.numpy().copy() for p in model.parameters()]
    bad = images()
    bad[0, 0, 0, 0] = float("nan")
    logs = step(bad, global_step=0, last_micro_step=True)
    step.vae_optimizer.step()  # what the drivers do next: cancelled by the guard
    step.vae_optimizer.clear_grad()
    assert logs["train/skipped_steps"].item() == 1
    # (np.testing's array asserts break on 0-d arrays once ppdiffusers has patched np.bool; compare directly)
    assert all(np.array_equal(p.numpy(), w) for p, w in zip(model.parameters(), weights))
    # A good step in between resets the consecutive count and does update the weights.
    step(images(), global_step=1, last_micro_step=True)
    step.vae_optimizer.step()
    assert not np.array_equal(model.vae.decoder.conv_out.weight.numpy(), weights[0])
    step.vae_optimizer.clear_grad()
    step(bad, global_step=2, last_micro_step=True)
    step.vae_optimizer.clear_grad()
    with pytest.raises(NonFiniteError, match="2 consecutive"):
        step(bad, global_step=3, last_micro_step=True)


def test_ema_follows_the_warmed_up_decay(tmp_path):
    """EMA after each step = d_t * EMA + (1 - d_t) * weights, d_t = min(decay, (1 + t) / (10 + t))."""
    from ppdiffusers.training_utils import EMAModel

    model = make_model()
    step = make_step(model, tmp_path, disc_weight=0.0, learning_rate=1e-2)
    step.ema = EMAModel(model.vae.parameters(), decay=0.5)
    expected = [p.numpy().astype("float64") for p in model.vae.parameters()]
    for t in range(1, 4):
        step(images(seed=t), global_step=t - 1, last_micro_step=True)
        step.vae_optimizer.step()
        step.vae_optimizer.clear_grad()
        step.after_optimizer_step()
        decay = min(0.5, (1 + t) / (10 + t))
        expected = [decay * e + (1 - decay) * p.numpy() for e, p in zip(expected, model.vae.parameters())]
    for shadow, e in zip(step.ema.shadow_params, expected):
        np.testing.assert_allclose(shadow.numpy(), e, rtol=1e-5, atol=1e-7)
    # Logged reconstructions use the EMA weights, and the raw weights come back afterwards.
    raw = model.vae.decoder.conv_out.weight.numpy().copy()
    inputs, recon = step.images_for_logging()
    assert not np.allclose(recon.numpy(), step.last_reconstructions.numpy())
    assert np.array_equal(model.vae.decoder.conv_out.weight.numpy(), raw)


def test_recompute_gives_the_same_gradients(tmp_path):
    """--recompute (gradient checkpointing) trades compute for memory without changing the gradients."""
    x = images()
    grads = []
    for recompute in (False, True):
        model = make_model()
        if recompute:
            model.vae.enable_gradient_checkpointing()
        step = make_step(model, tmp_path, disc_weight=0.0, sample_posterior=False)
        step(x, global_step=0, last_micro_step=False)
        grads.append([p.grad.numpy() for p in model.vae.parameters()])
    for plain, checkpointed in zip(*grads):
        np.testing.assert_allclose(checkpointed, plain, rtol=1e-5, atol=1e-7)


def test_recompute_flag_turns_on_gradient_checkpointing(tmp_path):
    from vae_trainer.arguments import ModelArguments
    from vae_trainer.build import build_components

    for recompute in (False, True):
        parts = build_components(ModelArguments(vae_config_file=MICRO, disc_num_layers=2, disc_base_channels=8),
                                 LossArguments(perceptual_weight=0.0), make_args(tmp_path, recompute=recompute))
        vae = parts.model.vae
        assert vae.encoder.gradient_checkpointing == recompute and vae.decoder.gradient_checkpointing == recompute

