"""The PyTorch side of the autoencoder-family parity tests (DC-AE, and the families after it), run by .venv-flux2's
python (diffusers 0.42.1, requirements-flux2-test.txt), never imported by the Paddle tests; tests/family_parity.py
drives it.

    make CLASS FOLDER --config JSON [--seed S] [--variant fp16] [--stress F]
        a seeded diffusers CLASS whose every weight is moved away from its initialisation (BatchNorm statistics
        made non-trivial too, and latent statistics kept as buffers named latents_mean / latents_std, LTX-2's),
        saved with diffusers' save_pretrained (safetensors); --stress: then the scales of the trainable
        normalisation layers not in front of an attention multiplied by F (_stress), so that the activations after
        them see inputs F times their ordinary range (LTX-2, whose RMS norms have no scale: its timestep modulation)
    run CLASS FOLDER --images IN.npy --out OUT.npz [--latents IN.npy] [--variant fp16] [--tile T --stride S]
        load FOLDER as CLASS (eval mode, float32) and write: the latent (a posterior's mode), the posterior's mean
        and log-variance when there is one, the decode of that latent, the decode of --latents when given, and
        loading_info (a JSON string: missing / unexpected / mismatched keys, and the class diffusers read).
        --tile: diffusers' own tiled encode and decode (enable_tiling with tiles of T px, stride S px)
        --train: then one training step as the trainer takes it (its family's encode and decode, in
        vae_trainer/models/): in train mode, the images on [-1, 1] (a video VAE's: one-frame clips; RAE's encoder
        sees them on [0, 1] and its decode is mapped back), the posterior's mode (or the deterministic latent), decoded
        without the final clamp of a video VAE's decode, loss = mean((decoded - images) ** 2), backward; writes
        train_decoded, grad:NAME for every parameter that requires a gradient (zeros where none reached it; RAE's
        frozen encoder has none) and buffer:NAME for every buffer after the step (BatchNorm statistics and
        counters), in diffusers' state-dict names
      further options of run:
        --more NAME=IN.npy (repeatable): more inputs (other shapes, such as clips of other lengths) run in the same
            process as --images is; their outputs are the same keys prefixed "NAME_"
        --unclamped: also decode --latents with torch.clamp made the identity, written as decoded_latents_unclamped
            (the decoder's output before a decode's final clamp); fails if decode never called torch.clamp
        --prelude FILE.py: python run before loading (a test's minimal fix-up of a known diffusers bug); in a
            batch it stays in force for the jobs after it
        --temb T: every decode (and --train's) given the timestep T for each sample (decode(z, temb): LTX-2's
            timestep_conditioning)
    dinov2 FOLDER --config JSON [--seed S]
        a seeded transformers Dinov2WithRegistersModel (weights moved off their initialisation), save_pretrained
    vit FOLDER --config JSON [--seed S]
        a seeded transformers ViTModel without pooler (a DINO ViT's layout), save_pretrained, and the same weights
        as a torch-hub dino_vits8 state dict, FOLDER.pth (timm names, fused qkv, 785 positions with the cls one)
    rae_tokens FOLDER --images IN.npy --out OUT.npy --input_size N
        RAE's latent before its normalisation, the independent way: transformers' Dinov2WithRegistersModel of FOLDER on
        the images (on [0, 1]) resized by torch's bicubic to N, ImageNet-normalised, final LayerNorm without affine,
        cls and register tokens dropped, as (B, C, h, w)
    rae_release FOLDER --config JSON [--seed S]
        the RAE authors' files of a seeded decoder (a diffusers AutoencoderRAE of the config's): FOLDER/model.pt, its
        decoder in their GeneralDecoder's names with their fixed sin-cos decoder_pos_embed; FOLDER/ep.pt, a stage-1
        training checkpoint ({"model", "ema"} of the whole RAE, the EMA's decoder weights + 1); FOLDER/stat.pt,
        {"mean", "var"} per channel and position; and FOLDER/diffusers, that decoder's diffusers folder (to compare)
    patchgan WEIGHTS.npz --images IN.npy --out OUT.npz --config JSON
        taming-transformers' NLayerDiscriminator (its layers, written out here; --config {"num_layers", "norm"}:
        "batch" as taming's, or "group" / "none" in the same places) with the weights of WEIGHTS.npz (our
        PatchDiscriminator's state dict, by its names), in train mode (batch statistics): logits of the images, and
        the gradients of mean(logits ** 2), grad:NAME per weight and grad:images
    lpips WEIGHTS.npz --images IN.npy --targets IN.npy --out OUT.npz
        lpips 0.1's LPIPS(net="vgg") forward written out (its ScalingLayer, VGG16's conv layers to relu5_3, unit-
        normalised taps, the linear heads without dropout as in eval mode, spatial means) with the weights of
        WEIGHTS.npz (our LPIPS's state dict): the distances, and grad:images, the gradient of their sum
    pipeline_encode FOLDER --config {"class": CLASS} --images IN.npy --out OUT.npy
        the latents a diffusion pipeline makes of the images with its own code: AutoencoderKLFlux2 through
        Flux2Pipeline._encode_vae_image (patchify, bn normalisation) then Flux2Pipeline._unpatchify_latents (NCHW);
        AutoencoderKLQwenImage through QwenImageEditPipeline._encode_vae_image, AutoencoderKLQwenImage21 through
        QwenImage21Pipeline._encode_vae_image (one-frame clips; frame axis dropped); AutoencoderKLLTX2Video as
        LTX2ImageToVideoPipeline.prepare_latents encodes its image (each image a one-frame clip, its module's
        retrieve_latents "argmax", LTX2ImageToVideoPipeline._normalize_latents by the VAE's latents_mean /
        latents_std buffers; 5-D, one frame)
    script FILE.py ARG...
        another torch-side script of tests/ (rae_torch_side.py, dinov2_torch_side.py): its main(ARG...), here
    batch JOBS.json
        several of the commands above in this one process, in order: JOBS.json is a list of their argument lists
        (torch and diffusers are imported once, ~3 s)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from unittest import mock

import numpy as np
import torch
import diffusers


def make(class_name: str, folder: str, config: dict, seed: int, variant: str | None, stress: float = 1.0) -> None:
    torch.manual_seed(seed)
    model = getattr(diffusers, class_name)(**config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.copy_(torch.randn_like(module.running_mean) * 0.3)
                module.running_var.copy_(torch.rand_like(module.running_var) * 2.0 + 0.5)
        for name, buffer in model.named_buffers():
            if name in ("latents_mean", "latents_std"):  # statistics in the weights (LTX-2): not 0 / 1
                buffer.copy_(torch.randn_like(buffer) * 0.5 if name == "latents_mean"
                             else torch.rand_like(buffer) * 1.5 + 0.25)
        if stress != 1.0:
            _stress(model, stress)
    if variant == "fp16":
        model = model.half()
    model.save_pretrained(folder, safe_serialization=True, variant=variant)


def _stress(model, factor: float) -> None:
    """The scale of every trainable normalisation layer (GroupNorm, LayerNorm, BatchNorm, diffusers' and Wan's RMS
    norms; not RAE's frozen encoder) times `factor`, but those in front of an attention's scores (in an attention
    block, or a ViT layer's layernorm_before): float32 softmax of logits `factor` ** 2 times their size is too
    ill-conditioned for any comparison (PyTorch's float32 gradients are then percents off its float64 ones). An
    "...AttnBlock" (HunyuanVideo 1.5's mid-block attention) is an attention block too. LTX-2's RMS norms have no
    parameters (their output is bounded by sqrt(channels)); what can push its activations that far is the timestep
    modulation, so there every `scale_shift_table` and each time embedder's first linear
    (`timestep_embedder.linear_1`, before its SiLU) are multiplied instead."""
    for name, param in model.named_parameters():
        if name.endswith("scale_shift_table") or name.endswith("timestep_embedder.linear_1.weight"):
            param.mul_(factor)
    for parent in model.modules():
        parent_kind = type(parent).__name__.lower()
        in_attention = "attention" in parent_kind or parent_kind.endswith("attnblock")
        for child_name, child in parent.named_children():
            if "norm" in type(child).__name__.lower() and not in_attention and child_name != "layernorm_before":
                for name, param in child.named_parameters(recurse=False):
                    if name in ("weight", "gamma") and param.requires_grad:
                        param.mul_(factor)


def _encode(model, images: torch.Tensor) -> dict:
    output = model.encode(images)
    if hasattr(output, "latent_dist"):
        dist = output.latent_dist
        return {"latent": dist.mode(), "mean": dist.mean, "logvar": dist.logvar}
    return {"latent": output.latents if hasattr(output, "latents") else output.latent}  # AutoencoderTiny's: latents


def _decode_kwargs(temb: float | None, batch: int) -> dict:
    return {} if temb is None else {"temb": torch.full((batch,), float(temb))}


def _train_step(model, images: torch.Tensor, temb: float | None = None) -> dict:
    model.train()
    kind = type(model).__name__
    video = kind in ("AutoencoderKLWan", "AutoencoderKLQwenImage", "AutoencoderKLQwenImage21")
    rae = kind == "AutoencoderRAE"
    latent = _encode(model, (images + 1) / 2 if rae else images)["latent"]
    with _clamp_made_identity([]) if video else contextlib.nullcontext():
        decoded = model.decode(latent, **_decode_kwargs(temb, latent.shape[0])).sample
    decoded = decoded * 2 - 1 if rae else decoded
    (decoded - images).pow(2).mean().backward()
    out = {"train_decoded": decoded.detach()}
    out.update({f"grad:{name}": torch.zeros_like(param) if param.grad is None else param.grad.detach()
                for name, param in model.named_parameters() if param.requires_grad})
    out.update({f"buffer:{name}": buffer.detach() for name, buffer in model.named_buffers()})
    return out


@contextlib.contextmanager
def _clamp_made_identity(calls: list):
    """Within: torch.clamp returns its input (a decode's final clamp gone); each call appends to `calls`."""
    def identity(tensor, *args, **kwargs):
        calls.append(1)
        return tensor

    with mock.patch.object(torch, "clamp", identity):
        yield


def _decode_unclamped(model, latents: torch.Tensor, temb: float | None = None) -> torch.Tensor:
    calls = []
    with _clamp_made_identity(calls):
        decoded = model.decode(latents, **_decode_kwargs(temb, latents.shape[0])).sample
    if not calls:
        raise SystemExit(f"--unclamped: {type(model).__name__}.decode never called torch.clamp")
    return decoded


def run(class_name: str, folder: str, images_file: str, out_file: str, latents_file: str | None,
        variant: str | None, tile: int | None, stride: int | None, more: list[str] | None = None,
        unclamped: bool = False, prelude: str | None = None, train: bool = False,
        temb: float | None = None) -> None:
    if prelude:
        with open(prelude) as handle:
            exec(compile(handle.read(), prelude, "exec"), {"__name__": "prelude"})
    model, info = getattr(diffusers, class_name).from_pretrained(folder, output_loading_info=True, variant=variant)
    model = model.float().eval()
    if tile:
        model.enable_tiling(tile, tile, stride, stride)
    inputs = [("", images_file)] + [(name + "_", path) for name, path in (item.split("=", 1) for item in more or [])]
    out = {}
    with torch.no_grad():
        for prefix, path in inputs:
            encoded = _encode(model, torch.from_numpy(np.load(path)))
            decode_kwargs = _decode_kwargs(temb, encoded["latent"].shape[0])
            encoded["decoded"] = model.decode(encoded["latent"], **decode_kwargs).sample
            out.update({prefix + key: value for key, value in encoded.items()})
        if latents_file:
            latents = torch.from_numpy(np.load(latents_file))
            out["decoded_latents"] = model.decode(latents, **_decode_kwargs(temb, latents.shape[0])).sample
            if unclamped:
                out["decoded_latents_unclamped"] = _decode_unclamped(model, latents, temb)
    if train:
        out.update(_train_step(model, torch.from_numpy(np.load(images_file)), temb))
    loading = {key: sorted(map(str, value)) for key, value in info.items()}
    loading["class"] = type(model).__name__
    np.savez(out_file, **{key: value.numpy() for key, value in out.items()}, loading_info=json.dumps(loading))


def _moved(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def dinov2(folder: str, config: dict, seed: int) -> None:
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    torch.manual_seed(seed)
    _moved(Dinov2WithRegistersModel(Dinov2WithRegistersConfig(**config)), seed).save_pretrained(folder)


def vit(folder: str, config: dict, seed: int) -> None:
    import os

    from safetensors.torch import load_file
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(seed)
    model = _moved(ViTModel(ViTConfig(**config), add_pooling_layer=False), seed)
    model.save_pretrained(folder)
    state = load_file(os.path.join(folder, "model.safetensors"))  # the file's names (transformers 5 renames in memory)
    hub = {"cls_token": state["embeddings.cls_token"], "pos_embed": state["embeddings.position_embeddings"],
           "patch_embed.proj.weight": state["embeddings.patch_embeddings.projection.weight"],
           "patch_embed.proj.bias": state["embeddings.patch_embeddings.projection.bias"],
           "norm.weight": state["layernorm.weight"], "norm.bias": state["layernorm.bias"]}
    for i in range(config["num_hidden_layers"]):
        source, target = f"encoder.layer.{i}.", f"blocks.{i}."
        for leaf in ("weight", "bias"):
            hub[target + f"attn.qkv.{leaf}"] = torch.cat([state[source + f"attention.attention.{name}.{leaf}"]
                                                          for name in ("query", "key", "value")])
            for theirs, ours in (("layernorm_before", "norm1"), ("layernorm_after", "norm2"),
                                 ("attention.output.dense", "attn.proj"), ("intermediate.dense", "mlp.fc1"),
                                 ("output.dense", "mlp.fc2")):
                hub[target + f"{ours}.{leaf}"] = state[source + f"{theirs}.{leaf}"]
    torch.save({k: v.contiguous() for k, v in hub.items()}, folder.rstrip("/") + ".pth")


def rae_tokens(folder: str, images_file: str, out_file: str, input_size: int) -> None:
    from transformers import Dinov2WithRegistersModel

    model = Dinov2WithRegistersModel.from_pretrained(folder).eval()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    pixels = torch.nn.functional.interpolate(torch.from_numpy(np.load(images_file)), size=(input_size, input_size),
                                             mode="bicubic", align_corners=False)
    with torch.no_grad():
        model.layernorm.weight.fill_(1.0)
        model.layernorm.bias.zero_()
        tokens = model(pixel_values=(pixels - mean) / std).last_hidden_state[:, 1 + model.config.num_register_tokens:]
    side = int(round(tokens.shape[1] ** 0.5))
    np.save(out_file, tokens.transpose(1, 2).reshape(tokens.shape[0], -1, side, side).numpy())


def authors_positions(width: int, grid: int) -> np.ndarray:
    """The RAE authors' decoder_pos_embed (MAE's 2-D sin-cos table of an unscaled grid; a zero cls row first)."""
    omega = 1.0 / 10000 ** (np.arange(width // 4, dtype=np.float64) / (width / 4.0))
    w, h = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32))  # w first, as theirs

    def half(positions):
        angles = np.outer(positions.reshape(-1), omega)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    table = np.concatenate([half(w), half(h)], axis=1)
    return np.concatenate([np.zeros((1, width)), table])[None].astype(np.float32)


def rae_release(folder: str, config: dict, seed: int) -> None:
    import os

    torch.manual_seed(seed)
    model = _moved(diffusers.AutoencoderRAE(**config), seed)
    model.save_pretrained(os.path.join(folder, "diffusers"))
    names = {"attention.to_q.": "attention.attention.query.", "attention.to_k.": "attention.attention.key.",
             "attention.to_v.": "attention.attention.value.", "attention.to_out.0.": "attention.output.dense."}
    decoder = {}
    for key, value in model.decoder.state_dict().items():
        for ours, theirs in names.items():
            key = key.replace(ours, theirs)
        decoder[key] = value.clone()
    grid = config["encoder_input_size"] // config["encoder_patch_size"]
    decoder["decoder_pos_embed"] = torch.from_numpy(authors_positions(config["decoder_hidden_size"], grid))
    torch.save(decoder, os.path.join(folder, "model.pt"))
    whole = {**{f"encoder.{k}": v for k, v in model.encoder.state_dict().items()},
             **{f"decoder.{k}": v for k, v in decoder.items()}}
    torch.save({"model": {f"module.{k}": v for k, v in whole.items()},
                "ema": {k: v + 1 if k.startswith("decoder.decoder_layers.") else v for k, v in whole.items()},
                "step": 7}, os.path.join(folder, "ep.pt"))
    shape = (config["encoder_hidden_size"], grid, grid)
    torch.save({"mean": torch.randn(shape) * 0.3, "var": torch.rand(shape) + 0.5}, os.path.join(folder, "stat.pt"))


def _leaf(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(array, np.float32)).requires_grad_()


def _gradients_out(loss: torch.Tensor, named: dict) -> dict:
    loss.backward()
    return {f"grad:{name}": tensor.grad for name, tensor in named.items()}


def patchgan(weights_file: str, images_file: str, out_file: str, config: dict) -> None:
    """taming's NLayerDiscriminator: conv 4x4 stride 2 + LeakyReLU(0.2); then per layer conv 4x4 (stride 2, the last
    stride 1, no bias before a norm) + norm + LeakyReLU(0.2); a 4x4 conv to 1 channel."""
    nn = torch.nn
    weights = dict(np.load(weights_file))
    layers, n_layers, norm = [], config["num_layers"], config["norm"]
    widths = [3] + [weights["main.0.weight"].shape[0] * min(2 ** n, 8) for n in range(n_layers + 1)]
    for n in range(n_layers + 1):
        has_norm = n > 0 and norm != "none"
        layers.append(nn.Conv2d(widths[n], widths[n + 1], 4, 2 if n < n_layers else 1, 1, bias=not has_norm))
        if has_norm:
            layers.append(nn.BatchNorm2d(widths[n + 1]) if norm == "batch"
                          else nn.GroupNorm(math.gcd(32, widths[n + 1]), widths[n + 1]))
        layers.append(nn.LeakyReLU(0.2, True))
    layers.append(nn.Conv2d(widths[-1], 1, 4, 1, 1))
    model = nn.Sequential(*layers)
    names = {k.replace("._mean", ".running_mean").replace("._variance", ".running_var")[len("main."):]: v
             for k, v in weights.items()}
    model.load_state_dict({k: torch.from_numpy(v) for k, v in names.items()}, strict=True)
    model.train()
    images = _leaf(np.load(images_file))
    logits = model(images)
    named = {f"main.{k}": p for k, p in model.named_parameters()}
    out = _gradients_out(logits.pow(2).mean(), {**named, "images": images})
    np.savez(out_file, logits=logits.detach().numpy(), **{k: v.numpy() for k, v in out.items()})


def lpips(weights_file: str, images_file: str, targets_file: str, out_file: str) -> None:
    """lpips 0.1's forward (net="vgg", normalize=False, eval mode) on the weights of our LPIPS."""
    functional = torch.nn.functional
    weights = {k: torch.from_numpy(v) for k, v in np.load(weights_file).items()}
    convs = sorted({int(k.split(".")[2]) for k in weights if k.startswith("vgg.features.")})
    pools_after, taps_after = {3, 8, 15, 22}, {3, 8, 15, 22, 29}  # relu indices of paddle's / torchvision's VGG16

    def features(x: torch.Tensor) -> list:
        shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
        scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)
        x, taps = (x - shift) / scale, []
        for index in convs:
            x = functional.relu(functional.conv2d(x, weights[f"vgg.features.{index}.weight"],
                                                  weights[f"vgg.features.{index}.bias"], padding=1))
            if index + 1 in taps_after:
                taps.append(x)
            if index + 1 in pools_after:
                x = functional.max_pool2d(x, 2, 2)
        return taps

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / (torch.sqrt(torch.sum(x ** 2, dim=1, keepdim=True)) + 1e-10)

    images = _leaf(np.load(images_file))
    with torch.no_grad():
        targets = features(torch.from_numpy(np.load(targets_file)))
    distances = sum(functional.conv2d((unit(a) - unit(b)) ** 2, weights[f"heads.{k}.weight"]).mean(dim=(2, 3))
                    for k, (a, b) in enumerate(zip(features(images), targets)))[:, 0]
    out = _gradients_out(distances.sum(), {"images": images})
    np.savez(out_file, distances=distances.detach().numpy(), **{k: v.numpy() for k, v in out.items()})


def pipeline_encode(folder: str, class_name: str, images_file: str, out_file: str) -> None:
    from types import SimpleNamespace

    from diffusers import Flux2Pipeline, QwenImageEditPipeline

    vae = getattr(diffusers, class_name).from_pretrained(folder).float().eval()
    images = torch.from_numpy(np.load(images_file))
    with torch.no_grad():
        if class_name == "AutoencoderKLFlux2":
            owner = SimpleNamespace(vae=vae, _patchify_latents=Flux2Pipeline._patchify_latents)
            latents = Flux2Pipeline._unpatchify_latents(Flux2Pipeline._encode_vae_image(owner, images, None))
        elif class_name == "AutoencoderKLLTX2Video":
            from diffusers.pipelines.ltx2 import pipeline_ltx2_image2video as ltx2

            latents = torch.cat([ltx2.retrieve_latents(vae.encode(image.unsqueeze(0).unsqueeze(2)), None, "argmax")
                                 for image in images])
            latents = ltx2.LTX2ImageToVideoPipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std)
        elif class_name == "AutoencoderKLQwenImage21":
            from diffusers import QwenImage21Pipeline

            owner = SimpleNamespace(vae=vae, latent_channels=vae.config.z_dim)
            latents = QwenImage21Pipeline._encode_vae_image(owner, images.unsqueeze(2), None).squeeze(2)
        else:
            owner = SimpleNamespace(vae=vae, latent_channels=vae.config.z_dim)
            latents = QwenImageEditPipeline._encode_vae_image(owner, images.unsqueeze(2), None).squeeze(2)
    np.save(out_file, latents.numpy())


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["batch"]:
        with open(argv[1]) as handle:
            for job in json.load(handle):
                main(job)
        return
    if argv[:1] == ["script"]:
        return _script(argv[1], argv[2:])
    parser = argparse.ArgumentParser()
    if argv[:1] and argv[0] in ("dinov2", "vit", "rae_tokens", "rae_release", "patchgan", "lpips",
                                          "pipeline_encode"):
        return _side_command(argv)
    parser.add_argument("command", choices=("make", "run"))
    parser.add_argument("class_name")
    parser.add_argument("folder")
    parser.add_argument("--config", help="the class's kwargs, JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", default=None)
    parser.add_argument("--stress", type=float, default=1.0)
    parser.add_argument("--images")
    parser.add_argument("--latents")
    parser.add_argument("--out")
    parser.add_argument("--tile", type=int, default=None)
    parser.add_argument("--stride", type=int, default=None)
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--more", action="append", default=None, metavar="NAME=IN.npy")
    parser.add_argument("--unclamped", action="store_true")
    parser.add_argument("--prelude", default=None)
    parser.add_argument("--temb", type=float, default=None)
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.class_name, args.folder, json.loads(args.config), args.seed, args.variant, args.stress)
    else:
        run(args.class_name, args.folder, args.images, args.out, args.latents, args.variant, args.tile, args.stride,
            args.more, args.unclamped, args.prelude, args.train, args.temb)


def _script(path: str, args: list) -> None:
    """Another torch-side script of tests/ (rae_torch_side.py, ...): its main(*args), in this process."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(*args)


def _side_command(argv) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("folder")
    parser.add_argument("--config", default="{}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images")
    parser.add_argument("--out")
    parser.add_argument("--input_size", type=int, default=224)
    parser.add_argument("--targets")
    args = parser.parse_args(argv)
    if args.command == "rae_tokens":
        rae_tokens(args.folder, args.images, args.out, args.input_size)
    elif args.command == "patchgan":
        patchgan(args.folder, args.images, args.out, json.loads(args.config))
    elif args.command == "pipeline_encode":
        pipeline_encode(args.folder, json.loads(args.config)["class"], args.images, args.out)
    elif args.command == "lpips":
        lpips(args.folder, args.images, args.targets, args.out)
    else:
        {"dinov2": dinov2, "vit": vit, "rae_release": rae_release}[args.command](args.folder, json.loads(args.config),
                                                                                 args.seed)


if __name__ == "__main__":
    sys.exit(main())
