"""--expand_to_rgba: a loaded RGB autoencoder grown to RGBA before training, in the source's latent space (what
LayerDiffuse-style work does by hand). The conv that reads the image takes a 4th input channel, alpha, on zero
weights; the conv that writes it gives a 4th output channel, on zero weights and a bias that decodes to alpha +1
(opaque on [-1, 1]). So at step 0 an opaque image has the source's latents and decodes to the source's RGB, plus an
opaque alpha: the grown convs only add exact zeros to their sums (bit for bit where the kernels sum the longer rows
in the same order; to float rounding where they block them otherwise). Where a family's image convs are is its
adapter's (`Family.image_convs`, or its `rgba_refusal`); `grow_conv` grows one. docs/fine-tuning.md, "Expanding an
RGB VAE to RGBA".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import paddle

from .family import Family, Layer

@dataclass(frozen=True)
class ImageConvs:
    """Where the image's channels enter and leave a network (--expand_to_rgba grows them: models/rgba.py): the conv
    that reads them and the one that writes them; how many of a conv's channels one image channel is (p * p beside a
    p x p patchify, 4 before a pixel shuffle; an image channel's are contiguous, in channel order); and the config
    entries of the network grown to RGBA."""

    first: Layer
    last: Layer
    rgba_config: Mapping[str, int]
    first_group: int = 1
    last_group: int = 1


# Each family that expands decodes the last conv's output as the image on [-1, 1], before any clamp: on zero
# weights, a bias of 1 is alpha +1, opaque.
OPAQUE = 1.0
FROM_SCRATCH = ("it grows the loaded weights of an RGB VAE, and a VAE trained from scratch has none: add "
                "--pretrained_model_name_or_path (or --init_from_ckpt), or state in_channels / out_channels 4 in "
                "--vae_config_file")
NOT_RGB = ("it grows an RGB VAE's 3 image channels to 4, and this {family} does not take 3 (its config's in_channels; "
           "Qwen-Image 2.1's VAE is RGBA already): drop it")


# Its flag's parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("expand_to_rgba",), lambda f: f.expand_to_rgba and not f.loads_weights, FROM_SCRATCH),
    (("expand_to_rgba",), lambda f: f.expand_to_rgba and f.geometry.channels != 3, NOT_RGB),
    (("expand_to_rgba",), lambda f: f.expand_to_rgba and f.geometry.rgba_refusal,
     lambda f: f"{f.family.class_name} cannot be grown to RGBA: {f.geometry.rgba_refusal}"),
)


def expand_to_rgba(vae: Layer, family: Family) -> None:
    """Grow `vae` (of `family`) in place from RGB to RGBA (the module docstring); its config then says 4 image
    channels, and so does its family's geometry."""
    convs = family.image_convs(vae)
    grow_conv(convs.first, extra_inputs=convs.first_group)
    grow_conv(convs.last, extra_outputs=convs.last_group, bias=OPAQUE)
    vae.register_to_config(**convs.rgba_config)


def grow_conv(conv: Layer, extra_inputs: int = 0, extra_outputs: int = 0, bias: float = 0.0) -> None:
    """`conv` (a Paddle Conv1D / 2D / 3D, one group) in place with `extra_inputs` input channels and `extra_outputs`
    output channels after its own, on zero weights, the new outputs' bias `bias`: its own outputs are computed from
    its own inputs as before, the new ones are `bias` everywhere. New parameters: build optimizers and EMA after."""
    if not isinstance(conv, (paddle.nn.Conv1D, paddle.nn.Conv2D, paddle.nn.Conv3D)) or conv._groups != 1:
        raise TypeError(f"grow_conv grows a convolution of one group, not {type(conv).__name__}")
    # Zeros after the outputs (axis 0) and the inputs (axis 1); a pad as long as 2 x the dims pads from the first.
    padding = [0, extra_outputs, 0, extra_inputs] + [0, 0] * (conv.weight.ndim - 2)
    conv.weight = _parameter_like(conv.weight, paddle.nn.functional.pad(conv.weight, padding))
    if conv.bias is not None:
        conv.bias = _parameter_like(conv.bias, paddle.nn.functional.pad(conv.bias, [0, extra_outputs], value=bias))
    elif extra_outputs and bias:
        raise ValueError(f"grow_conv: {type(conv).__name__} has no bias to give its new outputs {bias}")
    conv._in_channels += extra_inputs
    conv._out_channels += extra_outputs


def _parameter_like(old: paddle.Tensor, value: paddle.Tensor) -> paddle.Tensor:
    """A parameter holding `value`, trainable as `old` was."""
    param = paddle.create_parameter(value.shape, value.dtype,
                                    default_initializer=paddle.nn.initializer.Assign(value.detach()))
    param.stop_gradient = old.stop_gradient
    return param
