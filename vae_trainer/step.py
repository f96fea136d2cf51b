"""The training step, shared by both drivers: micro-batches in, both networks updated, numbers out.

Per micro-batch, `forward_backward`: ONE VAE forward (with --equivariance_prob, sometimes of a transformed
latent against the transformed image: equivariance.py); the VAE loss (pixel, LPIPS, KL, adaptive GAN term)
is backpropagated, running LPIPS's VGG16 and the frozen discriminator backwards once each (the adaptive
weight reuses their gradients at the reconstruction: losses.py, "One backward per head"); then the
discriminator loss on the *detached* reconstruction is backpropagated. Micro-steps never communicate
and never read a value back from the device.

Per optimizer step, `optimizer_step`, one straight block:
  1. all-reduce both networks' gradients over ranks (distributed.sync_gradients);
  2. unscale them (fp16: one loss scaler per network);
  3. gradient norms, then the finite check: ONE device-to-host read of a few counts, summed over
     ranks, so every rank takes the same decision (`NonFiniteGuard`);
  4. clip each network's gradients to --max_grad_norm (optim.clip_grads);
  5. step the VAE optimizer, 6. step the discriminator optimizer (each unless its step is skipped);
  7. both LR schedules follow the step counter (a skipped step still counts);
  8. update the fp16 loss scales from the decision, free both networks' gradients (not zeroed: memory);
  9. update the EMA of the VAE weights.
The drivers call this block and step nothing themselves (trainer.py: how the PaddleNLP Trainer's own
optimizer/scheduler calls become no-ops).

Skipping, counted and logged (`NonFiniteGuard`):
- a non-finite loss on any rank, or non-finite gradients without fp16 loss scaling, skips the step for both
  networks; --max_consecutive_nonfinite_steps in a row raise `NonFiniteError`;
- under fp16, non-finite gradients with finite losses are an overflow: only that network's step is
  skipped and its loss scale lowered (not below --min_loss_scale); --max_consecutive_overflow_steps in
  a row for one network raise `NonFiniteError` too;
- an adaptive GAN weight that overflows skips the GAN term of that micro-batch (losses.vae_objective),
  counted in the same host read.
On `NonFiniteError` the drivers save a checkpoint (the weights of the last good step) and stop. The guard's
counters are part of every checkpoint (`nonfinite_guard.pdparams`), so a resumed run counts on exactly.

The order of the two updates does not matter: the discriminator's gradients come from detached
reconstructions and the VAE's gradients are complete before either optimizer steps.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import paddle

from .distributed import sum_over_ranks, sync_gradients
from .ema import ema_weights
from .equivariance import Transform, draw, parse_transforms
from .losses import discriminator_objective, vae_objective
from .models.autoencoder_gan import VAEWithDiscriminator
from .models.vae import decoder_last_layer
from .optim import clip_grads, grad_norm
from .precision import Precision, half_precision_autocast
from .preemption import STOP_REQUESTED, stop_signal

logger = logging.getLogger("vae_trainer")


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps with non-finite losses or gradients (or fp16 overflows)."""


