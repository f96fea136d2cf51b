"""The PyTorch side of tests/test_autoencoder_rae.py's DINOv2 checks, run by .venv-flux2's python (torch, transformers
5.24.0, diffusers 0.42.1; requirements-flux2-test.txt), never imported by the Paddle tests.

    python rae_torch_side.py OUTDIR

builds a seeded tiny DINOv2 with registers the way RAE needs one (hidden 64 = one head of 64, 2 layers, patch 14,
image 518, 4 registers; every weight moved off its initialisation) and writes:
    OUTDIR/reg                 its transformers folder (save_pretrained: the files' old module names)
    OUTDIR/reg_timm.safetensors the same weights as a timm state dict (reg4 layout: cls position folded into
                               cls_token, no mask token, fused qkv)
    OUTDIR/plain               a DINOv2 without registers (transformers Dinov2Model folder), which RAE cannot use
    OUTDIR/refs.npz            images (on [0, 1]); rae_latent: diffusers' AutoencoderRAE (encoder_input_size 42)
                               with those encoder weights, encode(images).latent in eval mode; hf_tokens: transformers'
                               last_hidden_state of the same resized, normalised pixels with the final LayerNorm's
                               affine reset (RAE drops it), cls and register tokens removed; resize_* / resized_*:
                               random images and torch's bicubic resize (align_corners=False) of them
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderRAE
from safetensors.torch import save_file
from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel

SIZES = dict(hidden_size=64, num_attention_heads=1, num_hidden_layers=2, patch_size=14, image_size=518)
INPUT_SIZE = 42
RESIZES = [((48, 48), 42), ((40, 40), 42), ((48, 40), 56), ((64, 64), 28), ((32, 32), 224)]
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def build(model_cls, config_cls, seed: int):
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SIZES)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.5 if "position" in name or "lambda" in name else 0.1))
    return model


def to_timm(state: dict) -> dict:
    """transformers 5's in-memory names -> timm's vit_*_reg4_dinov2 layout."""
    out = {"cls_token": state["embeddings.cls_token"] + state["embeddings.position_embeddings"][:, :1],
           "reg_token": state["embeddings.register_tokens"],
           "pos_embed": state["embeddings.position_embeddings"][:, 1:],
           "patch_embed.proj.weight": state["embeddings.patch_embeddings.projection.weight"],
           "patch_embed.proj.bias": state["embeddings.patch_embeddings.projection.bias"],
           "norm.weight": state["layernorm.weight"], "norm.bias": state["layernorm.bias"]}
    for i in range(SIZES["num_hidden_layers"]):
        src, dst = f"encoder.layer.{i}.", f"blocks.{i}."
        for leaf in ("weight", "bias"):
            out[dst + f"attn.qkv.{leaf}"] = torch.cat([state[src + f"attention.{p}_proj.{leaf}"] for p in "qkv"])
            for a, b in (("norm1", "norm1"), ("norm2", "norm2"), ("attention.o_proj", "attn.proj"),
                         ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                out[dst + f"{b}.{leaf}"] = state[src + f"{a}.{leaf}"]
        out[dst + "ls1.gamma"] = state[src + "layer_scale1.lambda1"]
        out[dst + "ls2.gamma"] = state[src + "layer_scale2.lambda1"]
    return {k: v.contiguous() for k, v in out.items()}


def rae_latent(model, images: torch.Tensor) -> np.ndarray:
    rae = AutoencoderRAE(encoder_hidden_size=SIZES["hidden_size"], encoder_patch_size=SIZES["patch_size"],
                         encoder_num_hidden_layers=SIZES["num_hidden_layers"], decoder_hidden_size=32,
                         decoder_num_hidden_layers=1, decoder_num_attention_heads=2, decoder_intermediate_size=64,
                         patch_size=8, encoder_input_size=INPUT_SIZE).eval()
    missing, unexpected = rae.encoder.load_state_dict(model.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == ["layernorm.bias", "layernorm.weight"], (missing, unexpected)
    with torch.no_grad():
        return rae.encode(images).latent.numpy()


def hf_tokens(model, images: torch.Tensor) -> np.ndarray:
    pixels = F.interpolate(images, size=(INPUT_SIZE, INPUT_SIZE), mode="bicubic", align_corners=False)
    with torch.no_grad():
        model.layernorm.weight.fill_(1.0)
        model.layernorm.bias.zero_()
        tokens = model(pixel_values=(pixels - MEAN) / STD).last_hidden_state
    return tokens[:, 1 + model.config.num_register_tokens:].numpy()


def main(out_dir: str) -> None:
    model = build(Dinov2WithRegistersModel, Dinov2WithRegistersConfig, seed=0)
    model.save_pretrained(os.path.join(out_dir, "reg"))
    save_file(to_timm(model.state_dict()), os.path.join(out_dir, "reg_timm.safetensors"))
    build(Dinov2Model, Dinov2Config, seed=1).save_pretrained(os.path.join(out_dir, "plain"))
    torch.manual_seed(1234)
    images = torch.rand(2, 3, 48, 48)
    refs = {"images": images.numpy(), "rae_latent": rae_latent(model, images), "hf_tokens": hf_tokens(model, images)}
    for (h, w), size in RESIZES:  # down, up, non-square, strong down-scaling
        grid = torch.rand(2, 3, h, w)
        refs[f"resize_{h}x{w}_{size}"] = grid.numpy()
        refs[f"resized_{h}x{w}_{size}"] = F.interpolate(grid, size=(size, size), mode="bicubic",
                                                        align_corners=False).numpy()
    np.savez(os.path.join(out_dir, "refs.npz"), **refs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
