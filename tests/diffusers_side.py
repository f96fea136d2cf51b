"""The PyTorch side of the autoencoder-family parity tests (DC-AE, and the families after it), run by .venv-flux2's
python (diffusers 0.42.1, requirements-flux2-test.txt), never imported by the Paddle tests; tests/family_parity.py
drives it.

    make CLASS FOLDER --config JSON [--seed S] [--variant fp16]
        a seeded diffusers CLASS whose every weight is moved away from its initialisation (BatchNorm statistics
        made non-trivial too), saved with diffusers' save_pretrained (safetensors)
    run CLASS FOLDER --images IN.npy --out OUT.npz [--latents IN.npy] [--variant fp16] [--tile T --stride S]
        load FOLDER as CLASS (eval mode, float32) and write: the latent (a posterior's mode), the posterior's mean
        and log-variance when there is one, the decode of that latent, the decode of --latents when given, and
        loading_info (a JSON string: missing / unexpected / mismatched keys, and the class diffusers read).
        --tile: diffusers' own tiled encode and decode (enable_tiling with tiles of T px, stride S px)
        --train: then one training-mode step: forward(images) in train mode, loss = mean(sample ** 2), backward;
        also writes train_decoded, grad:NAME for every parameter and buffer:NAME for every buffer after the step
        (BatchNorm statistics and counters), in diffusers' state-dict names
      further options of run:
        --more NAME=IN.npy (repeatable): more inputs (other shapes, such as clips of other lengths) run in the same
            process as --images is; their outputs are the same keys prefixed "NAME_"
        --unclamped: also decode --latents with torch.clamp made the identity, written as decoded_latents_unclamped
            (the decoder's output before a decode's final clamp); fails if decode never called torch.clamp
        --prelude FILE.py: python run before loading (a test's minimal fix-up of a known diffusers bug); in a
            batch it stays in force for the jobs after it
    batch JOBS.json
        several of the commands above in this one process, in order: JOBS.json is a list of their argument lists
        (torch and diffusers are imported once, ~3 s)
"""

from __future__ import annotations

import argparse
import json
import sys
from unittest import mock

import numpy as np
import torch
import diffusers


def make(class_name: str, folder: str, config: dict, seed: int, variant: str | None) -> None:
    torch.manual_seed(seed)
    model = getattr(diffusers, class_name)(**config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.copy_(torch.randn_like(module.running_mean) * 0.3)
                module.running_var.copy_(torch.rand_like(module.running_var) * 2.0 + 0.5)
    if variant == "fp16":
        model = model.half()
    model.save_pretrained(folder, safe_serialization=True, variant=variant)


def _encode(model, images: torch.Tensor) -> dict:
    output = model.encode(images)
    if hasattr(output, "latent_dist"):
        dist = output.latent_dist
        return {"latent": dist.mode(), "mean": dist.mean, "logvar": dist.logvar}
    return {"latent": output.latent}


def _train_step(model, images: torch.Tensor) -> dict:
    model.train()
    sample = model(images).sample
    sample.pow(2).mean().backward()
    out = {"train_decoded": sample.detach()}
    out.update({f"grad:{name}": param.grad.detach() for name, param in model.named_parameters()
                if param.grad is not None})
    out.update({f"buffer:{name}": buffer.detach() for name, buffer in model.named_buffers()})
    return out


def _decode_unclamped(model, latents: torch.Tensor) -> torch.Tensor:
    calls = []

    def identity(tensor, *args, **kwargs):
        calls.append(1)
        return tensor

    with mock.patch.object(torch, "clamp", identity):
        decoded = model.decode(latents).sample
    if not calls:
        raise SystemExit(f"--unclamped: {type(model).__name__}.decode never called torch.clamp")
    return decoded


def run(class_name: str, folder: str, images_file: str, out_file: str, latents_file: str | None,
        variant: str | None, tile: int | None, stride: int | None, more: list[str] | None = None,
        unclamped: bool = False, prelude: str | None = None, train: bool = False) -> None:
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
            encoded["decoded"] = model.decode(encoded["latent"]).sample
            out.update({prefix + key: value for key, value in encoded.items()})
        if latents_file:
            out["decoded_latents"] = model.decode(torch.from_numpy(np.load(latents_file))).sample
            if unclamped:
                out["decoded_latents_unclamped"] = _decode_unclamped(model, torch.from_numpy(np.load(latents_file)))
    if train:
        out.update(_train_step(model, torch.from_numpy(np.load(images_file))))
    loading = {key: sorted(map(str, value)) for key, value in info.items()}
    loading["class"] = type(model).__name__
    np.savez(out_file, **{key: value.numpy() for key, value in out.items()}, loading_info=json.dumps(loading))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["batch"]:
        with open(argv[1]) as handle:
            for job in json.load(handle):
                main(job)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("make", "run"))
    parser.add_argument("class_name")
    parser.add_argument("folder")
    parser.add_argument("--config", help="the class's kwargs, JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", default=None)
    parser.add_argument("--images")
    parser.add_argument("--latents")
    parser.add_argument("--out")
    parser.add_argument("--tile", type=int, default=None)
    parser.add_argument("--stride", type=int, default=None)
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--more", action="append", default=None, metavar="NAME=IN.npy")
    parser.add_argument("--unclamped", action="store_true")
    parser.add_argument("--prelude", default=None)
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.class_name, args.folder, json.loads(args.config), args.seed, args.variant)
    else:
        run(args.class_name, args.folder, args.images, args.out, args.latents, args.variant, args.tile, args.stride,
            args.more, args.unclamped, args.prelude, args.train)


if __name__ == "__main__":
    sys.exit(main())
