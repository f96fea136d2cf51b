"""The training step, shared by both drivers: one micro-batch in, gradients and a dict of scalars out.

Per micro-batch: ONE VAE forward; the VAE loss (pixel, LPIPS, KL, adaptive GAN term) is backpropagated;
then the discriminator loss on the *detached* reconstruction is backpropagated. On the last micro-batch
of an optimizer step both networks' gradients are averaged over ranks, and the discriminator optimizer
steps. The VAE optimizer step belongs to the driver (the Trainer's own loop, or ours), which then clips,
steps and schedules exactly the same optimizer built by `optim.build_optimizer`.

The order of the two updates does not matter: the discriminator's gradients come from detached
reconstructions and the VAE's gradients are complete before either optimizer steps.
"""

from __future__ import annotations

from typing import Dict, Optional

import paddle

from .distributed import sync_gradients
from .losses import discriminator_objective, vae_objective
from .models.autoencoder_gan import VAEWithDiscriminator
from .models.vae import decoder_last_layer


class TrainStep:
    def __init__(
        self,
        model: VAEWithDiscriminator,
        lpips: Optional[paddle.nn.Layer],
        loss_args,
        disc_optimizer: paddle.optimizer.Optimizer,
        disc_scheduler,
        accumulation_steps: int = 1,
    ):
        self.model = model
        self.lpips = lpips
        self.loss_args = loss_args
        self.disc_optimizer = disc_optimizer
        self.disc_scheduler = disc_scheduler
        self.accumulation_steps = accumulation_steps

    def gan_active(self, global_step: int) -> bool:
        """The GAN terms (and the discriminator's training) start at --disc_start."""
        return self.loss_args.disc_weight > 0 and global_step >= self.loss_args.disc_start

    def __call__(self, pixel_values: paddle.Tensor, global_step: int, last_micro_step: bool) -> Dict[str, paddle.Tensor]:
        """Forward and backward for one micro-batch; on the last one, sync and step the discriminator."""
        model, gan_active = self.model, self.gan_active(global_step)
        model.train()
        recon, post_mean, post_logvar = model(pixel_values, sample_posterior=self.loss_args.sample_posterior)
        loss, logs = vae_objective(
            pixel_values, recon, post_mean, post_logvar, model.logvar,
            loss_args=self.loss_args, lpips=self.lpips, discriminator=model.discriminator,
            last_layer=decoder_last_layer(model.vae), gan_active=gan_active,
        )
        (loss / self.accumulation_steps).backward()
        self.last_inputs, self.last_reconstructions = pixel_values, recon.detach()  # for image logging

        if gan_active:
            d_loss, d_logs = discriminator_objective(model.discriminator, pixel_values, recon, self.loss_args.disc_loss)
            (d_loss / self.accumulation_steps).backward()
            logs.update(d_logs)

        if last_micro_step:
            sync_gradients(model.vae_parameters())
            if gan_active:
                sync_gradients(model.discriminator_parameters())
                self.disc_optimizer.step()
                self.disc_scheduler.step()
                self.disc_optimizer.clear_grad()
            logs["train/disc_learning_rate"] = paddle.full([], self.disc_optimizer.get_lr(), "float32")
        return logs
