"""The training step, shared by both drivers: one micro-batch in, gradients and a dict of scalars out.

Per micro-batch: ONE VAE forward; the VAE loss (pixel, LPIPS, KL, adaptive GAN term) is backpropagated;
then the discriminator loss on the *detached* reconstruction is backpropagated. Micro-steps never
communicate. On the last micro-batch of an optimizer step (`finish`):
  1. both networks' gradients are averaged over ranks (distributed.sync_gradients);
  2. fp16 loss scales are removed (one scaler per network);
  3. the NaN/Inf guard: a non-finite loss or gradient cancels this step for both networks (counted,
     logged); K consecutive ones raise `NonFiniteError`, and the drivers save a checkpoint of the last
     good weights before stopping;
  4. the discriminator optimizer and its schedule step.
The VAE optimizer step belongs to the driver (the Trainer's loop, or ours) and is the same `GuardedAdamW`
either way, which honours the guard's cancellation. Then `after_optimizer_step` updates the EMA.

The order of the two updates does not matter: the discriminator's gradients come from detached
reconstructions and the VAE's gradients are complete before either optimizer steps.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import paddle

from .distributed import all_ranks_agree, sync_gradients
from .losses import discriminator_objective, vae_objective
from .models.autoencoder_gan import VAEWithDiscriminator
from .models.vae import decoder_last_layer
from .precision import Precision

logger = logging.getLogger("vae_trainer")


class ema_weights:
    """Context manager: the VAE temporarily holds its EMA weights."""

    def __init__(self, ema, vae: paddle.nn.Layer):
        self.ema, self.vae = ema, vae

    def __enter__(self):
        self.ema.store(self.vae.parameters())
        self.ema.copy_to(self.vae.parameters())

    def __exit__(self, *exc):
        self.ema.restore(self.vae.parameters())


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps with non-finite losses or gradients."""


def all_finite(tensors: List[paddle.Tensor]) -> bool:
    """One device sync: are all given tensors free of NaN and Inf?"""
    flags = [paddle.isfinite(t.astype("float32")).all() for t in tensors if t is not None]
    return bool(paddle.stack(flags).all().item()) if flags else True


def update_scaler(scaler, found_inf: bool) -> None:
    """Adjust an fp16 loss scale after an optimizer step we took (or skipped) ourselves.

    Paddle's GradScaler.update() reads `_cache_found_inf`, which only its own step()/minimize() set;
    we step the optimizers ourselves (after our own finite checks), so we set it from our decision.
    """
    if scaler is not None:
        scaler._cache_found_inf = found_inf
        scaler.update()


