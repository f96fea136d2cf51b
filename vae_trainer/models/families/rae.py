"""The representation autoencoder (diffusers' `AutoencoderRAE`, autoencoder_rae.py) as a family (family.py): a frozen
DINOv2 whose patch tokens are the latent, and a ViT decoder, the only part that trains.

The network takes and returns images on [0, 1]; the trainer's are on [-1, 1], so `encode` / `decode` convert. Its
encode normalises the tokens itself (latent_normalisation.PerPosition: per channel and position, as RAE's stat.pt):
the posterior's `raw` holds the tokens before it, whose statistics set latents_mean / latents_std. A fine-tune keeps
the folder's; a decoder trained from scratch on a downloaded DINOv2 (`build` with `fresh` and --rae_encoder_path)
gets them measured on the training data at export.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

from ..autoencoder_rae import AutoencoderRAE, encoder_state_from_dinov2
from ..family import Deterministic, Family, Geometry, Layer, Tensor, check_config_keys, constructor_defaults
from ..latent_normalisation import PerPosition

RGB_TOKENS = ("its latent is a frozen DINOv2's tokens of RGB (normalised by ImageNet's three means and stds): "
              "an alpha channel has no way into that representation")


class RAEFamily(Family):
    network = AutoencoderRAE
    normalisation = PerPosition()
    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        """The token grid is encoder_input_size / encoder_patch_size whatever the image (the encoder resizes it);
        the decoder returns patch_size x that grid."""
        config = {**constructor_defaults(self), **{k: v for k, v in config.items() if v is not None}}
        grid, patch = int(config["encoder_input_size"]) // int(config["encoder_patch_size"]), int(config["patch_size"])
        return Geometry(patch, patch, int(config["encoder_hidden_size"]), output_size=patch * grid, deterministic=True,
                        encoder_trains=False, rgba_refusal=RGB_TOKENS)

    def build(self, config: Mapping[str, Any], where: str, fresh: bool = False,
              encoder_path: Optional[str] = None) -> Layer:
        """Fresh: a decoder to train from scratch on the DINOv2 of `encoder_path`, whose weights give the encoder's
        sizes; a config stating other sizes is an error naming the key."""
        if not fresh:  # else a fresh decoder on the frozen DINOv2 weights of `encoder_path`
            check_config_keys(config, self, where)
            if config.get("reshape_to_2d") is False:
                raise ValueError(f"{where}: reshape_to_2d false gives token latents (N, h * w, C), and the trainer "
                                 "trains image-shaped latents (N, C, h, w): set it true (as RAE's released decoders "
                                 "have it)")
            try:
                return self.network.from_config(dict(config))
            except ValueError as error:  # the constructor's own checks, which do not name the file
                raise ValueError(f"{where}: {error}") from None
        if not encoder_path:
            raise ValueError(f"{where}: an {self.class_name} trained from scratch needs its frozen encoder's weights: "
                             "give --rae_encoder_path (a transformers Dinov2WithRegistersModel folder, or a timm / "
                             "torch-hub DINOv2-with-registers file)")
        if config.get("encoder_type", "dinov2") != "dinov2":
            raise ValueError(f"{where}: encoder_type {config['encoder_type']!r}, but --rae_encoder_path reads a DINOv2")
        state, sizes = encoder_state_from_dinov2(encoder_path)
        for key, value in sizes.items():
            if key in config and int(config[key]) != value:
                raise ValueError(f"{where}: {key} {config[key]} contradicts --rae_encoder_path {encoder_path}, whose "
                                 f"weights have {key} {value}: drop the key (the weights give it)")
        vae = self.build({**config, **sizes}, where)
        missing = sorted(k for k in vae.state_dict() if k.startswith("encoder.") and k not in state)
        if missing:
            raise ValueError(f"--rae_encoder_path {encoder_path} lacks {missing[:4]} of {self.class_name}'s encoder")
        vae.set_state_dict({**vae.state_dict(), **state})
        return vae

    # ---- the network
    def encode(self, vae: Layer, images: Tensor) -> Deterministic:
        latent, tokens = vae.encode_with_tokens((images + 1.0) / 2.0)
        return Deterministic(latent, raw=tokens)

    def decode(self, vae: Layer, latents: Tensor) -> Tensor:
        return vae.decode(latents).sample * 2.0 - 1.0

    def last_layers(self, vae: Layer) -> Tuple[Tensor, Optional[Tensor]]:
        return vae.decoder.decoder_pred.weight, None  # the encoder is frozen: no latent loss trains it

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """The decoder's transformer layers (not its embedding, norm and decoder_pred, the last layer)."""
        return [(f"decoder.decoder_layers.{i}", layer) for i, layer in enumerate(vae.decoder.decoder_layers)]


RAE = RAEFamily()
