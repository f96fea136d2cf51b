"""The VAE loss runs LPIPS's VGG16 and the discriminator backwards once per micro-step, with the gradients
of the objective as it was computed before (adaptive weight by `paddle.grad` at the decoder's last layer,
through VGG16 and the discriminator, then the loss's backward through them again)."""

import contextlib
import copy

import numpy as np
import paddle
import pytest
from test_step import images, make_step

from vae_trainer.objectives.gan import ADAPTIVE_WEIGHT_EPS, ADAPTIVE_WEIGHT_MAX, discriminator_objective, generator_loss
from vae_trainer.objectives.reconstruction import kl_loss, pixel_term
from vae_trainer.models.trainable import VAEWithDiscriminator
from vae_trainer.models.discriminator import build_discriminator
from vae_trainer.models.lpips import DEFAULT_LPIPS_WEIGHTS, LPIPS
from vae_trainer.models.families import family_of
from vae_trainer.models.vae_loading import build_vae

paddle.set_device("cpu")
ACCUMULATION = 2


@pytest.fixture(scope="module")
def lpips():
    import os

    if not os.path.exists(DEFAULT_LPIPS_WEIGHTS):
        pytest.skip(f"no LPIPS weights at {DEFAULT_LPIPS_WEIGHTS} (make setup)")
    return LPIPS()


def make_model(learn_logvar):
    """Micro VAE with the default discriminator (BatchNorm PatchGAN); a non-zero output log-variance."""
    paddle.seed(0)
    model = VAEWithDiscriminator(build_vae("configs/vae_micro.json"), build_discriminator(), learn_logvar=learn_logvar)
    model.logvar.set_value(paddle.full([], 0.25))
    return model


@contextlib.contextmanager
def frozen(layer):
    """No gradients reach `layer`'s parameters inside (the reference's backward runs through the discriminator)."""
    params = [p for p in layer.parameters() if not p.stop_gradient]
    for p in params:
        p.stop_gradient = True
    try:
        yield
    finally:
        for p in params:
            p.stop_gradient = False


def reference_vae_loss(x, recon, post_mean, post_logvar, model, lpips, loss_args, grad_scale):
    """REFERENCE, the computation before the heads' gradients were taken once: the adaptive weight from
    two `paddle.grad` calls at W (each a backward through VGG16 / the discriminator), its loss
    backpropagated through both again by the caller."""
    pixels = float(x.shape[1] * x.shape[2] * x.shape[3])
    perceptual = lpips(x, recon).astype("float32").mean()
    weighted = pixel_term(x, recon, loss_args) + loss_args.perceptual_weight * perceptual
    nll = weighted / model.logvar.exp() + model.logvar
    kl = kl_loss(post_mean, post_logvar).mean() / pixels
    with frozen(model.discriminator):
        gan = generator_loss(model.discriminator(recon), loss_args.disc_loss)
    last_layer = family_of(model.vae).last_layers(model.vae)[0]
    nll_grad = paddle.grad(nll * grad_scale, last_layer, retain_graph=True)[0]
    gan_grad = paddle.grad(gan * grad_scale, last_layer, retain_graph=True)[0]
    ratio = paddle.linalg.norm(nll_grad) / (paddle.linalg.norm(gan_grad) + ADAPTIVE_WEIGHT_EPS * grad_scale)
    d_weight = paddle.clip(ratio, 0.0, ADAPTIVE_WEIGHT_MAX / pixels) * loss_args.disc_weight
    return nll + loss_args.kl_weight * kl + d_weight * gan, d_weight


def reference_micro_step(model, x, lpips, loss_args):
    recon, post_mean, post_logvar = model(x)
    loss, d_weight = reference_vae_loss(x, recon, post_mean, post_logvar, model, lpips, loss_args, 1 / ACCUMULATION)
    (loss / ACCUMULATION).backward()
    d_loss, _ = discriminator_objective(model.discriminator, x, recon, loss_args)
    (d_loss / ACCUMULATION).backward()
    return loss, d_weight


def relative_error(ours, theirs):
    return np.linalg.norm((ours - theirs).ravel()) / max(np.linalg.norm(theirs.ravel()), 1e-30)