class TrainStep:
    def __init__(
        self,
        model: VAEWithDiscriminator,
        lpips: Optional[paddle.nn.Layer],
        loss_args,
        vae_optimizer,
        disc_optimizer,
        disc_scheduler,
        accumulation_steps: int = 1,
        precision: Optional[Precision] = None,
        ema=None,
        max_consecutive_nonfinite: int = 5,
    ):
        self.model = model
        self.lpips = lpips
        self.loss_args = loss_args
        self.vae_optimizer = vae_optimizer
        self.disc_optimizer = disc_optimizer
        self.disc_scheduler = disc_scheduler
        self.accumulation_steps = accumulation_steps
        self.precision = precision or Precision()
        self.ema = ema
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.nonfinite_steps = 0  # total skipped steps (logged)
        self.consecutive_nonfinite = 0
        self._window_losses: List[paddle.Tensor] = []

    def gan_active(self, global_step: int) -> bool:
        """The GAN terms (and the discriminator's training) start at --disc_start."""
        return self.loss_args.disc_weight > 0 and global_step >= self.loss_args.disc_start

    def __call__(self, pixel_values: paddle.Tensor, global_step: int, last_micro_step: bool) -> Dict[str, paddle.Tensor]:
        """Forward and backward for one micro-batch; on the last one, `finish` the optimizer step."""
        model, gan_active = self.model, self.gan_active(global_step)
        model.train()
        with self.precision.autocast():
            recon, post_mean, post_logvar = model(pixel_values, sample_posterior=self.loss_args.sample_posterior)
            loss, logs = vae_objective(
                pixel_values, recon, post_mean, post_logvar, model.logvar,
                loss_args=self.loss_args, lpips=self.lpips, discriminator=model.discriminator,
                last_layer=decoder_last_layer(model.vae), gan_active=gan_active,
                grad_scale=self.precision.vae_loss_scale() / self.accumulation_steps,
            )
        self.precision.scale_vae(loss / self.accumulation_steps).backward()
        self.last_inputs, self.last_reconstructions = pixel_values, recon.detach()  # for image logging
        self._window_losses.append(logs["loss/total"])

        if gan_active:
            with self.precision.autocast():
                d_loss, d_logs = discriminator_objective(
                    model.discriminator, pixel_values, recon, self.loss_args.disc_loss, lecam_ema=model.lecam_ema,
                    lecam_weight=self.loss_args.lecam_weight, lecam_decay=self.loss_args.lecam_decay)
            self.precision.scale_disc(d_loss / self.accumulation_steps).backward()
            self._window_losses.append(d_logs["loss/discriminator"])
            logs.update(d_logs)

        if last_micro_step:
            logs.update(self.finish(global_step, gan_active))
        return logs

    def finish(self, global_step: int, gan_active: bool) -> Dict[str, paddle.Tensor]:
        """End of an optimizer step: sync, unscale, guard, step the discriminator.

        Every decision here is taken from values that are identical on all ranks (all-reduced gradients
        and a rank-global loss check), so all ranks always skip or step together.
        """
        model, precision = self.model, self.precision
        vae_params = model.vae_parameters()
        disc_params = model.discriminator_parameters() if gan_active else []
        sync_gradients(vae_params)
        sync_gradients(disc_params)
        if precision.vae_scaler is not None:
            precision.vae_scaler.unscale_(self.vae_optimizer)
        if gan_active and precision.disc_scaler is not None:
            precision.disc_scaler.unscale_(self.disc_optimizer)

        losses_finite = all_ranks_agree(all_finite(self._window_losses))
        self._window_losses = []
        vae_grads_finite = all_finite([p.grad for p in vae_params])
        disc_grads_finite = all_finite([p.grad for p in disc_params])
        if losses_finite and precision.vae_scaler is not None:
            # fp16: an overflow is the loss scaler's business and cancels only that network's step.
            step_vae, step_disc = vae_grads_finite, disc_grads_finite
            if not (step_vae and step_disc):
                logger.info("step %d: fp16 gradient overflow (%s), step skipped and loss scale lowered", global_step + 1,
                            "vae" if not step_vae else "discriminator")
        else:
            step_vae = step_disc = losses_finite and vae_grads_finite and disc_grads_finite
            if not step_vae:
                self._guard(global_step, losses_finite)
        if step_vae and step_disc:
            self.consecutive_nonfinite = 0
        if not step_vae:
            self.vae_optimizer.skip_next_step = True
            self.nonfinite_steps += 1
        if gan_active and step_disc:
            self.disc_optimizer.step()
            self.disc_scheduler.step()
        update_scaler(precision.vae_scaler, found_inf=not step_vae)
        if gan_active:
            update_scaler(precision.disc_scaler, found_inf=not step_disc)
        self.disc_optimizer.clear_grad()
        return {
            "train/disc_learning_rate": paddle.full([], self.disc_optimizer.get_lr(), "float32"),
            "train/skipped_steps": paddle.full([], self.nonfinite_steps, "float32"),
        }

    def _guard(self, global_step: int, losses_finite: bool) -> None:
        """Count a non-finite step (loss, or gradients without fp16 scaling); stop after K in a row."""
        self.consecutive_nonfinite += 1
        logger.warning("step %d: non-finite %s, step skipped for both networks (%d in a row, %d in total)",
                       global_step + 1, "gradients" if losses_finite else "loss", self.consecutive_nonfinite,
                       self.nonfinite_steps + 1)
        if self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
            self.vae_optimizer.skip_next_step = True
            raise NonFiniteError(
                f"{self.consecutive_nonfinite} consecutive optimizer steps had non-finite losses or gradients "
                f"(last at step {global_step + 1}); stopping. The weights are those of the last good step. "
                "Lower --learning_rate, check the data, or resume from an earlier checkpoint."
            )

    def images_for_logging(self):
        """(inputs, reconstructions) of the last micro-batch; with EMA, reconstructed by the EMA weights."""
        if self.ema is None:
            return self.last_inputs, self.last_reconstructions
        with ema_weights(self.ema, self.model.vae), paddle.no_grad():  # the container: --input_size applies
            recon = self.model(self.last_inputs, sample_posterior=False)[0]
        return self.last_inputs, recon

    def after_optimizer_step(self) -> None:
        """After the VAE optimizer stepped: update the EMA of the VAE weights."""
        if self.ema is not None:
            self.ema.step(self.model.vae.parameters())
