"""The VAE objective (`vae_objective`), the discriminator's (`discriminator_objective`) and their parts, on images
[B, C, H, W] and clips [B, C, T, H, W] (per-frame terms on the clip's frames, `frames`; a temporal term).

The heads (pixel loss, LPIPS, temporal term, discriminator) run on a leaf copy of the reconstruction: their gradients
there are taken once and enter the VAE's backward at the reconstruction (`VAELoss.backward`). docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import paddle
import paddle.nn.functional as F

from .alignment import vf_loss
from .distributed import sum_over_ranks, world_size
from .metrics import fold_frames as frames  # clips [B, C, T, H, W] as their frames [(B T), C, H, W]

Tensor = paddle.Tensor

GRADNORM_EPS = 1e-12
ADAPTIVE_WEIGHT_MAX = 1e4  # LDM's bound on the adaptive GAN weight, in its units: ours is this / N (docs)
ADAPTIVE_WEIGHT_EPS = 1e-4
VF_WEIGHT_MAX = 1e8  # VA-VAE's bound on the adaptive VF weight, in its units: ours is this / N (docs)
_GRAY_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R BT.601 luma, for the low-pass mask
_HIGH_PASS = np.full((5, 5), -1.0, dtype=np.float32)
_HIGH_PASS[2, 2] = 24.0
_GAUSSIAN = np.exp(-np.arange(-2.0, 3.0) ** 2 / 2)  # sigma 1
_BLUR = (np.outer(_GAUSSIAN, _GAUSSIAN) / np.outer(_GAUSSIAN, _GAUSSIAN).sum()).astype(np.float32)
# Floor of the edge energy's normaliser: without it, faint noise of an image with no real edge would be
# stretched to [0, 1] and half masked. A step of 0.1 (in [-1, 1]) reaches about this value.
_MIN_EDGE_ENERGY = 1.0
_LPIPS_STREAM = 0x4C504653  # "LPFS": the LPIPS frame subsets' draws, apart from any other use of the seed


def temporal_loss(x: Tensor, recon: Tensor) -> Tensor:
    """mean |(x[t+1] - x[t]) - (recon[t+1] - recon[t])| over the consecutive frames of clips [B, C, T, H, W]."""
    x, recon = x.astype("float32"), recon.astype("float32")
    return ((x[:, :, 1:] - x[:, :, :-1]) - (recon[:, :, 1:] - recon[:, :, :-1])).abs().mean()


def lpips_subset(seed: int, step: int, micro_batch: int, shape: Sequence[int], k: int) -> Optional[np.ndarray]:
    """The rows of `frames(x)` LPIPS scores for a batch of `shape`: K frames of each clip, drawn from (seed, step,
    micro-batch) alone (both drivers and a resume draw the same), or None: every frame (K = 0, images)."""
    if len(shape) == 4 or not 0 < k < shape[2]:
        return None
    rng, t = np.random.default_rng([_LPIPS_STREAM, seed, step, micro_batch]), shape[2]
    return np.concatenate([clip * t + np.sort(rng.choice(t, k, replace=False)) for clip in range(shape[0])])


def pixel_loss(x: Tensor, recon: Tensor, kind: str = "l1") -> Tensor:
    """Element-wise reconstruction error, same shape as the images (float32)."""
    diff = x.astype("float32") - recon.astype("float32")
    if kind == "l1":
        return diff.abs()
    if kind == "l2":
        return diff.square()
    raise ValueError(f"unknown pixel loss {kind!r}")


def kl_loss(mean: Tensor, logvar: Tensor) -> Tensor:
    """Per-image KL(N(mean, exp(logvar)) || N(0, I)) summed over latent elements (every axis but the batch's), in
    float32 (no fp16 overflow)."""
    mean, logvar = mean.astype("float32"), paddle.clip(logvar.astype("float32"), -30.0, 20.0)
    return 0.5 * paddle.sum(mean.square() + logvar.exp() - 1.0 - logvar, axis=list(range(1, mean.ndim)))


def latent_penalty(mean: Tensor) -> Tensor:
    """mean(z_mean^2) over all latent elements: keeps the latents' scale fixed under --posterior_std."""
    return mean.astype("float32").square().mean()


def _filter_2d(images: Tensor, kernel: np.ndarray) -> Tensor:
    """Single-channel 'same' convolution with replicate padding (no false edges at the border)."""
    pad = kernel.shape[0] // 2
    return F.conv2d(F.pad(images, [pad] * 4, mode="replicate"), paddle.to_tensor(kernel[None, None]))


def lowpass_mask(x: Tensor, threshold: float = 0.5) -> Tensor:
    """1 where the image is smooth, 0 near edges and texture; [B, 1, H, W], no gradient (docs/techniques.md 4)."""
    with paddle.no_grad():
        x = x.astype("float32")
        gray = sum(w * x[:, c : c + 1] for c, w in enumerate(_GRAY_WEIGHTS))
        energy = _filter_2d(_filter_2d(gray, _HIGH_PASS).abs(), _BLUR)
        energy = energy / paddle.clip(energy.amax(axis=[1, 2, 3], keepdim=True), min=_MIN_EDGE_ENERGY)
        return (1.0 - energy >= threshold).astype("float32")


def pixel_term(x: Tensor, recon: Tensor, loss_args) -> Tensor:
    """The pixel loss as configured: optionally between K-pooled images, optionally mean(low-pass mask * error)."""
    pool = loss_args.pixel_loss_pool
    if pool > 1:
        x, recon = F.avg_pool2d(x.astype("float32"), pool), F.avg_pool2d(recon.astype("float32"), pool)
    error = pixel_loss(x, recon, loss_args.pixel_loss)
    if loss_args.pixel_loss_mask == "lowpass":
        error = error * lowpass_mask(x, loss_args.pixel_loss_mask_threshold)
    return error.mean()


def normalize_gradient(grad: Tensor, norm: float, scope: str = "sample") -> Tensor:
    """`grad` in float32 rescaled to the L2 norm `norm`: per sample (norm / B each), or for the whole micro-batch
    ("global": the root mean square over ranks of each rank's norm, one scalar all-reduce)."""
    grad = grad.astype("float32")
    if scope == "sample":
        current, norm = grad.square().sum(axis=list(range(1, grad.ndim)), keepdim=True).sqrt(), norm / grad.shape[0]
    else:
        current = (sum_over_ranks(grad.square().sum()) / world_size()).sqrt()
    return grad * (norm / (current + GRADNORM_EPS))


def generator_loss(logits_fake: Tensor, kind: str = "hinge", logits_real: Optional[Tensor] = None,
                   margin: float = 0.0) -> Tensor:
    """Adversarial loss of the VAE (hinge, vanilla, relative_hinge: needs `logits_real`, constant for the VAE)."""
    logits_fake = logits_fake.astype("float32")
    if kind == "relative_hinge":
        return F.relu(logits_real.astype("float32").detach() - logits_fake - margin).mean()
    return -logits_fake.mean() if kind == "hinge" else F.softplus(-logits_fake).mean()


def discriminator_loss(logits_real: Tensor, logits_fake: Tensor, kind: str = "hinge") -> Tensor:
    """Discriminator loss (hinge or vanilla) on real images and detached reconstructions."""
    logits_real, logits_fake = logits_real.astype("float32"), logits_fake.astype("float32")
    if kind == "hinge":
        return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())
    return 0.5 * (F.softplus(-logits_real).mean() + F.softplus(logits_fake).mean())


