"""Switching the GAN on: what it costs the reconstruction in the steps after, and what it leaves at the end.

    OMP_NUM_THREADS=1 python benchmarks/gan_start.py --output_dir outputs/gan_start

Per family (a tiny Qwen-Image-shaped VAE, and `configs/vae_micro.json`, a tiny AutoencoderKL), the plain loop trains
the seeded VAE on the demo photos without the GAN up to its switch step (one run: the "pretrained" start, checkpointed
there), then continues from that checkpoint: without the GAN, with LDM's start (the term at full weight at once,
--disc_weight_warmup_steps 0) and with the term ramped in over each of --ramps steps (the trainer's default, 1000, is
longer than the benchmark; 100 shows a whole ramp). The continuations resume one data stream, so they train on the
same batches and their training pixel losses compare step by step. Batch 4 at 64 px, learning rate 1e-3 (issue 42's
setting), the default discriminator (BatchNorm PatchGAN, hinge, adaptive weight). Held-out: the 28 tiles of
data/filelist/demo_eval.filelist, every --eval_every steps.

Prints per family a markdown table: held-out PSNR / LPIPS at the switch and after it; the mean training pixel loss
over windows of steps after the switch; at the end, the detail ratio (the energy of the reconstruction's finite
differences over the image's, on [0, 1], posterior mode: below 1 is blur) and, over the last 10 steps, the mean GAN
weight that reached the loss (gan/adaptive_weight) and the discriminator's margin, mean D(x) - D(x_hat) (near 0: it
tells real from reconstructed no better than chance). Writes them to OUTPUT_DIR/gan_start.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before Paddle loads (vae_trainer/threads.py): the tiny models' fastest

import harness  # noqa: E402
from harness import REPO_ROOT  # noqa: E402

# Qwen-Image's layout (Wan 2.1's causal 3D VAE), tiny: as tests/test_wan.py's TINY_QWEN.
TINY_QWEN = {"_class_name": "AutoencoderKLQwenImage", "base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2],
             "num_res_blocks": 1, "temperal_downsample": [True, True], "latents_mean": [0.1, -0.2, 0.3, -0.4],
             "latents_std": [1.5, 0.5, 2.0, 1.0]}
WINDOWS = ((1, 25), (26, 50), (51, 100), (101, 200))  # of steps after the switch: the training pixel loss's means
EVAL_LIST, NUM_EVAL = "data/filelist/demo_eval.filelist", 28
# {family: (its config, None: TINY_QWEN written at run time; the switch step; the steps after it)}: the micro
# AutoencoderKL learns and steps slower
FAMILIES = {"qwen_image": (None, 100, 300), "autoencoder_kl": ("configs/vae_micro.json", 300, 200)}


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="outputs/gan_start")
    parser.add_argument("--families", default=",".join(FAMILIES), help="Comma-separated subset of: " + ", ".join(FAMILIES))
    parser.add_argument("--ramps", default="100,1000", help="Comma-separated --disc_weight_warmup_steps of the ramped "
                                                            "starts (the trainer's default: 1000)")
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--reuse", action="store_true", help="Keep the runs OUTPUT_DIR holds already (with a vae/).")
    return parser.parse_args(argv)


def common_flags(args: argparse.Namespace, config: str) -> List[str]:
    return harness.argv({"file_list": "data/filelist/demo.filelist.list", "vae_config_file": config,
                         "resolution": 64, "per_device_train_batch_size": 4, "learning_rate": args.learning_rate,
                         "seed": args.seed, "device": "cpu", "dataloader_num_workers": 0, "logging_steps": 1,
                         "image_logging_steps": 0, "disable_tqdm": "true", "eval_file_list": EVAL_LIST,
                         "eval_num_images": NUM_EVAL})


def train(argv: List[str], output_dir: str, reuse: bool) -> None:
    """The plain loop in a process of its own (a process that has built one model cannot resume another's optimizer
    state: Paddle names parameters by a per-process counter). --reuse keeps a finished run's folder."""
    if reuse and os.path.isdir(os.path.join(output_dir, "vae")):
        return
    if os.path.isdir(output_dir):  # a continuation cannot --overwrite_output_dir (it would delete what it resumes)
        shutil.rmtree(output_dir)
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "train_vae_no_trainer.py"), *argv,
                             "--output_dir", output_dir], cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"training failed ({result.returncode}):\n{result.stderr[-4000:]}")


def detail_ratio(vae_dir: str, num_images: int) -> float:
    """Sum over the held-out tiles of the squared finite differences of the reconstruction (posterior mode, on
    [0, 1]) over the image's: 1 keeps the image's detail, below 1 is blur."""
    import paddle

    from vae_trainer.data.dataset import build_eval_dataloader
    from vae_trainer.models.families import family_of
    from vae_trainer.models.vae_loading import build_vae

    def energy(images: paddle.Tensor) -> float:
        images = (images.clip(-1, 1) + 1) / 2
        return float((images[:, :, 1:] - images[:, :, :-1]).square().sum() +
                     (images[:, :, :, 1:] - images[:, :, :, :-1]).square().sum())

    vae = build_vae(None, pretrained_model_name_or_path=vae_dir)
    vae.eval()
    family, sums = family_of(vae), [0.0, 0.0]
    with paddle.no_grad():
        for batch in build_eval_dataloader(EVAL_LIST, 64, 4, 0, 1, num_images):
            pixels = batch["pixel_values"].astype("float32")
            sums[0] += energy(family.decode(vae, family.encode(vae, pixels).mode()).astype("float32"))
            sums[1] += energy(pixels)
    return sums[0] / sums[1]