class NonFiniteGuard:
    """Decides from rank-global counts which network steps, counts the skips, stops runs that stay broken."""

    def __init__(self, max_consecutive_nonfinite: int = 5, max_consecutive_overflow: int = 25):
        if min(max_consecutive_nonfinite, max_consecutive_overflow) < 1:
            raise ValueError("--max_consecutive_nonfinite_steps and --max_consecutive_overflow_steps must be >= 1")
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.max_consecutive_overflow = max_consecutive_overflow
        self.skipped_steps = 0  # steps skipped for both networks (non-finite loss or gradients)
        self.consecutive_nonfinite = 0
        self.overflow_steps = {"vae": 0, "discriminator": 0}  # fp16: steps of one network skipped for overflow
        self.consecutive_overflow = {"vae": 0, "discriminator": 0}
        self.skipped_gan_terms = 0  # micro-batches whose adaptive GAN weight overflowed

    def decide(self, step: int, losses_finite: bool, grads_finite: Dict[str, bool], scales_losses: bool,
               loss_scales: Dict[str, float]) -> Dict[str, bool]:
        """{network: take its optimizer step?} for optimizer step `step` (1-based). Raises NonFiniteError."""
        if not losses_finite or (not scales_losses and not all(grads_finite.values())):
            self.skipped_steps += 1
            self.consecutive_nonfinite += 1
            what = "loss" if not losses_finite else "gradients"
            logger.warning("step %d: non-finite %s, step skipped for both networks (%d in a row, %d in total)",
                           step, what, self.consecutive_nonfinite, self.skipped_steps)
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

    def count_gan_overflows(self, step: int, count: int) -> None:
        if count:
            self.skipped_gan_terms += count
            logger.warning("step %d: the adaptive GAN weight overflowed in %d micro-batch(es); their GAN term was "
                           "skipped (%d in total)", step, count, self.skipped_gan_terms)

    # Checkpointed (build.Optimization.stateful), so a resumed run counts on exactly as the uninterrupted one:
    # the limits see the same runs of bad steps, and the logged totals go on from the saved ones.
    def state_dict(self) -> Dict[str, object]:
        return {"skipped_steps": self.skipped_steps, "consecutive_nonfinite": self.consecutive_nonfinite,
                "overflow_steps": dict(self.overflow_steps), "consecutive_overflow": dict(self.consecutive_overflow),
                "skipped_gan_terms": self.skipped_gan_terms}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.skipped_steps, self.skipped_gan_terms = int(state["skipped_steps"]), int(state["skipped_gan_terms"])
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        self.overflow_steps = {name: int(count) for name, count in state["overflow_steps"].items()}
        self.consecutive_overflow = {name: int(count) for name, count in state["consecutive_overflow"].items()}

    def counters(self) -> Dict[str, float]:
        return {"train/skipped_steps": self.skipped_steps, "train/overflow_steps": self.overflow_steps["vae"],
                "train/disc_overflow_steps": self.overflow_steps["discriminator"],
                "train/skipped_gan_terms": self.skipped_gan_terms}