def lecam_regularization(logits_real: Tensor, logits_fake: Tensor, ema_real: Tensor, ema_fake: Tensor) -> Tensor:
    """LeCAM (Tseng et al. 2021): mean(relu(D(x) - ema_fake)^2) + mean(relu(ema_real - D(x_hat))^2)."""
    return (F.relu(logits_real.astype("float32") - ema_fake).square().mean()
            + F.relu(ema_real - logits_fake.astype("float32")).square().mean())


def update_lecam_ema(ema: Tensor, logits_real: Tensor, logits_fake: Tensor, decay: float) -> None:
    """[ema_real, ema_fake] <- decay * ema + (1 - decay) * batch means over ranks (one small all-reduce), in
    float32 even under O2."""
    with paddle.no_grad(), paddle.amp.auto_cast(enable=False):
        means = paddle.stack([logits_real.astype("float32").mean(), logits_fake.astype("float32").mean()])
        means = sum_over_ranks(means) / world_size()
        ema.set_value((decay * ema.astype("float32") + (1.0 - decay) * means).astype(ema.dtype))


def adaptive_weight(nll_grad: Tensor, gan_grad: Tensor, max_weight: float = ADAPTIVE_WEIGHT_MAX,
                    eps: float | Tensor = ADAPTIVE_WEIGHT_EPS) -> Tensor:
    """||nll_grad|| / (||gan_grad|| + eps) clamped to [0, max_weight] (taming's calculate_adaptive_weight); NaN,
    not clamped, when a norm is not finite (an fp16 overflow: the caller skips the term)."""
    nll_norm, gan_norm = (paddle.linalg.norm(grad.astype("float32")) for grad in (nll_grad, gan_grad))
    weight = paddle.clip(nll_norm / (gan_norm + eps), 0.0, max_weight)
    finite = paddle.isfinite(nll_norm) & paddle.isfinite(gan_norm)
    return paddle.where(finite, weight, paddle.full_like(weight, float("nan"))).detach()


