"""The PyTorch side of the DINOv2 tests (tests/test_dinov2.py), run by .venv-flux2's python (torch, transformers
5.24.0; requirements-flux2-test.txt), never imported by the Paddle tests.

    python dinov2_torch_side.py OUTDIR

builds seeded tiny DINOv2s with transformers (every weight moved away from its initialisation), saves them as
transformers folders (save_pretrained; one as pytorch_model.bin of its state_dict) and, renamed, as timm /
torch-hub state dicts (.safetensors, torch.save .pth), and writes OUTDIR/refs.npz: the input images
and each model's tokens after the final norm (last_hidden_state), plus torch's bicubic resizes of a random grid
(the three position-embedding conventions). timm itself cannot run here (it needs torchvision); its and the hub's
position resizing are re-implemented below from their code (timm's `resample_abs_pos_embed`, the hub's
`interpolate_pos_encoding`) and swapped into transformers' embeddings for those references.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel
from transformers.models.dinov2.modeling_dinov2 import Dinov2Embeddings

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
ODD = (154, 182)  # 11 x 13 patches: the 16 x 16 stored grid is resized
# name -> (class, config kwargs); the "w128" models have head dim 64, so heads are inferred from timm / hub files.
MODELS = {
    "plain": (Dinov2Model, Dinov2Config, dict(hidden_size=48, num_attention_heads=3)),
    "reg": (Dinov2WithRegistersModel, Dinov2WithRegistersConfig, dict(hidden_size=48, num_attention_heads=3, num_register_tokens=4)),
    "swiglu": (Dinov2Model, Dinov2Config, dict(hidden_size=48, num_attention_heads=3, use_swiglu_ffn=True)),
    "w128": (Dinov2Model, Dinov2Config, dict(hidden_size=128, num_attention_heads=2)),
    "w128reg": (Dinov2WithRegistersModel, Dinov2WithRegistersConfig, dict(hidden_size=128, num_attention_heads=2, num_register_tokens=4)),
}


def build(cls, config_cls, kwargs, seed):
    torch.manual_seed(seed)
    model = cls(config_cls(num_hidden_layers=2, patch_size=14, image_size=224, **kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.5 if "position" in name or "lambda" in name else 0.1))
    return model


def to_timm(state: dict, hub: bool) -> dict:
    """transformers' key names -> timm's (hub=False: reg4 layout with the cls position folded in) or the hub's."""
    out = {}
    for key, value in state.items():
        key = (key.replace("embeddings.patch_embeddings.projection", "patch_embed.proj").replace("embeddings.", "")
               .replace("position_embeddings", "pos_embed").replace("encoder.layer.", "blocks.")
               .replace("attention.output.dense", "attn.proj").replace("layer_scale1.lambda1", "ls1.gamma")
               .replace("layer_scale2.lambda1", "ls2.gamma").replace("mlp.weights_in", "mlp.w12" if hub else "mlp.fc1")
               .replace("mlp.weights_out", "mlp.w3" if hub else "mlp.fc2").replace("layernorm.", "norm."))
        out[key] = value
    for key in [k for k in out if "attention.attention.query" in k]:
        parts = [out.pop(key.replace("query", x)) for x in ("query", "key", "value")]
        out[key.replace("attention.attention.query", "attn.qkv")] = torch.cat(parts)
    if not hub:
        out.pop("mask_token")
        if "register_tokens" in out:  # timm's no_embed_class layout, as its checkpoint_filter_fn converts the hub's
            out["reg_token"] = out.pop("register_tokens")
            out["cls_token"] = out["cls_token"] + out["pos_embed"][:, :1]
            out["pos_embed"] = out["pos_embed"][:, 1:]
    return {k: v.contiguous() for k, v in out.items()}


def timm_positions(self, embeddings, height, width):
    """timm's resample_abs_pos_embed (bicubic, antialias=True, size=grid) on transformers' embeddings."""
    pos, (h, w) = self.position_embeddings, (height // 14, width // 14)
    if embeddings.shape[1] - 1 == pos.shape[1] - 1 and h == w:
        return pos
    g = math.isqrt(pos.shape[1] - 1)
    grid = F.interpolate(pos[:, 1:].reshape(1, g, g, -1).permute(0, 3, 1, 2).float(), size=(h, w), mode="bicubic", antialias=True)
    return torch.cat([pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, h * w, -1)], dim=1)


