"""FLUX.2's VAE (diffusers' `AutoencoderKLFlux2`, also ERNIE-Image's): ppdiffusers' AutoencoderKL with diffusers'
constructor and config keys, plus `bn`, a BatchNorm over the 2x2-patchified latents that the forward never calls: its
statistics are the latent normalisation (`BatchNormStatistics`), kept or measured at export; its family (family.py)
is AutoencoderKL's but for that. docs/fine-tuning.md has the details.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import paddle
from ppdiffusers import AutoencoderKL
from ppdiffusers.configuration_utils import register_to_config

from .family import Layer, Tensor
from .kl import KLFamily, widths

CLASS_NAME = "AutoencoderKLFlux2"
# Config keys only this class has (diffusers' AutoencoderKL also has mid_block_add_attention).
FLUX2_ONLY_KEYS = ("decoder_block_out_channels", "batch_norm_eps", "batch_norm_momentum", "patch_size")


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


def patchify(latents: paddle.Tensor, patch_size: Sequence[int] = (2, 2)) -> paddle.Tensor:
    """(B, C, H, W) -> (B, C*ph*pw, H/ph, W/pw) in the channel order of diffusers' Flux2Pipeline._patchify_latents."""
    ph, pw = patch_size
    batch, channels, height, width = latents.shape
    patches = latents.reshape([batch, channels, height // ph, ph, width // pw, pw]).transpose([0, 1, 3, 5, 2, 4])
    return patches.reshape([batch, channels * ph * pw, height // ph, width // pw])


@dataclass
class BatchNormStatistics:
    """What `bn` holds: per patchified channel the running mean and (population) variance, and the counter."""

    running_mean: List[float]
    running_var: List[float]
    num_batches_tracked: int

    def record(self, eps: float) -> dict:
        return {"running_mean": self.running_mean, "running_var": self.running_var,
                "num_batches_tracked": self.num_batches_tracked, "batch_norm_eps": eps,
                "normalisation": "(patchify(z) - running_mean) / sqrt(running_var + batch_norm_eps), z the posterior "
                                 "mode, patchify 2x2 (Flux2Pipeline)"}


def bn_statistics(vae: AutoencoderKLFlux2) -> BatchNormStatistics:
    return BatchNormStatistics(vae.bn._mean.astype("float32").numpy().tolist(),
                               vae.bn._variance.astype("float32").numpy().tolist(),
                               int(vae.bn.num_batches_tracked.numpy().reshape(-1)[0]))



class Flux2Family(KLFamily):
    class_name = CLASS_NAME
    network = AutoencoderKLFlux2
    encoder_prefixes = ("encoder.", "quant_conv.", "bn.")  # the bn statistics define the latent's normalisation
    scale_keys = ()  # no scaling_factor: the bn statistics
    scale_name = "latent normalisation"
    held_scale = "bn statistics"

    def owns(self, config: Mapping[str, Any]) -> bool:
        """An AutoencoderKL-shaped config (block_out_channels) with a key of this class's."""
        return "block_out_channels" in config and any(key in config for key in FLUX2_ONLY_KEYS)

    def build(self, config: Mapping[str, Any], where: str) -> Layer:
        """A fresh AutoencoderKLFlux2 whose config also holds (and exports) entries it does not take
        (`force_upcast`)."""
        accepted = set(inspect.signature(AutoencoderKLFlux2.__init__).parameters)
        vae = AutoencoderKLFlux2.from_config({k: v for k, v in config.items() if k in accepted or k.startswith("_")})
        vae.register_to_config(**{k: v for k, v in config.items() if not k.startswith("_") and k not in vae.config})
        return vae

    def normalised_view(self, vae: Layer, posterior) -> Optional[Tensor]:
        return patchify(posterior.mode().astype("float32"), vae.config.patch_size)

    def protocol_items(self, measured_view: bool) -> Tuple[Tuple[str, str], ...]:
        if not measured_view:
            return ()
        return (("patchified latent statistics", "FLUX.2's VAE: per channel of the 2x2-patchified posterior mode "
                 "(Flux2Pipeline's channel order), population mean and variance over all images and positions, what "
                 "its bn statistics hold"),)

    def measured_scale(self, config: Mapping[str, Any], stats) -> Dict[str, Any]:
        if stats.patchified_mode_mean is None:
            raise ValueError("measuring FLUX.2's latent normalisation needs the patchified latents' statistics")
        # num_batches_tracked counts the images (PyTorch's counter; no pipeline reads it)
        return {"bn_statistics": BatchNormStatistics(stats.patchified_mode_mean, stats.patchified_mode_var,
                                                     stats.num_images)}

    def scale_record(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, Any]:
        normalisation = updates.get("bn_statistics") or bn_statistics(vae)
        return {"class": CLASS_NAME, "latent_normalisation": normalisation.record(vae.config.batch_norm_eps)}

    def scale_text(self, record: Mapping[str, Any]) -> str:
        normalisation = record["latent_normalisation"]
        return (f"latent normalisation (bn statistics of {len(normalisation['running_mean'])} patchified channels, "
                f"eps {normalisation['batch_norm_eps']})")

    def measured_record(self, stats) -> Dict[str, Any]:
        return {"statistic": "per patchified channel (2x2 patches of the posterior mode, Flux2Pipeline's order): "
                             "population mean and variance over all images and positions",
                "patchified_mode_mean": stats.patchified_mode_mean, "patchified_mode_var": stats.patchified_mode_var,
                "latent_mean": stats.latent_mean, "latent_std": stats.latent_std}

    def pipeline_normalisation(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        """Flux2Pipeline's (patchify(z) - running_mean) / sqrt(running_var + batch_norm_eps) un-patchified: patchified
        channel c * ph * pw + i * pw + j is channel c at (i, j) of each patch; no scaling_factor applies."""
        ph, pw = vae.config.patch_size
        shape = [vae.config.latent_channels, ph, pw]
        mean = vae.bn._mean.astype("float32").numpy().reshape(shape)
        std = np.sqrt(vae.bn._variance.astype("float32").numpy() + vae.config.batch_norm_eps).reshape(shape)
        return mean, std.astype(np.float32)

    def held_normalisation(self, vae: Layer) -> BatchNormStatistics:
        return bn_statistics(vae)

    def exported_values(self, vae: Layer, posterior_std: float, updates: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        values = super().exported_values(vae, posterior_std, updates)
        statistics = updates.get("bn_statistics")
        if statistics is not None:
            values.update({"bn._mean": np.asarray(statistics.running_mean, np.float32),
                           "bn._variance": np.asarray(statistics.running_var, np.float32),
                           "bn.num_batches_tracked": np.asarray([statistics.num_batches_tracked], np.int64)})
        return values

    def diffusers_problem(self, vae: Layer) -> Optional[str]:
        config = vae.config  # AutoencoderKLFlux2 takes the decoder's widths apart: one per block
        encoder, decoder = widths(vae)
        if len(config.down_block_types) == len(encoder) and len(config.up_block_types) == len(decoder):
            return None
        return (f"PyTorch diffusers' {CLASS_NAME} builds one block per width, and this VAE has {len(encoder)} "
                f"encoder / {len(decoder)} decoder widths for {len(config.down_block_types)} / "
                f"{len(config.up_block_types)} blocks")


FLUX2 = Flux2Family()