def last_layer_gradient(recon: Tensor, recon_grad: Tensor, last_layer: Tensor,
                        latent: Optional[Tensor] = None) -> Tensor:
    """dL/dW for a loss L whose gradient at `recon` is `recon_grad`, by the graph's path from `recon` back to W (for
    conv_out, one small convolution); keeps the graph, leaves `.grad` untouched. `latent` (the decoded one) is an input
    too: paddle.grad stops paths W is not on, and the Wan clip decoder's one backward node for its chunks needs all."""
    return paddle.grad(recon, [last_layer] + ([latent] if latent is not None else []), grad_outputs=recon_grad,
                       retain_graph=True)[0]


def discriminate(discriminator: paddle.nn.Layer, images: Tensor) -> Tensor:
    """Logits of images or clips: a 2-D discriminator scores a clip's frames, a 3-D one (`takes_clips`) the clip."""
    return discriminator(images if getattr(discriminator, "takes_clips", False) else frames(images))


def _generator_term(x: Tensor, recon: Tensor, discriminator: paddle.nn.Layer, loss_args) -> Tensor:
    """The adversarial loss of `recon`; only its gradient at `recon` is taken (`paddle.grad`: the discriminator's
    `.grad` stays untouched)."""
    kind = loss_args.gen_loss or loss_args.disc_loss
    logits_fake = discriminate(discriminator, recon)
    logits_real = discriminate(discriminator, x.detach()) if kind == "relative_hinge" else None  # no VAE forward
    return generator_loss(logits_fake, kind, logits_real, loss_args.relative_hinge_margin)


@dataclass
class VAELoss:
    """One micro-batch's VAE objective: `direct`'s backward plus `recon_grad` at the reconstruction."""

    value: Tensor  # the objective: nll + kl_weight * kl + latent penalty + d * gan (+ w * vf), detached
    direct: Tensor  # the terms differentiated as they stand: those not through a head
    recon_grad: Tensor  # grad_scale * the heads' gradient at the reconstruction, float32
    logs: Dict[str, Tensor]  # detached parts, for logging

    def backward(self, recon: Tensor, scale: Callable[[Tensor], Tensor] = lambda loss: loss) -> None:
        """`scale(direct)`'s backward and `recon_grad` entering at `recon`, in one pass; `scale` must multiply by
        the `grad_scale` the heads' gradients were taken with."""
        direct = scale(self.direct)
        roots = ([] if direct.stop_gradient else [direct]) + [recon]
        paddle.autograd.backward(roots, [None] * (len(roots) - 1) + [self.recon_grad.astype(recon.dtype)])


