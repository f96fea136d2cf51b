"""Test helpers for the PyTorch side (torch + diffusers are test-only dependencies, requirements-test.txt):
tiny PyTorch diffusers AutoencoderKLs with seeded non-default weights, the original LDM single-file layout,
and reconstructions of real photos in both frameworks."""

from __future__ import annotations

import re

import numpy as np
import paddle
from conftest import import_test_extra

# A micro VAE (like configs/vae_micro.json) with SDXL's scaling factor, so that "kept" is not the default.
MICRO = dict(block_out_channels=[8, 16], down_block_types=["DownEncoderBlock2D"] * 2,
             up_block_types=["UpDecoderBlock2D"] * 2, layers_per_block=1, latent_channels=4, norm_num_groups=8,
             sample_size=32, scaling_factor=0.13025, force_upcast=False)
# SD's GroupNorm of 32 groups: the config a single file without config is assumed to have.
SD_LIKE = dict(MICRO, block_out_channels=[32, 32], norm_num_groups=32, scaling_factor=0.18215)


def diffusers():
    return import_test_extra("diffusers", reason="PyTorch diffusers is a test dependency (requirements-test.txt)")


def make_torch_vae(config: dict = MICRO, seed: int = 0):
    """A diffusers AutoencoderKL whose every weight is moved away from its initialisation (seeded)."""
    autoencoder = diffusers().AutoencoderKL  # skips the test when the PyTorch side is not installed
    # diffusers' save_pretrained calls safetensors.torch.save_file after importing only `safetensors`: the
    # submodule is there only if something else (e.g. ppdiffusers) imported it first.
    import safetensors.torch  # noqa: F401
    import torch

    torch.manual_seed(seed)
    vae = autoencoder(**config)
    with torch.no_grad():
        for param in vae.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return vae.eval()


def photos(size: int = 32, count: int = 3) -> np.ndarray:
    """Real photos (scikit-image) as float32 NCHW in [-1, 1]."""
    from skimage import data
    from skimage.transform import resize

    images = [resize(getattr(data, name)(), (size, size), anti_aliasing=True)
              for name in ("astronaut", "chelsea", "coffee", "rocket")[:count]]
    return (np.stack(images).transpose(0, 3, 1, 2) * 2 - 1).astype(np.float32)


def torch_reconstruct(vae, images: np.ndarray) -> np.ndarray:
    """Decode of the posterior mode (no sampling)."""
    import torch

    with torch.no_grad():
        return vae(torch.from_numpy(images), sample_posterior=False).sample.numpy()


def paddle_reconstruct(vae, images: np.ndarray) -> np.ndarray:
    vae.eval()
    with paddle.no_grad():
        return vae(paddle.to_tensor(images), sample_posterior=False).sample.numpy()


def diffusers_to_ldm(state: dict, num_up_blocks: int) -> dict:
    """A diffusers VAE state dict (torch layout) under the original LDM/SD names and shapes (what
    vae-ft-mse-840000-ema-pruned.safetensors holds). Checked in the tests by diffusers' own single-file loader."""
    out = {}
    for key, value in state.items():
        new = key
        for side in ("encoder", "decoder"):
            new = new.replace(f"{side}.conv_norm_out", f"{side}.norm_out")
            new = new.replace(f"{side}.mid_block.resnets.0", f"{side}.mid.block_1")
            new = new.replace(f"{side}.mid_block.resnets.1", f"{side}.mid.block_2")
            new = new.replace(f"{side}.mid_block.attentions.0", f"{side}.mid.attn_1")
        new = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets", r"encoder.down.\1.block", new)
        new = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0", r"encoder.down.\1.downsample", new)
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets",
                     lambda m: f"decoder.up.{num_up_blocks - 1 - int(m.group(1))}.block", new)
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0",
                     lambda m: f"decoder.up.{num_up_blocks - 1 - int(m.group(1))}.upsample", new)
        new = new.replace("conv_shortcut", "nin_shortcut")
        if ".mid.attn_1." in new:  # LDM's attention projections are 1x1 convolutions
            new = (new.replace("group_norm", "norm").replace("to_q", "q").replace("to_k", "k")
                   .replace("to_v", "v").replace("to_out.0", "proj_out"))
            if value.ndim == 2:
                value = value[:, :, None, None]
        out[new] = value.contiguous()
    return out
