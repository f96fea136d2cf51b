"""The autoencoder objectives, written once for both drivers: LDM's, and the optional techniques.

Owns: the VAE loss (`vae_objective`), the discriminator loss (`discriminator_objective`), their parts
(pixel, KL, latent penalty, GAN losses, LeCAM, adaptive weight), the low-pass pixel-loss mask and the
gradient-normalising identity used by `--loss_balancing gradnorm`. Formulas: docs/techniques.md.

VAE loss (what the VAE optimizer minimises), per micro-batch, with the default flags (LDM):

    rec    = mean over pixels of |x - x_hat| (or squared, --pixel_loss l2)
    p      = mean over images of LPIPS(x, x_hat)
    nll    = (rec + perceptual_weight * p) / exp(logvar) + logvar
    kl     = mean over images of sum over latent elements of KL(q(z|x) || N(0, I)), divided by C*H*W
    gan    = -mean(D(x_hat))                       (hinge)  or  mean(softplus(-D(x_hat)))   (vanilla)
    loss   = nll + kl_weight * kl + d_weight * gan,   d_weight = disc_weight * ||dnll/dW|| / ||dgan/dW||

Normalisation: LDM (taming-transformers' LPIPSWithDiscriminator) *sums* the reconstruction over pixels
and the KL over latent elements and divides by the batch size. We divide both by the number of pixel
values N = C*H*W instead, so the pixel term is a per-pixel mean (comparable across resolutions) while
`--kl_weight` and `--perceptual_weight` keep exactly their LDM meaning (1e-6 and 1.0 mean what they mean
in the SD VAE configs). W is the weight of the decoder's last conv. Before `--disc_start` the GAN term
is off and its gradient norms are not computed at all.

The adaptive weight, and why its clamp is 1e4 / N (LDM: 1e4). With LDM's quantities marked _L:
    nll = nll_L / N,  kl = kl_L / N,  gan = gan_L                  (the GAN loss is a mean in both)
    r   = ||dnll/dW|| / (||dgan/dW|| + 1e-4) = r_L / N             (the same epsilon: gan is unscaled)
LDM uses d_L = disc_weight * min(r_L, 1e4). With d = disc_weight * min(r, 1e4 / N) = d_L / N,
    loss = nll + kl_weight * kl + d * gan = (nll_L + kl_weight * kl_L + d_L * gan_L) / N = loss_L / N,
LDM's objective up to a constant factor, which Adam's update ignores (up to its epsilon). A clamp at 1e4
on r would bind only when r_L > 1e4 * N (2e9 at 256 px), i.e. never: LDM's guard against a vanishing
GAN gradient would be gone. So the clamp is `ADAPTIVE_WEIGHT_MAX / N`, and the logged
`gan/adaptive_weight` is LDM's d_L / N. The fp16 loss scale / accumulation factor s multiplies both
losses and the epsilon, which leaves r unchanged.

One backward per head. The heads (pixel loss, LPIPS, discriminator) see the decoder only through x_hat, so
they run on a leaf copy of x_hat and their gradients there are taken once each (s = `grad_scale`, the loss
scale / accumulation factor the step multiplies the loss by, so that fp16 gradients do not underflow):
    g_nll = s * dnll/dx_hat    (one VGG16 backward),    g_gan = s * dgan/dx_hat    (one D input-backward)
dnll/dW and dgan/dW follow from them by the decoder's backward from x_hat to W, which for W = conv_out's
weight (whose output IS x_hat) is one small convolution (`last_layer_gradient`): that gives d. The objective
    loss = nll + kl_weight * kl + d * gan
is then differentiated as `VAELoss` says: the terms that do not go through the heads (`direct`: KL, latent
penalty, nll's path to a learnable logvar) by their own backward, and the rest by handing
`recon_grad` = g_nll + d * g_gan to the reconstruction, in the same backward pass (step.py). VGG16 and the
discriminator are backpropagated once per micro-batch (LDM's `paddle.grad(nll, W)` and `paddle.grad(gan, W)`
on the loss's own graph run both twice). The discriminator's parameters get nothing from this loss (it runs
`frozen`). An overflowing d (fp16) skips the GAN term: weight 0 and none of its gradient.

VF loss (VA-VAE, --vf_model_path; alignment.py): vf = L_mdms + L_mcos between the projected latent and the
foundation model's tokens, added as w * vf to `direct` (it reaches the encoder through z, not the heads),
    w = vf_weight * min(||dnll/dE|| / (||dvf/dE|| + 1e-4), 1e8 / N)     (--adaptive_vf; else w = vf_weight)
E the encoder's conv_out weight; dnll/dE is the decoder's backward of g_nll taken once more (to E), the
price of the adaptive weight. The clamp is VA-VAE's 1e8 in our units, as for d. A non-finite w (fp16) is 0.

Discriminator loss on detached reconstructions: hinge mean(relu(1 - D(x))) + mean(relu(1 + D(x_hat)))
(halved, as in LDM) or vanilla mean(softplus(-D(x))) + mean(softplus(D(x_hat))) (halved), plus
`lecam_weight` * LeCAM when enabled.

Options (all off by default): `--pixel_weight`, `--pixel_loss_pool K`, `--pixel_loss_mask lowpass`,
`--latent_penalty_weight`, `--gen_loss relative_hinge`, `--lecam_weight`, `--loss_balancing gradnorm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from .alignment import vf_loss

Tensor = paddle.Tensor

GRADNORM_EPS = 1e-12
# LDM's bound on the adaptive GAN weight, in its units (a sum over the N pixel values); see the module doc.
ADAPTIVE_WEIGHT_MAX = 1e4
ADAPTIVE_WEIGHT_EPS = 1e-4
VF_WEIGHT_MAX = 1e8  # VA-VAE's bound on the adaptive VF weight, in its units (module doc)
# Luma weights (ITU-R BT.601) for the grayscale image the low-pass mask is built from.
_GRAY_WEIGHTS = (0.299, 0.587, 0.114)
_MASK_BLUR_SIZE = 5
_MASK_BLUR_SIGMA = 1.0
# Floor of the normaliser of the edge energy: without it an image with no real edge would have its
# faint noise stretched to [0, 1] and half masked. A step of 0.1 (in [-1, 1]) reaches about this value.
_MIN_EDGE_ENERGY = 1.0


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


def latent_penalty(mean: Tensor) -> Tensor:
    """mean(z_mean^2) over all latent elements: keeps the latents' scale fixed under --posterior_std."""
    return mean.astype("float32").square().mean()


