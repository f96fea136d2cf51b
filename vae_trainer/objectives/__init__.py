"""The training objective, composed of parts that each own their flags' refusals (`REFUSALS`), loss terms and metrics:

    reconstruction.py  the pixel loss, LPIPS, KL, the latent penalty; LDM's nll or gradnorm balancing of the heads
    gan.py             the adversarial term, its adaptive weight and gentle start; the discriminator's loss; replay
    clips.py           the per-frame and temporal terms of clips
    alignment.py       VA-VAE's VF loss against a frozen DINOv2, vf_alignment_cka
    equivariance.py    EQ-VAE's transforms, the equivariance diagnostics
    distillation.py    a tiny student's encoder against its teacher's latents, the metrics against the teacher

`vae_objective` composes them for one micro-batch, on images [B, C, H, W] and clips [B, C, T, H, W]. Its heads
(pixel loss, LPIPS, temporal term, discriminator) run on a leaf copy of the reconstruction: their gradients there are
taken once, and enter the VAE's backward at the reconstruction (`VAELoss.backward`). The adaptive GAN and VF weights
compare gradients at a last layer, which from the leaf costs one small convolution's backward instead of a second pass
through LPIPS and the discriminator (benchmarks/head_gradients.py measures it); gradnorm needs each head's gradient
alone anyway. docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import paddle

from .alignment import weighted_vf_term
from .clips import flicker
from .gan import generator_term, weighted_gan_term
from .reconstruction import kl_loss, latent_penalty, normalize_gradient, over_grey, pixel_loss, pixel_term
from ..metrics import fold_frames as frames

Tensor = paddle.Tensor


@dataclass
class VAELoss:
    """One micro-batch's VAE objective: `direct`'s backward plus `recon_grad` at the reconstruction."""

    direct: Tensor  # the terms differentiated as they stand: those not through a head
    recon_grad: Tensor  # grad_scale * the heads' gradient at the reconstruction, float32
    logs: Dict[str, Tensor]  # detached: "loss/total" (nll + kl_weight * kl + latent penalty + d * gan + w * vf), parts

    def backward(self, recon: Tensor, scale: Callable[[Tensor], Tensor] = lambda loss: loss) -> None:
        """`scale(direct)`'s backward and `recon_grad` entering at `recon`, in one pass; `scale` must multiply by
        the `grad_scale` the heads' gradients were taken with."""
        direct = scale(self.direct)
        roots = ([] if direct.stop_gradient else [direct]) + [recon]
        paddle.autograd.backward(roots, [None] * (len(roots) - 1) + [self.recon_grad.astype(recon.dtype)])


