"""What training does to any autoencoder through its family (family.py): its input (--input_size), the size check
of what it returns, and --recompute (docs/training.md "Memory")."""

from __future__ import annotations

import logging
from typing import List, Mapping, Optional, Sequence

import paddle
from paddle.distributed.fleet.utils import recompute

from .families import family_for_config, family_of

# Paddle's recompute warns when no input of a segment needs a gradient: true of its reentrant form, not of the
# non-reentrant one used here, which recomputes a segment whose own parameters train (a clip's first encoder chunk).
logging.getLogger("paddle.distributed.fleet.utils.log_util").addFilter(
    lambda record: "None of the inputs to current recompute block need grad" not in record.getMessage())


def encoder_input(images: paddle.Tensor, input_size: Optional[Sequence[int]]) -> paddle.Tensor:
    """The images, or with --input_size H W the images bilinearly resized to HxW."""
    if input_size is None:
        return images
    return paddle.nn.functional.interpolate(images, size=list(input_size), mode="bilinear", align_corners=False)


def check_reconstruction_shape(config: Mapping, input_size: Optional[Sequence[int]], resolution: int,
                               where: str = "the VAE's config") -> None:
    """The decoder must give back `resolution` from what the encoder sees (`input_size`, default the image)."""
    family = family_for_config(config, where)
    geometry = family.geometry(config)
    if geometry.output_size is not None:  # it resizes its input itself
        if input_size:
            raise ValueError(f"--input_size: {family.class_name} resizes its input itself ({where}); drop it")
        if resolution != geometry.output_size:
            raise ValueError(f"{family.class_name} decodes {geometry.output_size}x{geometry.output_size} images "
                             f"whatever its input ({where}), and the loss compares --resolution {resolution}: use "
                             f"--resolution {geometry.output_size}")
        return
    encoder_factor, decoder_factor = geometry.factor, geometry.decoder_factor
    height, width = input_size or (resolution, resolution)
    if height % encoder_factor or width % encoder_factor:
        flag = f"--input_size {height} {width}" if input_size else f"--resolution {resolution}"
        raise ValueError(f"{flag} must be a multiple of the VAE's downsampling factor {encoder_factor} "
                         f"({geometry.rule}, {where})")
    out = (height // encoder_factor * decoder_factor, width // encoder_factor * decoder_factor)
    if out != (resolution, resolution):
        raise ValueError(
            f"the encoder sees {height}x{width} images and the decoder (x{decoder_factor} from x{encoder_factor} "
            f"latents) returns {out[0]}x{out[1]}, but the loss compares {resolution}x{resolution} targets "
            "(--resolution). With --input_size H W the decoder needs more up blocks than the encoder has down "
            "blocks (up_block_types / up_block_out_channels in --vae_config_file), so that it returns --resolution.")


class RecomputedForward:
    """A segment's forward under Paddle's non-reentrant `recompute` when a graph is being built (an input or one of
    its parameters needs a gradient); `calls` counts them. A segment called while another one runs (a block inside
    a video family's clip chunk) runs as it is: the outer re-run covers it."""

    running = False  # a recomputed forward is under way (first run or re-run)

    def __init__(self, forward, parameters):
        self.forward = forward
        self.parameters = parameters
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if RecomputedForward.running or not self._builds_graph(args):
            return self.forward(*args, **kwargs)  # also evaluation, a frozen encoder: nothing to keep for a backward
        self.calls += 1
        return recompute(self._outermost, *args, use_reentrant=False, **kwargs)

    def _builds_graph(self, args) -> bool:
        return paddle.is_grad_enabled() and (
            any(isinstance(a, paddle.Tensor) and not a.stop_gradient for a in args)
            or any(not p.stop_gradient for p in self.parameters()))

    def _outermost(self, *args, **kwargs):
        RecomputedForward.running = True
        try:
            return self.forward(*args, **kwargs)
        finally:
            RecomputedForward.running = False


def enable_recompute(vae: paddle.nn.Layer) -> List[str]:
    """--recompute: each of the family's `recompute_segments` recomputed in the backward (its forward replaced on the
    instance); returns their names. ppdiffusers' block-level checkpointing stays off (nested, segments would run
    twice)."""
    family, names = family_of(vae), []
    segments = family.recompute_segments(vae)
    if not segments:
        raise ValueError(f"--recompute: {family.class_name} has no recompute segments here; drop --recompute")
    for name, layer in segments:
        if not isinstance(layer.__dict__.get("forward"), RecomputedForward):
            layer.forward = RecomputedForward(layer.forward, layer.parameters)
        names.append(name)
    return names