class TrainStep:
    def __init__(
        self,
        model: VAEWithDiscriminator,
        lpips: Optional[paddle.nn.Layer],
        loss_args,
        vae_optimizer,
        vae_scheduler,
        disc_optimizer,
        disc_scheduler,
        accumulation_steps: int = 1,
        precision: Optional[Precision] = None,
        ema=None,
        max_grad_norm: float = 0.0,
        guard: Optional[NonFiniteGuard] = None,
        seed: int = 0,
    ):
        self.model = model
        self.lpips = lpips
        self.loss_args = loss_args
        self.vae_optimizer, self.vae_scheduler = vae_optimizer, vae_scheduler
        self.disc_optimizer, self.disc_scheduler = disc_optimizer, disc_scheduler
        self.accumulation_steps = accumulation_steps
        self.precision = precision or Precision()
        self.ema = ema
        self.max_grad_norm = max_grad_norm
        self.guard = guard or NonFiniteGuard()
        self.seed = seed  # EQ-VAE's transforms are drawn from (seed, step, micro-batch): equivariance.draw
        self.transforms = parse_transforms(loss_args.equivariance_transforms)
        self._micro_batch = 0  # of this optimizer step
        self._window_losses: List[paddle.Tensor] = []  # this optimizer step's losses, checked in one read
        self._window_gan_overflows: List[paddle.Tensor] = []

    def gan_active(self, global_step: int) -> bool:
        """The GAN terms (and the discriminator's training) start at --disc_start."""
        return self.loss_args.disc_weight > 0 and global_step >= self.loss_args.disc_start

    def equivariance_transform(self, global_step: int) -> Optional[Transform]:
        """EQ-VAE's transform of this micro-batch, or None (the plain objective): the same on every rank."""
        return draw(self.seed, global_step, self._micro_batch, self.loss_args.equivariance_prob,
                    self.loss_args.equivariance_min_scale, self.transforms)

    def forward_backward(self, pixel_values: paddle.Tensor, global_step: int) -> Dict[str, paddle.Tensor]:
        """One micro-batch: forward, both losses, both backwards. Returns detached device scalars to log.

        With an EQ-VAE transform tau, the decoder decodes tau(z) and every reconstruction term (pixel, LPIPS,
        adversarial, and the discriminator's real images) compares with tau(x); the KL stays on the clean z."""
        model, gan_active = self.model, self.gan_active(global_step)
        transform = self.equivariance_transform(global_step)
        self._micro_batch += 1
        model.train()
        with self.precision.autocast():
            image_size = pixel_values.shape[2:]
            recon, post_mean, post_logvar = model(
                pixel_values, sample_posterior=self.loss_args.sample_posterior,
                latent_transform=(lambda z: transform.latent(z, image_size)) if transform else None)
            encoded_pixels = float(pixel_values.shape[1] * pixel_values.shape[2] * pixel_values.shape[3])
            clean_inputs = pixel_values
            if transform is not None:
                pixel_values = transform.images(pixel_values, post_mean.shape[2:])
            loss, logs = vae_objective(
                pixel_values, recon, post_mean, post_logvar, model.logvar,
                loss_args=self.loss_args, lpips=self.lpips, discriminator=model.discriminator,
                last_layer=decoder_last_layer(model.vae), gan_active=gan_active,
                grad_scale=self.precision.vae_loss_scale() / self.accumulation_steps, encoded_pixels=encoded_pixels,
            )
        self.precision.scale_vae(loss / self.accumulation_steps).backward()
        # For image logging: the compared pair (with a transform, tau(x) and decode(tau(z))) and the clean images.
        self.last_inputs, self.last_reconstructions = pixel_values, recon.detach()
        self.last_clean_inputs = clean_inputs
        self._window_losses.append(logs["loss/total"])
        if "gan/adaptive_weight_overflow" in logs:
            self._window_gan_overflows.append(logs["gan/adaptive_weight_overflow"])

        if gan_active:
            with self.precision.autocast():
                d_loss, d_logs = discriminator_objective(
                    model.discriminator, pixel_values, recon, self.loss_args.disc_loss, lecam_ema=model.lecam_ema,
                    lecam_weight=self.loss_args.lecam_weight, lecam_decay=self.loss_args.lecam_decay)
            self.precision.scale_disc(d_loss / self.accumulation_steps).backward()
            self._window_losses.append(d_logs["loss/discriminator"])
            logs.update(d_logs)
        return logs

    def optimizer_step(self, global_step: int) -> Dict[str, object]:
        """The update after the last micro-batch of optimizer step `global_step` (0-based).

        Returns this step's values for logging: learning rates, skip counters and loss scales (host
        numbers) and the gradient norms (device scalars, read only when logged); and under STOP_REQUESTED,
        which the drivers take out before logging, whether any rank was signalled to stop (preemption.py).
        """
        gan = self.gan_active(global_step)
        self._micro_batch = 0
        vae_params = self.model.vae_parameters()
        disc_params = self.model.discriminator_parameters() if gan else []
        report: Dict[str, object] = {"train/learning_rate": self.vae_optimizer.get_lr(),
                  "train/disc_learning_rate": self.disc_optimizer.get_lr()}

        sync_gradients(vae_params + disc_params)                                          # 1. all-reduce
        self.precision.unscale(self.vae_optimizer, self.disc_optimizer if gan else None)  # 2. unscale
        vae_norm, disc_norm = grad_norm(vae_params), grad_norm(disc_params)
        losses_finite, vae_finite, disc_finite, gan_overflows, stop = self._read_checks(vae_norm, disc_norm)  # 3.
        self.guard.count_gan_overflows(global_step + 1, gan_overflows)
        take = self.guard.decide(global_step + 1, losses_finite, {"vae": vae_finite, "discriminator": disc_finite},
                                 self.precision.scales_losses, self.precision.loss_scales())
        if take["vae"]:
            clip_grads(vae_params, vae_norm, self.max_grad_norm)                          # 4. clip
            self.vae_optimizer.step()                                                     # 5. VAE update
        if gan and take["discriminator"]:
            clip_grads(disc_params, disc_norm, self.max_grad_norm)
            self.disc_optimizer.step()                                                    # 6. D update
        self.vae_scheduler.step()                                                         # 7. schedules
        if gan:
            self.disc_scheduler.step()
        self.precision.update_scales(not take["vae"], (not take["discriminator"]) if gan else None)  # 8.
        # Freed, not zeroed (Paddle's default keeps a zero tensor per parameter): the VAE's gradients are as big
        # as its weights (335 MB for SD), and between steps, through the next forward and any checkpoint save,
        # nothing needs them. The next backward creates them, as at the first step.
        self.vae_optimizer.clear_grad(set_to_zero=False)
        self.disc_optimizer.clear_grad(set_to_zero=False)
        if self.ema is not None:                                                          # 9. EMA
            self.ema.step(self.model.vae.parameters())

        report["train/grad_norm"] = vae_norm
        if gan:
            report["train/disc_grad_norm"] = disc_norm
        report.update(self.guard.counters())
        if self.precision.scales_losses:
            scales = self.precision.loss_scales()
            report.update({"train/loss_scale": scales["vae"], "train/disc_loss_scale": scales["discriminator"]})
        report[STOP_REQUESTED] = stop
        return report

    def _read_checks(self, vae_norm: paddle.Tensor, disc_norm: paddle.Tensor) -> Tuple[bool, bool, bool, int, bool]:
        """THE host sync of an optimizer step: (all losses finite on every rank, VAE gradients finite,
        discriminator gradients finite, GAN terms skipped for overflow on all ranks, some rank signalled to
        stop), from one read of a few numbers summed over ranks. Gradients are already all-reduced (a
        non-finite value on one rank is non-finite on all); losses and signals are per rank, hence the sum."""
        losses = paddle.stack(self._window_losses).astype("float32")
        gan_overflows = (paddle.stack(self._window_gan_overflows).sum() if self._window_gan_overflows
                         else paddle.zeros([], "float32"))
        self._window_losses, self._window_gan_overflows = [], []
        bad = paddle.stack([
            (~paddle.isfinite(losses)).any().astype("float32"),
            (~paddle.isfinite(vae_norm)).astype("float32"),
            (~paddle.isfinite(disc_norm)).astype("float32"),
            gan_overflows.astype("float32"),
            paddle.full([], 0.0 if stop_signal() is None else 1.0, "float32"),  # agreed here (preemption.py)
        ])
        bad_losses, bad_vae, bad_disc, overflows, signalled = sum_over_ranks(bad).numpy().tolist()
        return bad_losses == 0, bad_vae == 0, bad_disc == 0, int(overflows), signalled > 0

    def images_for_logging(self) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """(inputs, reconstructions) of the last micro-batch: the pair its objective compared (with an EQ-VAE
        transform tau(x) and decode(tau(z))); with EMA, the clean images reconstructed by the EMA weights.
        Call it only on the rank that writes images: with EMA it runs a VAE forward."""
        if self.ema is None:
            return self.last_inputs, self.last_reconstructions
        # The container, so that --input_size applies; O2: float32 images into half-precision weights.
        with ema_weights(self.ema, self.model.vae), paddle.no_grad(), half_precision_autocast(self.model.vae):
            recon = self.model(self.last_clean_inputs, sample_posterior=False)[0]
        return self.last_clean_inputs, recon.astype("float32")
