"""What LPIPS and the discriminator should see of RGBA images (docs/fine-tuning.md, "Qwen-Image 2.1"): one tiny
Qwen-Image 2.1 VAE (AutoencoderKLQwenImage21, 4 channels) trained from scratch per arm, same seed, same data, then
held-out RGBA PSNR, alpha PSNR, SSIM and LPIPS.

    python benchmarks/rgba_views.py --steps 300 --output_dir outputs/rgba_views

Arms (both: the L1 pixel loss over all four channels, LPIPS weight 1, the GAN from --disc_start):
    grey  the trainer's: LPIPS of the RGB over mid-grey (objectives.reconstruction.over_grey); a PatchGAN of 4 input
          channels, that composite and alpha (objectives.gan.discriminator_view)
    rgb   the plain one: LPIPS of the RGB channels alone, alpha ignored; a PatchGAN of 3 input channels, the RGB alone
Data: scripts/make_demo_rgba.py's RGBA crops of the demo photos (data/demo/train: --train_images; data/demo/eval: its
28 images held out), --resolution px, so no resize; random flips. The evaluation (the trainer's protocol) reports LPIPS
over mid-grey; `lpips_rgb` is LPIPS of the RGB channels alone, the plain arm's own training measure. The arms run one
after the other in this process (same machine, its load printed before); a short CPU run from scratch, one seed: it
compares early behaviour, not converged Qwen-Image 2.1 fine-tuning.
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import ExitStack
from typing import Dict, List
from unittest import mock

import harness
from vae_trainer.argument_parser import parse_arguments
from vae_trainer.data.dataset import build_eval_dataloader
from vae_trainer.evaluation import evaluate_vae
from vae_trainer.loop import train
from vae_trainer.models.lpips import LPIPS
from vae_trainer.models.vae_loading import build_vae

CONFIG = {"_class_name": "AutoencoderKLQwenImage21", "base_dim": 16, "decoder_base_dim": 24, "z_dim": 8,
          "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1, "temperal_downsample": [False, True, True],
          "scale_factor_spatial": 8, "latents_mean": [0.0] * 8, "latents_std": [1.0] * 8}


def rgb_alone(images, in_channels: int = 3):
    """The plain arm's view of RGBA images, for LPIPS and the discriminator alike: the RGB channels, alpha dropped."""
    return images[:, :3]


# arm -> what is patched (module attribute -> replacement) while it trains
ARMS = {"grey": {},
        "rgb": {"vae_trainer.objectives.over_grey": rgb_alone,  # what LPIPS sees (vae_objective)
                "vae_trainer.objectives.gan.discriminator_view": rgb_alone,  # what the discriminator sees
                "vae_trainer.build.image_channels": lambda vae: 3}}  # so its PatchGAN has 3 input channels
METRICS = ("psnr", "alpha_psnr", "ssim", "lpips", "lpips_rgb")


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--disc_start", type=int, default=None, help="default: half of --steps")
    parser.add_argument("--output_dir", default="outputs/rgba_views")
    parser.add_argument("--train_images", type=int, default=256)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS), help="default: both")
    return parser.parse_args(argv)


def make_data(args: argparse.Namespace) -> tuple[str, str, str]:
    """(training folder, held-out folder, config file) under --output_dir, written once."""
    from scripts import make_demo_rgba

    folders = {name: os.path.join(args.output_dir, "data", name) for name in ("train", "eval")}
    for name, count in (("train", args.train_images), ("eval", 28)):
        if not os.path.isdir(folders[name]):
            make_demo_rgba.main(["--image_dir", os.path.join(harness.REPO_ROOT, "data", "demo", name), "--output_dir",
                                 folders[name], "--num_images", str(count), "--size", str(args.resolution),
                                 "--seed", "1"])
    config = os.path.join(args.output_dir, "data", "qwenimage21_tiny.json")
    with open(config, "w") as handle:
        json.dump(CONFIG, handle)
    return folders["train"], folders["eval"], config


def train_and_evaluate(args: argparse.Namespace, arm: str, data: tuple[str, str, str], lpips: LPIPS) -> Dict:
    train_dir, eval_dir, config = data
    flags = {"file_list": train_dir, "vae_config_file": config, "output_dir": os.path.join(args.output_dir, arm),
             "resolution": args.resolution, "per_device_train_batch_size": args.batch_size, "max_steps": args.steps,
             "disc_start": args.steps // 2 if args.disc_start is None else args.disc_start, "disc_base_channels": 32,
             "learning_rate": args.learning_rate, "seed": args.seed, "device": "cpu", "dataloader_num_workers": 0,
             "logging_steps": max(args.steps // 10, 1), "save_steps": 0, "image_logging_steps": 0, "report_to": "none",
             "disable_tqdm": "true", "overwrite_output_dir": "true"}
    with _patched(ARMS[arm]):
        outputs = train(*parse_arguments(harness.argv(flags)))
    vae = build_vae(pretrained_model_name_or_path=outputs["vae"])
    metrics = evaluate_vae(vae, build_eval_dataloader(eval_dir, args.resolution, 8, 0, 1, None, channels=4),
                           lpips=lpips).metrics
    with _patched({"vae_trainer.evaluation.over_grey": rgb_alone}):
        metrics["lpips_rgb"] = evaluate_vae(vae, build_eval_dataloader(eval_dir, args.resolution, 8, 0, 1, None,
                                                                       channels=4), lpips=lpips).metrics["lpips"]
    return {name: metrics[name] for name in METRICS}


def _patched(replacements: Dict[str, object]) -> ExitStack:
    """Within: each `module.attribute` of `replacements` replaced."""
    stack = ExitStack()
    for target, value in replacements.items():
        stack.enter_context(mock.patch(target, value))
    return stack


def main(argv: List[str] | None = None) -> None:
    args = parse_args(argv)
    harness.header(__file__, argv)
    data = make_data(args)
    lpips, results = LPIPS(), {}
    for arm in args.arms:
        results[arm] = train_and_evaluate(args, arm, data, lpips)
        print(f"{arm}: {json.dumps(results[arm])}", flush=True)
    table = harness.markdown(["arm", "PSNR RGBA (dB) ↑", "alpha PSNR (dB) ↑", "SSIM ↑", "LPIPS over grey ↓",
                              "LPIPS RGB alone ↓"],
                             [[arm, *(f"{m[name]:.4f}" if "ssim" in name or "lpips" in name else f"{m[name]:.2f}"
                                      for name in METRICS)] for arm, m in results.items()])
    print(f"28 held-out RGBA images, {args.steps} steps per arm, load average after: {harness.load()}\n{table}")


if __name__ == "__main__":
    main()