@dataclass
class VFTerm:
    """The VF loss's inputs: projected latent and foundation-model tokens ([B, N, C] each), encoder's last layer."""

    projected: Tensor
    features: Tensor
    encoder_last_layer: Tensor


def vae_objective(x: Tensor, recon: Tensor, posterior_mean: Tensor, posterior_logvar: Optional[Tensor], logvar: Tensor,
                  *, loss_args, lpips: Optional[Callable[[Tensor, Tensor], Tensor]],
                  discriminator: Optional[paddle.nn.Layer], last_layer: Optional[Tensor], gan_weight: float,
                  grad_scale: float = 1.0, encoded_pixels: Optional[float] = None, vf: Optional[VFTerm] = None,
                  lpips_rows: Optional[np.ndarray] = None, latent: Optional[Tensor] = None,
                  latent_target: Optional[Tensor] = None) -> VAELoss:
    """The VAE's objective for one micro-batch. `gan_weight`: this step's --disc_weight (0: no GAN term; its schedule
    is `step.gan_weight`'s). `grad_scale`: the factor (loss scale / accumulation steps) the caller multiplies the loss
    by, which the heads' gradients carry too. `encoded_pixels`: C*(T*)H*W of what the posterior encodes, normalising
    the KL, when `x` is another (EQ-VAE's target). Clips [B, C, T, H, W]: per-frame pixel loss, LPIPS (on the rows
    `lpips_rows` of `frames(x)` if given) and 2-D GAN, a temporal head in the nll; `latent`: `last_layer_gradient`'s.
    `latent_target` (distillation: the teacher's latents) adds the encoder's error against it."""
    pixels_per_image = float(x.shape[1] * x.shape[-2] * x.shape[-1])  # per frame: the adaptive weight's units
    encoded_pixels = encoded_pixels or float(np.prod(x.shape[1:]))
    x_hat = recon.detach()  # the heads' leaf: their gradients there are taken once, below
    x_hat.stop_gradient = False
    frame_x, frame_hat = frames(x), frames(x_hat)
    rec = pixel_term(frame_x, frame_hat, loss_args)
    use_lpips = lpips is not None and loss_args.perceptual_weight > 0
    if use_lpips and lpips_rows is not None:
        rows = paddle.to_tensor(lpips_rows)
        frame_x, frame_hat = paddle.gather(frame_x, rows), paddle.gather(frame_hat, rows)
    perceptual = lpips(frame_x, frame_hat).astype("float32").mean() if use_lpips else paddle.zeros([], "float32")
    temporal_weight = loss_args.temporal_loss_weight if x.ndim == 5 else 0.0  # none between an image's frames
    temporal = temporal_loss(x, x_hat) if temporal_weight > 0 else paddle.zeros([], "float32")
    head_logs = {"loss/pixel": rec, "loss/perceptual": perceptual}
    head_logs.update({"loss/temporal": temporal} if temporal_weight > 0 else {})
    if posterior_logvar is None:  # a deterministic latent: no posterior, no KL term
        latent_loss, latent_logs = paddle.zeros([], "float32"), {}
    else:
        kl = kl_loss(posterior_mean, posterior_logvar).mean() / encoded_pixels  # per pixel value of the image
        latent_loss, latent_logs = loss_args.kl_weight * kl, {"loss/kl": kl}
    if latent_target is not None:
        distill = pixel_loss(latent_target, posterior_mean, loss_args.latent_distill_loss).mean()
        latent_logs["loss/latent_distill"] = distill
        latent_loss = latent_loss + loss_args.latent_distill_weight * distill
    if loss_args.latent_penalty_weight > 0:
        latent_logs["loss/latent_penalty"] = latent_penalty(posterior_mean)
        latent_loss = latent_loss + loss_args.latent_penalty_weight * latent_logs["loss/latent_penalty"]
    if loss_args.loss_balancing == "gradnorm":
        # Each head's scaled gradient at x_hat rescaled to norm weight * grad_scale: the weights act in the
        # backward only, so the value is the heads' unweighted sum (+ the latent terms).
        heads = [(rec, loss_args.pixel_weight), (perceptual, loss_args.perceptual_weight if use_lpips else 0.0),
                 (temporal, temporal_weight)]  # a head of weight 0 is left out
        loss, logs = rec + perceptual + temporal + latent_loss, {**head_logs, **latent_logs}
        if gan_weight > 0:
            gan = _generator_term(x, x_hat, discriminator, loss_args)
            heads.append((gan, gan_weight))
            loss = loss + gan
            logs.update({"loss/generator": gan, "gan/adaptive_weight": paddle.full([], gan_weight)})
        recon_grad = paddle.zeros(x_hat.shape, "float32")
        for head, weight in heads:
            if weight > 0:
                head_grad = paddle.grad(head * grad_scale, x_hat)[0]
                recon_grad = recon_grad + normalize_gradient(head_grad, weight * grad_scale, loss_args.gradnorm_scope)
        logs["loss/total"] = loss
        return VAELoss(loss.detach(), latent_loss, recon_grad, {k: v.detach() for k, v in logs.items()})
    weighted = loss_args.pixel_weight * rec + loss_args.perceptual_weight * perceptual + temporal_weight * temporal
    nll = weighted / logvar.detach().exp() + logvar.detach()
    direct = weighted.detach() / logvar.exp() + logvar + latent_loss  # nll's path to a learnable logvar only
    loss = direct.detach()
    logs = {**head_logs, "loss/nll": nll, **latent_logs, "train/logvar": logvar}
    nll_grad = paddle.grad(nll * grad_scale, x_hat)[0]  # frees LPIPS's graph
    recon_grad = nll_grad.astype("float32")
    if gan_weight > 0:
        gan, d_weight, gan_grad, overflow = _weighted_gan_term(x, recon, x_hat, nll_grad, discriminator, last_layer,
                                                               loss_args, gan_weight, grad_scale, pixels_per_image,
                                                               latent)
        recon_grad, loss = recon_grad + gan_grad, loss + (d_weight * gan).detach()
        logs.update({"loss/generator": gan, "gan/adaptive_weight": d_weight})
        if overflow is not None:
            logs["gan/adaptive_weight_overflow"] = overflow.astype("float32")
    if vf is not None:
        weighted_vf, vf_logs = _weighted_vf_term(vf, recon, nll_grad, loss_args, grad_scale, encoded_pixels)
        direct, loss = direct + weighted_vf, loss + weighted_vf.detach()
        logs.update(vf_logs)
    logs["loss/total"] = loss
    return VAELoss(loss, direct, recon_grad, {k: v.detach() for k, v in logs.items()})