def scalars(output_dir: str, tag: str) -> Dict[int, float]:
    """{step (1-based): value} of a VisualDL scalar over the run's record files."""
    return {step: record.value for step, record in harness.scalars(os.path.join(output_dir, "logs"), tag).items()}


def evaluations(output_dir: str) -> Dict[int, Dict[str, float]]:
    with open(os.path.join(output_dir, "eval_metrics.jsonl")) as handle:
        return {line["step"]: line["metrics"] for line in map(json.loads, handle)}


def mean(values: Dict[int, float], first: int, last: int) -> float:
    window = [values[step] for step in range(first, last + 1) if step in values]
    return sum(window) / len(window) if window else float("nan")


def run_family(args: argparse.Namespace, family: str) -> Dict[str, Dict[str, object]]:
    """{variant: its numbers} for one family: the run to the switch, then the continuations."""
    root = os.path.join(args.output_dir, family)
    config, switch, after = FAMILIES[family]
    end = switch + after
    if config is None:
        os.makedirs(root, exist_ok=True)
        config = os.path.join(root, "vae_config.json")
        with open(config, "w") as handle:
            json.dump(TINY_QWEN, handle)
    base = os.path.join(root, "base")
    train(common_flags(args, config) + ["--max_steps", str(switch), "--save_steps", str(switch), "--eval_steps",
                                        str(switch), "--disc_start", str(switch)], base, args.reuse)
    at_switch = evaluations(base)[switch]
    variants = {"no GAN": ["--disc_weight", "0"],
                "LDM start": ["--disc_start", str(switch), "--disc_weight_warmup_steps", "0"]}
    for ramp in map(int, args.ramps.split(",")):
        variants[f"{ramp}-step ramp"] = ["--disc_start", str(switch), "--disc_weight_warmup_steps", str(ramp)]
    results = {}
    for variant, flags in variants.items():
        out = os.path.join(root, variant.replace(" ", "_"))
        train(common_flags(args, config) + flags + [
            "--resume_from_checkpoint", os.path.join(base, f"checkpoint-{switch}"), "--max_steps", str(end),
            "--save_steps", "0", "--eval_steps", str(args.eval_every)], out, args.reuse)
        pixel = scalars(out, "loss/pixel")
        margin = {step: real - scalars(out, "gan/logits_fake")[step]
                  for step, real in scalars(out, "gan/logits_real").items()}
        results[variant] = {"evals": {switch: at_switch, **evaluations(out)},
                            "pixel": [mean(pixel, switch + first, switch + last) for first, last in WINDOWS],
                            "detail_end": detail_ratio(os.path.join(out, "vae"), NUM_EVAL),
                            "gan_weight_end": mean(scalars(out, "gan/adaptive_weight"), end - 9, end),
                            "margin_end": mean(margin, end - 9, end)}
        print(f"{family} / {variant}: " + json.dumps({k: v for k, v in results[variant].items() if k != "evals"}),
              flush=True)
    return results


def markdown_table(switch: int, results: Dict[str, Dict[str, object]]) -> str:
    steps = sorted(next(iter(results.values()))["evals"])
    header = ["start"] + [f"step {s}" + (" (switch)" if s == switch else "") for s in steps] + [
        *[f"pixel loss +{first}-{last}" for first, last in WINDOWS], "detail ratio, end",
        "GAN weight, last 10", "D margin, last 10"]
    rows = []
    for variant, result in results.items():
        cells = [f"{result['evals'][s]['psnr']:.2f} / {result['evals'][s]['lpips']:.3f}" for s in steps]
        extra = [f"{value:.4f}" for value in result["pixel"]] + [f"{result['detail_end']:.3f}"]
        extra += ["-", "-"] if variant == "no GAN" else [f"{result['gan_weight_end']:.4f}", f"{result['margin_end']:.2f}"]
        rows.append([variant] + cells + extra)
    return harness.markdown(header, rows)


def main(argv: List[str] | None = None) -> None:
    args = parse_args(argv)
    os.chdir(REPO_ROOT)
    names = [name.strip() for name in args.families.split(",")]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    command = "python benchmarks/gan_start.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = [f"`{command}` on {harness.machine_description()}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; "
              f"PSNR (dB) / LPIPS on the 28 held-out tiles."]
    for family in names:
        table = markdown_table(FAMILIES[family][1], run_family(args, family))
        report.append(f"\n{family}, load average {os.getloadavg()[0]:.1f} at its end:\n\n{table}")
        print(report[-1], flush=True)
    with open(os.path.join(args.output_dir, "gan_start.md"), "w") as handle:
        handle.write("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
