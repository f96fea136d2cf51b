"""The parts of the ppdiffusers AutoencoderKL that training touches: the adaptive GAN weight's layer, the encoder's
parameters (--freeze_encoder), its input (--input_size) and --recompute (docs/training.md "Memory").
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence

import paddle
from paddle.distributed.fleet.utils import recompute
from ppdiffusers import AutoencoderKL


def decoder_last_layer(vae: AutoencoderKL) -> paddle.Tensor:
    return vae.decoder.conv_out.weight


def encoder_parameters(vae: AutoencoderKL) -> List[paddle.Tensor]:
    """What --freeze_encoder freezes: everything that defines the latents."""
    params = list(vae.encoder.parameters())
    if vae.quant_conv is not None:
        params += list(vae.quant_conv.parameters())
    return params


def encoder_input(images: paddle.Tensor, input_size: Optional[Sequence[int]]) -> paddle.Tensor:
    """The images, or with --input_size H W the images bilinearly resized to HxW."""
    if input_size is None:
        return images
    return paddle.nn.functional.interpolate(images, size=list(input_size), mode="bilinear", align_corners=False)


def check_reconstruction_shape(config: Mapping, input_size: Optional[Sequence[int]], resolution: int,
                               where: str = "the VAE's config") -> None:
    """The decoder must give back `resolution` from what the encoder sees (`input_size`, default the image)."""
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


class RecomputedForward:
    """A layer's forward under Paddle's non-reentrant `recompute` when a graph is being built; `calls` counts them."""

    def __init__(self, forward):
        self.forward = forward
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if paddle.is_grad_enabled() and any(isinstance(a, paddle.Tensor) and not a.stop_gradient for a in args):
            self.calls += 1
            return recompute(self.forward, *args, use_reentrant=False, **kwargs)
        return self.forward(*args, **kwargs)  # evaluation, a frozen encoder: nothing to keep for a backward


def recompute_segments(vae: AutoencoderKL) -> List[tuple]:
    """(name, layer) of every resnet, attention, down- and upsampler of the encoder's and decoder's blocks (not the
    convs in and out, so that the adaptive GAN weight's gradient never enters a segment)."""
    out = []
    for coder_name, blocks in (("encoder", "down_blocks"), ("decoder", "up_blocks")):
        coder = getattr(vae, coder_name)
        named_blocks = [(f"{blocks}.{i}", block) for i, block in enumerate(getattr(coder, blocks))]
        for block_name, block in named_blocks + [("mid_block", coder.mid_block)]:
            for kind in ("resnets", "attentions", "downsamplers", "upsamplers"):
                for i, layer in enumerate(getattr(block, kind, None) or []):
                    if layer is not None:
                        out.append((f"{coder_name}.{block_name}.{kind}.{i}", layer))
    return out


def enable_recompute(vae: AutoencoderKL) -> List[str]:
    """--recompute: each of `recompute_segments` recomputed in the backward (its forward replaced on the instance);
    returns their names. ppdiffusers' block-level checkpointing stays off (nested, segments would run twice)."""
    names = []
    for name, layer in recompute_segments(vae):
        if not isinstance(layer.__dict__.get("forward"), RecomputedForward):
            layer.forward = RecomputedForward(layer.forward)
        names.append(name)
    return names

