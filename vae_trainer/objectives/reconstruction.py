"""The reconstruction part of the objective (docs/training.md, "The objective"): the pixel loss (optionally between
pooled images, or masked to smooth regions; of RGBA images over all four channels), LPIPS (of RGBA images, their RGB
over mid-grey: `over_grey`), the KL of the posterior and the latent-magnitude penalty; the heads' balance, LDM's nll
with its output log-variance or per-branch gradient normalisation (--loss_balancing gradnorm); and the refusals of its
flags."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from ..distributed import sum_over_ranks, world_size
from ..refusals import FAMILY, FROZEN_LATENT

Tensor = paddle.Tensor
GRADNORM_EPS = 1e-12
_GRAY_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R BT.601 luma, for the low-pass mask
_HIGH_PASS = np.full((5, 5), -1.0, dtype=np.float32)
_HIGH_PASS[2, 2] = 24.0
_GAUSSIAN = np.exp(-np.arange(-2.0, 3.0) ** 2 / 2)  # sigma 1
_BLUR = (np.outer(_GAUSSIAN, _GAUSSIAN) / np.outer(_GAUSSIAN, _GAUSSIAN).sum()).astype(np.float32)
# Floor of the edge energy's normaliser: without it, faint noise of an image with no real edge would be
# stretched to [0, 1] and half masked. A step of 0.1 (in [-1, 1]) reaches about this value.
_MIN_EDGE_ENERGY = 1.0


# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("kl_weight",), lambda f: f.deterministic, f"{FAMILY}'s encoder is deterministic: no posterior, so no KL term "
     "to weigh; drop it (--posterior_std S adds noise to its latent in training; for RAE, its own --noise_tau T)"),
    (("learn_logvar", "logvar_init"), lambda f: f.deterministic, f"with {FAMILY}'s deterministic encoder there is no "
     "KL term, and the nll's log-variance would only rescale the VAE's whole gradient, which AdamW undoes: drop it"),
    (("posterior_std",), lambda f: f.deterministic and f.posterior_std > 0 and not f.sample_posterior,
     f"with {FAMILY}'s deterministic encoder it is noise added to the latent in training, and "
     "--sample_posterior false adds none: drop one of them"),
    (("sample_posterior",), lambda f: f.deterministic and f.sample_posterior and f.posterior_std == 0,
     f"{FAMILY}'s encoder is deterministic: there is no posterior to sample; drop it, or "
     "add --posterior_std S to decode the latent plus noise of std S"),
    (("pixel_loss_pool",), lambda f: f.pixel_loss_pool < 1, "it must be >= 1"),
    (("posterior_std",), lambda f: f.posterior_std < 0, "it must be >= 0 (0 keeps the encoder's variance)"),
    (("learn_logvar",), lambda f: f.learn_logvar and f.loss_balancing == "gradnorm",
     "it has no effect under --loss_balancing gradnorm (the nll is not used): drop it"),
    (("latent_penalty_weight",), lambda f: f.latent_penalty_weight > 0 and f.frozen_latent,
     f"it penalises the latents' magnitude, and {FROZEN_LATENT}: drop it"),
    (("gradnorm_scope",), lambda f: f.loss_balancing != "gradnorm",
     "it does nothing without --loss_balancing gradnorm: add that, or drop it"),
    (("adaptive_disc_weight", "adaptive_disc_weight_max", "logvar_init"), lambda f: f.loss_balancing == "gradnorm",
     "--loss_balancing gradnorm replaces the adaptive weight and the nll: drop it"),
    (("pixel_loss_mask_threshold",), lambda f: f.pixel_loss_mask == "none",
     "it does nothing without --pixel_loss_mask lowpass: add that, or drop it"),
)


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


def over_grey(images: Tensor) -> Tensor:
    """What the RGB networks (LPIPS, an RGB discriminator's backbone, InceptionV3, DINOv2) see of images: RGB images
    as they are; RGBA (4 channels, straight alpha) composited over mid-grey, which on [-1, 1] is a * rgb with a =
    (alpha + 1) / 2: an alpha error shows where it shows over a background, and colour under a = 0 is not seen. (The
    pixel loss takes all four channels; docs/fine-tuning.md, "Qwen-Image 2.1", says why and what was measured.)"""
    if images.shape[1] != 4:
        return images
    return images[:, :3] * (images[:, 3:] + 1.0) / 2.0


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
