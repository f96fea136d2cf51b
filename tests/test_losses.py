"""The loss math of vae_trainer/objectives/, checked against numpy and against autograd by hand."""

import numpy as np
import paddle
import pytest
from ppdiffusers.models.vae import DiagonalGaussianDistribution

from vae_trainer import objectives
from vae_trainer.objectives import gan, reconstruction

paddle.set_device("cpu")


def _t(a):
    return paddle.to_tensor(np.asarray(a, dtype="float32"))


def test_pixel_losses_match_numpy():
    rng = np.random.default_rng(0)
    x, y = rng.uniform(-1, 1, (2, 3, 4, 4)), rng.uniform(-1, 1, (2, 3, 4, 4))
    np.testing.assert_allclose(reconstruction.pixel_loss(_t(x), _t(y), "l1").numpy(), np.abs(x - y), rtol=1e-6)
    np.testing.assert_allclose(reconstruction.pixel_loss(_t(x), _t(y), "l2").numpy(), (x - y) ** 2, rtol=1e-5)
    with pytest.raises(ValueError):
        reconstruction.pixel_loss(_t(x), _t(y), "l3")


def test_kl_matches_closed_form_and_ppdiffusers():
    rng = np.random.default_rng(1)
    mean, logvar = rng.normal(size=(3, 4, 5, 5)), rng.normal(scale=0.5, size=(3, 4, 5, 5))
    expected = 0.5 * np.sum(mean**2 + np.exp(logvar) - 1 - logvar, axis=(1, 2, 3))
    got = reconstruction.kl_loss(_t(mean), _t(logvar)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    posterior = DiagonalGaussianDistribution(_t(np.concatenate([mean, logvar], axis=1)))
    np.testing.assert_allclose(got, posterior.kl().numpy(), rtol=1e-5)
    # A posterior equal to the prior has zero KL.
    assert np.abs(reconstruction.kl_loss(_t(np.zeros((1, 4, 2, 2))), _t(np.zeros((1, 4, 2, 2)))).numpy()).max() == 0


def test_kl_stays_finite_in_half_precision():
    mean = paddle.full([1, 4, 2, 2], 200.0, "float16")  # 200^2 overflows nothing in float32, inf in float16
    value = reconstruction.kl_loss(mean, paddle.zeros([1, 4, 2, 2], "float16"))
    assert value.dtype == paddle.float32 and np.isfinite(value.numpy()).all()
    np.testing.assert_allclose(value.numpy(), [0.5 * 16 * 200.0**2], rtol=1e-6)


@pytest.mark.parametrize("kind", ["hinge", "vanilla"])
def test_gan_losses_match_formulas(kind):
    real, fake = np.array([2.0, 0.5, -1.0]), np.array([-2.0, 0.3, 1.5])
    softplus = lambda v: np.log1p(np.exp(v))  # noqa: E731
    if kind == "hinge":
        d_expected = 0.5 * (np.maximum(0, 1 - real).mean() + np.maximum(0, 1 + fake).mean())
        g_expected = -fake.mean()
    else:
        d_expected = 0.5 * (softplus(-real).mean() + softplus(fake).mean())
        g_expected = softplus(-fake).mean()
    assert gan.discriminator_loss(_t(real), _t(fake), kind).item() == pytest.approx(d_expected, rel=1e-6)
    assert gan.generator_loss(_t(fake), kind).item() == pytest.approx(g_expected, rel=1e-6)


def test_adaptive_weight_is_ratio_of_gradient_norms_clamped():
    rng = np.random.default_rng(0)
    g_nll, g_gan = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    expected = np.linalg.norm(g_nll) / (np.linalg.norm(g_gan) + 1e-4)
    assert gan.adaptive_weight(_t(g_nll), _t(g_gan)).item() == pytest.approx(expected, rel=1e-5)
    clamped = gan.adaptive_weight(_t(g_nll), _t(g_gan), max_weight=0.1 * expected)
    assert clamped.item() == pytest.approx(0.1 * expected)
    assert gan.adaptive_weight(_t(g_nll), _t(g_gan), eps=2.0).item() == pytest.approx(
        np.linalg.norm(g_nll) / (np.linalg.norm(g_gan) + 2.0), rel=1e-5)


def test_adaptive_weight_is_nan_when_a_gradient_norm_overflows_not_clipped_to_its_maximum():
    g = _t(np.ones((3, 4)))
    assert np.isfinite(gan.adaptive_weight(g, g).item())
    # nll's gradient overflows: inf / finite would be clipped to max_weight (1e4), a huge GAN weight.
    assert np.isnan(gan.adaptive_weight(g * 3e38 * 3e38, g).item())
    # gan's gradient overflows: finite / inf would be 0 by accident.
    assert np.isnan(gan.adaptive_weight(g, g * 3e38 * 3e38).item())


def test_last_layer_gradient_is_the_loss_gradient_at_the_layer_from_its_gradient_at_the_output():
    """dL/dW from dL/d(output) alone, for a layer that is not the last op before the output either, and
    without touching .grad (the real backward comes later)."""
    paddle.seed(0)
    layer = paddle.nn.Linear(4, 3)
    x = paddle.randn([5, 4])
    out = paddle.tanh(layer(x))
    leaf = out.detach()
    leaf.stop_gradient = False
    head_loss = (leaf.square() * paddle.arange(15, dtype="float32").reshape([5, 3])).sum()
    out_grad = paddle.grad(head_loss, leaf)[0]
    expected = paddle.grad((out.square() * paddle.arange(15, dtype="float32").reshape([5, 3])).sum(), layer.weight,
                           retain_graph=True)[0]
    got = gan.last_layer_gradient(out, out_grad, layer.weight)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)
    assert layer.weight.grad is None  # paddle.grad does not accumulate into .grad
    out.sum().backward()  # the graph is kept for the real backward
    assert layer.weight.grad is not None