# ---------------------------------------------------------------- low-pass mask and pooled pixel loss
def _high_pass_kernel() -> np.ndarray:
    """5x5 Laplacian-like high-pass filter: 24 at the centre, -1 elsewhere (sums to 0)."""
    kernel = -np.ones((5, 5), dtype=np.float32)
    kernel[2, 2] = 24.0
    return kernel


def _gaussian_kernel(size: int, sigma: float) -> np.ndarray:
    axis = np.arange(size, dtype=np.float64) - (size - 1) / 2
    one_d = np.exp(-(axis**2) / (2 * sigma**2))
    two_d = np.outer(one_d, one_d)
    return (two_d / two_d.sum()).astype(np.float32)


def _filter_2d(images: Tensor, kernel: np.ndarray) -> Tensor:
    """Single-channel 'same' convolution with replicate padding (no false edges at the border)."""
    pad = kernel.shape[0] // 2
    weight = paddle.to_tensor(kernel[None, None])
    return F.conv2d(F.pad(images, [pad] * 4, mode="replicate"), weight)


def lowpass_mask(x: Tensor, threshold: float = 0.5) -> Tensor:
    """1 where the image is smooth, 0 near edges and texture; shape [B, 1, H, W], no gradient.

    gray -> 5x5 high-pass -> |.| -> Gaussian blur (5x5, sigma 1) -> e = divide by the per-image max
    (at least _MIN_EDGE_ENERGY, so [0, 1]) -> 1 - e -> (>= threshold).
    """
    with paddle.no_grad():
        x = x.astype("float32")
        gray = sum(w * x[:, c : c + 1] for c, w in enumerate(_GRAY_WEIGHTS))
        energy = _filter_2d(_filter_2d(gray, _high_pass_kernel()).abs(), _gaussian_kernel(_MASK_BLUR_SIZE, _MASK_BLUR_SIGMA))
        energy = energy / paddle.clip(energy.amax(axis=[1, 2, 3], keepdim=True), min=_MIN_EDGE_ENERGY)
        return (1.0 - energy >= threshold).astype("float32")


