"""The shared training step: one VAE forward, clean gradients for both networks, GAN switch, accumulation,
the NaN guard (non-finite loss or gradients), EMA."""

import copy
import os

import numpy as np
import paddle
import pytest

from vae_trainer.arguments import LossArguments, VAETrainingArguments
from vae_trainer.build import Networks, train_networks
from vae_trainer.objectives.gan import discriminator_objective, gan_weight
from vae_trainer.objectives import vae_objective
from vae_trainer.models.trainable import VAEWithDiscriminator
from vae_trainer.models.discriminator import build_discriminator
from vae_trainer.models.families import family_of
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.step import NonFiniteError, NonFiniteGuard, TrainStep, logged_images

paddle.set_device("cpu")
MICRO = "configs/vae_micro.json"


def make_model(learn_logvar=False, seed=0, norm="group"):
    paddle.seed(seed)
    vae = build_vae(MICRO)
    disc = build_discriminator(norm=norm, num_layers=2, base_channels=8)
    return VAEWithDiscriminator(vae, disc, learn_logvar=learn_logvar)


def make_args(tmp_path, **kw):
    return VAETrainingArguments(output_dir=str(tmp_path), max_steps=10, report_to=[], **kw)


def make_step(model, tmp_path, accumulation=1, max_nonfinite=5, learning_rate=1e-4, scalers=(), max_overflow=25,
              **loss_kw):
    loss_kw = {"perceptual_weight": 0.0, "disc_start": 0, "disc_weight_warmup_steps": 0, **loss_kw}  # LDM's start
    loss_args = LossArguments(**loss_kw)
    args = make_args(tmp_path, learning_rate=learning_rate, gradient_accumulation_steps=accumulation, seed=0)
    networks = train_networks(model, loss_args, args)
    for network, scaler in zip(networks, scalers):  # the VAE's and the discriminator's, if given
        network.scaler = scaler
    return TrainStep(Networks(model, None, {}), loss_args, args, networks,
                     guard=NonFiniteGuard(max_nonfinite, max_overflow))


def full_step(step, x, global_step):
    """One micro-batch and its optimizer step, as the drivers run them (accumulation 1)."""
    logs = step.forward_backward(x, global_step, 0)
    scalars = step.optimizer_step(global_step)[0]
    step.schedule(global_step)
    return {**logs, **scalars}


def weights(layer):
    return [p.numpy().copy() for p in layer.parameters()]


def unchanged(layer, before):
    # (np.testing's array asserts break on 0-d arrays once ppdiffusers has patched np.bool; compare directly)
    return all(np.array_equal(p.numpy(), w) for p, w in zip(layer.parameters(), before))


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
    logs = full_step(step, images(), global_step=0)
    assert len(enc) == 1 and len(dec) == 1
    assert "loss/generator" in logs and "loss/discriminator" in logs and "gan/adaptive_weight" in logs


@pytest.mark.parametrize("norm", ["batch", "group"])  # batch: the default PatchGAN
def test_each_network_gets_exactly_its_own_loss_gradient(tmp_path, norm):
    """The generator pass leaks nothing into the discriminator, the discriminator's loss nothing into the VAE.

    With BatchNorm both networks' gradients depend on the discriminator normalising with batch statistics
    (train mode) in every pass; the generator pass also moves its running statistics, which a train-mode
    forward never uses. The reference computes each loss on its own, on a copy of the model.
    """
    model = make_model(norm=norm)
    assert any(isinstance(m, paddle.nn.BatchNorm2D) for m in model.discriminator.sublayers()) == (norm == "batch")
    reference = copy.deepcopy(model)
    step = make_step(model, tmp_path)
    x = images()
    paddle.seed(5)
    step.forward_backward(x, 0, 0)  # no optimizer step: the gradients stay in .grad
    paddle.seed(5)  # same posterior sample
    recon, mean, logvar = reference(x)
    vae_loss = vae_objective(x, recon, mean, logvar, reference.logvar, loss_args=step.loss_args, lpips=None,
                             discriminator=reference.discriminator, last_layer=family_of(reference.vae).last_layers(reference.vae)[0],
                             gan_weight=step.loss_args.disc_weight)
    vae_loss.backward(recon)
    assert all(p.grad is None for p in reference.discriminator.parameters() if not p.stop_gradient)
    d_loss, _ = discriminator_objective(reference.discriminator, x, recon, LossArguments())
    d_loss.backward()
    for network in ("vae", "discriminator"):
        ours, theirs = getattr(model, network).parameters(), getattr(reference, network).parameters()
        for p, q in zip(ours, theirs):
            if q.grad is None:
                assert p.grad is None
                continue
            np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=network)


