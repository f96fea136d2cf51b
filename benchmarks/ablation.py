"""Ablation of the training techniques: train the demo VAE once per recipe, print held-out metrics.

    python benchmarks/ablation.py --steps 100 --output_dir outputs/ablation

Each variant trains configs/vae_tiny.json at 64 px on data/filelist/demo.filelist.list for the same
number of steps with the plain loop (`vae_trainer.loop.train`, same seed, same data order), then
reconstructs data/filelist/demo_eval.filelist with `vae_trainer.evaluation.evaluate_vae` (posterior
mean) and reports PSNR / SSIM / LPIPS. The GAN starts halfway (--disc_start steps/2) in every variant.
Prints a markdown table and writes it, with the command line, to OUTPUT_DIR/ablation.md.
A short CPU run compares the techniques' early behaviour; it says nothing about large-scale training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

import paddle

import harness
from vae_trainer.argument_parser import parse_arguments
from vae_trainer.data.dataset import build_eval_dataloader
from vae_trainer.evaluation import evaluate_vae
from vae_trainer.loop import train
from vae_trainer.models.lpips import LPIPS

# name -> extra flags. Single techniques are added to the LDM recipe one at a time.
VARIANTS: Dict[str, List[str]] = {
    "ldm": ["--recipe", "ldm"],
    "ldm + gradnorm": ["--recipe", "ldm", "--loss_balancing", "gradnorm", "--gradnorm_scope", "global",
                       "--disc_weight", "0.1"],
    "ldm + constant variance": ["--recipe", "ldm", "--posterior_std", "0.1", "--kl_weight", "0",
                                "--latent_penalty_weight", "1e-3"],
    "ldm + low-pass pixel loss": ["--recipe", "ldm", "--pixel_loss_mask", "lowpass"],
    "ldm + VGG discriminator": ["--recipe", "ldm", "--disc_type", "vgg"],
    "balanced": ["--recipe", "balanced"],
}
METRICS = ("psnr", "ssim", "lpips")


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="Optimizer steps per variant.")
    parser.add_argument("--output_dir", default="outputs/ablation")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="Comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--vae_config_file", default="configs/vae_tiny.json")
    parser.add_argument("--file_list", default="data/filelist/demo.filelist.list")
    parser.add_argument("--eval_file_list", default="data/filelist/demo_eval.filelist")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def training_argv(args: argparse.Namespace, name: str) -> List[str]:
    run_dir = os.path.join(args.output_dir, name.replace(" + ", "_").replace(" ", "_").replace("-", ""))
    return harness.argv({
        "file_list": args.file_list, "vae_config_file": args.vae_config_file, "output_dir": run_dir,
        "resolution": args.resolution, "per_device_train_batch_size": args.batch_size, "max_steps": args.steps,
        "disc_start": args.steps // 2, "learning_rate": args.learning_rate, "seed": args.seed, "device": "cpu",
        "dataloader_num_workers": 0, "logging_steps": max(args.steps // 10, 1), "save_steps": 0,
        "image_logging_steps": 0, "report_to": "none", "disable_tqdm": "true", "overwrite_output_dir": "true",
    }) + VARIANTS[name]


def train_and_evaluate(args: argparse.Namespace, name: str, lpips: LPIPS) -> Dict[str, float]:
    model_args, data_args, loss_args, training_args = parse_arguments(training_argv(args, name))
    outputs = train(model_args, data_args, loss_args, training_args)
    from ppdiffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(outputs["vae"])
    batches = build_eval_dataloader(args.eval_file_list, args.resolution, 8, 0, 1, None)
    result = evaluate_vae(vae, batches, lpips=lpips)
    return {metric: result.metrics[metric] for metric in METRICS} | {"images": result.num_images}


def markdown_table(results: Dict[str, Dict[str, float]]) -> str:
    return harness.markdown(["variant", "PSNR (dB) ↑", "SSIM ↑", "LPIPS ↓"], [
        [name, f"{m['psnr']:.2f}", f"{m['ssim']:.4f}", f"{m['lpips']:.4f}"] for name, m in results.items()])


def main(argv: List[str] | None = None) -> None:
    args = parse_args(argv)
    paddle.set_device("cpu")
    names = [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    lpips = LPIPS()
    results = {}
    for name in names:
        results[name] = train_and_evaluate(args, name, lpips)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    table = markdown_table(results)
    command = "python benchmarks/ablation.py " + " ".join(sys.argv[1:] if argv is None else argv)
    images = next(iter(results.values()))["images"]
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "ablation.md"), "w") as handle:
        handle.write(f"`{command}`\n\n{images} held-out images, {args.steps} steps per variant.\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