def pixel_term(x: Tensor, recon: Tensor, loss_args) -> Tensor:
    """The pixel loss as configured: optionally between K-pooled images, optionally low-pass masked.

    With the mask, the loss is mean(mask * error): masked pixels count as zero error, so the term's
    scale shrinks with the fraction of textured area instead of blowing up on busy images.
    """
    pool = getattr(loss_args, "pixel_loss_pool", 1)
    if pool > 1:
        x, recon = F.avg_pool2d(x.astype("float32"), pool), F.avg_pool2d(recon.astype("float32"), pool)
    error = pixel_loss(x, recon, loss_args.pixel_loss)
    if getattr(loss_args, "pixel_loss_mask", "none") == "lowpass":
        error = error * lowpass_mask(x, loss_args.pixel_loss_mask_threshold)
    return error.mean()


# ---------------------------------------------------------------- gradient-normalised balancing
def _global_norm(grad: Tensor) -> Tensor:
    """sqrt of the squared gradient norm averaged over ranks (the local norm on one process)."""
    squared = grad.square().sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(squared)
        squared = squared / dist.get_world_size()
    return squared.sqrt()


class _NormalizeGradient(PyLayer):
    """Identity forward; backward rescales the incoming gradient to a fixed norm (see normalize_gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, target_norm: float, per_sample: bool) -> Tensor:
        ctx.target_norm, ctx.per_sample = target_norm, per_sample
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad32 = grad.astype("float32")
        if ctx.per_sample:
            norm = grad32.square().sum(axis=list(range(1, grad.ndim)), keepdim=True).sqrt()
            target = ctx.target_norm / grad.shape[0]
        else:
            norm, target = _global_norm(grad32), ctx.target_norm
        return (grad32 * (target / (norm + GRADNORM_EPS))).astype(grad.dtype)


def normalize_gradient(x: Tensor, weight: float, scope: str = "sample") -> Tensor:
    """An identity copy of x whose backward sets the gradient's norm to `weight`.

    scope "sample": every sample's gradient gets norm weight / B (the gradient of a batch mean of
    per-sample losses with gradient norm `weight`). scope "global": the whole micro-batch's gradient
    gets norm `weight`, the norm being the root mean square over ranks of each rank's batch norm.
    """
    if scope not in ("sample", "global"):
        raise ValueError(f"unknown gradnorm scope {scope!r}")
    return _NormalizeGradient.apply(x, float(weight), scope == "sample")


# ---------------------------------------------------------------- adversarial losses
def generator_loss(
    logits_fake: Tensor, kind: str = "hinge", logits_real: Optional[Tensor] = None, margin: float = 0.0
) -> Tensor:
    """Adversarial loss of the VAE (the generator).

    relative_hinge: mean(relu(D(x) - D(x_hat) - margin)), zero once the reconstruction scores within
    `margin` of the real image; needs `logits_real` (constant for the VAE).
    """
    logits_fake = logits_fake.astype("float32")
    if kind == "hinge":
        return -logits_fake.mean()
    if kind == "vanilla":
        return F.softplus(-logits_fake).mean()
    if kind == "relative_hinge":
        return F.relu(logits_real.astype("float32").detach() - logits_fake - margin).mean()
    raise ValueError(f"unknown GAN loss {kind!r}")


def discriminator_loss(logits_real: Tensor, logits_fake: Tensor, kind: str = "hinge") -> Tensor:
    """Discriminator loss on real images and detached reconstructions."""
    logits_real, logits_fake = logits_real.astype("float32"), logits_fake.astype("float32")
    if kind == "hinge":
        return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())
    if kind == "vanilla":
        return 0.5 * (F.softplus(-logits_real).mean() + F.softplus(logits_fake).mean())
    raise ValueError(f"unknown GAN loss {kind!r}")


def lecam_regularization(logits_real: Tensor, logits_fake: Tensor, ema_real: Tensor, ema_fake: Tensor) -> Tensor:
    """LeCAM (Tseng et al. 2021): mean(relu(D(x) - ema_fake)^2) + mean(relu(ema_real - D(x_hat))^2)."""
    real_term = F.relu(logits_real.astype("float32") - ema_fake).square().mean()
    fake_term = F.relu(ema_real - logits_fake.astype("float32")).square().mean()
    return real_term + fake_term


def update_lecam_ema(ema: Tensor, logits_real: Tensor, logits_fake: Tensor, decay: float) -> None:
    """ema = [ema_real, ema_fake] <- decay * ema + (1 - decay) * batch means (averaged over ranks), in float32
    even inside an O2 autocast (which would round the update in half precision; the buffer stays float32)."""
    with paddle.no_grad(), paddle.amp.auto_cast(enable=False):
        means = paddle.stack([logits_real.astype("float32").mean(), logits_fake.astype("float32").mean()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(means)
            means = means / dist.get_world_size()
        ema.set_value((decay * ema.astype("float32") + (1.0 - decay) * means).astype(ema.dtype))


def adaptive_weight(nll_grad: Tensor, gan_grad: Tensor, max_weight: float = ADAPTIVE_WEIGHT_MAX,
                    eps: float | Tensor = ADAPTIVE_WEIGHT_EPS) -> Tensor:
    """||d nll / dW|| / (||d gan / dW|| + eps) from the two gradients at the decoder's last layer W,
    clamped to [0, max_weight] (taming's calculate_adaptive_weight; see the module doc for the clamp our
    normalisation needs).

    NaN when either gradient norm is not finite (an fp16 overflow of the scaled gradients): the caller
    then skips the GAN term (clipping would turn an infinite ratio into `max_weight`).
    """
    nll_norm = paddle.linalg.norm(nll_grad.astype("float32"))
    gan_norm = paddle.linalg.norm(gan_grad.astype("float32"))
    weight = paddle.clip(nll_norm / (gan_norm + eps), 0.0, max_weight)
    finite = paddle.isfinite(nll_norm) & paddle.isfinite(gan_norm)
    return paddle.where(finite, weight, paddle.full_like(weight, float("nan"))).detach()


def last_layer_gradient(recon: Tensor, recon_grad: Tensor, last_layer: Tensor) -> Tensor:
    """dL/dW for any loss L whose gradient at `recon` is `recon_grad` (L depends on W only through recon).

    `paddle.grad` follows only the graph's path from `recon` to W: for W = decoder.conv_out.weight, whose
    output is `recon`, that is one weight-gradient convolution (vae_tiny, 64 px: 1-3% of the VAE's
    backward). Keeps the VAE's graph for its real backward and leaves `.grad` untouched.
    """
    return paddle.grad(recon, last_layer, grad_outputs=recon_grad, retain_graph=True)[0]


def _input_gradient(loss: Tensor, leaf: Tensor) -> Tensor:
    """d loss / d leaf, freeing the loss's graph (LPIPS's VGG16 or the discriminator's)."""
    return paddle.grad(loss, leaf)[0]


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


