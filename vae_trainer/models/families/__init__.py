"""The autoencoder families the trainer trains, one adapter file each (models/family.py says what an adapter
implements), listed by the `_class_name` their config.json persists and by the keys that make a config without one
theirs: adding a family is its file and one entry in OWNERS. Also what every caller asks of any network through its
family: its encoder's weights, its image channels and its geometry's size check."""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from ..family import Family, Layer, Tensor
from .dc_ae import DC_AE
from .flux2 import FLUX2
from .hunyuanvideo15 import HUNYUAN_VIDEO15
from .kl import KL
from .ltx2 import LTX2
from .qwenimage21 import QWEN_IMAGE21
from .rae import RAE
from .tiny import TINY
from .wan import QWEN_IMAGE, WAN

# A config without `_class_name` goes to the first family whose test its keys pass; KL's passes any, so it comes
# last; TINY's keys include DC-AE's encoder_block_out_channels, so it comes before DC_AE; QWEN_IMAGE21's are WAN's
# (with 4 image channels); LTX2's include FLUX2's patch_size and block_out_channels, so it comes before FLUX2. A
# network's family is the first whose class it is an instance of, so a class comes before the one it derives from
# (FLUX2 before KL).
OWNERS: Tuple[Tuple[Family, Callable[[Mapping[str, Any]], bool]], ...] = (
    (TINY, lambda c: any(key in c for key in ("num_encoder_blocks", "num_decoder_blocks", "latent_magnitude",
                                               "upsampling_scaling_factor"))),  # keys only AutoencoderTiny has
    (QWEN_IMAGE, lambda c: "z_dim" in c and "input_channels" in c),
    (QWEN_IMAGE21, lambda c: "z_dim" in c and "input_channels" not in c and c.get("in_channels") == 4),
    (WAN, lambda c: "z_dim" in c and "input_channels" not in c),
    (DC_AE, lambda c: "encoder_block_out_channels" in c or "encoder_block_types" in c),  # only AutoencoderDC's
    (LTX2, lambda c: "spatio_temporal_scaling" in c or "decoder_inject_noise" in c),
    # AutoencoderKL-shaped (block_out_channels), with a key only AutoencoderKLFlux2 has (diffusers' AutoencoderKL
    # also has mid_block_add_attention)
    (FLUX2, lambda c: "block_out_channels" in c and any(
        key in c for key in ("decoder_block_out_channels", "batch_norm_eps", "batch_norm_momentum", "patch_size"))),
    (RAE, lambda c: "decoder_hidden_size" in c or "encoder_input_size" in c),
    (HUNYUAN_VIDEO15, lambda c: "downsample_match_channel" in c or "upsample_match_channel" in c),
    (KL, lambda c: True),  # the fallback: a config of no other family's keys
)
FAMILIES = tuple(family for family, _ in OWNERS)
TRAINED_CLASSES = ", ".join(family.class_name for family in FAMILIES)


def family_of(vae: Layer) -> Family:
    """The family of a network: of its class or the class it derives from, else (a stand-in) of its config."""
    for family in FAMILIES:
        if isinstance(vae, family.network):
            return family
    if hasattr(vae, "config"):
        return family_for_config(vae.config)
    raise TypeError(f"{type(vae).__name__} is not an autoencoder class this trainer trains ({TRAINED_CLASSES})")


def family_for_config(config: Mapping[str, Any], where: str = "the VAE's config") -> Family:
    """The family of a config: by its `_class_name`, else by its keys; an unknown class is one error naming it."""
    name = config.get("_class_name")
    if name is None:
        return next(family for family, owns in OWNERS if owns(config))
    for family in FAMILIES:
        if family.class_name == name:
            return family
    raise ValueError(f"{where}: its \"_class_name\" is {name}, a class this trainer does not train (yet); it trains "
                     f"{TRAINED_CLASSES}")


def encoder_parameters(vae: Layer) -> List[Tensor]:
    """The weights that define the latent: those at the family's `encoder_prefixes`, prefix by prefix (those the
    network has: FLUX.1's has no quant_conv)."""
    named = list(vae.named_parameters())
    return [p for prefix in family_of(vae).encoder_prefixes for name, p in named if name.startswith(prefix)]


def image_channels(vae: Layer) -> int:
    """The image channels `vae` takes and gives, as its family's geometry says (4: RGBA, 3: RGB)."""
    return family_of(vae).geometry(vae.config).channels


def check_reconstruction_shape(config: Mapping[str, Any], input_size: Optional[Sequence[int]], resolution: int,
                               where: str = "the VAE's config") -> None:
    """The decoder must give back `resolution` from what the encoder sees (`input_size`, default the image)."""
    family = family_for_config(config, where)
    geometry, name = family.geometry(config), family.class_name
    if geometry.output_size is not None:  # it resizes its input itself
        if input_size:
            raise ValueError(f"--input_size: {name} resizes its input itself ({where}); drop it")
        if resolution != geometry.output_size:
            raise ValueError(f"{name} decodes {geometry.output_size}x{geometry.output_size} images whatever its "
                             f"input ({where}), and the loss compares --resolution {resolution}: use --resolution "
                             f"{geometry.output_size}")
        return
    height, width = input_size or (resolution, resolution)
    flag = f"--input_size {height} {width}" if input_size else f"--resolution {resolution}"
    if height % geometry.factor or width % geometry.factor:
        raise ValueError(f"{flag} must be a multiple of the VAE's downsampling factor {geometry.factor} "
                         f"({geometry.rule}, {where})")
    if min(height, width) // geometry.factor < geometry.min_latent_side:
        side = geometry.min_latent_side
        raise ValueError(f"{flag} gives latents below {side}x{side}, the smallest {name} takes ({where}: its "
                         f"reflect padding): give at least {side * geometry.factor} px")
    out = (height // geometry.factor * geometry.decoder_factor, width // geometry.factor * geometry.decoder_factor)
    if out != (resolution, resolution):
        raise ValueError(
            f"the encoder sees {height}x{width} images and the decoder (x{geometry.decoder_factor} from "
            f"x{geometry.factor} latents) returns {out[0]}x{out[1]}, but the loss compares {resolution}x{resolution} "
            "targets (--resolution). With --input_size H W the decoder needs more up blocks than the encoder has "
            "down blocks (up_block_types / up_block_out_channels in --vae_config_file), so that it returns "
            "--resolution.")