def _weighted_gan_term(x, recon, x_hat, nll_grad, discriminator, last_layer, loss_args, gan_weight, grad_scale,
                       pixels_per_image, latent=None) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(gan on the leaf `x_hat`, its weight d, d * its scaled gradient at the reconstruction in float32, the
    adaptive weight's overflow flag or None); `nll_grad`: nll's scaled gradient at the reconstruction."""
    gan = _generator_term(x, x_hat, discriminator, loss_args)
    gan_grad = paddle.grad(gan * grad_scale, x_hat)[0]  # frees the discriminator's graph
    if not loss_args.adaptive_disc_weight:
        d_weight = paddle.full([], gan_weight, "float32")
        return gan, d_weight, gan_grad.astype("float32") * d_weight, None
    # The epsilon carries grad_scale as both gradients do, which leaves the ratio unchanged.
    bound = loss_args.adaptive_disc_weight_max  # in our units (losses are means); default LDM's bound in them
    weight = adaptive_weight(last_layer_gradient(recon, nll_grad, last_layer, latent),
                             last_layer_gradient(recon, gan_grad, last_layer, latent),
                             eps=ADAPTIVE_WEIGHT_EPS * grad_scale,
                             max_weight=ADAPTIVE_WEIGHT_MAX / pixels_per_image if bound is None else bound)
    # An overflow skips this micro-batch's GAN term, its maybe non-finite gradient included; the step counts it.
    overflow = ~paddle.isfinite(weight)
    d_weight = paddle.where(overflow, paddle.zeros_like(weight), weight) * gan_weight
    weighted_grad = gan_grad.astype("float32") * d_weight
    return gan, d_weight, paddle.where(overflow, paddle.zeros_like(weighted_grad), weighted_grad), overflow


def _weighted_vf_term(vf: VFTerm, recon: Tensor, nll_grad: Tensor, loss_args, grad_scale,
                      pixels_per_image: float) -> Tuple[Tensor, Dict[str, Tensor]]:
    """w * (L_mdms + L_mcos) and its logs; w adaptive from the encoder's last layer with --adaptive_vf (a
    non-finite w is 0); `nll_grad`: nll's scaled gradient at the reconstruction."""
    mdms, mcos = vf_loss(vf.projected, vf.features, loss_args.distmat_margin, loss_args.cos_margin)
    value = mdms + mcos
    weight = paddle.full([], loss_args.vf_weight, "float32")
    if loss_args.adaptive_vf:
        nll_at_encoder = last_layer_gradient(recon, nll_grad, vf.encoder_last_layer)
        vf_at_encoder = paddle.grad(value * grad_scale, vf.encoder_last_layer, retain_graph=True)[0]
        ratio = adaptive_weight(nll_at_encoder, vf_at_encoder, max_weight=VF_WEIGHT_MAX / pixels_per_image,
                                eps=ADAPTIVE_WEIGHT_EPS * grad_scale)
        weight = paddle.where(paddle.isfinite(ratio), ratio, paddle.zeros_like(ratio)) * loss_args.vf_weight
    return weight * value, {"train/vf_loss": value, "train/vf_weight": weight, "train/vf_distmat_loss": mdms,
                            "train/vf_cos_loss": mcos}