# ---------------------------------------------------------------- the objectives
def _uses_gradnorm(loss_args) -> bool:
    return getattr(loss_args, "loss_balancing", "none") == "gradnorm"


def _generator_term(x: Tensor, recon: Tensor, discriminator: paddle.nn.Layer, loss_args) -> Tensor:
    kind = getattr(loss_args, "gen_loss", None) or loss_args.disc_loss
    with frozen(discriminator):
        logits_fake = discriminator(recon)
        # The relative hinge compares with D(x): one more discriminator forward, no VAE forward.
        logits_real = discriminator(x.detach()) if kind == "relative_hinge" else None
    return generator_loss(logits_fake, kind, logits_real, getattr(loss_args, "relative_hinge_margin", 0.0))


def _latent_terms(posterior_mean: Tensor, posterior_logvar: Tensor, pixels_per_image: float, loss_args):
    kl = kl_loss(posterior_mean, posterior_logvar).mean() / pixels_per_image
    penalty_weight = getattr(loss_args, "latent_penalty_weight", 0.0)
    penalty = latent_penalty(posterior_mean) if penalty_weight > 0 else paddle.zeros([], "float32")
    return kl, penalty, loss_args.kl_weight * kl + penalty_weight * penalty


@dataclass
class VAELoss:
    """One micro-batch's VAE objective, as the step differentiates it (module doc, "One backward per head"):
    its gradient is the backward of `direct` plus `recon_grad` handed to the reconstruction."""

    value: Tensor  # the objective: nll + kl_weight * kl + latent penalty + d * gan (detached)
    direct: Tensor  # the terms differentiated as they stand (all of the objective when recon_grad is None)
    recon_grad: Optional[Tensor]  # grad_scale * the heads' gradient at the reconstruction, float32
    logs: Dict[str, Tensor]  # detached parts, for logging

    def backward(self, recon: Tensor, scale: Callable[[Tensor], Tensor] = lambda loss: loss) -> None:
        """The objective's backward: `scale(direct)`'s, and `recon_grad` entering at `recon`, in one pass.
        `scale` must multiply by the `grad_scale` the heads' gradients were taken with."""
        direct = scale(self.direct)
        if self.recon_grad is None:
            direct.backward()
            return
        roots = ([] if direct.stop_gradient else [direct]) + [recon]
        paddle.autograd.backward(roots, [None] * (len(roots) - 1) + [self.recon_grad.astype(recon.dtype)])


