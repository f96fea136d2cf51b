"""The seam between the trainer and the autoencoder classes it trains: `Family`, all that differs between them.

A family is one adapter file under models/families/ (kl.py: AutoencoderKL; flux2.py; dc_ae.py; wan.py: Wan and
Qwen-Image; rae.py; tiny.py), listed in models/families/__init__.py by the `_class_name` its config.json persists,
and one port file (models/autoencoder_*.py) where ppdiffusers lacks the class. Above models/, the step, objectives,
evaluation, checkpoints and the export ask the family of the network they hold (`families.family_of`), never its
class. Images are NCHW (clips NCTHW) on [-1, 1] on both sides of `encode` / `decode`: a family converts ranges or
frame axes itself. What a config alone says is its `Geometry`; its latent normalisation is one value of a kind of
latent_normalisation.py.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Dict, List, Mapping, Optional, Tuple

import numpy as np
import paddle

from .latent_normalisation import Normalisation

Layer, Tensor = paddle.nn.Layer, paddle.Tensor
TILE_OVERLAP = 0.25  # diffusers' and ppdiffusers' tiles: the stride is 3/4 of a tile (256 px tiles, stride 192)


@dataclass(frozen=True)
class Geometry:
    """What a config alone says of the network: its shapes and what its encoder gives (flag checks and the data
    reader need no network)."""

    factor: int  # image pixels per latent pixel, along each side (the encoder's downsampling)
    decoder_factor: int  # the decoder's upsampling: the factor, unless it super-resolves
    latent_channels: int
    rule: str = ""  # how the config gives the factor, for messages ("2 ** (down blocks - 1)")
    output_size: Optional[int] = None  # a decoder that returns this square size whatever the input (RAE's)
    # A video VAE's temporal factor k: it takes clips of 1 + k * n frames, and an image is a one-frame clip, so
    # training its encoder on images changes the latent space of a video model too (0: images only).
    frames: int = 0
    deterministic: bool = False  # the encoder gives the latent itself: no posterior, so no KL term
    encoder_trains: bool = True  # False: a frozen representation encoder (RAE's DINOv2), whatever the flags
    channels: int = 3  # image channels in and out
    # Why --expand_to_rgba cannot grow its image channels ("": `Family.image_convs` says where they are).
    rgba_refusal: str = ""
    min_latent_side: int = 1  # the smallest latent side the network takes (reflect padding of 1 needs 2)


class Deterministic:
    """A deterministic encoder's latent read as a posterior (the reads of ppdiffusers' DiagonalGaussianDistribution):
    its mean, mode and sample are the latent; it has no variance, so no KL term. `raw`: the latent before a
    normalisation the encoder applies itself (RAE's tokens), if any."""

    logvar = var = std = None

    def __init__(self, latent: Tensor, raw: Optional[Tensor] = None):
        self.mean, self.raw = latent, raw

    def mode(self) -> Tensor:
        return self.mean

    sample = mode


class Family:
    """An autoencoder class as the trainer sees it."""

    network: ClassVar[type]  # the Paddle class, named as diffusers' class
    normalisation: ClassVar[Normalisation]  # its latent normalisation (latent_normalisation.py)
    # The state-dict prefixes of what defines the latent: --freeze_encoder freezes these layers, --ignore_keys of any
    # re-initialises the latent space (FLUX.2's bn statistics are among them).
    encoder_prefixes: ClassVar[Tuple[str, ...]] = ("encoder.",)
    tiling: ClassVar[str] = ""  # how --eval_tiled tiles, for the protocol ("": it cannot)

    @property
    def class_name(self) -> str:
        """The `_class_name` of its config.json: its class's name, which is diffusers' too."""
        return self.network.__name__

    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        raise NotImplementedError

    def build(self, config: Mapping[str, Any], where: str, fresh: bool = False,
              encoder_path: Optional[str] = None) -> Layer:
        """A network of `config` (from `where`, named in errors), weights from Paddle's global RNG; `fresh`: to train
        from scratch (no weights follow), on the encoder weights of `encoder_path` where the encoder never trains."""
        raise NotImplementedError

    def encode(self, vae: Layer, images: Tensor):
        """The posterior of [-1, 1] images (`Deterministic` for a deterministic encoder), latents NCHW (clips NCTHW); by
        default the class's own encode's `latent_dist`."""
        return vae.encode(images).latent_dist

    def decode(self, vae: Layer, latents: Tensor) -> Tensor:
        """Images on [-1, 1] in intent, not clamped (a clamp would stop the loss's gradients); by default the
        class's own decode, whose output is that."""
        return vae.decode(latents).sample

    def last_layers(self, vae: Layer) -> Tuple[Tensor, Optional[Tensor]]:
        """(the decoder's last weight, where the adaptive GAN weight compares gradients; the encoder's, where the
        adaptive VF weight does, None if the encoder never trains); by default those of the decoder's and the
        encoder's `conv_out` (of the conv a block in its place holds: DC-AE's DCUpBlock2d)."""
        conv_out = vae.decoder.conv_out
        return getattr(conv_out, "conv", conv_out).weight, vae.encoder.conv_out.weight

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """(name, layer) recomputed under --recompute, never the decoder's last layer nor a layer holding a
        BatchNorm (recomputing its training forward would update its statistics twice); empty: refused."""
        return []

    def tiled(self, vae: Layer, tile: int) -> ContextManager[None]:
        """Within: `vae` encodes and decodes images larger than `tile` px tile by tile (`tiling` says how); by default
        with the class's diffusers-style `enable_tiling`, square tiles overlapping by TILE_OVERLAP of a tile."""
        if not self.tiling:
            raise ValueError(f"{self.class_name} has no tiled encode / decode here")
        stride = tile - int(tile * TILE_OVERLAP)
        return tiling_enabled(vae, tile, tile, stride, stride)

    def posterior_std_values(self, vae: Layer, posterior_std: float) -> Dict[str, np.ndarray]:
        """Weights the export writes in place of the network's own (by state-dict name) so that its posterior has
        --posterior_std's constant std, which training used in place of the encoder's variance."""
        return {}

    def diffusers_problem(self, vae: Layer) -> Optional[str]:
        """Why PyTorch diffusers could not load this network as its class, or None."""
        return None

    def image_convs(self, vae: Layer) -> Any:
        """Where the image's channels enter and leave `vae` (rgba.ImageConvs), where its geometry's `rgba_refusal`
        is ""."""
        refusal = self.geometry(vae.config).rgba_refusal or "where its image channels enter and leave is not known here"
        raise ValueError(f"--expand_to_rgba: {self.class_name}: {refusal}")


def constructor_defaults(family: Family) -> Dict[str, Any]:
    """The family's constructor defaults: what a config leaves out."""
    parameters = inspect.signature(family.network.__init__).parameters
    return {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


def constant_logvar_values(vae: Layer, prefix: str, channels: int, posterior_std: float) -> Dict[str, np.ndarray]:
    """The conv at `prefix` (its outputs: `channels` means, then as many log-variances) with zero log-variance weights
    and bias log(std^2): its posterior then has --posterior_std's constant std (`Family.posterior_std_values`)."""
    if not posterior_std or posterior_std <= 0:
        return {}
    state = vae.state_dict()
    weight, bias = state[prefix + "weight"].numpy().copy(), state[prefix + "bias"].numpy().copy()
    weight[channels:], bias[channels:] = 0.0, 2.0 * np.log(posterior_std)
    return {prefix + "weight": weight, prefix + "bias": bias}


def diffusers_tiling(class_name: str, note: str = "") -> str:
    """A `Family.tiling` of a class's own diffusers-style tiled passes."""
    return (f"overlapping by {TILE_OVERLAP:.0%}, overlaps blended linearly ({class_name} tiled_encode / tiled_decode, "
            f"as diffusers'{note})")


@contextlib.contextmanager
def tiling_enabled(vae: Layer, *settings: Any):
    """Within: `vae.enable_tiling(*settings)`; its tiling attributes (`use_tiling`, `tile_*`) restored on leaving."""
    state = {name: value for name, value in vars(vae).items() if name == "use_tiling" or name.startswith("tile_")}
    try:
        vae.enable_tiling(*settings)
        yield
    finally:
        for name, value in state.items():
            setattr(vae, name, value)


def check_config_keys(config: Mapping[str, Any], family: Family, where: str, required: Tuple[str, ...] = (),
                      retired: Tuple[str, ...] = ()) -> None:
    """One error naming `where` and the key: a key the class does not take (another release's?; `retired` keys, which
    diffusers 0.42.1's class no longer takes and ignores, are read), or a required architecture key left out."""
    defaults = constructor_defaults(family)
    unknown = sorted(k for k in config if not k.startswith("_") and k not in defaults and k not in retired)
    if unknown:
        raise ValueError(f"{where}: {family.class_name} config key(s) {', '.join(unknown)} are not known to this "
                         f"version (it knows {', '.join(sorted(defaults))}); from another diffusers release? This "
                         "trainer cannot build that architecture.")
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(f"{where}: {family.class_name} config lacks {', '.join(missing)} (diffusers' defaults: "
                         f"{', '.join(f'{k}={defaults[k]!r}' for k in missing)}): state the architecture's values.")


def holds_batch_norm(layer: Layer) -> bool:
    """Does `layer` hold a BatchNorm (whose training forward updates its statistics)?"""
    return any(isinstance(sub, paddle.nn.layer.norm._BatchNormBase) for sub in layer.sublayers(include_self=True))
