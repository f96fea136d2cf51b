"""The adversarial part of the objective (docs/training.md; techniques.md, 14): the generator's term and its adaptive
weight, the discriminator's loss with LeCAM, the gentle start (the term's weight rises from 0 to --disc_weight over
--disc_weight_warmup_steps from --disc_start; the discriminator may train from --disc_update_start), past
reconstructions replayed to the discriminator (`FakeReplay`), what it sees of RGBA images (`discriminator_view`), and
the refusals of its flags. The networks: models/discriminator.py.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np
import paddle
import paddle.nn.functional as F

from ..distributed import sum_over_ranks, world_size
from ..metrics import fold_frames as frames
from .reconstruction import over_grey

Tensor = paddle.Tensor
ADAPTIVE_WEIGHT_MAX = 1e4  # LDM's bound on the adaptive GAN weight, in its units: ours is this / N (docs)
ADAPTIVE_WEIGHT_EPS = 1e-4
# Every flag of the --help group "discriminator" but --disc_weight, which switches the discriminator on.
DISCRIMINATOR_FLAGS = ("discriminator_path", "disc_type", "disc_norm", "disc_num_layers", "disc_base_channels",
                       "disc_start", "disc_loss", "adaptive_disc_weight", "gen_loss", "relative_hinge_margin",
                       "lecam_weight", "lecam_decay", "disc_learning_rate", "disc_backbone_path", "disc_update_start",
                       "adaptive_disc_weight_max", "disc_weight_warmup_steps", "disc_replay_size")


# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (DISCRIMINATOR_FLAGS, lambda f: f.disc_weight == 0,
     "with --disc_weight 0 the discriminator never trains: drop it, or set --disc_weight > 0"),
    (("disc_norm", "disc_num_layers"), lambda f: f.disc_type not in ("patch", "patchgan3d"),
     "the VGG16 and DINO discriminators (--disc_type vgg, dino) have no such setting: drop it"),
    (("disc_base_channels",), lambda f: f.disc_type == "dino",
     "the DINO discriminator's heads are as wide as its ViT's tokens: drop it"),
    (("disc_backbone_path",), lambda f: f.disc_type != "dino", "it is the ViT of --disc_type dino: add it, or drop it"),
    (("gen_loss",), lambda f: f.gen_loss == "relative_hinge" and f.disc_type == "dino",
     "the DINO discriminator augments and quantises the real images of its own step only, and relative_hinge scores "
     "real images in the VAE's: use hinge or vanilla with --disc_type dino"),
    (("disc_type",), lambda f: f.disc_type == "dino" and not f.disc_backbone_path,
     "the DINO discriminator needs its frozen ViT-S/8: add --disc_backbone_path (a dino_vits8 state dict, or a "
     "transformers ViTModel folder of facebook/dino-vits8)"),
    (("disc_update_start",),
     lambda f: f.disc_update_start is not None and f.disc_update_start not in range(f.disc_start + 1),
     "it starts the discriminator's training at or before its term enters the loss: 0 <= it <= --disc_start"),
    (("disc_weight_warmup_steps",), lambda f: f.disc_weight_warmup_steps < 0,
     "it is the number of steps the GAN weight takes to rise to --disc_weight: >= 0 (0: at once)"),
    (("adaptive_disc_weight_max",), lambda f: f.adaptive_disc_weight_max is not None and not (
        f.adaptive_disc_weight and f.adaptive_disc_weight_max > 0),
     "it bounds the adaptive GAN weight (--adaptive_disc_weight true): > 0, with that"),
    (("relative_hinge_margin",), lambda f: f.gen_loss != "relative_hinge",
     "it is the margin of --gen_loss relative_hinge: add that, or drop it"),
    (("lecam_decay",), lambda f: f.lecam_weight == 0,
     "it does nothing without --lecam_weight > 0: add that, or drop it"),
    (("disc_replay_size",), lambda f: f.disc_replay_size < 0, "it is a number of reconstructions: >= 0 (0: off)"),
    (("disc_replay_size", "aspect_ratio_buckets"), lambda f: f.disc_replay_size > 0 and f.aspect_ratio_buckets,
     "the discriminator's replay (--disc_replay_size; the tiny recipe's: 50) holds one image shape, and buckets make "
     "several: give --disc_replay_size 0, or drop --aspect_ratio_buckets"),
)


def gan_weight(loss_args, global_step: int) -> float:
    """The GAN term's weight at `global_step`: 0 before --disc_start, then --disc_weight reached linearly over
    --disc_weight_warmup_steps (0: at once, LDM's). A function of the step alone: resume stays exact."""
    args = loss_args
    if args.disc_weight == 0 or global_step < args.disc_start:
        return 0.0
    return args.disc_weight * min(1.0, (global_step - args.disc_start + 1) / max(args.disc_weight_warmup_steps, 1))


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


def lecam(ema: Tensor, logits_real: Tensor, logits_fake: Tensor, decay: float) -> Tensor:
    """LeCAM (Tseng et al. 2021) against `ema` = [ema D(x), ema D(x_hat)] as it stands: mean(relu(D(x) - ema_fake)^2)
    + mean(relu(ema_real - D(x_hat))^2); then ema <- decay * ema + (1 - decay) * batch means over ranks (one small
    all-reduce), in float32 even under O2."""
    real, fake = logits_real.astype("float32"), logits_fake.astype("float32")
    ema_real, ema_fake = ema.detach().clone()  # the in-place update below must not reach this loss
    term = F.relu(real - ema_fake).square().mean() + F.relu(ema_real - fake).square().mean()
    with paddle.no_grad(), paddle.amp.auto_cast(enable=False):
        means = sum_over_ranks(paddle.stack([real.mean(), fake.mean()])) / world_size()
        ema.set_value((decay * ema.astype("float32") + (1.0 - decay) * means).astype(ema.dtype))
    return term


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
    """Logits of images or clips: a 2-D discriminator scores a clip's frames, a 3-D one (`takes_clips`) the clip;
    RGBA images as `discriminator_view` shows them."""
    layer = getattr(discriminator, "func", discriminator)  # a conditioned scorer (a functools.partial): its layer's
    images = images if getattr(layer, "takes_clips", False) else frames(images)
    return discriminator(discriminator_view(images, getattr(layer, "in_channels", 3)))


def discriminator_view(images: Tensor, in_channels: int = 3) -> Tensor:
    """What a discriminator of `in_channels` sees: RGB images as they are; of RGBA ones, their RGB over mid-grey (what
    LPIPS sees, `over_grey`), and for a PatchGAN of 4 input channels alpha too, as its fourth: over one background a
    transparent pixel and an opaque one of its colour look alike, and the PatchGAN tells them apart (an RGB backbone's,
    VGG's or DINO's, sees the composite). Colour under alpha 0, which no viewer sees, is never shown."""
    if images.shape[1] != 4:
        return images
    composite = over_grey(images)
    return paddle.concat([composite, images[:, 3:]], axis=1) if in_channels == 4 else composite


def generator_term(x: Tensor, recon: Tensor, discriminator: paddle.nn.Layer, loss_args) -> Tensor:
    """The adversarial loss of `recon`; only its gradient at `recon` is taken (`paddle.grad`: the discriminator's
    `.grad` stays untouched)."""
    kind = loss_args.gen_loss or loss_args.disc_loss
    logits_fake = discriminate(discriminator, recon)
    logits_real = discriminate(discriminator, x.detach()) if kind == "relative_hinge" else None  # no VAE forward
    return generator_loss(logits_fake, kind, logits_real, loss_args.relative_hinge_margin)


def weighted_gan_term(x, recon, x_hat, nll_grad, discriminator, last_layer, loss_args, gan_weight, grad_scale,
                       latent=None) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """(d * gan on the leaf `x_hat`, detached; d * its scaled gradient at the reconstruction in float32; its logs,
    with the adaptive weight's overflow flag); `nll_grad`: nll's scaled gradient at the reconstruction."""
    gan = generator_term(x, x_hat, discriminator, loss_args)
    gan_grad = paddle.grad(gan * grad_scale, x_hat)[0]  # frees the discriminator's graph
    d_weight, overflow = paddle.full([], gan_weight, "float32"), {}
    if loss_args.adaptive_disc_weight:
        # The epsilon carries grad_scale as both gradients do, which leaves the ratio unchanged.
        bound = loss_args.adaptive_disc_weight_max  # in our units (losses are means); default LDM's bound in them,
        bound = ADAPTIVE_WEIGHT_MAX / (x.shape[1] * x.shape[-2] * x.shape[-1]) if bound is None else bound  # per frame
        weight = adaptive_weight(last_layer_gradient(recon, nll_grad, last_layer, latent),
                                 last_layer_gradient(recon, gan_grad, last_layer, latent),
                                 eps=ADAPTIVE_WEIGHT_EPS * grad_scale, max_weight=bound)
        # An overflow skips this micro-batch's GAN term, its maybe non-finite gradient included; the step counts it.
        skip = ~paddle.isfinite(weight)
        d_weight = paddle.where(skip, paddle.zeros_like(weight), weight) * gan_weight
        gan_grad = paddle.where(skip, paddle.zeros_like(gan_grad), gan_grad)
        overflow = {"gan/adaptive_weight_overflow": skip.astype("float32")}
    logs = {"loss/generator": gan, "gan/adaptive_weight": d_weight, **overflow}
    return (d_weight * gan).detach(), gan_grad.astype("float32") * d_weight, logs


def discriminator_objective(discriminator: paddle.nn.Layer, x: Tensor, recon: Tensor, loss_args, *,
                            lecam_ema: Optional[Tensor] = None,
                            fake_discriminator: Optional[Callable[[Tensor], Tensor]] = None
                            ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The discriminator's --disc_loss on real images and detached reconstructions, and its logs; with --lecam_weight
    > 0, plus lecam_weight * LeCAM against `lecam_ema` = [ema D(x), ema D(x_hat)], then that EMA's --lecam_decay
    update. `fake_discriminator`: how the reconstructions are scored, if not as the images (other latents')."""
    logits_real = discriminate(discriminator, x.detach())
    logits_fake = discriminate(fake_discriminator or discriminator, recon.detach())
    loss = discriminator_loss(logits_real, logits_fake, loss_args.disc_loss)
    logs = {"gan/logits_real": logits_real.astype("float32").mean(),
            "gan/logits_fake": logits_fake.astype("float32").mean()}
    if loss_args.lecam_weight > 0:
        logs["gan/lecam"] = lecam(lecam_ema, logits_real, logits_fake, loss_args.lecam_decay)
        loss = loss + loss_args.lecam_weight * logs["gan/lecam"]
    logs["loss/discriminator"] = loss
    return loss, {k: v.detach() for k, v in logs.items()}


class FakeReplay:
    """Past reconstructions shown to the discriminator (Shrivastava et al. 2017; CycleGAN's image pool), with the
    latents they were decoded from: until `size` are held each new one is kept and shown; then each is, with
    probability 1/2, swapped for a random held one (the old one shown, the new one kept). One per rank, its draws
    from its own generator; `state_dict` goes into the rank's checkpoint state, so a resume replays the same."""

    def __init__(self, size: int, seed: int):
        self.size, self.rng = size, np.random.default_rng([0x52504C59, seed])  # "RPLY": a stream of its own
        self.fakes: list = []  # [(fake, condition or None)], detached

    def mix(self, fakes: paddle.Tensor, conditions: paddle.Tensor | None) -> tuple:
        """(fakes, conditions) to show, as many as given; a batch of another shape than those held empties it. Each
        row is held as a copy of its own (a view would keep its whole batch), non-finite values as 0 (an fp16
        overflow's fakes, whose step the guard skips, must not come back later)."""
        if self.fakes and self.fakes[0][0].shape != fakes.shape[1:]:
            self.fakes = []
        shown, held = [], paddle.nan_to_num(fakes.detach(), nan=0.0, posinf=0.0, neginf=0.0)
        for row in range(held.shape[0]):
            new = (held[row].clone(), None if conditions is None else conditions[row].detach().clone())
            if len(self.fakes) < self.size:
                self.fakes.append(new)
            elif self.rng.random() < 0.5:
                slot = int(self.rng.integers(self.size))
                self.fakes[slot], new = new, self.fakes[slot]
            shown.append(new)
        return tuple(paddle.stack(part) if part[0] is not None else None for part in zip(*shown))

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "fakes": [fake.numpy() for fake, _ in self.fakes],
                "conditions": [None if c is None else c.numpy() for _, c in self.fakes]}

    def set_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.fakes = [(paddle.to_tensor(f), None if c is None else paddle.to_tensor(c))
                      for f, c in zip(state["fakes"], state["conditions"])]
