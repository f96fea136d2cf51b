"""What a run trains, in one Layer (`VAEWithDiscriminator`: the VAE, its discriminator, the output
log-variance, LeCAM's EMA buffer, a VF loss's latent projection), so that a checkpoint holds every trained weight and
the PaddleNLP Trainer has one `model`; the export saves `vae` alone. The VAE is read through its family (family.py);
`encoder_input` is what its encoder sees (--input_size).
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import paddle

from .families import encoder_parameters, family_of

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("freeze_encoder", "trainable_modules"),
     lambda f: (f.freeze_encoder or f.trainable_modules) and not f.loads_weights and not f.distils,
     "it keeps weights as loaded, and a VAE trained from scratch has only random ones: add "
     "--pretrained_model_name_or_path or --init_from_ckpt, or drop it"),
    (("input_size",), lambda f: f.input_size is not None and (len(f.input_size) != 2 or min(f.input_size) < 1),
     "it takes two positive numbers H W"),
)


def encoder_input(images: paddle.Tensor, input_size: Optional[Sequence[int]]) -> paddle.Tensor:
    """The images, or with --input_size H W the images bilinearly resized to HxW."""
    if input_size is None:
        return images
    return paddle.nn.functional.interpolate(images, size=list(input_size), mode="bilinear", align_corners=False)


class VAEWithDiscriminator(paddle.nn.Layer):
    def __init__(self, vae: paddle.nn.Layer, discriminator: paddle.nn.Layer, logvar_init: float = 0.0,
                 learn_logvar: bool = False, posterior_std: float = 0.0, freeze_encoder: bool = False,
                 input_size: Optional[Sequence[int]] = None, vf_feature_dim: Optional[int] = None,
                 trainable_modules: Optional[Sequence[str]] = None):
        super().__init__()
        self.vae = vae
        self.family = family_of(vae)
        geometry = self.family.geometry(vae.config)
        self.deterministic, self.encoder_trains = geometry.deterministic, geometry.encoder_trains
        self.discriminator = discriminator
        self.posterior_std = posterior_std
        self.family.posterior_std_values(vae, posterior_std)  # a family that cannot export it refuses it at the start
        self.input_size = [int(n) for n in input_size] if input_size else None
        # The weights an optimizer could train (not e.g. BatchNorm statistics, which Paddle keeps as parameters);
        # a family's encoder that never trains (RAE's) is frozen whatever the flags, and kept float32 under O2.
        self._trainable = {id(p) for p in vae.parameters() if not p.stop_gradient}
        self._trainable |= set() if self.encoder_trains else {id(p) for p in encoder_parameters(vae)}
        freeze = freeze_encoder or not self.encoder_trains
        frozen = {id(p) for p in encoder_parameters(vae)} if freeze else set()
        if trainable_modules:  # the VAE weights no pattern takes; a pattern whose weights are all frozen anyway
            # (--freeze_encoder, an encoder that never trains) is an error
            named = {name: p for name, p in vae.named_parameters() if id(p) in self._trainable}
            trained = set()
            for pattern in trainable_modules:
                matched = trainable_names(named, pattern)
                if all(id(named[name]) in frozen for name in matched):
                    why = (f"{self.family.class_name}'s encoder never trains" if not self.encoder_trains
                           else "--freeze_encoder keeps them frozen")
                    raise ValueError(f"--trainable_modules {pattern!r} names encoder weights only, which stay "
                                     f"frozen ({why}): drop it")
                trained |= {id(named[name]) for name in matched} - frozen
            frozen |= {id(p) for p in named.values()} - trained
        for param in vae.parameters():
            if id(param) in frozen:
                param.stop_gradient = True  # before the optimizers are built: they take trainable weights only
        # Whether the latent space trains (--freeze_encoder, or --trainable_modules that leave the encoder out).
        self.encoder_frozen = all(p.stop_gradient for p in encoder_parameters(vae))
        # BatchNorm layers left with no trainable weight keep their statistics too (evaluated, never updated).
        self._frozen_norms = [layer for layer in vae.sublayers() if isinstance(layer, paddle.nn.layer.norm._BatchNormBase)
                              and self._trainable & {id(p) for p in layer.parameters()}
                              and all(p.stop_gradient for p in layer.parameters())]
        # LeCAM's EMAs of [mean D(real), mean D(fake)]: a buffer so checkpoints and resume include it.
        self.register_buffer("lecam_ema", paddle.zeros([2], dtype="float32"), persistable=True)
        # LDM's learnable output log-variance. Unlike LDM, when learnable it IS in the VAE optimizer.
        self.logvar = self.create_parameter(shape=[], dtype="float32",
                                            default_initializer=paddle.nn.initializer.Constant(logvar_init))
        self.logvar.stop_gradient = not learn_logvar
        # VA-VAE's `reverse_proj`: latent channels -> the foundation model's feature width.
        self.vf_projection = (paddle.nn.Conv2D(geometry.latent_channels, vf_feature_dim, 1, bias_attr=False)
                              if vf_feature_dim else None)

    def vae_parameters(self) -> List[paddle.Tensor]:
        params = list(self.vae.parameters())
        if self.vf_projection is not None:
            params += list(self.vf_projection.parameters())
        if not self.logvar.stop_gradient:
            params.append(self.logvar)
        return params

    def train(self, mode: bool = True):
        super().train(mode)
        for layer in self._frozen_norms:
            layer.eval()
        return self

    def refuse_frozen_readers(self, loss_args) -> None:
        """Objective terms that read a layer --trainable_modules leaves frozen (they would fail at their first step,
        maybe at --disc_start, or shape a latent space that cannot move): one error."""
        gan_adaptive = (loss_args.disc_weight > 0 and loss_args.adaptive_disc_weight
                        and loss_args.loss_balancing != "gradnorm")
        if gan_adaptive and self.family.last_layers(self.vae)[0].stop_gradient:
            raise ValueError("the adaptive GAN weight compares gradients at the decoder's last layer, which "
                             "--trainable_modules leaves frozen: add its pattern (e.g. 'decoder.conv_out.*'), or give "
                             "--adaptive_disc_weight false")
        if self.encoder_frozen and self.vf_projection is not None:
            raise ValueError("--vf_model_path aligns the latent space, and --trainable_modules leaves the encoder "
                             "frozen: train the encoder's weights, or give --vf_weight 0 (the diagnostic only)")
        if self.encoder_frozen and loss_args.equivariance_prob > 0:
            raise ValueError("--equivariance_prob shapes the latent space, and --trainable_modules leaves the encoder "
                             "frozen: train the encoder's weights, or drop it")

    def frozen_layers(self) -> List[paddle.nn.Layer]:
        """The VAE's layers no optimizer updates (--freeze_encoder, --trainable_modules), kept float32 under O2: each
        layer whose own weights are all frozen; one with frozen and trained weights both is refused."""
        out = []
        for name, layer in self.vae.named_sublayers(include_self=True):
            own = [p.stop_gradient for p in layer.parameters(include_sublayers=False) if id(p) in self._trainable]
            if own and all(own):
                out.append(layer)
            elif any(own):
                raise ValueError(f"{name or 'the VAE'} has frozen and trained weights both, which --fp16_opt_level O2 "
                                 "cannot keep apart (it casts layers): make --trainable_modules take whole layers")
        return out

    def encode(self, x: paddle.Tensor):
        """The posterior of `x` (resized to `input_size` if set); no graph when frozen."""
        with paddle.no_grad() if self.encoder_frozen else contextlib.nullcontext():
            return self.family.encode(self.vae, encoder_input(x, self.input_size))

    def forward(self, x: paddle.Tensor, sample_posterior: bool = True,
                latent_transform: Optional[Callable[[paddle.Tensor], paddle.Tensor]] = None,
                return_latent: bool = False, decoded: Optional[paddle.Tensor] = None) -> Tuple[paddle.Tensor, ...]:
        """Reconstruction, posterior mean and log-variance (None: a deterministic latent; with `posterior_std` > 0:
        z = mean + std * noise and the constant log(std^2)), and with `return_latent` z itself. `latent_transform`
        (EQ-VAE) changes z before decoding, not the posterior or the z returned; `decoded` (a teacher's latent, in
        distillation) is decoded in place of z."""
        posterior = self.encode(x)
        if self.posterior_std > 0:
            mean, logvar = posterior.mean, paddle.full_like(posterior.mean, 2.0 * math.log(self.posterior_std))
            z = mean + self.posterior_std * paddle.randn(mean.shape, mean.dtype) if sample_posterior else mean
            logvar = None if self.deterministic else logvar  # noise on the latent, no posterior: no KL
        else:
            mean, logvar = posterior.mean, posterior.logvar
            z = posterior.sample() if sample_posterior else posterior.mode()
        if z.ndim == 5 and z.stop_gradient and paddle.is_grad_enabled():  # a frozen encoder's clip latent: a
            z = z.detach()  # leaf the adaptive GAN weight's gradient can reach (losses.last_layer_gradient)
            z.stop_gradient = False
        if decoded is None:
            decoded = latent_transform(z) if latent_transform is not None else z
        recon = self.family.decode(self.vae, decoded)
        return (recon, mean, logvar, z) if return_latent else (recon, mean, logvar)


def trainable_names(named: Dict[str, paddle.Tensor], pattern: str) -> List[str]:
    """The parameter names of `named` a --trainable_modules glob matches; none is an error naming the closest
    parameter and layer names."""
    matched = fnmatch.filter(named, pattern)
    if not matched:
        layers = sorted({name.rsplit(".", 1)[0] + ".*" for name in named})
        closest = difflib.get_close_matches(pattern, list(named) + layers, n=5, cutoff=0.4)
        raise ValueError(f"--trainable_modules {pattern!r} matches no parameter of the VAE; closest names: "
                         f"{', '.join(closest) or ', '.join(layers[:5])} (patterns are globs on parameter names, "
                         "e.g. 'decoder.*')")
    return matched
