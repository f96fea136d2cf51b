"""FLUX.2's VAE in Paddle: diffusers' `AutoencoderKLFlux2` (0.42.1; also ERNIE-Image's), ppdiffusers' AutoencoderKL
with diffusers' constructor and config keys, plus `bn`, a BatchNorm over the 2x2-patchified latents that the forward
never calls: its statistics are the latent normalisation (families/flux2.py says how the trainer reads them).
"""

from __future__ import annotations

import math
from typing import Sequence

import paddle
from ppdiffusers import AutoencoderKL
from ppdiffusers.configuration_utils import register_to_config


class AutoencoderKLFlux2(AutoencoderKL):
    """diffusers' AutoencoderKLFlux2 (0.42.1): same parameters, same config keys."""

    @register_to_config
    def __init__(self, in_channels: int = 3, out_channels: int = 3,
                 down_block_types: Sequence[str] = ("DownEncoderBlock2D",) * 4,
                 up_block_types: Sequence[str] = ("UpDecoderBlock2D",) * 4,
                 block_out_channels: Sequence[int] = (128, 256, 512, 512),
                 decoder_block_out_channels: Sequence[int] | None = None, layers_per_block: int = 2,
                 act_fn: str = "silu", latent_channels: int = 32, norm_num_groups: int = 32, sample_size: int = 1024,
                 use_quant_conv: bool = True, use_post_quant_conv: bool = True, mid_block_add_attention: bool = True,
                 batch_norm_eps: float = 1e-4, batch_norm_momentum: float = 0.1, patch_size: Sequence[int] = (2, 2)):
        if not mid_block_add_attention:
            raise ValueError("mid_block_add_attention false: ppdiffusers 0.29's AutoencoderKL always has the mid-block "
                             "attention, so this VAE cannot be built here")
        # The parent's undecorated constructor: this class's config is diffusers' (the decorator above registers it).
        AutoencoderKL.__init__.__wrapped__(
            self, in_channels=in_channels, out_channels=out_channels, down_block_types=tuple(down_block_types),
            down_block_out_channels=tuple(block_out_channels), up_block_types=tuple(up_block_types),
            up_block_out_channels=tuple(decoder_block_out_channels or block_out_channels),
            block_out_channels=tuple(block_out_channels), layers_per_block=layers_per_block, act_fn=act_fn,
            latent_channels=latent_channels, norm_num_groups=norm_num_groups, sample_size=sample_size,
            use_quant_conv=use_quant_conv, use_post_quant_conv=use_post_quant_conv)
        # That constructor states the decoder's widths as block_out_channels; diffusers' key is the encoder's.
        self.register_to_config(block_out_channels=list(block_out_channels))
        # Paddle's momentum weighs the running value, PyTorch's the batch. Never used: the statistics are set.
        self.bn = paddle.nn.BatchNorm2D(math.prod(patch_size) * latent_channels, momentum=1.0 - batch_norm_momentum,
                                        epsilon=batch_norm_eps, weight_attr=False, bias_attr=False)
        # [1], not PyTorch's 0-d: ppdiffusers saves a 0-d tensor as [1] (the PyTorch export is 0-d: vae_saving.py).
        self.bn.register_buffer("num_batches_tracked", paddle.zeros([1], dtype="int64"))