def test_a_given_scaled_gradient_reaches_a_half_precision_reconstruction_without_underflow():
    """The VAE's backward starts from the heads' gradient at the reconstruction, computed with the loss
    scale s (VAELoss.backward): the fp16 reconstruction gets that scaled gradient, whose unscaled value (1e-8)
    would be 0 in float16, together with the scaled gradient of `direct`."""
    weight = paddle.create_parameter([3], "float32")
    weight.set_value(_t([1.0, 2.0, 3.0]))
    recon = weight.astype("float16") * 2  # a half-precision output, as under autocast
    scale = 2.0**16
    given = _t([1e-8, 1e-3, -2e-3]) * scale
    direct = weight.sum()
    objectives.VAELoss(direct, given, {}).backward(recon, lambda loss: loss * scale)
    np.testing.assert_allclose(weight.grad.numpy(), 2 * given.numpy() + scale, rtol=1e-3)
    assert np.float16(1e-8) == 0


def test_vae_objective_skips_the_gan_term_when_the_adaptive_weight_overflows():
    """fp16: the adaptive weight's gradients carry the loss scale; if they overflow, the micro-batch's loss is
    the loss without the GAN term (finite) and the overflow is flagged for the step to count."""
    from vae_trainer.arguments import LossArguments

    paddle.seed(0)
    x = paddle.uniform([2, 3, 8, 8], min=-1, max=1)
    decoder = paddle.nn.Conv2D(3, 3, 3, padding=1)
    discriminator = paddle.nn.Conv2D(3, 1, 3)
    recon = decoder(x)
    mean, logvar = paddle.zeros([2, 4, 2, 2]), paddle.zeros([2, 4, 2, 2])
    args = LossArguments(perceptual_weight=0.0, disc_start=0)
    results = {}
    for grad_scale in (1.0, 3e38):
        results[grad_scale] = objectives.vae_objective(
            x, recon, mean, logvar, paddle.zeros([]), loss_args=args, lpips=None, discriminator=discriminator,
            last_layer=decoder.weight, gan_weight=args.disc_weight, grad_scale=grad_scale)
    (loss, logs), (loss_skipped, logs_skipped) = [(results[s].logs["loss/total"], results[s].logs) for s in (1.0, 3e38)]
    assert logs["gan/adaptive_weight_overflow"].item() == 0 and logs["gan/adaptive_weight"].item() > 0
    assert logs_skipped["gan/adaptive_weight_overflow"].item() == 1 and logs_skipped["gan/adaptive_weight"].item() == 0
    without_gan = logs["loss/nll"].item() + args.kl_weight * logs["loss/kl"].item()
    assert loss_skipped.item() == pytest.approx(without_gan, rel=1e-6)
    assert loss.item() != pytest.approx(without_gan, rel=1e-6)


