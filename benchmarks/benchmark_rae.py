"""The RAE decoder's training step on CPU (or GPU): seconds per optimizer step and peak memory, at 256 px, for RAE's
ViT-B and ViT-XL decoders on a DINOv2-B encoder (random weights; the sizes of the authors' configs/decoder).

    python benchmarks/benchmark_rae.py                           # ViT-B and ViT-XL, batch 1, L1 + LPIPS, + DINO GAN
    python benchmarks/benchmark_rae.py --decoders ViTB --gan none --batch_size 2 --threads 2

Each setting runs in a fresh process (the thread count must be set before Paddle loads; peak RSS is a high-water
mark of the process), built as the drivers build a run from scratch: a random DINOv2-B with registers written as a
timm file (--rae_encoder_path), the decoder's config as --vae_config_file, LPIPS on, and with --gan dino RAE's
discriminator (a random DINO ViT-S/8 file as --disc_backbone_path) active from the first step with the adaptive
weight at decoder_pred. Timed: `TrainStep.forward_backward` + `optimizer_step` (the frozen encoder's forward
included), median over --steps after --warmup. Peak: RSS after the warm-up (CPU), or Paddle's allocator peak (GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from benchmark import busy_thread_count, one_forward_step, parameter_count, peak_rss_mib
from common import REPO_ROOT, machine_description, run_setting

# RAE's decoders (configs/decoder/ViT*/config.json of bytetriper/RAE): width, layers, heads, MLP width.
DECODERS = {"ViTB": (768, 12, 12, 3072), "ViTL": (1024, 24, 16, 4096), "ViTXL": (1152, 28, 16, 4096)}
DINOV2_B = dict(width=768, depth=12, patch=14, grid=37, registers=4)  # dinov2_vitb14_reg: 518 px stored
DINO_VITS8 = dict(width=384, depth=12, patch=8, grid=28, registers=0)  # dino_vits8: 224 px


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoders", nargs="+", default=["ViTB", "ViTXL"], choices=tuple(DECODERS))
    parser.add_argument("--gan", nargs="+", default=["none", "dino"], choices=("none", "dino"))
    parser.add_argument("--resolution", type=int, default=256, help="256: RAE's (224 px encoder input, patch 16)")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--json", help="Also write the results to this JSON file.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: JSON of one setting
    parser.add_argument("--worker_output", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def random_vit_file(path: str, width: int, depth: int, patch: int, grid: int, registers: int) -> str:
    """A timm-layout ViT state dict of random weights (DINOv2 with layer scales and registers, or DINO v1)."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    state = {"cls_token": normal(1, 1, width), "pos_embed": normal(1, grid * grid + (0 if registers else 1), width),
             "patch_embed.proj.weight": normal(width, 3, patch, patch), "patch_embed.proj.bias": normal(width),
             "norm.weight": np.ones(width, np.float32), "norm.bias": normal(width)}
    if registers:
        state["reg_token"] = normal(1, registers, width)
    for i in range(depth):
        block = {"norm1.weight": np.ones(width, np.float32), "norm1.bias": normal(width),
                 "attn.qkv.weight": normal(3 * width, width), "attn.qkv.bias": normal(3 * width),
                 "attn.proj.weight": normal(width, width), "attn.proj.bias": normal(width),
                 "norm2.weight": np.ones(width, np.float32), "norm2.bias": normal(width),
                 "mlp.fc1.weight": normal(4 * width, width), "mlp.fc1.bias": normal(4 * width),
                 "mlp.fc2.weight": normal(width, 4 * width), "mlp.fc2.bias": normal(width)}
        if registers:
            block.update({"ls1.gamma": np.ones(width, np.float32), "ls2.gamma": np.ones(width, np.float32)})
        state.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    save_file(state, path)
    return path