def test_gan_is_off_before_disc_start(tmp_path):
    model = make_model()
    step = make_step(model, tmp_path, disc_start=5)
    before = weights(model.discriminator)
    logs = step.forward_backward(images(), 4, 0)
    assert "loss/generator" not in logs and "gan/adaptive_weight" not in logs
    assert all(p.grad is None for p in model.discriminator.parameters())
    report = step.optimizer_step(global_step=4)[0]
    step.schedule(4)
    assert unchanged(model.discriminator, before) and "train/disc_grad_norm" not in report
    assert step.networks[1].scheduler.last_epoch == 0  # its schedule starts at disc_start
    logs = full_step(step, images(), global_step=5)
    assert "loss/generator" in logs
    assert not unchanged(model.discriminator, before) and step.networks[1].scheduler.last_epoch == 1


def test_the_gan_weight_ramps_in_linearly_from_disc_start(tmp_path):
    """--disc_weight_warmup_steps M: at step t the GAN term weighs --disc_weight * min(1, (t - disc_start + 1) / M),
    and that is what reaches the loss: the adaptive weight and the GAN's share of the loss scale by that fraction."""
    model = make_model()
    ramped = make_step(model, tmp_path, disc_start=3, disc_weight_warmup_steps=4)
    assert [gan_weight(ramped.loss_args, t) for t in range(1, 10)] == [0, 0, 0.125, 0.25, 0.375, 0.5, 0.5, 0.5, 0.5]
    ldm = make_step(copy.deepcopy(model), tmp_path, disc_start=3, disc_weight_warmup_steps=0)  # the term at once
    assert [gan_weight(ldm.loss_args, t) for t in range(1, 5)] == [0, 0, 0.5, 0.5]
    logs = {}
    for name, step in (("ramped", ramped), ("ldm", ldm)):
        paddle.seed(5)  # the same posterior sample
        logs[name] = step.forward_backward(images(), 4, 0)  # step 4: 2/4 of the way
    ramped_weight, ldm_weight = logs["ramped"]["gan/adaptive_weight"].item(), logs["ldm"]["gan/adaptive_weight"].item()
    assert ldm_weight > 0 and ramped_weight == pytest.approx(0.5 * ldm_weight, rel=1e-6)
    gan_part = {name: (log["loss/total"] - log["loss/nll"] - 1e-6 * log["loss/kl"]).item()
                for name, log in logs.items()}
    assert gan_part["ramped"] == pytest.approx(0.5 * gan_part["ldm"], rel=1e-3)
    # The discriminator trains from disc_start whatever the ramp.
    assert "loss/discriminator" in logs["ramped"] and any(p.grad is not None for p in model.discriminator.parameters())


def test_learnable_logvar_is_optimized(tmp_path):
    for learn in (True, False):
        model = make_model(learn_logvar=learn)
        step = make_step(model, tmp_path, disc_weight=0.0, learning_rate=1e-2)
        full_step(step, images(), global_step=0)
        assert (model.logvar.item() != 0.0) == learn


def test_optimizer_step_clips_steps_schedules_and_clears_both_networks(tmp_path):
    """The update: both optimizers step once (with clipped gradients), grads are cleared; then `schedule` advances
    both schedules (the optimizer step leaves them)."""
    model = make_model()
    step = make_step(model, tmp_path, learning_rate=1e-3)
    step.args.max_grad_norm = 1e-3  # far below the gradient norms: clipping binds
    vae_before, disc_before = weights(model.vae), weights(model.discriminator)
    step.forward_backward(images(), 0, 0)
    grads = {id(p): p.grad.numpy().copy() for p in model.parameters() if p.grad is not None}
    report = step.optimizer_step(global_step=0)[0]
    norm = report["train/grad_norm"].item()
    expected = np.sqrt(sum(np.square(grads[id(p)].astype(np.float64)).sum() for p in model.vae_parameters()
                           if id(p) in grads))
    assert norm == pytest.approx(expected, rel=1e-4) and norm > 1e-3
    assert not unchanged(model.vae, vae_before) and not unchanged(model.discriminator, disc_before)
    assert step.networks[0].scheduler.last_epoch == 0 and step.networks[1].scheduler.last_epoch == 0
    step.schedule(0)
    assert step.networks[0].scheduler.last_epoch == 1 and step.networks[1].scheduler.last_epoch == 1
    assert all(p.grad is None or not p.grad.numpy().any() for p in model.parameters())
    # Adam's first step moves each weight by about lr whatever the gradient's scale; the clipped gradient
    # is what the optimizer holds as its first moment: (1 - beta1) * g * max_norm / norm.
    moment = step.networks[0].optimizer._accumulators["moment1"]
    weight = model.vae.decoder.conv_out.weight
    np.testing.assert_allclose(moment[weight.name].numpy(), (1 - 0.5) * grads[id(weight)] * 1e-3 / norm,
                               rtol=1e-4, atol=1e-12)


