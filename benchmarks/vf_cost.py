"""What the VF loss (VA-VAE, --vf_model_path) adds to a training step: median seconds per optimizer step without
it, with it, and with it but without the adaptive weight (--adaptive_vf false), in one process.

    python benchmarks/vf_cost.py --vae_config_file configs/vae_tiny.json --resolution 256 --steps 4
    python benchmarks/vf_cost.py ... --vf_model_path /models/dinov2-small     # real weights (timing only)

Without --vf_model_path a DINOv2-small-sized model (width 384, 12 blocks, 6 heads, patch 14) with seeded random
weights is written to a temporary timm-style file: the cost does not depend on the weights. LPIPS on, the GAN
on from the first step, batch --batch_size, posterior sampled; the settings' steps are interleaved (a drifting load
meets them alike) and the first of each is not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from common import REPO_ROOT, machine_description

sys.path.insert(0, REPO_ROOT)


def write_random_dinov2(path: str, width: int = 384, depth: int = 12, seed: int = 0) -> str:
    """A DINOv2 ViT/14 state dict with timm's key names and seeded random weights (224 px position grid)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"patch_embed.proj.weight": normal(width, 3, 14, 14), "patch_embed.proj.bias": normal(width),
               "cls_token": normal(1, 1, width), "pos_embed": normal(1, 257, width),
               "norm.weight": np.ones(width, np.float32), "norm.bias": normal(width)}
    for block in range(depth):
        shapes = {"norm1.weight": (width,), "norm1.bias": (width,), "attn.qkv.weight": (3 * width, width),
                  "attn.qkv.bias": (3 * width,), "attn.proj.weight": (width, width), "attn.proj.bias": (width,),
                  "ls1.gamma": (width,), "norm2.weight": (width,), "norm2.bias": (width,),
                  "mlp.fc1.weight": (4 * width, width), "mlp.fc1.bias": (4 * width,),
                  "mlp.fc2.weight": (width, 4 * width), "mlp.fc2.bias": (width,), "ls2.gamma": (width,)}
        tensors.update({f"blocks.{block}.{name}": normal(*shape) for name, shape in shapes.items()})
    save_file(tensors, path)
    return path


def build_step(flags: list):
    """The training step of a run with `flags`, and a batch of its size."""
    import paddle

    from vae_trainer.argument_parser import parse_arguments
    from vae_trainer.build import build_networks, build_optimization

    model_args, data_args, loss_args, args = parse_arguments(flags)
    step = build_optimization(build_networks(model_args, loss_args, args), loss_args, args)
    size = data_args.resolution
    return step, paddle.uniform([args.per_device_train_batch_size, 3, size, size], min=-1, max=1)


def interleaved_seconds(settings: dict, steps: int) -> dict:
    """{setting: median seconds per optimizer step}, the settings' steps interleaved (a load that drifts
    meets them all alike); each setting's first step is not timed."""
    built = {name: build_step(flags) for name, flags in settings.items()}
    times = {name: [] for name in settings}
    for number in range(steps + 1):
        for name, (step, pixels) in built.items():
            started = time.perf_counter()
            step.forward_backward(pixels, number, 0)
            step.optimizer_step(number)
            if number:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae_config_file", default="configs/vae_tiny.json")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--vf_model_path", default=None)
    options = parser.parse_args()
    scratch = tempfile.mkdtemp()
    vf_model = options.vf_model_path or write_random_dinov2(os.path.join(scratch, "dinov2_small_random.safetensors"))
    base = ["--file_list", "unused", "--vae_config_file", os.path.join(REPO_ROOT, options.vae_config_file),
            "--output_dir", scratch, "--resolution", str(options.resolution), "--device", "cpu",
            "--per_device_train_batch_size", str(options.batch_size), "--disc_start", "0", "--report_to", "none", "--max_steps", "100"]
    settings = {"no VF": base, "VF": base + ["--vf_model_path", vf_model],
                "VF, --adaptive_vf false": base + ["--vf_model_path", vf_model, "--adaptive_vf", "false"]}
    print(f"machine: {machine_description()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"{options.vae_config_file} at {options.resolution} px, batch {options.batch_size}, median of "
          f"{options.steps} steps")
    results = interleaved_seconds(settings, options.steps)
    for name, seconds in results.items():
        print(f"{name:26} {seconds:8.2f} s/step   x{seconds / results['no VF']:.2f}")


if __name__ == "__main__":
    main()