@pytest.mark.parametrize("learn_logvar", [False, True])
def test_gradients_and_adaptive_weight_equal_the_two_extra_backwards_computation(tmp_path, lpips, learn_logvar):
    """LPIPS, BatchNorm PatchGAN, GAN on with the adaptive weight, 2 accumulated micro-batches: every
    parameter gradient of both networks (the log-variance's too when learnable), the adaptive weight,
    the logged loss and the discriminator's BatchNorm statistics as before."""
    model = make_model(learn_logvar)
    reference = copy.deepcopy(model)
    reference.train()
    step = make_step(model, tmp_path, accumulation=ACCUMULATION, perceptual_weight=1.0, kl_weight=1e-3)
    step.built.lpips = lpips
    batches = [images(n=2, seed=s) for s in range(ACCUMULATION)]
    for micro, x in enumerate(batches):
        paddle.seed(10 + micro)  # the same posterior samples in both
        logs = step.forward_backward(x, 0, micro)
        paddle.seed(10 + micro)
        loss, d_weight = reference_micro_step(reference, x, lpips, step.loss_args)
        assert logs["gan/adaptive_weight"].item() == pytest.approx(d_weight.item(), rel=1e-5)
        assert logs["gan/adaptive_weight"].item() > 0 and logs["gan/adaptive_weight_overflow"].item() == 0
        assert logs["loss/total"].item() == pytest.approx(loss.item(), rel=1e-6)

    checked = 0
    for network in ("vae", "discriminator"):
        ours = dict(getattr(model, network).named_parameters())
        theirs = {name: p.grad.numpy() for name, p in getattr(reference, network).named_parameters()
                  if p.grad is not None}
        assert set(theirs) == {name for name, p in ours.items() if p.grad is not None}, network
        largest = max(np.abs(g).max() for g in theirs.values())
        largest_norm = max(np.linalg.norm(g) for g in theirs.values())
        for name, expected in theirs.items():
            got = ours[name].grad.numpy()
            # Every element to 1e-5 of the network's largest gradient; every gradient that is not tiny (some
            # are zero but for rounding: a conv bias before a per-channel GroupNorm) to 1e-5 of its norm.
            assert np.abs(got - expected).max() <= 1e-5 * largest, (network, name)
            if np.linalg.norm(expected) >= 0.01 * largest_norm:
                assert relative_error(got, expected) < 1e-5, (network, name)
                checked += 1
    assert checked > 100
    if learn_logvar:
        assert relative_error(model.logvar.grad.numpy(), reference.logvar.grad.numpy()) < 1e-5
        assert reference.logvar.grad.item() != 0
    assert (model.logvar.grad is not None) == learn_logvar
    ours, theirs = model.discriminator.state_dict(), reference.discriminator.state_dict()
    for name in ours:  # the weights, and BatchNorm's running statistics (non-trainable parameters in Paddle)
        np.testing.assert_allclose(ours[name].numpy(), theirs[name].numpy(), rtol=1e-6, atol=1e-7, err_msg=name)


class BackwardCounter:
    """For every forward of `layer` that builds a graph: how many backward passes reach its output."""

    def __init__(self, layer):
        self.per_forward = []
        self.handle = layer.register_forward_post_hook(self._forward)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _forward(self, layer, inputs, output):
        if output.stop_gradient:
            return
        count = [0]
        self.per_forward.append(count)

        def backward(grad):
            count[0] += 1

        output.register_hook(backward)

    def take(self):
        counts, self.per_forward = [c[0] for c in self.per_forward], []
        return counts


def test_vgg16_and_discriminator_are_backpropagated_once_per_forward(tmp_path, lpips):
    """Per micro-step: one VGG16 forward with a graph (the reconstruction's) and one backward through it;
    three discriminator forwards with a graph (D(x_hat) for the generator, D(x) and D(x_hat) for its own
    loss), each backpropagated once. The counters see the earlier computation's second backwards."""
    model = make_model(learn_logvar=True)
    reference = copy.deepcopy(model)
    step = make_step(model, tmp_path, accumulation=ACCUMULATION, perceptual_weight=1.0)
    step.built.lpips = lpips
    # The first conv of each network: its output's gradient is needed by every backward through it.
    with BackwardCounter(lpips.vgg.features[0]) as vgg, BackwardCounter(model.discriminator.main[0]) as disc:
        for micro in range(ACCUMULATION):
            step.forward_backward(images(n=2, seed=micro), 0, micro)
            assert vgg.take() == [1] and disc.take() == [1, 1, 1]
    with BackwardCounter(lpips.vgg.features[0]) as vgg, BackwardCounter(reference.discriminator.main[0]) as disc:
        reference_micro_step(reference, images(n=2), lpips, step.loss_args)
        assert vgg.take() == [2] and disc.take() == [2, 1, 1]