def test_accumulated_micro_batches_give_the_full_batch_gradient(tmp_path):
    """k micro-batches of b = one batch of k*b for pixel + LPIPS + KL (posterior mean, no GAN): the README's claim."""
    from vae_trainer.models.lpips import DEFAULT_LPIPS_WEIGHTS, LPIPS

    if not os.path.exists(DEFAULT_LPIPS_WEIGHTS):
        pytest.skip(f"no LPIPS weights at {DEFAULT_LPIPS_WEIGHTS} (make setup)")
    lpips = LPIPS()
    x = images(n=4)
    grads = []
    for accumulation in (1, 2):
        model = make_model()
        step = make_step(model, tmp_path, accumulation, disc_weight=0.0, sample_posterior=False, kl_weight=1e-3,
                         perceptual_weight=1.0)
        step.built.lpips = lpips
        for micro_batch, chunk in enumerate(paddle.split(x, accumulation)):
            step.forward_backward(chunk, 0, micro_batch)
        grads.append([p.grad.numpy() for p in model.vae.parameters()])
    for full, accumulated in zip(*grads):
        np.testing.assert_allclose(accumulated, full, rtol=1e-4, atol=1e-7)


def poison_gradient(param):
    """Make `param`'s gradient infinite from now on, leaving every loss finite."""
    return param.register_hook(lambda grad: grad + float("inf"))


def test_nan_loss_skips_the_step_for_both_networks_then_stops(tmp_path):
    model = make_model()
    step = make_step(model, tmp_path, max_nonfinite=2)
    before = weights(model)
    bad = images()
    bad[0, 0, 0, 0] = float("nan")
    report = full_step(step, bad, global_step=0)
    assert report["train/skipped_steps"] == 1 and unchanged(model, before)
    # A good step in between resets the consecutive count and does update the weights.
    full_step(step, images(), global_step=1)
    assert not unchanged(model.vae, before)
    full_step(step, bad, global_step=2)
    with pytest.raises(NonFiniteError, match="2 consecutive"):
        full_step(step, bad, global_step=3)


@pytest.mark.parametrize("network", ["vae", "discriminator"])
def test_inf_gradient_with_a_finite_loss_skips_the_step_for_both_networks(tmp_path, network):
    """Finite losses, one infinite gradient (in either network): nothing is updated, the skip is counted,
    and the run stops after --max_consecutive_nonfinite_steps such steps."""
    model = make_model()
    step = make_step(model, tmp_path, max_nonfinite=2)
    first_layer = model.vae.encoder.conv_in if network == "vae" else model.discriminator.sublayers()[1]
    hook = poison_gradient(first_layer.weight)
    before, vae_before, disc_before = weights(model), weights(model.vae), weights(model.discriminator)
    logs = step.forward_backward(images(), 0, 0)
    assert np.isfinite(logs["loss/total"].item()) and np.isfinite(logs["loss/discriminator"].item())
    report = step.optimizer_step(global_step=0)[0]
    assert report["train/skipped_steps"] == 1 and unchanged(model, before)
    assert all(p.grad is None or not p.grad.numpy().any() for p in model.parameters())  # nothing carried over
    step.schedule(0)
    assert step.networks[0].scheduler.last_epoch == 1  # the schedule follows the step counter, skipped or not
    with pytest.raises(NonFiniteError, match="2 consecutive"):
        full_step(step, images(), global_step=1)
    assert unchanged(model, before)
    hook.remove()  # and start again, as after a resume: fresh gradients and counters
    step.networks[0].optimizer.clear_grad(), step.networks[1].optimizer.clear_grad()
    step.guard.consecutive_nonfinite = 0
    full_step(step, images(), global_step=2)
    assert not unchanged(model.vae, vae_before) and not unchanged(model.discriminator, disc_before)


