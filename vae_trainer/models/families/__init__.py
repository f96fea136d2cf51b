"""The autoencoder families the trainer trains, one adapter file each (models/family.py says what an adapter
implements), listed by the `_class_name` their config.json persists: adding a family is its file and one entry in
FAMILIES. Also what every caller asks of any network through its family: its encoder's layers and weights, its image
channels and its geometry's size check."""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

from ..family import Family, Layer, Tensor, encoder_layers
from .dc_ae import DC_AE
from .flux2 import FLUX2
from .hunyuanvideo15 import HUNYUAN_VIDEO15
from .kl import KL
from .ltx2 import LTX2
from .qwenimage21 import QWEN_IMAGE21
from .rae import RAE
from .tiny import TINY
from .wan import QWEN_IMAGE, WAN

# A config without `_class_name` goes to the first family that owns its keys; KL owns any, so it comes last;
# TINY's keys include DC-AE's encoder_block_out_channels, so it comes before DC_AE; QWEN_IMAGE21's are WAN's;
# LTX2's include FLUX2's patch_size and block_out_channels, so it comes before FLUX2. A network's family is the first
# whose class it is an instance of, so a class comes before the one it derives from (FLUX2 before KL).
FAMILIES = (TINY, QWEN_IMAGE, QWEN_IMAGE21, WAN, DC_AE, LTX2, FLUX2, RAE, HUNYUAN_VIDEO15, KL)


def trained_classes() -> str:
    return ", ".join(family.class_name for family in FAMILIES)


def family_of(vae: Layer) -> Family:
    """The family of a network: of its class or the class it derives from, else (a stand-in) of its config."""
    for family in FAMILIES:
        if isinstance(vae, family.network):
            return family
    if hasattr(vae, "config"):
        return family_for_config(vae.config)
    raise TypeError(f"{type(vae).__name__} is not an autoencoder class this trainer trains ({trained_classes()})")


def family_for_config(config: Mapping[str, Any], where: str = "the VAE's config") -> Family:
    """The family of a config: by its `_class_name`, else by its keys; an unknown class is one error naming it."""
    name = config.get("_class_name")
    if name is None:
        return next(family for family in FAMILIES if family.owns(config))
    for family in FAMILIES:
        if family.class_name == name:
            return family
    raise ValueError(f"{where}: its \"_class_name\" is {name}, a class this trainer does not train (yet); it trains "
                     f"{trained_classes()}")


def encoder_parameters(vae: Layer) -> List[Tensor]:
    """The weights that define the latent: those of the family's `encoder_prefixes` layers."""
    return [param for layer in encoder_layers(family_of(vae), vae) for param in layer.parameters()]


def image_channels(vae: Layer) -> int:
    """The image channels `vae` takes and gives, as its family's geometry says (4: RGBA, 3: RGB)."""
    return family_of(vae).geometry(vae.config).channels


def check_reconstruction_shape(config: Mapping[str, Any], input_size: Optional[Sequence[int]], resolution: int,
                               where: str = "the VAE's config") -> None:
    """The decoder must give back `resolution` from what the encoder sees (`input_size`, default the image)."""
    family = family_for_config(config, where)
    family.geometry(config).check_reconstruction(input_size, resolution, where, family.class_name)
