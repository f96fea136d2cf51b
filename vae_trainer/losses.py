"""The LDM autoencoder objective, written once for both drivers.

VAE loss (what the VAE optimizer minimises), per micro-batch:

    rec    = mean over pixels of |x - x_hat| (or squared, --pixel_loss l2)
    p      = mean over images of LPIPS(x, x_hat)
    nll    = (rec + perceptual_weight * p) / exp(logvar) + logvar
    kl     = mean over images of sum over latent elements of KL(q(z|x) || N(0, I)), divided by C*H*W
    gan    = -mean(D(x_hat))                       (hinge)  or  mean(softplus(-D(x_hat)))   (vanilla)
    loss   = nll + kl_weight * kl + d_weight * gan,   d_weight = disc_weight * ||dnll/dW|| / ||dgan/dW||

Normalisation: LDM (taming-transformers' LPIPSWithDiscriminator) *sums* the reconstruction over pixels
and the KL over latent elements and divides by the batch size. We divide both by the number of pixel
values C*H*W instead, so the pixel term is a per-pixel mean (comparable across resolutions) while
`--kl_weight` and `--perceptual_weight` keep exactly their LDM meaning (1e-6 and 1.0 mean what they mean
in the SD VAE configs). The adaptive weight is scale-free, so the GAN balance is LDM's too.
W is the weight of the decoder's last conv. Before `--disc_start` the GAN term is off and its gradient
norms are not computed at all.

Discriminator loss on detached reconstructions: hinge mean(relu(1 - D(x))) + mean(relu(1 + D(x_hat)))
(halved, as in LDM) or vanilla mean(softplus(-D(x))) + mean(softplus(D(x_hat))) (halved).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import paddle
import paddle.nn.functional as F

Tensor = paddle.Tensor


def pixel_loss(x: Tensor, recon: Tensor, kind: str = "l1") -> Tensor:
    """Element-wise reconstruction error, same shape as the images (float32)."""
    diff = x.astype("float32") - recon.astype("float32")
    if kind == "l1":
        return diff.abs()
    if kind == "l2":
        return diff.square()
    raise ValueError(f"unknown pixel loss {kind!r}")


def kl_loss(mean: Tensor, logvar: Tensor) -> Tensor:
    """Per-image KL(N(mean, exp(logvar)) || N(0, I)) summed over latent elements, in float32.

    Computed from the posterior's parameters in float32 so that exp(logvar) and the squares cannot
    overflow under fp16/bf16 autocast.
    """
    mean = mean.astype("float32")
    logvar = paddle.clip(logvar.astype("float32"), -30.0, 20.0)
    return 0.5 * paddle.sum(mean.square() + logvar.exp() - 1.0 - logvar, axis=[1, 2, 3])


def generator_loss(logits_fake: Tensor, kind: str = "hinge") -> Tensor:
    """Adversarial loss of the VAE (the generator)."""
    logits_fake = logits_fake.astype("float32")
    if kind == "hinge":
        return -logits_fake.mean()
    if kind == "vanilla":
        return F.softplus(-logits_fake).mean()
    raise ValueError(f"unknown GAN loss {kind!r}")


def discriminator_loss(logits_real: Tensor, logits_fake: Tensor, kind: str = "hinge") -> Tensor:
    """Discriminator loss on real images and detached reconstructions."""
    logits_real, logits_fake = logits_real.astype("float32"), logits_fake.astype("float32")
    if kind == "hinge":
        return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())
    if kind == "vanilla":
        return 0.5 * (F.softplus(-logits_real).mean() + F.softplus(logits_fake).mean())
    raise ValueError(f"unknown GAN loss {kind!r}")


def adaptive_weight(nll: Tensor, gan: Tensor, last_layer: Tensor, max_weight: float = 1e4) -> Tensor:
    """||d nll / dW|| / ||d gan / dW|| at the decoder's last layer (taming's calculate_adaptive_weight).

    Uses `paddle.grad`, which leaves `.grad` untouched, so the real backward afterwards is unaffected.
    """
    nll_grad = paddle.grad(nll, last_layer, retain_graph=True)[0]
    gan_grad = paddle.grad(gan, last_layer, retain_graph=True)[0]
    weight = paddle.linalg.norm(nll_grad.astype("float32")) / (paddle.linalg.norm(gan_grad.astype("float32")) + 1e-4)
    return paddle.clip(weight, 0.0, max_weight).detach()


class frozen:
    """Context manager: no gradients reach a layer's parameters while it is used inside."""

    def __init__(self, layer: paddle.nn.Layer):
        self.params = [p for p in layer.parameters() if not p.stop_gradient]

    def __enter__(self):
        for p in self.params:
            p.stop_gradient = True

    def __exit__(self, *exc):
        for p in self.params:
            p.stop_gradient = False


def vae_objective(
    x: Tensor,
    recon: Tensor,
    posterior_mean: Tensor,
    posterior_logvar: Tensor,
    logvar: Tensor,
    *,
    loss_args,
    lpips: Optional[Callable[[Tensor, Tensor], Tensor]],
    discriminator: Optional[paddle.nn.Layer],
    last_layer: Optional[Tensor],
    gan_active: bool,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The VAE's loss for one micro-batch and its parts (detached) for logging."""
    rec = pixel_loss(x, recon, loss_args.pixel_loss).mean()
    use_lpips = lpips is not None and loss_args.perceptual_weight > 0
    perceptual = lpips(x, recon).astype("float32").mean() if use_lpips else paddle.zeros([], "float32")
    nll = (rec + loss_args.perceptual_weight * perceptual) / logvar.exp() + logvar
    pixels_per_image = float(x.shape[1] * x.shape[2] * x.shape[3])
    kl = kl_loss(posterior_mean, posterior_logvar).mean() / pixels_per_image
    loss = nll + loss_args.kl_weight * kl

    logs = {"loss/pixel": rec, "loss/perceptual": perceptual, "loss/nll": nll, "loss/kl": kl, "train/logvar": logvar}
    if gan_active:
        with frozen(discriminator):
            logits_fake = discriminator(recon)
        gan = generator_loss(logits_fake, loss_args.disc_loss)
        if loss_args.adaptive_disc_weight:
            d_weight = adaptive_weight(nll, gan, last_layer) * loss_args.disc_weight
        else:
            d_weight = paddle.full([], loss_args.disc_weight, "float32")
        loss = loss + d_weight * gan
        logs.update({"loss/generator": gan, "gan/adaptive_weight": d_weight})
    logs["loss/total"] = loss
    return loss, {k: v.detach() for k, v in logs.items()}


def discriminator_objective(
    discriminator: paddle.nn.Layer, x: Tensor, recon: Tensor, kind: str
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The discriminator's loss on real images and detached reconstructions, and its logs."""
    logits_real = discriminator(x.detach())
    logits_fake = discriminator(recon.detach())
    loss = discriminator_loss(logits_real, logits_fake, kind)
    logs = {
        "loss/discriminator": loss,
        "gan/logits_real": logits_real.astype("float32").mean(),
        "gan/logits_fake": logits_fake.astype("float32").mean(),
    }
    return loss, {k: v.detach() for k, v in logs.items()}