def test_ema_follows_the_warmed_up_decay(tmp_path):
    """EMA after each step = d_t * EMA + (1 - d_t) * weights, d_t = min(decay, (1 + t) / (10 + t))."""
    from ppdiffusers.training_utils import EMAModel

    model = make_model()
    step = make_step(model, tmp_path, disc_weight=0.0, learning_rate=1e-2)
    step.ema = EMAModel(model.vae.parameters(), decay=0.5)
    expected = [p.numpy().astype("float64") for p in model.vae.parameters()]
    for t in range(1, 4):
        step.forward_backward(images(seed=t), t - 1, 0)
        step.optimizer_step(t - 1)
        decay = min(0.5, (1 + t) / (10 + t))
        expected = [decay * e + (1 - decay) * p.numpy() for e, p in zip(expected, model.vae.parameters())]
    for shadow, e in zip(step.ema.shadow_params, expected):
        np.testing.assert_allclose(shadow.numpy(), e, rtol=1e-5, atol=1e-7)
    # Logged reconstructions use the EMA weights, and the raw weights come back afterwards.
    raw = model.vae.decoder.conv_out.weight.numpy().copy()
    inputs, recon = logged_images(step)
    assert not np.allclose(recon.numpy(), step.last_images[1].numpy())
    assert np.array_equal(model.vae.decoder.conv_out.weight.numpy(), raw)


def test_recompute_gives_the_same_losses_and_gradients(tmp_path):
    """--recompute (every resnet, attention and sampler recomputed in the backward) trades compute for memory
    without changing the numbers: one step with the GAN on (the adaptive weight's paddle.grad at the decoder's
    last layer) and a sampled posterior gives the same losses, VAE and discriminator gradients."""
    from vae_trainer.models.families import family_of
    from vae_trainer.models.recompute import enable_recompute

    x = images()
    results = []
    for recompute in (False, True):
        model = make_model()
        segments = enable_recompute(model.vae) if recompute else []
        step = make_step(model, tmp_path)  # disc_start 0: GAN, adaptive weight and discriminator update on
        paddle.seed(11)
        logs = step.forward_backward(x, 0, 0)
        calls = sum(getattr(layer.forward, "calls", 0) for _, layer in family_of(model.vae).recompute_segments(model.vae))
        assert calls == len(segments)  # each segment's forward ran once, under recompute
        results.append(({k: v.numpy() for k, v in logs.items()},
                         [p.grad.numpy() for p in model.vae.parameters() + model.discriminator.parameters()]))
    (plain_logs, plain_grads), (logs, grads) = results
    assert len(segments) == 14  # micro: down blocks 2 resnets + 1 downsampler, up blocks 4 + 1, 2 mid blocks 2x3
    assert "gan/adaptive_weight" in logs and plain_logs["gan/adaptive_weight"] > 0
    for key, value in plain_logs.items():
        assert np.allclose(np.atleast_1d(logs[key]), np.atleast_1d(value), rtol=1e-5, atol=1e-7), key  # (0-d: np.bool)
    for plain, checkpointed in zip(plain_grads, grads):
        np.testing.assert_allclose(checkpointed, plain, rtol=1e-4, atol=1e-7)


def test_recompute_flag_recomputes_each_resnet_attention_and_sampler(tmp_path):
    from vae_trainer.arguments import ModelArguments
    from vae_trainer.build import build_networks
    from vae_trainer.models.families import family_of
    from vae_trainer.models.recompute import RecomputedForward

    for recompute in (False, True):
        networks = build_networks(ModelArguments(vae_config_file=MICRO, disc_num_layers=2, disc_base_channels=8),
                                 LossArguments(perceptual_weight=0.0), make_args(tmp_path, recompute=recompute))
        vae = networks.model.vae
        names = [name for name, layer in family_of(vae).recompute_segments(vae)
                 if isinstance(layer.__dict__.get("forward"), RecomputedForward)]
        assert bool(names) == recompute
        if recompute:
            assert {"encoder.mid_block.attentions.0", "decoder.mid_block.attentions.0",
                    "decoder.up_blocks.1.resnets.1", "encoder.down_blocks.0.downsamplers.0",
                    "decoder.up_blocks.0.upsamplers.0"} <= set(names)
        # ppdiffusers' block-level checkpointing stays off (nested, it would recompute everything twice)
        assert not vae.encoder.gradient_checkpointing and not vae.decoder.gradient_checkpointing
        assert set(vae.state_dict()) == set(build_vae(MICRO).state_dict())  # parameter names unchanged