def test_an_overflowing_gan_gradient_leaves_the_vae_the_gradient_of_the_loss_without_the_gan_term():
    """fp16: the GAN's scaled gradient at the reconstruction overflows (inf entries, finite GAN loss). The
    skipped term must contribute nothing to the VAE's gradient (0 * inf would make it NaN)."""
    from vae_trainer.arguments import LossArguments

    paddle.seed(0)
    x = paddle.uniform([2, 3, 8, 8], min=-1, max=1)
    decoder = paddle.nn.Conv2D(3, 3, 3, padding=1)
    discriminator = paddle.nn.Conv2D(3, 1, 3)
    discriminator.weight.set_value(discriminator.weight * 1e6)
    zeros = paddle.zeros([2, 4, 2, 2])
    args = LossArguments(perceptual_weight=0.0, disc_start=0)
    grad_scale = 1e36  # the scaled pixel gradient stays finite, the scaled GAN gradient does not
    recon = decoder(x)
    loss = objectives.vae_objective(x, recon, zeros, zeros, paddle.zeros([]), loss_args=args, lpips=None,
                                discriminator=discriminator, last_layer=decoder.weight, gan_weight=args.disc_weight,
                                grad_scale=grad_scale)
    logs = loss.logs
    assert logs["gan/adaptive_weight_overflow"].item() == 1 and np.isfinite(logs["loss/generator"].item())
    loss.backward(recon, lambda direct: direct * grad_scale)  # as the step scales it
    expected = paddle.grad(reconstruction.pixel_term(x, decoder(x), args) * grad_scale, decoder.weight)[0]
    assert np.isfinite(decoder.weight.grad.numpy()).all()
    np.testing.assert_allclose(decoder.weight.grad.numpy(), expected.numpy(), rtol=1e-5)


def _ldm_reference_loss(x, recon, mean, logvar, discriminator, last_layer, kl_weight, disc_weight):
    """taming-transformers' LPIPSWithDiscriminator (perceptual weight 0, logvar 0), written out:
    sums over pixel values and latent elements, mean over images, adaptive weight clamped to [0, 1e4]."""
    batch = x.shape[0]
    nll = (x - recon).abs().sum() / batch
    kl = reconstruction.kl_loss(mean, logvar).sum() / batch
    gan = -discriminator(recon).mean()
    nll_grad = paddle.grad(nll, last_layer, retain_graph=True)[0]
    gan_grad = paddle.grad(gan, last_layer, retain_graph=True)[0]
    d_weight = paddle.clip(paddle.linalg.norm(nll_grad) / (paddle.linalg.norm(gan_grad) + 1e-4), 0.0, 1e4) * disc_weight
    return (nll + kl_weight * kl + d_weight * gan).item(), d_weight.item()


@pytest.mark.parametrize("disc_scale,clamped", [(1.0, False), (1e-9, True)])
def test_objective_is_ldm_objective_over_pixel_count_including_the_adaptive_weight_clamp(disc_scale, clamped):
    """loss = LDM loss / (C*H*W) and adaptive weight = LDM's / (C*H*W), also where LDM's 1e4 clamp binds
    (a discriminator whose gradient vanishes): the clamp must scale with the normalisation (docs/training.md)."""
    from vae_trainer.arguments import LossArguments

    paddle.seed(3)
    features = paddle.randn([2, 4, 8, 8])
    decoder_out = paddle.nn.Conv2D(4, 3, 1)  # stands in for the decoder's last layer W
    discriminator = paddle.nn.Conv2D(3, 1, 4, stride=2)
    discriminator.weight.set_value(discriminator.weight * disc_scale)
    discriminator.bias.set_value(discriminator.bias * disc_scale)
    x = paddle.uniform([2, 3, 8, 8], min=-1, max=1)
    mean, logvar = 0.3 * paddle.randn([2, 4, 2, 2]), 0.1 * paddle.randn([2, 4, 2, 2])
    args = LossArguments(perceptual_weight=0.0, kl_weight=1e-3, disc_weight=0.5)
    pixel_values = 3 * 8 * 8

    expected_loss, expected_weight = _ldm_reference_loss(x, decoder_out(features), mean, logvar, discriminator,
                                                         decoder_out.weight, args.kl_weight, args.disc_weight)
    objective = objectives.vae_objective(x, decoder_out(features), mean, logvar, paddle.zeros([]), loss_args=args,
                                     lpips=None, discriminator=discriminator, last_layer=decoder_out.weight,
                                     gan_weight=args.disc_weight)
    loss, logs = objective.logs["loss/total"], objective.logs
    assert (expected_weight == pytest.approx(1e4 * args.disc_weight)) == clamped  # the case is what it claims
    assert logs["gan/adaptive_weight"].item() * pixel_values == pytest.approx(expected_weight, rel=1e-4)
    assert loss.item() * pixel_values == pytest.approx(expected_loss, rel=1e-4)
