"""The representation autoencoder (diffusers' `AutoencoderRAE`, autoencoder_rae.py) as a family (family.py): a frozen
DINOv2 whose patch tokens are the latent, and a ViT decoder, the only part that trains.

The network takes and returns images on [0, 1]; the trainer's are on [-1, 1], so `encode` / `decode` convert. Its
encode normalises the tokens itself, `(tokens + training noise - latents_mean) / (latents_std + 1e-5) *
scaling_factor`, as diffusers' does: the latent statistics that set latents_mean / latents_std are taken on the
tokens before that (`normalised_view`), per channel and position as RAE's stat.pt (the authors' calculate_stat.py
keeps one mean and variance per element of the (C, h, w) latent), and stored the way diffusers converts stat.pt,
latents_std = sqrt(var + 1e-5). A fine-tune keeps the folder's; a decoder trained from scratch on a downloaded
DINOv2 (`build_fresh` with --rae_encoder_path) gets them measured on the training data at export.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .autoencoder_rae import AutoencoderRAE, encoder_state_from_dinov2
from .family import Deterministic, Family, Geometry, Layer, Tensor, check_config_keys

CLASS_NAME = "AutoencoderRAE"
STAT_EPS = 1e-5  # stat.pt holds variances; diffusers' conversion stores latents_std = sqrt(var + 1e-5)
ENCODER_SIZES = ("encoder_hidden_size", "encoder_patch_size", "encoder_num_hidden_layers")
NORMALISATION = "(tokens - latents_mean) / (latents_std + 1e-5) * scaling_factor, inside encode (diffusers')"
TOKEN_STATISTIC = ("per channel and position of the encoder's tokens (eval mode: no noise) before the latent "
                   "normalisation, population mean and variance over all images, as RAE's stat.pt; latents_std = "
                   f"sqrt(variance + {STAT_EPS}), as diffusers converts stat.pt")


class RAELatent(Deterministic):
    """The normalised latent, and the encoder's tokens it was made of (their statistics are the normalisation's)."""

    def __init__(self, latent: Tensor, tokens: Tensor):
        super().__init__(latent)
        self.tokens = tokens


class RAEFamily(Family):
    class_name = CLASS_NAME
    network = AutoencoderRAE
    deterministic = True
    encoder_never_trains = True
    stats_on_training_data = True  # stat.pt: over ImageNet's training images
    lists_view_statistics = False  # C x h x w numbers (196608 for DINOv2-B): in config.json, not in every record
    scale_keys = ("scaling_factor", "latents_mean", "latents_std")
    scale_name = "latent normalisation (latents_mean / latents_std)"

    def owns(self, config: Mapping[str, Any]) -> bool:
        return "decoder_hidden_size" in config or "encoder_input_size" in config

    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        """The token grid is encoder_input_size / encoder_patch_size whatever the image (the encoder resizes it);
        the decoder returns patch_size x that grid."""
        config = {**self.defaults(), **{k: v for k, v in config.items() if v is not None}}
        grid, patch = int(config["encoder_input_size"]) // int(config["encoder_patch_size"]), int(config["patch_size"])
        return Geometry(patch, patch, int(config["encoder_hidden_size"]), output_size=patch * grid)

    def build(self, config: Mapping[str, Any], where: str) -> Layer:
        check_config_keys(config, self, where)
        if config.get("reshape_to_2d") is False:
            raise ValueError(f"{where}: reshape_to_2d false gives token latents (N, h * w, C), and the trainer trains "
                             "image-shaped latents (N, C, h, w): set it true (as RAE's released decoders have it)")
        try:
            return self.network.from_config(dict(config))
        except ValueError as error:  # the constructor's own checks, which do not name the file
            raise ValueError(f"{where}: {error}") from None

    def build_fresh(self, config: Mapping[str, Any], where: str, encoder_path: Optional[str] = None) -> Layer:
        """A decoder to train from scratch on the DINOv2 of `encoder_path`, whose weights give the encoder's sizes;
        a config stating other sizes is an error naming the key."""
        if not encoder_path:
            raise ValueError(f"{where}: an {CLASS_NAME} trained from scratch needs its frozen encoder's weights: give "
                             "--rae_encoder_path (a transformers Dinov2WithRegistersModel folder, or a timm / "
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
            raise ValueError(f"--rae_encoder_path {encoder_path} lacks {missing[:4]} of {CLASS_NAME}'s encoder")
        vae.set_state_dict({**vae.state_dict(), **state})
        return vae

    def set_training_noise(self, vae: Layer, tau: float) -> None:
        vae.noise_tau = float(tau)  # what encode reads in training mode
        vae.register_to_config(noise_tau=float(tau))  # the export says how its decoder was trained

    # ---- the network
    def encode(self, vae: Layer, images: Tensor) -> RAELatent:
        latent, tokens = vae.encode_with_tokens((images + 1.0) / 2.0)
        return RAELatent(latent, tokens)

    def decode(self, vae: Layer, latents: Tensor) -> Tensor:
        return vae.decode(latents).sample * 2.0 - 1.0

    def decoder_last_layer(self, vae: Layer) -> Tensor:
        return vae.decoder.decoder_pred.weight

    def encoder_last_layer(self, vae: Layer) -> Tensor:
        raise ValueError(f"{CLASS_NAME}'s encoder is frozen: no latent loss trains it")

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """The decoder's transformer layers (not its embedding, norm and decoder_pred, the last layer)."""
        return [(f"decoder.decoder_layers.{i}", layer) for i, layer in enumerate(vae.decoder.decoder_layers)]

    def tiled(self, vae: Layer, tile: int):
        raise ValueError(f"{CLASS_NAME} has no tiled encode / decode (its decoder returns one fixed size)")

    def pipeline_normalisation(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        raise ValueError(f"{CLASS_NAME}: its encode already normalises (latents_mean / latents_std per channel and "
                         "position, times scaling_factor), and its decoder returns one fixed size from patch-14 tokens: "
                         "no tiny autoencoder (a power-of-two factor, output size set by the latent) can stand in")

    def normalised_view(self, vae: Layer, posterior: RAELatent) -> Optional[Tensor]:
        """The tokens, each channel at each position a "channel" of its own: statistics per channel and position."""
        tokens = posterior.tokens.astype("float32")
        return tokens.reshape([tokens.shape[0], -1, 1, 1])

    def protocol_items(self, measured_view: bool) -> Tuple[Tuple[str, str], ...]:
        items = (("latent statistics", f"per channel, of the latents encode returns: {NORMALISATION}"),)
        return items + ((("token statistics", TOKEN_STATISTIC),) if measured_view else ())

    # ---- the latent scale
    def measured_scale(self, config: Mapping[str, Any], stats) -> Dict[str, Any]:
        """latents_mean / latents_std of the measured token statistics; the scaling_factor stays the config's (the
        normalised latents have unit variance)."""
        if stats.patchified_mode_mean is None:
            raise ValueError(f"measuring {CLASS_NAME}'s latent normalisation needs its token statistics")
        shape = token_shape(config)
        mean = np.asarray(stats.patchified_mode_mean, np.float64).reshape(shape)
        variance = np.asarray(stats.patchified_mode_var, np.float64).reshape(shape)
        # float32 values in the config, so that config.json and the weights hold the same numbers
        return {"latents_mean": mean.astype(np.float32).tolist(),
                "latents_std": np.sqrt(variance + STAT_EPS).astype(np.float32).tolist()}

    def scale_record(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, Any]:
        config = {**vae.config, **updates}
        stated = config.get("latents_mean") is not None
        return {"scaling_factor": config.get("scaling_factor"), "latent_normalisation": {
            "latents_mean / latents_std": f"in config.json, shape {list(np.shape(config['latents_mean']))}"
                                          if stated else "unset: encode normalises nothing but the scaling_factor",
            "normalisation": NORMALISATION}}

    def scale_text(self, record: Mapping[str, Any]) -> str:
        return (f"scaling_factor {record['scaling_factor']}, latents_mean / latents_std "
                f"{record['latent_normalisation']['latents_mean / latents_std']}")

    def measured_record(self, stats) -> Dict[str, Any]:
        return {"statistic": TOKEN_STATISTIC, "latent_mean": stats.latent_mean, "latent_std": stats.latent_std}

    def scale_mode_problem(self, vae: Layer, mode) -> Optional[str]:
        if mode == "measure" and vae.config.get("latents_mean") is not None:
            return (f"--scaling_factor measure: this {CLASS_NAME}'s latents_mean / latents_std are those its diffusion "
                    "model was trained with, and its encoder never trains: a fine-tune keeps them (drop it)")
        if mode not in ("keep", "measure") and vae.config.get("latents_mean") is None:
            return (f"--scaling_factor {mode}: this {CLASS_NAME} has no latents_mean / latents_std yet (a decoder "
                    "trained from scratch), which --scaling_factor measure (the default here) measures; its "
                    "scaling_factor is the config's (state it in --vae_config_file)")
        return None

    # ---- the export
    def exported_values(self, vae: Layer, posterior_std: float, updates: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """Measured latents_mean / latents_std (`updates`) as the buffers diffusers' constructor makes of them; the
        other buffers go out as loaded (a folder's encoder_mean / encoder_std, which its config need not state)."""
        return {f"_{key}": np.asarray(updates[key], np.float32) for key in ("latents_mean", "latents_std")
                if key in updates}


def token_shape(config: Mapping[str, Any]) -> List[int]:
    """(C, h, w) of the tokens: the latent's shape."""
    grid = int(config["encoder_input_size"]) // int(config["encoder_patch_size"])
    return [int(config["encoder_hidden_size"]), grid, grid]


RAE = RAEFamily()