def build_step(setting: Dict, root: str):
    """The run's TrainStep, built as the drivers build one (build_networks, build_optimization)."""
    from vae_trainer.arguments import LossArguments, ModelArguments, VAETrainingArguments
    from vae_trainer.build import build_networks, build_optimization, init_process, seed_training

    width, layers, heads, hidden = DECODERS[setting["decoder"]]
    config = os.path.join(root, "rae.json")
    with open(config, "w") as handle:
        json.dump({"_class_name": "AutoencoderRAE", "encoder_input_size": 224, "patch_size": 16, "noise_tau": 0.8,
                   "decoder_hidden_size": width, "decoder_num_hidden_layers": layers,
                   "decoder_num_attention_heads": heads, "decoder_intermediate_size": hidden}, handle)
    dino = setting["gan"] == "dino"
    model_args = ModelArguments(
        vae_config_file=config, rae_encoder_path=random_vit_file(os.path.join(root, "dinov2.safetensors"), **DINOV2_B),
        disc_type="dino" if dino else "patch",
        disc_backbone_path=random_vit_file(os.path.join(root, "dino.safetensors"), **DINO_VITS8) if dino else None)
    loss_args = LossArguments(disc_start=0 if dino else 10**9, disc_weight=0.75, adaptive_disc_weight_max=1e4,
                              pixel_weight=0.5)
    training_args = VAETrainingArguments(
        output_dir=os.path.join(root, "out"), report_to=[], device=setting["device"], seed=0, disable_tqdm=True,
        max_steps=setting["warmup"] + setting["steps"], per_device_train_batch_size=setting["batch_size"],
        learning_rate=2e-4, adam_beta1=0.9, adam_beta2=0.95)
    init_process(training_args)
    networks = build_networks(model_args, loss_args, training_args, setting["resolution"])
    step = build_optimization(networks, loss_args, training_args)
    seed_training(0)
    return networks, step


def run_worker(setting: Dict, output_path: str) -> None:
    import paddle

    sys.path.insert(0, REPO_ROOT)
    with tempfile.TemporaryDirectory() as root:
        networks, step = build_step(setting, root)
        size, batch = setting["resolution"], setting["batch_size"]
        images = paddle.uniform([batch, 3, size, size], min=-1.0, max=1.0)
        times = []
        for global_step in range(setting["warmup"] + setting["steps"]):
            started = time.perf_counter()
            one_forward_step(step, images, global_step)
            times.append(time.perf_counter() - started)
            if global_step + 1 == setting["warmup"]:
                rss_after_warmup = peak_rss_mib()
    result = {"setting": setting, "decoder_params": parameter_count(networks.model.vae.decoder),
              "encoder_params": parameter_count(networks.model.vae.encoder), "times_s": times,
              "median_s": statistics.median(times[setting["warmup"]:]), "peak_rss_mib": rss_after_warmup,
              "peak_rss_mib_end": peak_rss_mib(), "busy_threads": busy_thread_count()}
    if setting["device"] == "gpu":
        result["gpu_peak_mib"] = paddle.device.cuda.max_memory_allocated() / 2**20
    with open(output_path, "w") as handle:
        json.dump(result, handle)


def run_in_worker(setting: Dict) -> Dict:
    return run_setting(__file__, setting, setting["threads"])


def markdown_table(results: List[Dict]) -> str:
    lines = ["| decoder | GAN | px | batch | threads (busy) | decoder params | s/step | img/s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        s = result["setting"]
        head = f"| {s['decoder']} | {s['gan']} | {s['resolution']} | {s['batch_size']} | {s['threads']}"
        if "error" in result:
            lines.append(f"{head} | failed: {' '.join(result['error'])[-120:]} | | | |")
            continue
        lines.append(f"{head} ({result['busy_threads']}) | {result['decoder_params'] / 1e6:.1f} M "
                     f"| {result['median_s']:.2f} | {s['batch_size'] / result['median_s']:.3f} "
                     f"| {result['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker), args.worker_output)
        return
    print(f"$ python benchmarks/benchmark_rae.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {machine_description()}; before: {uptime()}",
          flush=True)
    results = []
    for decoder in args.decoders:
        for gan in args.gan:
            setting = {"decoder": decoder, "gan": gan, "resolution": args.resolution, "batch_size": args.batch_size,
                       "threads": args.threads, "warmup": args.warmup, "steps": args.steps, "device": args.device}
            results.append(run_in_worker(setting))
            print(f"  {decoder} {gan}: {'failed' if 'error' in results[-1] else 'done'}", file=sys.stderr, flush=True)
    print()
    print(markdown_table(results))
    print(f"\nMedian of {args.steps} timed optimizer steps after {args.warmup} warm-up, random weights and images, "
          f"L1 (--pixel_weight 0.5) + LPIPS{' (+ DINO GAN where noted)' if 'dino' in args.gan else ''}, "
          f"DINOv2-B encoder at 224 px (frozen, in the step). After: {uptime()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
