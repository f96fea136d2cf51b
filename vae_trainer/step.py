"""The training step shared by both drivers (docs/training.md, docs/architecture.md), nanoGPT's in shape:
`forward_backward` per micro-batch (forward, the objective's parts, backward; then the discriminator's loss and
backward: no read from the device; it communicates only for LeCAM's logit EMA, gradnorm's global scope and a
SyncBatchNorm discriminator), then `optimizer_step` (for each network: all-reduce, unscale, one finite check,
clip, step) and `schedule`; `NonFiniteGuard` decides the skips (docs/reliability.md)."""

from __future__ import annotations

import copy
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import paddle

from .distributed import average_over_ranks, stop_signal, sum_over_ranks, sync_gradients, world_size
from .ema import ema_weights
from .objectives import vae_objective
from .objectives.alignment import to_token_grid
from .objectives.clips import lpips_subset
from .objectives.equivariance import draw, parse_transforms
from .objectives.gan import discriminator_objective, gan_weight
from .objectives.reconstruction import over_grey
from .optim import clip_grads, grad_norm
from .precision import LossScaler, Precision, half_precision_autocast

logger = logging.getLogger("vae_trainer")


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps with non-finite losses or gradients (or fp16 overflows)."""


class NonFiniteGuard:
    """Decides which network steps (fp16: an overflow skips that network only), counts the skips (checkpointed),
    stops broken runs."""

    _STATE = ("skipped_steps", "consecutive_nonfinite", "overflow_steps", "consecutive_overflow", "skipped_gan_terms")

    def __init__(self, max_consecutive_nonfinite: int = 5, max_consecutive_overflow: int = 25):
        if min(max_consecutive_nonfinite, max_consecutive_overflow) < 1:
            raise ValueError("--max_consecutive_nonfinite_steps and --max_consecutive_overflow_steps must be >= 1")
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.max_consecutive_overflow = max_consecutive_overflow
        self.skipped_steps = self.consecutive_nonfinite = 0  # steps skipped for both networks (non-finite values)
        self.overflow_steps = {"vae": 0, "discriminator": 0}  # fp16: steps of one network skipped for overflow
        self.consecutive_overflow = {"vae": 0, "discriminator": 0}
        self.skipped_gan_terms = 0  # micro-batches whose adaptive GAN weight overflowed

    def decide(self, step: int, losses_finite: bool, grads_finite: Dict[str, bool], gan_overflows: int,
               scales_losses: bool, loss_scales: Dict[str, float]) -> Dict[str, bool]:
        """{network: take its optimizer step?} for optimizer step `step` (1-based). Raises NonFiniteError."""
        if gan_overflows:
            self.skipped_gan_terms += gan_overflows
            logger.warning("step %d: the adaptive GAN weight overflowed in %d micro-batch(es); their GAN term was "
                           "skipped (%d in total)", step, gan_overflows, self.skipped_gan_terms)
        if not losses_finite or (not scales_losses and not all(grads_finite.values())):
            self.skipped_steps += 1
            self.consecutive_nonfinite += 1
            logger.warning("step %d: non-finite %s, step skipped for both networks (%d in a row, %d in total)", step,
                           "gradients" if losses_finite else "loss", self.consecutive_nonfinite, self.skipped_steps)
            if self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
                raise NonFiniteError(
                    f"{self.consecutive_nonfinite} consecutive optimizer steps had non-finite losses or gradients "
                    f"(last at step {step}); stopping. The weights are those of the last good step. Lower "
                    "--learning_rate, check the data, or resume from an earlier checkpoint.")
            return {name: False for name in grads_finite}
        self.consecutive_nonfinite = 0
        for name, finite in grads_finite.items():  # fp16: an overflow is that network's business only
            if finite:
                self.consecutive_overflow[name] = 0
                continue
            self.overflow_steps[name] += 1
            self.consecutive_overflow[name] += 1
            logger.warning("step %d: fp16 overflow in the %s's gradients (loss scale %g): its step is skipped "
                           "(%d in a row)", step, name, loss_scales[name], self.consecutive_overflow[name])
            if self.consecutive_overflow[name] >= self.max_consecutive_overflow:
                raise NonFiniteError(
                    f"{self.consecutive_overflow[name]} consecutive optimizer steps had fp16 gradient overflow in "
                    f"the {name} (last at step {step}, loss scale {loss_scales[name]:g}; it is not lowered below "
                    "--min_loss_scale); stopping. The weights are those of the last good step. Try --bf16, a "
                    "lower --learning_rate, or resume from an earlier checkpoint.")
        return dict(grads_finite)

    def state_dict(self) -> Dict[str, object]:
        return copy.deepcopy({name: getattr(self, name) for name in self._STATE})

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.__dict__.update(copy.deepcopy({name: state[name] for name in self._STATE}))


@dataclass
class Network:
    """One network the step trains, and what trains it (built once: build.train_networks)."""

    name: str  # the guard's and its messages': "vae" | "discriminator"
    prefix: str  # of its log keys and checkpoint files: "" | "disc_" (its loss scaler's file: "vae_" | "disc_")
    parameters: List[paddle.Tensor]
    optimizer: Any
    scheduler: Any
    scaler: LossScaler  # fp16's (disabled without --fp16)
    start: float = 0  # the first (0-based) optimizer step it trains at; math.inf: never (--disc_weight 0)


@dataclass
class TrainStep:
    built: Any  # build.Networks: the container `model`, the frozen LPIPS, VF model (with model.vf_projection), teacher
    loss_args: Any
    args: Any  # the training arguments: --gradient_accumulation_steps, --max_grad_norm, --seed (EQ-VAE's transforms
    # are drawn from (seed, step, micro-batch): equivariance.draw)
    networks: Tuple[Network, Network]  # the VAE's, the discriminator's
    precision: Precision = field(default_factory=Precision)
    ema: Any = None
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)
    replay: Any = None  # --disc_replay_size: past reconstructions shown to the discriminator (FakeReplay)

    def __post_init__(self) -> None:
        self.transforms = parse_transforms(self.loss_args.equivariance_transforms)
        self._window_losses, self._window_gan_overflows = [], []  # this optimizer step's, checked in one read
        self._norm_statistics = trained_norm_statistics(self.built.model.vae) if world_size() > 1 else []

    def forward_backward(self, pixel_values: paddle.Tensor, global_step: int, micro_batch: int
                         ) -> Dict[str, paddle.Tensor]:
        """Micro-batch `micro_batch` of optimizer step `global_step` (both 0-based): its logs, detached device scalars
        (averaged over the logging window). With an EQ-VAE transform tau, the objectives compare decode(tau(z)) with
        tau(x); the KL stays on the clean z."""
        model, args, (vae, disc) = self.built.model, self.loss_args, self.networks
        accumulation, seed = self.args.gradient_accumulation_steps, self.args.seed
        transform = draw(seed, global_step, micro_batch, args.equivariance_prob, args.equivariance_min_scale,
                         self.transforms, model.family.geometry(model.vae.config).min_latent_side)
        model.train()
        clean, image_size = pixel_values, pixel_values.shape[2:]
        taught = self.built.teacher.latents(clean) if self.built.teacher is not None else None  # distillation's targets
        # Distillation's discriminator sees the latent an image was decoded from (a conditioned PatchGAN).
        discriminator = model.discriminator if taught is None else functools.partial(model.discriminator,
                                                                                     condition=taught)
        with self.precision.autocast():
            recon, post_mean, post_logvar, z = model(                                     # forward
                clean, sample_posterior=args.sample_posterior, return_latent=True, decoded=taught,
                latent_transform=(lambda z: transform(z, z.shape[2:4], image_size)) if transform else None)
            with paddle.amp.auto_cast(enable=False):  # tau(x) in float32 under any autocast, as the plain target
                target = transform(clean, post_mean.shape[2:], image_size) if transform else clean
            vf = None  # the VF loss's inputs: the clean latent projected onto the clean images' token grid, ...
            if model.vf_projection is not None:
                with paddle.no_grad():
                    # RGBA: what an RGB network sees
                    features, grid = self.built.vf_model.patch_tokens(over_grey(clean))
                vf = (to_token_grid(model.vf_projection(z), grid), features, model.family.last_layers(model.vae)[1])
            vae_loss = vae_objective(                                                     # losses
                target, recon, post_mean, post_logvar, model.logvar, loss_args=args, lpips=self.built.lpips,
                discriminator=discriminator, last_layer=model.family.last_layers(model.vae)[0],
                gan_weight=gan_weight(args, global_step), vf=vf,
                grad_scale=vae.scaler.scale_value / accumulation,
                encoded_pixels=float(math.prod(clean.shape[1:])),  # C*H*W, clips C*T*H*W: a KL per pixel value
                lpips_rows=lpips_subset(seed, global_step, micro_batch, clean.shape, args.lpips_num_frames),
                latent=z if clean.ndim == 5 else None, latent_target=taught)
        # backward: one pass. The heads' gradient at the reconstruction was taken once, on a leaf copy (so the
        # adaptive GAN weight costs one small conv's backward, not a second pass through LPIPS and the discriminator:
        # benchmarks/training_step.py --heads); it enters here beside the direct terms' (the KL, the latent ones).
        vae_loss.backward(recon, lambda loss: vae.scaler.scale(loss / accumulation))
        logs = vae_loss.logs
        self._window_losses.append(logs["loss/total"])
        if "gan/adaptive_weight_overflow" in logs:
            self._window_gan_overflows.append(logs["gan/adaptive_weight_overflow"])
        if global_step >= disc.start:
            fakes, condition = self.replay.mix(recon, taught) if self.replay else (recon, taught)
            with self.precision.autocast():                                               # discriminator: loss
                d_loss, d_logs = discriminator_objective(
                    discriminator, target, fakes, args, lecam_ema=model.lecam_ema,
                    fake_discriminator=None if condition is taught else functools.partial(  # a replay's latents
                        model.discriminator, condition=condition))
            disc.scaler.scale(d_loss / accumulation).backward()  # and backward
            self._window_losses.append(d_logs["loss/discriminator"])
            logs.update(d_logs)
        # For `logged_images`: what the objective compared, x ([B, C, T, H, W] for clips) or tau(x) under EQ-VAE, and
        # decode(z) or decode(tau(z)), detached; x itself (what the EMA's image logging reconstructs).
        self.last_images = (target, recon.detach(), clean)
        return logs

    def optimizer_step(self, global_step: int) -> Tuple[Dict[str, object], bool]:
        """The update after the last micro-batch of optimizer step `global_step` (0-based): the gradients all-reduced;
        for each network that trains (the VAE, and the discriminator from its start) unscale; one finite check of
        both; for each, clip, step and its loss scale; the gradients freed, the BatchNorm statistics averaged over
        ranks and the EMA stepped. The learning rates move on in `schedule`. Returns the numbers to log (learning
        rates, skip counters, loss scales on the host; gradient norms on the device) and whether to stop: some rank
        was signalled to (distributed.py), agreed by every rank."""
        trained = [net for net in self.networks if global_step >= net.start]
        scales_losses = self.networks[0].scaler.is_enable()  # fp16: non-finite gradients, finite losses: overflows
        sync_gradients([p for net in trained for p in net.parameters], fill_missing=self.built.clips)  # all-reduce
        for net in trained:
            net.scaler.unscale_(net.optimizer)                                            # unscale
        norms = {net.name: grad_norm(net.parameters) for net in trained}
        scalars: Dict[str, object] = {f"train/{net.prefix}learning_rate": net.optimizer.get_lr()  # before they move on
                                      for net in self.networks}
        scalars.update({f"train/{net.prefix}grad_norm": norms[net.name] for net in trained})
        # finite check: THE host sync of an optimizer step, one read of a few numbers summed over ranks (losses finite
        # on every rank, VAE / discriminator gradients finite, GAN terms skipped for overflow, some rank signalled to
        # stop), and the guard's decision {network: take its step?} (which raises when a run is broken).
        zero = paddle.zeros([], "float32")
        losses = paddle.stack(self._window_losses).astype("float32")
        gan_overflows = paddle.stack(self._window_gan_overflows + [zero]).sum()
        self._window_losses, self._window_gan_overflows = [], []
        nonfinite = [(~paddle.isfinite(value)).any().astype("float32")
                     for value in [losses] + [norms.get(net.name, zero) for net in self.networks]]
        signal = paddle.full([], 0.0 if stop_signal() is None else 1.0, "float32")  # agreed here (distributed.py)
        bad = paddle.stack(nonfinite + [gan_overflows, signal])
        bad_losses, *bad_grads, overflows, signalled = sum_over_ranks(bad).numpy().tolist()
        take = self.guard.decide(global_step + 1, bad_losses == 0,
                                 {net.name: not bad for net, bad in zip(self.networks, bad_grads)}, int(overflows),
                                 scales_losses, {net.name: net.scaler.scale_value for net in self.networks})
        for net in trained:
            if take[net.name]:
                clip_grads(net.parameters, norms[net.name], self.args.max_grad_norm)      # clip
                net.optimizer.step()                                                      # step
            net.scaler.update_after(not take[net.name])                                   # loss scale
        # Freed, not zeroed (Paddle's default keeps a zero tensor per parameter): the VAE's gradients are as big
        # as its weights (335 MB for SD), and between steps nothing needs them.
        for net in self.networks:
            net.optimizer.clear_grad(set_to_zero=False)
        average_over_ranks(self._norm_statistics)                                         # BatchNorm statistics
        if self.ema is not None:                                                          # EMA
            self.ema.step(self.built.model.vae.parameters())
        guard = self.guard
        overflow_steps = {f"train/{net.prefix}overflow_steps": guard.overflow_steps[net.name] for net in self.networks}
        scalars.update({"train/skipped_steps": guard.skipped_steps, **overflow_steps,
                        "train/skipped_gan_terms": guard.skipped_gan_terms})
        if scales_losses:
            scalars.update({f"train/{net.prefix}loss_scale": net.scaler.scale_value for net in self.networks})
        return scalars, signalled > 0

    def schedule(self, global_step: int) -> None:
        """After `optimizer_step` of `global_step`: the learning rate of each network that trained moves on."""
        for net in self.networks:
            if global_step >= net.start:
                net.scheduler.step()


def trained_norm_statistics(vae: paddle.nn.Layer) -> List[paddle.Tensor]:
    """The running statistics of the VAE's training BatchNorms (DC-AE's in / mix decoders), to average over ranks
    after each step: the global batch's then (SyncBatchNorm would drop PyTorch's unbiased variance update). Not a
    frozen one's (no trainable weight: kept in eval mode), whose statistics must stay as loaded, bit for bit."""
    return [tensor for layer in vae.sublayers() if isinstance(layer, paddle.nn.layer.norm._BatchNormBase)
            and any(not p.stop_gradient for p in layer.parameters()) for tensor in (layer._mean, layer._variance)]


def logged_images(step: TrainStep) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """(inputs, reconstructions) for the image grid: the pair the last micro-batch's objective compared; with an
    EMA, the clean images reconstructed by the EMA weights (a VAE forward: call it only on the rank that logs)."""
    inputs, reconstructions, clean = step.last_images
    if step.ema is None:
        return inputs, reconstructions
    # The container, so that --input_size applies; O2: float32 images into half-precision weights. In eval mode: a
    # BatchNorm's statistics are used, not changed (the next step sets training mode again).
    model = step.built.model
    model.eval()
    with ema_weights(step.ema, model.vae), paddle.no_grad(), half_precision_autocast(model.vae):
        recon = model(clean, sample_posterior=False)[0]
    return clean, recon.astype("float32")
