"""The seam between the trainer and the autoencoder classes it trains: `Family`, what differs between them.

One subclass per class, in its own file (kl.py: AutoencoderKL; flux2.py; dc_ae.py; rae.py; wan.py: Wan and
Qwen-Image), registered in families.py by the `_class_name` its config.json persists. Above models/, the step, losses,
evaluation, checkpoints, the latent scale and the export ask the family of the network they hold
(`families.family_of`), never its class. Images are NCHW on [-1, 1] on both sides of `encode` / `decode`: a family
converts ranges or frame axes itself.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Dict, List, Mapping, Optional, Tuple

import numpy as np
import paddle

Layer, Tensor = paddle.nn.Layer, paddle.Tensor


@dataclass(frozen=True)
class Geometry:
    """What a config alone says of the shapes (flag checks need no network)."""

    factor: int  # image pixels per latent pixel, along each side (the encoder's downsampling)
    decoder_factor: int  # the decoder's upsampling: the factor, unless it super-resolves
    latent_channels: int
    rule: str = ""  # how the config gives the factor, for messages ("2 ** (down blocks - 1)")
    output_size: Optional[int] = None  # a decoder that returns this square size whatever the input (RAE's)


class Deterministic:
    """A deterministic encoder's latent read as a posterior (the reads of ppdiffusers' DiagonalGaussianDistribution):
    its mean, mode and sample are the latent; it has no variance, so no KL term."""

    logvar = var = std = None

    def __init__(self, latent: Tensor):
        self.mean = latent

    def mode(self) -> Tensor:
        return self.mean

    def sample(self) -> Tensor:
        return self.mean


class Family:
    """An autoencoder class as the trainer sees it. The defaults are those of a class with a `scaling_factor` in
    its config, an `encoder` and a `decoder`."""

    class_name: ClassVar[str]  # the `_class_name` of its config.json (diffusers' class)
    network: ClassVar[type]  # the Paddle class
    deterministic: ClassVar[bool] = False  # no posterior: the KL flags are refused, the latent is its own mean
    # The state-dict prefixes that define the latent (--ignore_keys of them re-initialise the latent space):
    # `encoder_layers`' names, and buffers such as FLUX.2's bn statistics.
    encoder_prefixes: ClassVar[Tuple[str, ...]] = ("encoder.",)
    scale_keys: ClassVar[Tuple[str, ...]] = ("scaling_factor",)  # the latent scale's config keys, kept from sources
    scale_name: ClassVar[str] = "scaling factor"  # what latent_stats.json calls its latent normalisation
    held_scale: ClassVar[str] = ""  # a latent normalisation its weights hold (FLUX.2: "bn statistics"), else ""
    tiling_method: ClassVar[str] = ""  # --eval_tiled's method, for the protocol ("": no tiling)
    encoder_never_trains: ClassVar[bool] = False  # never trained, whatever the flags (RAE's representation encoder)
    stats_on_training_data: ClassVar[bool] = False  # a measured normalisation is of --file_list, not held-out images
    lists_view_statistics: ClassVar[bool] = True  # eval records list the normalised view's statistics (not: too many)
    # Its latents also encode video (an image is a one-frame clip): training its encoder on images changes the
    # latent space of a video model too, so the trainer warns; temporal weights images never reach go out unchanged.
    video: ClassVar[bool] = False
    # Config keys of released folders that diffusers 0.42.1's class no longer takes and ignores: read, not refused.
    retired_keys: ClassVar[Tuple[str, ...]] = ()
    fixed_scale: ClassVar[bool] = False  # its latent scale is fixed: never measured nor changed at export

    # ---- config: no network needed
    def owns(self, config: Mapping[str, Any]) -> bool:
        """Is a config without `_class_name` this family's (by its keys)?"""
        return False

    def defaults(self) -> Dict[str, Any]:
        """The constructor's defaults: what a config leaves out."""
        parameters = inspect.signature(self.network.__init__).parameters
        return {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}

    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        raise NotImplementedError

    def build(self, config: Mapping[str, Any], where: str) -> Layer:
        """A fresh network of `config` (from `where`, named in errors), weights from Paddle's global RNG."""
        raise NotImplementedError

    def build_fresh(self, config: Mapping[str, Any], where: str, encoder_path: Optional[str] = None) -> Layer:
        """A network to train from scratch (no weights follow): `build`, given the weights of an encoder trained
        elsewhere (--rae_encoder_path) for a family that takes them."""
        if encoder_path:
            raise ValueError(f"--rae_encoder_path {encoder_path}: {self.class_name} ({where}) trains its own encoder; "
                             "drop it")
        return self.build(config, where)

    def set_training_noise(self, vae: Layer, tau: float) -> None:
        """--noise_tau: the noise training adds to the encoder's output (RAE's)."""
        raise ValueError(f"--noise_tau {tau}: {self.class_name} adds no noise to its latents in training; drop it")

    # ---- the network
    def encode(self, vae: Layer, images: Tensor):
        """The posterior of [-1, 1] images (`Deterministic` for a deterministic encoder), latents NCHW."""
        raise NotImplementedError

    def decode(self, vae: Layer, latents: Tensor) -> Tensor:
        """Images on [-1, 1] in intent, not clamped (a clamp would stop the loss's gradients)."""
        raise NotImplementedError

    def decoder_last_layer(self, vae: Layer) -> Tensor:
        """The weight the adaptive GAN weight compares gradients at."""
        raise NotImplementedError

    def encoder_last_layer(self, vae: Layer) -> Tensor:
        """The weight the adaptive VF weight compares gradients at."""
        raise NotImplementedError

    def encoder_layers(self, vae: Layer) -> List[Layer]:
        """What --freeze_encoder freezes: every layer that defines the latent."""
        return [vae.encoder]

    def encoder_parameters(self, vae: Layer) -> List[Tensor]:
        return [param for layer in self.encoder_layers(vae) for param in layer.parameters()]

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """(name, layer) recomputed under --recompute, never the decoder's last layer nor a layer holding a
        BatchNorm (recomputing its training forward would update its statistics twice); empty: refused."""
        return []

    def tiled(self, vae: Layer, tile: int) -> ContextManager[None]:
        """Within: `vae` encodes and decodes images larger than `tile` px tile by tile."""
        raise NotImplementedError

    def normalised_view(self, vae: Layer, posterior) -> Optional[Tensor]:
        """The view of `posterior` (`encode`'s) whose per-channel statistics define its latent normalisation, if not
        the latents themselves: FLUX.2's patchified modes, RAE's tokens before normalisation (channel and position)."""
        return None

    def protocol_items(self, measured_view: bool) -> Tuple[Tuple[str, str], ...]:
        """(name, text) of what an evaluation's protocol says beyond the defaults, or in place of them (names
        kept); `measured_view`: the statistics of `normalised_view` were measured."""
        return ()

    # ---- the latent scale
    def measured_scale(self, config: Mapping[str, Any], stats) -> Dict[str, Any]:
        """Config updates of `--scaling_factor measure` from measured statistics (evaluation.EvalResult)."""
        updates = {"scaling_factor": stats.scaling_factor}
        if config.get("shift_factor") is not None:
            updates["shift_factor"] = stats.shift_factor
        return updates

    def scale_record(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, Any]:
        """The exported latent scale, as latent_stats.json states it."""
        return {key: updates.get(key, vae.config.get(key)) for key in ("scaling_factor", "shift_factor")}

    def scale_text(self, record: Mapping[str, Any]) -> str:
        return f"scaling_factor {record['scaling_factor']}, shift_factor {record['shift_factor']}"

    def measured_record(self, stats) -> Dict[str, Any]:
        """What latent_stats.json says was measured, beyond where and how many."""
        return {"statistic": self.statistic(), "latent_mean": stats.latent_mean, "latent_std": stats.latent_std,
                "suggested_scaling_factor": stats.scaling_factor, "suggested_shift_factor": stats.shift_factor}

    def statistic(self) -> str:
        if self.deterministic:
            return "the latents (the encoder is deterministic)"
        return "posterior samples, exact expectation from the posterior means and variances"

    def pipeline_normalisation(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        """(mean, std), float32 [C, p, p]: a diffusion pipeline's latents are (z - mean) / std, z the posterior mode
        (`encode(...).mode()`), the pattern tiled over latent positions with period p (teacher.to_pipeline)."""
        raise ValueError(f"{self.class_name}: no diffusion pipeline's latent normalisation is known for this class")

    def held_normalisation(self, vae: Layer):
        """The latent normalisation its weights hold (`held_scale`: FLUX.2's bn statistics), or None."""
        return None

    def scale_mode_problem(self, vae: Layer, mode) -> Optional[str]:
        """Why --scaling_factor `mode` ("keep", "measure" or a number) cannot export this network, or None."""
        return None

    # ---- the export
    def exported_values(self, vae: Layer, posterior_std: float, updates: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """Weights the export writes in place of the network's own (by state-dict name)."""
        return {}

    def diffusers_problem(self, vae: Layer) -> Optional[str]:
        """Why PyTorch diffusers could not load this network as its class, or None."""
        return None


def constant_logvar_values(vae: Layer, prefix: str, channels: int, posterior_std: float) -> Dict[str, np.ndarray]:
    """The conv at `prefix` (its outputs: `channels` means, then as many log-variances) with zero log-variance weights
    and bias log(std^2): its posterior then has --posterior_std's constant std (the export's `exported_values`)."""
    state = vae.state_dict()
    weight, bias = state[prefix + "weight"].numpy().copy(), state[prefix + "bias"].numpy().copy()
    weight[channels:], bias[channels:] = 0.0, 2.0 * math.log(posterior_std)
    return {prefix + "weight": weight, prefix + "bias": bias}


@contextlib.contextmanager
def tiling_enabled(vae: Layer, tile: int, overlap: float, state: Tuple[str, ...]):
    """Within: diffusers-style `vae.enable_tiling` with square `tile` px tiles overlapping by `overlap` of a tile;
    the attributes named in `state` restored on leaving."""
    stride = tile - int(tile * overlap)
    with attributes_set(vae, **{name: getattr(vae, name) for name in state}):
        vae.enable_tiling(tile, tile, stride, stride)
        yield


@contextlib.contextmanager
def attributes_set(owner: Any, **values: Any):
    """Within: `owner`'s attributes set to `values`, restored on leaving."""
    saved = {name: getattr(owner, name) for name in values}
    try:
        for name, value in values.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def check_config_keys(config: Mapping[str, Any], family: Family, where: str, required: Tuple[str, ...] = ()) -> None:
    """One error naming `where` and the key: a key the class does not take (another release's?; its
    `retired_keys` are read, as diffusers ignores them), or a required architecture key left out."""
    known = set(family.defaults())
    readable = known | set(family.retired_keys)
    unknown = sorted(k for k in config if not k.startswith("_") and k not in readable)
    if unknown:
        raise ValueError(f"{where}: {family.class_name} config key(s) {', '.join(unknown)} are not known to this "
                         f"version (it knows {', '.join(sorted(known))}); from another diffusers release? This "
                         "trainer cannot build that architecture.")
    missing = [k for k in required if k not in config]
    if missing:
        defaults = family.defaults()
        raise ValueError(f"{where}: {family.class_name} config lacks {', '.join(missing)} (diffusers' defaults: "
                         f"{', '.join(f'{k}={defaults[k]!r}' for k in missing)}): state the architecture's values.")


def holds_batch_norm(layer: Layer) -> bool:
    """Does `layer` hold a BatchNorm (whose training forward updates its statistics)?"""
    return any(isinstance(sub, paddle.nn.layer.norm._BatchNormBase) for sub in layer.sublayers(include_self=True))
