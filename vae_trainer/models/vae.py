"""The parts of the ppdiffusers AutoencoderKL that training and export touch.

Owns: `decoder_last_layer` (adaptive GAN weight), `encoder_parameters` (--freeze_encoder),
`posterior_layer` (the --posterior_std export fix), and `encoder_input` / `check_reconstruction_size`
(--input_size, --resolution). Building and loading the VAE is `vae_loading.py`, saving it `vae_saving.py`.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence

import paddle
from ppdiffusers import AutoencoderKL


def posterior_layer(vae: AutoencoderKL) -> paddle.nn.Layer:
    """The conv whose output channels [C:2C] are the posterior's log-variance: quant_conv, or the encoder's
    conv_out in VAEs without quant_conv (FLUX)."""
    return vae.quant_conv if vae.quant_conv is not None else vae.encoder.conv_out


def decoder_last_layer(vae: AutoencoderKL) -> paddle.Tensor:
    """Weight of decoder.conv_out: the layer the adaptive GAN weight compares gradient norms at."""
    return vae.decoder.conv_out.weight


def encoder_parameters(vae: AutoencoderKL) -> List[paddle.Tensor]:
    """What --freeze_encoder freezes: the encoder and quant_conv, i.e. everything that defines the latents."""
    params = list(vae.encoder.parameters())
    if vae.quant_conv is not None:
        params += list(vae.quant_conv.parameters())
    return params


def encoder_input(images: paddle.Tensor, input_size: Optional[Sequence[int]]) -> paddle.Tensor:
    """What the encoder sees: the images, or with --input_size H W the images bilinearly resized to HxW
    (as the reference trainer's --input_size: F.interpolate, bilinear, align_corners False)."""
    if input_size is None:
        return images
    return paddle.nn.functional.interpolate(images, size=list(input_size), mode="bilinear", align_corners=False)


def check_reconstruction_size(vae: AutoencoderKL, input_size: Optional[Sequence[int]], resolution: int) -> None:
    """The decoder must give back `resolution` from what the encoder sees (`input_size`, default the image)."""
    check_reconstruction_shape(vae.config, input_size, resolution)


def check_reconstruction_shape(config: Mapping, input_size: Optional[Sequence[int]], resolution: int,
                               where: str = "the VAE's config") -> None:
    """`check_reconstruction_size` from an AutoencoderKL config (its block lists), before the VAE is built
    (flag_checks.py): the encoder input is a multiple of its downsampling factor 2 ** (down blocks - 1), and
    the decoder returns `resolution` from it."""
    encoder_factor = 2 ** (len(config["down_block_types"]) - 1)
    decoder_factor = 2 ** (len(config["up_block_types"]) - 1)
    height, width = input_size or (resolution, resolution)
    if height % encoder_factor or width % encoder_factor:
        flag = f"--input_size {height} {width}" if input_size else f"--resolution {resolution}"
        raise ValueError(f"{flag} must be a multiple of the VAE's downsampling factor {encoder_factor} "
                         f"(2 ** (down blocks - 1), {where})")
    out = (height // encoder_factor * decoder_factor, width // encoder_factor * decoder_factor)
    if out != (resolution, resolution):
        raise ValueError(
            f"the encoder sees {height}x{width} images and the decoder (x{decoder_factor} from x{encoder_factor} "
            f"latents) returns {out[0]}x{out[1]}, but the loss compares {resolution}x{resolution} targets "
            "(--resolution). With --input_size H W the decoder needs more up blocks than the encoder has down "
            "blocks (up_block_types / up_block_out_channels in --vae_config_file), so that it returns --resolution.")