@dataclass
class VFTerm:
    """The VF loss's inputs for one micro-batch (step.py): the projected latent and the foundation model's tokens
    on one grid ([B, N, C] each, alignment.to_token_grid), and the encoder's last layer E."""

    projected: Tensor
    features: Tensor
    encoder_last_layer: Tensor


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
    grad_scale: float | Tensor = 1.0,
    encoded_pixels: Optional[float] = None,
    vf: Optional[VFTerm] = None,
) -> VAELoss:
    """The VAE's objective for one micro-batch (`VAELoss`: module doc, "One backward per head").

    `grad_scale` (loss scale / accumulation steps, a float or a 0-d tensor): the factor the caller
    multiplies the loss by before its backward. The heads' gradients are computed with it (fp16: no
    underflow), and gradnorm needs it, as its backward would otherwise undo the caller's scaling.
    `encoded_pixels`: C x H x W of the image the posterior encodes, which normalises the KL, when `x` is
    another (EQ-VAE's transformed target, step.py); default `x`'s. `vf`: the VF loss's inputs (module doc).
    """
    if _uses_gradnorm(loss_args):
        return _gradnorm_objective(x, recon, posterior_mean, posterior_logvar, loss_args=loss_args, lpips=lpips,
                                   discriminator=discriminator, gan_active=gan_active, grad_scale=grad_scale,
                                   encoded_pixels=encoded_pixels)
    # The heads see a leaf copy of the reconstruction; their gradients there are taken once, below.
    x_hat = recon.detach()
    x_hat.stop_gradient = False
    rec = pixel_term(x, x_hat, loss_args)
    use_lpips = lpips is not None and loss_args.perceptual_weight > 0
    perceptual = lpips(x, x_hat).astype("float32").mean() if use_lpips else paddle.zeros([], "float32")
    weighted = getattr(loss_args, "pixel_weight", 1.0) * rec + loss_args.perceptual_weight * perceptual
    logvar_value = logvar.detach()
    nll = weighted / logvar_value.exp() + logvar_value
    pixels_per_image = float(x.shape[1] * x.shape[2] * x.shape[3])
    kl, penalty, latent_loss = _latent_terms(posterior_mean, posterior_logvar, encoded_pixels or pixels_per_image,
                                             loss_args)
    # nll again, with its path to a learnable output log-variance only.
    direct = weighted.detach() / logvar.exp() + logvar + latent_loss
    loss = direct.detach()
    logs = {"loss/pixel": rec, "loss/perceptual": perceptual, "loss/nll": nll, "loss/kl": kl, "train/logvar": logvar}
    if getattr(loss_args, "latent_penalty_weight", 0.0) > 0:
        logs["loss/latent_penalty"] = penalty

    nll_grad = _input_gradient(nll * grad_scale, x_hat)
    recon_grad = nll_grad.astype("float32")
    if gan_active:
        gan, d_weight, gan_grad, overflow = _weighted_gan_term(x, recon, x_hat, nll_grad, discriminator, last_layer,
                                                               loss_args, grad_scale, pixels_per_image)
        recon_grad = recon_grad + gan_grad
        loss = loss + (d_weight * gan).detach()
        logs.update({"loss/generator": gan, "gan/adaptive_weight": d_weight})
        if overflow is not None:
            logs["gan/adaptive_weight_overflow"] = overflow.astype("float32")
    if vf is not None:
        weighted_vf, vf_logs = _weighted_vf_term(vf, recon, nll_grad, loss_args, grad_scale,
                                                 encoded_pixels or pixels_per_image)
        direct = direct + weighted_vf
        loss = loss + weighted_vf.detach()
        logs.update(vf_logs)
    logs["loss/total"] = loss
    return VAELoss(loss, direct, recon_grad, {k: v.detach() for k, v in logs.items()})


