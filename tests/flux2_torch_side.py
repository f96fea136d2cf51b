"""The PyTorch side of the FLUX.2 VAE tests, run by .venv-flux2's python (diffusers 0.42.1, which has
AutoencoderKLFlux2; requirements-flux2-test.txt), never imported by the Paddle tests.

    make FOLDER --config JSON [--seed S] [--variant fp16] [--bin]
        a seeded AutoencoderKLFlux2 whose every weight is moved away from its initialisation and whose bn
        holds non-trivial statistics, saved with diffusers' save_pretrained (safetensors, or .bin)
    run FOLDER --images IN.npy --out OUT.npz [--variant fp16]
        load FOLDER as AutoencoderKLFlux2 and write: the posterior mode, its decode, the normalised
        patchified latents as Flux2Pipeline computes them, the bn statistics, and loading_info (a JSON
        string: missing / unexpected / mismatched keys, and the class diffusers read)
    batch JOBS.json
        several of the commands above in this one process, in order: JOBS.json is a list of their argument lists
        (torch and diffusers are imported once)
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, Flux2Pipeline


def make(folder: str, config: dict, seed: int, variant: str | None, bin_format: bool) -> None:
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(**config)
    with torch.no_grad():
        for param in vae.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        channels = vae.bn.running_mean.shape[0]
        vae.bn.running_mean.copy_(torch.randn(channels) * 0.3)
        vae.bn.running_var.copy_(torch.rand(channels) * 2.0 + 0.5)
        vae.bn.num_batches_tracked.fill_(7)
    if variant == "fp16":
        vae = vae.half()
    vae.save_pretrained(folder, safe_serialization=not bin_format, variant=variant)


def run(folder: str, images_file: str, out_file: str, variant: str | None = None) -> None:
    vae, info = AutoencoderKLFlux2.from_pretrained(folder, output_loading_info=True, variant=variant)
    vae = vae.float().eval()
    images = torch.from_numpy(np.load(images_file))
    with torch.no_grad():
        mode = vae.encode(images).latent_dist.mode()
        decoded = vae.decode(mode).sample
        patches = Flux2Pipeline._patchify_latents(mode)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        normalised = (patches - mean) / std
    loading = {key: sorted(map(str, value)) for key, value in info.items()}
    loading["class"] = type(vae).__name__
    np.savez(out_file, mode=mode.numpy(), decoded=decoded.numpy(), normalised=normalised.numpy(),
             running_mean=vae.bn.running_mean.numpy(), running_var=vae.bn.running_var.numpy(),
             num_batches_tracked=np.asarray(int(vae.bn.num_batches_tracked)), loading_info=json.dumps(loading))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["batch"]:
        with open(argv[1]) as handle:
            for job in json.load(handle):
                main(job)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("make", "run"))
    parser.add_argument("folder")
    parser.add_argument("--config", help="AutoencoderKLFlux2 kwargs, JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", default=None)
    parser.add_argument("--bin", action="store_true")
    parser.add_argument("--images")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.folder, json.loads(args.config), args.seed, args.variant, args.bin)
    else:
        run(args.folder, args.images, args.out, args.variant)


if __name__ == "__main__":
    sys.exit(main())
