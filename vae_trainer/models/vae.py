"""The ppdiffusers AutoencoderKL being trained: building it, saving it, and its GAN-weight layer.

Owns: `build_vae` (from a JSON of AutoencoderKL init kwargs, i.e. a checkpoint's `vae/config.json`,
or from a LOCAL pretrained folder; never from a hub), `save_vae` (save_pretrained after config
updates such as scaling_factor/shift_factor) and `decoder_last_layer` (the weight the adaptive GAN
weight differentiates against). Ready-made configs live in `configs/*.json`.
"""

from __future__ import annotations

import os

import paddle
from ppdiffusers import AutoencoderKL
from ppdiffusers.utils import is_safetensors_available


def build_vae(
    vae_config_file: str | None = None,
    pretrained_model_name_or_path: str | None = None,
    subfolder: str | None = None,
) -> AutoencoderKL:
    """A fresh AutoencoderKL from a config file, or a pretrained one from a local folder (exactly one)."""
    if (vae_config_file is None) == (pretrained_model_name_or_path is None):
        raise ValueError(
            "Give exactly one VAE source: vae_config_file (a JSON of AutoencoderKL kwargs, e.g. "
            "configs/vae_tiny.json) or pretrained_model_name_or_path (a local folder); got "
            f"vae_config_file={vae_config_file!r}, pretrained_model_name_or_path={pretrained_model_name_or_path!r}"
        )
    if vae_config_file is not None:
        return _vae_from_config_file(vae_config_file)
    return _vae_from_local_folder(pretrained_model_name_or_path, subfolder)


def _vae_from_config_file(config_file: str) -> AutoencoderKL:
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"VAE config file {config_file} does not exist")
    return AutoencoderKL.from_config(AutoencoderKL.load_config(config_file))


def _vae_from_local_folder(folder: str, subfolder: str | None) -> AutoencoderKL:
    model_dir = os.path.join(folder, subfolder) if subfolder else folder
    config_path = os.path.join(model_dir, AutoencoderKL.config_name)
    # Checked here because ppdiffusers would treat a missing folder as a hub id and download it.
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"No pretrained VAE at {config_path}: pretrained_model_name_or_path must be a local folder "
            "(with subfolder, e.g. 'vae', when the VAE sits inside a pipeline checkpoint); "
            "nothing is downloaded."
        )
    return AutoencoderKL.from_pretrained(folder, subfolder=subfolder or "", local_files_only=True)


def decoder_last_layer(vae: AutoencoderKL) -> paddle.Tensor:
    """Weight of decoder.conv_out: the layer the adaptive GAN weight compares gradient norms at."""
    return vae.decoder.conv_out.weight


def save_vae(vae: AutoencoderKL, out_dir: str, **config_updates) -> None:
    """save_pretrained into out_dir (safetensors when available) after updating config entries."""
    if config_updates:
        vae.register_to_config(**config_updates)
    vae.save_pretrained(out_dir, safe_serialization=is_safetensors_available())
