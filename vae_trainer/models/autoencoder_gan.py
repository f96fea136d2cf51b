"""The trainable state of a run in one Layer (`VAEWithDiscriminator`: the VAE, its discriminator, the output
log-variance, LeCAM's EMA buffer, a VF loss's latent projection), so that a checkpoint holds every trained weight and
the PaddleNLP Trainer has one `model`; the export saves `vae` alone.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, List, Optional, Sequence, Tuple

import paddle
from ppdiffusers import AutoencoderKL

from .vae import encoder_input, encoder_parameters


class VAEWithDiscriminator(paddle.nn.Layer):
    def __init__(self, vae: AutoencoderKL, discriminator: paddle.nn.Layer, logvar_init: float = 0.0,
                 learn_logvar: bool = False, posterior_std: float = 0.0, freeze_encoder: bool = False,
                 input_size: Optional[Sequence[int]] = None, vf_feature_dim: Optional[int] = None):
        super().__init__()
        self.vae = vae
        self.discriminator = discriminator
        self.posterior_std = posterior_std
        self.input_size = [int(n) for n in input_size] if input_size else None
        self.freeze_encoder = freeze_encoder
        for param in encoder_parameters(vae) if freeze_encoder else []:
            param.stop_gradient = True  # before the optimizers are built: they take trainable weights only
        # LeCAM's EMAs of [mean D(real), mean D(fake)]: a buffer so checkpoints and resume include it.
        self.register_buffer("lecam_ema", paddle.zeros([2], dtype="float32"), persistable=True)
        # LDM's learnable output log-variance. Unlike LDM, when learnable it IS in the VAE optimizer.
        self.logvar = self.create_parameter(shape=[], dtype="float32",
                                            default_initializer=paddle.nn.initializer.Constant(logvar_init))
        self.logvar.stop_gradient = not learn_logvar
        # VA-VAE's `reverse_proj`: latent channels -> the foundation model's feature width.
        self.vf_projection = (paddle.nn.Conv2D(vae.config.latent_channels, vf_feature_dim, 1, bias_attr=False)
                              if vf_feature_dim else None)

    def vae_parameters(self) -> List[paddle.Tensor]:
        params = list(self.vae.parameters())
        if self.vf_projection is not None:
            params += list(self.vf_projection.parameters())
        if not self.logvar.stop_gradient:
            params.append(self.logvar)
        return params

    def frozen_layers(self) -> List[paddle.nn.Layer]:
        """Layers no optimizer updates (--freeze_encoder), kept float32 under O2."""
        if not self.freeze_encoder:
            return []
        return [layer for layer in (self.vae.encoder, self.vae.quant_conv) if layer is not None]

    def discriminator_parameters(self) -> List[paddle.Tensor]:
        return list(self.discriminator.parameters())

    def encode(self, x: paddle.Tensor):
        """The posterior of `x` (resized to `input_size` if set); no graph when frozen."""
        with paddle.no_grad() if self.freeze_encoder else contextlib.nullcontext():
            return self.vae.encode(encoder_input(x, self.input_size)).latent_dist

    def forward(self, x: paddle.Tensor, sample_posterior: bool = True,
                latent_transform: Optional[Callable[[paddle.Tensor], paddle.Tensor]] = None,
                return_latent: bool = False) -> Tuple[paddle.Tensor, ...]:
        """Reconstruction, posterior mean and log-variance (with `posterior_std` > 0: z = mean + std * noise and the
        constant log(std^2)), and with `return_latent` z itself. `latent_transform` (EQ-VAE) changes z before
        decoding, not the posterior or the z returned."""
        posterior = self.encode(x)
        if self.posterior_std > 0:
            mean, logvar = posterior.mean, paddle.full_like(posterior.mean, 2.0 * math.log(self.posterior_std))
            z = mean + self.posterior_std * paddle.randn(mean.shape, mean.dtype) if sample_posterior else mean
        else:
            mean, logvar = posterior.mean, posterior.logvar
            z = posterior.sample() if sample_posterior else posterior.mode()
        decoded = self.vae.decode(latent_transform(z) if latent_transform is not None else z).sample
        return (decoded, mean, logvar, z) if return_latent else (decoded, mean, logvar)