def _weighted_gan_term(x, recon, x_hat, nll_grad, discriminator, last_layer, loss_args, grad_scale,
                       pixels_per_image) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The GAN term on the heads' leaf `x_hat`: (gan, its weight d, d * its scaled gradient at the
    reconstruction in float32, the adaptive weight's overflow flag or None without the adaptive weight).

    `nll_grad`: the scaled gradient of nll at the reconstruction, for the adaptive weight.
    """
    gan = _generator_term(x, x_hat, discriminator, loss_args)
    gan_grad = _input_gradient(gan * grad_scale, x_hat)
    if not loss_args.adaptive_disc_weight:
        d_weight = paddle.full([], loss_args.disc_weight, "float32")
        return gan, d_weight, gan_grad.astype("float32") * d_weight, None
    # Both gradients carry grad_scale; so does the epsilon, which leaves the ratio unchanged. Clamp: LDM's,
    # in our units (module doc).
    weight = adaptive_weight(last_layer_gradient(recon, nll_grad, last_layer),
                             last_layer_gradient(recon, gan_grad, last_layer),
                             max_weight=ADAPTIVE_WEIGHT_MAX / pixels_per_image, eps=ADAPTIVE_WEIGHT_EPS * grad_scale)
    # An overflow skips the GAN term of this micro-batch (weight 0, and none of its gradient, which may be
    # the non-finite one) instead of making the loss NaN; counted by the step (no host read here).
    overflow = ~paddle.isfinite(weight)
    d_weight = paddle.where(overflow, paddle.zeros_like(weight), weight) * loss_args.disc_weight
    weighted_grad = gan_grad.astype("float32") * d_weight
    return gan, d_weight, paddle.where(overflow, paddle.zeros_like(weighted_grad), weighted_grad), overflow


def _weighted_vf_term(vf: VFTerm, recon: Tensor, nll_grad: Tensor, loss_args, grad_scale,
                      pixels_per_image: float) -> Tuple[Tensor, Dict[str, Tensor]]:
    """w * (L_mdms + L_mcos) and its logs (module doc, "VF loss"); `nll_grad`: the scaled gradient of nll at the
    reconstruction."""
    mdms, mcos = vf_loss(vf.projected, vf.features, loss_args.distmat_margin, loss_args.cos_margin)
    value = mdms + mcos
    weight = paddle.full([], loss_args.vf_weight, "float32")
    if loss_args.adaptive_vf:
        nll_at_encoder = paddle.grad(recon, vf.encoder_last_layer, grad_outputs=nll_grad, retain_graph=True)[0]
        vf_at_encoder = paddle.grad(value * grad_scale, vf.encoder_last_layer, retain_graph=True)[0]
        ratio = adaptive_weight(nll_at_encoder, vf_at_encoder, max_weight=VF_WEIGHT_MAX / pixels_per_image,
                                eps=ADAPTIVE_WEIGHT_EPS * grad_scale)
        weight = paddle.where(paddle.isfinite(ratio), ratio, paddle.zeros_like(ratio)) * loss_args.vf_weight
    logs = {"train/vf_loss": value, "train/vf_weight": weight, "train/vf_distmat_loss": mdms,
            "train/vf_cos_loss": mcos}
    return weight * value, logs


def _gradnorm_objective(x, recon, posterior_mean, posterior_logvar, *, loss_args, lpips, discriminator,
                        gan_active, grad_scale, encoded_pixels=None) -> VAELoss:
    """--loss_balancing gradnorm: each branch gets its own gradient-normalised copy of the reconstruction.

    The branch weights act in the backward only, so the loss value is the unweighted sum of the branch
    losses (plus the weighted latent terms); the output log-variance and the adaptive weight are unused.
    """
    scope = loss_args.gradnorm_scope
    if isinstance(grad_scale, Tensor):  # e.g. fp16 loss scale / accumulation steps
        grad_scale = grad_scale.item()

    def branch(weight: float) -> Tensor:
        return normalize_gradient(recon, weight * grad_scale, scope)

    zero = paddle.zeros([], "float32")
    pixel_weight = getattr(loss_args, "pixel_weight", 1.0)
    rec = pixel_term(x, branch(pixel_weight), loss_args) if pixel_weight > 0 else pixel_term(x, recon.detach(), loss_args)
    use_lpips = lpips is not None and loss_args.perceptual_weight > 0
    perceptual = lpips(x, branch(loss_args.perceptual_weight)).astype("float32").mean() if use_lpips else zero
    pixels_per_image = encoded_pixels or float(x.shape[1] * x.shape[2] * x.shape[3])
    kl, penalty, latent_loss = _latent_terms(posterior_mean, posterior_logvar, pixels_per_image, loss_args)
    loss = rec + perceptual + latent_loss
    logs = {"loss/pixel": rec, "loss/perceptual": perceptual, "loss/kl": kl}
    if getattr(loss_args, "latent_penalty_weight", 0.0) > 0:
        logs["loss/latent_penalty"] = penalty
    if gan_active:
        gan = _generator_term(x, branch(loss_args.disc_weight), discriminator, loss_args)
        loss = loss + gan
        logs.update({"loss/generator": gan, "gan/adaptive_weight": paddle.full([], loss_args.disc_weight, "float32")})
    logs["loss/total"] = loss
    return VAELoss(loss.detach(), loss, None, {k: v.detach() for k, v in logs.items()})


def discriminator_objective(
    discriminator: paddle.nn.Layer,
    x: Tensor,
    recon: Tensor,
    kind: str,
    *,
    lecam_weight: float = 0.0,
    lecam_ema: Optional[Tensor] = None,
    lecam_decay: float = 0.99,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The discriminator's loss on real images and detached reconstructions, and its logs.

    With `lecam_weight` > 0, adds lecam_weight * LeCAM against `lecam_ema` = [ema D(x), ema D(x_hat)]
    (from earlier steps), then updates the EMA in place with this batch.
    """
    logits_real = discriminator(x.detach())
    logits_fake = discriminator(recon.detach())
    loss = discriminator_loss(logits_real, logits_fake, kind)
    logs = {
        "gan/logits_real": logits_real.astype("float32").mean(),
        "gan/logits_fake": logits_fake.astype("float32").mean(),
    }
    if lecam_weight > 0:
        previous = lecam_ema.detach().clone()  # the in-place EMA update below must not reach this loss
        lecam = lecam_regularization(logits_real, logits_fake, previous[0], previous[1])
        update_lecam_ema(lecam_ema, logits_real, logits_fake, lecam_decay)
        loss = loss + lecam_weight * lecam
        logs["gan/lecam"] = lecam
    logs["loss/discriminator"] = loss
    return loss, {k: v.detach() for k, v in logs.items()}