def discriminator_objective(discriminator: paddle.nn.Layer, x: Tensor, recon: Tensor, kind: str, *,
                            lecam_weight: float = 0.0, lecam_ema: Optional[Tensor] = None,
                            lecam_decay: float = 0.99, fake_discriminator: Optional[Callable[[Tensor], Tensor]] = None
                            ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The discriminator's loss on real images and detached reconstructions, and its logs; with `lecam_weight`
    > 0, plus lecam_weight * LeCAM against `lecam_ema` = [ema D(x), ema D(x_hat)], then updates that EMA.
    `fake_discriminator`: how the reconstructions are scored, if not as the images (conditioned on other latents)."""
    logits_real = discriminate(discriminator, x.detach())
    logits_fake = discriminate(fake_discriminator or discriminator, recon.detach())
    loss = discriminator_loss(logits_real, logits_fake, kind)
    logs = {"gan/logits_real": logits_real.astype("float32").mean(),
            "gan/logits_fake": logits_fake.astype("float32").mean()}
    if lecam_weight > 0:
        previous = lecam_ema.detach().clone()  # the in-place EMA update below must not reach this loss
        lecam = lecam_regularization(logits_real, logits_fake, previous[0], previous[1])
        update_lecam_ema(lecam_ema, logits_real, logits_fake, lecam_decay)
        loss = loss + lecam_weight * lecam
        logs["gan/lecam"] = lecam
    logs["loss/discriminator"] = loss
    return loss, {k: v.detach() for k, v in logs.items()}