def hub_positions(self, embeddings, height, width):
    """facebookresearch/dinov2's interpolate_pos_encoding (interpolate_offset 0.1, antialias False)."""
    pos, (h, w) = self.position_embeddings, (height // 14, width // 14)
    if embeddings.shape[1] == pos.shape[1] and height == width:
        return pos
    g = math.isqrt(pos.shape[1] - 1)
    grid = F.interpolate(pos[:, 1:].reshape(1, g, g, -1).permute(0, 3, 1, 2).float(), mode="bicubic",
                         scale_factor=((h + 0.1) / g, (w + 0.1) / g), antialias=False)
    assert grid.shape[-2:] == (h, w)
    return torch.cat([pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, h * w, -1)], dim=1)


def tokens(model, images):
    with torch.no_grad():
        return model(pixel_values=((images + 1) / 2 - MEAN) / STD).last_hidden_state.numpy()


def main(out_dir: str) -> None:
    torch.manual_seed(1234)
    images = {"224": torch.rand(2, 3, 224, 224) * 2 - 1, "odd": torch.rand(2, 3, *ODD) * 2 - 1,
              "256": torch.rand(2, 3, 256, 256) * 2 - 1}
    refs = {f"images_{k}": v.numpy() for k, v in images.items()}
    for seed, (name, (cls, config_cls, kwargs)) in enumerate(MODELS.items()):
        model = build(cls, config_cls, kwargs, seed)
        model.save_pretrained(os.path.join(out_dir, name))
        resized = F.interpolate(images["256"], size=(224, 224), mode="bilinear", align_corners=False)
        refs.update({f"{name}_224": tokens(model, images["224"]), f"{name}_odd": tokens(model, images["odd"]),
                     f"{name}_256": tokens(model, resized)})
        if name == "swiglu":  # a pytorch_model.bin folder with transformers 5's own names (q_proj, gate_proj, ...)
            os.makedirs(os.path.join(out_dir, "swiglu_bin"))
            torch.save(model.state_dict(), os.path.join(out_dir, "swiglu_bin", "pytorch_model.bin"))
            model.config.to_json_file(os.path.join(out_dir, "swiglu_bin", "config.json"))
        if name.startswith("w128"):
            state = model.state_dict()
            save_file(to_timm(state, hub=False), os.path.join(out_dir, f"{name}_timm.safetensors"))
            torch.save(to_timm(state, hub=False), os.path.join(out_dir, f"{name}_timm.pth"))
            torch.save(to_timm(state, hub=True), os.path.join(out_dir, f"{name}_hub.pth"))
            if name == "w128":  # the other conventions on the same weights (the registers model already is timm's)
                for label, fn in (("timm", timm_positions), ("hub", hub_positions)):
                    original, Dinov2Embeddings.interpolate_pos_encoding = Dinov2Embeddings.interpolate_pos_encoding, fn
                    refs[f"w128_odd_{label}"] = tokens(model, images["odd"])
                    Dinov2Embeddings.interpolate_pos_encoding = original
    grid = torch.randn(1, 5, 16, 16)
    for out in ((11, 13), (16, 16), (37, 20), (7, 37)):
        refs[f"resize_bicubic_{out[0]}x{out[1]}"] = F.interpolate(grid, size=out, mode="bicubic").numpy()
        refs[f"resize_antialias_{out[0]}x{out[1]}"] = F.interpolate(grid, size=out, mode="bicubic", antialias=True).numpy()
        refs[f"resize_offset_{out[0]}x{out[1]}"] = F.interpolate(
            grid, scale_factor=((out[0] + 0.1) / 16, (out[1] + 0.1) / 16), mode="bicubic").numpy()
    refs["resize_grid"] = grid.numpy()
    np.savez(os.path.join(out_dir, "refs.npz"), **refs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