def vae_objective(x: Tensor, recon: Tensor, posterior_mean: Tensor, posterior_logvar: Optional[Tensor], logvar: Tensor,
                  *, loss_args, lpips: Optional[Callable[[Tensor, Tensor], Tensor]],
                  discriminator: Optional[paddle.nn.Layer], last_layer: Optional[Tensor], gan_weight: float,
                  grad_scale: float = 1.0, encoded_pixels: Optional[float] = None, vf: Optional[Tuple] = None,
                  lpips_rows: Optional[np.ndarray] = None, latent: Optional[Tensor] = None,
                  latent_target: Optional[Tensor] = None) -> VAELoss:
    """The VAE's objective for one micro-batch. `gan_weight`: this step's --disc_weight (0: no GAN term; its schedule
    is `gan.gan_weight`'s). `grad_scale`: the factor (loss scale / accumulation steps) the caller multiplies the loss
    by, which the heads' gradients carry too. `encoded_pixels`: C*(T*)H*W of what the posterior encodes, normalising
    the KL, when `x` is another (EQ-VAE's target). Clips [B, C, T, H, W]: per-frame pixel loss, LPIPS (on the rows
    `lpips_rows` of `frames(x)` if given) and 2-D GAN, a temporal head in the nll; `latent`: `last_layer_gradient`'s.
    `latent_target` (distillation: the teacher's latents) adds the encoder's error against it. `vf`: the VF loss's
    (projected latent tokens, foundation-model tokens, the encoder's last layer), or None."""
    encoded_pixels = encoded_pixels or float(np.prod(x.shape[1:]))
    x_hat = recon.detach()  # the heads' leaf: their gradients there are taken once, below
    x_hat.stop_gradient = False
    frame_x, frame_hat = frames(x), frames(x_hat)
    heads = {"loss/pixel": (pixel_term(frame_x, frame_hat, loss_args), loss_args.pixel_weight)}  # {log: (term, weight)}
    use_lpips = lpips is not None and loss_args.perceptual_weight > 0
    if use_lpips and lpips_rows is not None:
        frame_x, frame_hat = (paddle.gather(batch, paddle.to_tensor(lpips_rows)) for batch in (frame_x, frame_hat))
    perceptual = (lpips(over_grey(frame_x), over_grey(frame_hat)).astype("float32").mean() if use_lpips
                  else paddle.zeros([], "float32"))
    heads["loss/perceptual"] = (perceptual, loss_args.perceptual_weight if use_lpips else 0.0)
    if x.ndim == 5 and loss_args.temporal_loss_weight > 0:  # (none between an image's frames)
        heads["loss/temporal"] = (flicker(x, x_hat).mean(), loss_args.temporal_loss_weight)
    head_logs = {name: term for name, (term, _) in heads.items()}
    latent_terms = {}  # {log name: (term, weight)}, the terms on the latent
    if posterior_logvar is not None:  # (a deterministic latent: no posterior, no KL term)
        kl = kl_loss(posterior_mean, posterior_logvar).mean() / encoded_pixels  # per pixel value of the image
        latent_terms["loss/kl"] = (kl, loss_args.kl_weight)
    if latent_target is not None:
        distill = pixel_loss(latent_target, posterior_mean, loss_args.latent_distill_loss).mean()
        latent_terms["loss/latent_distill"] = (distill, loss_args.latent_distill_weight)
    if loss_args.latent_penalty_weight > 0:
        latent_terms["loss/latent_penalty"] = (latent_penalty(posterior_mean), loss_args.latent_penalty_weight)
    latent_loss = sum((weight * term for term, weight in latent_terms.values()), paddle.zeros([], "float32"))
    latent_logs = {name: term for name, (term, _) in latent_terms.items()}
    if loss_args.loss_balancing == "gradnorm":
        # Each head's scaled gradient at x_hat rescaled to norm weight * grad_scale: the weights act in the
        # backward only, so the value is the heads' unweighted sum (+ the latent terms). A head of weight 0 is left out.
        loss = sum((term for term, _ in heads.values()), paddle.zeros([], "float32")) + latent_loss
        logs = {**head_logs, **latent_logs}
        if gan_weight > 0:
            gan = generator_term(x, x_hat, discriminator, loss_args)
            heads["loss/generator"] = (gan, gan_weight)
            loss = loss + gan
            logs.update({"loss/generator": gan, "gan/adaptive_weight": paddle.full([], gan_weight)})
        recon_grad = paddle.zeros(x_hat.shape, "float32")
        for head, weight in heads.values():
            if weight > 0:
                head_grad = paddle.grad(head * grad_scale, x_hat)[0]
                recon_grad = recon_grad + normalize_gradient(head_grad, weight * grad_scale, loss_args.gradnorm_scope)
        direct = latent_loss
    else:
        weighted = sum((weight * term for term, weight in heads.values()), paddle.zeros([], "float32"))
        nll = weighted / logvar.detach().exp() + logvar.detach()
        direct = weighted.detach() / logvar.exp() + logvar + latent_loss  # nll's path to a learnable logvar only
        loss = direct.detach()
        logs = {**head_logs, "loss/nll": nll, **latent_logs, "train/logvar": logvar}
        nll_grad = paddle.grad(nll * grad_scale, x_hat)[0]  # frees LPIPS's graph
        recon_grad = nll_grad.astype("float32")
        if gan_weight > 0:
            weighted_gan, gan_grad, gan_logs = weighted_gan_term(x, recon, x_hat, nll_grad, discriminator, last_layer,
                                                                 loss_args, gan_weight, grad_scale, latent)
            recon_grad, loss = recon_grad + gan_grad, loss + weighted_gan
            logs.update(gan_logs)
        if vf is not None:
            weighted_vf, vf_logs = weighted_vf_term(*vf, recon, nll_grad, loss_args, grad_scale, encoded_pixels)
            direct, loss = direct + weighted_vf, loss + weighted_vf.detach()
            logs.update(vf_logs)
    logs["loss/total"] = loss
    return VAELoss(direct, recon_grad, {k: v.detach() for k, v in logs.items()})
