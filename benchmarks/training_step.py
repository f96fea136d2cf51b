"""What does our training step cost on CPU: per config and thread count, part by part, and for RAE's
decoders? Seconds per optimizer step, images/s, peak memory, parameters.

    python benchmarks/training_step.py                  # vae_tiny 64 px b4 and vae_micro 32 px b8, 1 and 2 threads
    python benchmarks/training_step.py --configs configs/sd_vae.json --resolution 64 --batch_size 1 --threads 2
    python benchmarks/training_step.py --breakdown      # where our step's time goes
    python benchmarks/training_step.py --rae ViTB ViTXL --gan none dino --resolution 256 --batch_size 1 --threads 2

Every setting (config or RAE decoder, resolution, batch size, threads) runs in a fresh process that builds the real
components with the package's builders (harness.build: LPIPS on, the default PatchGAN, the GAN with its adaptive
weight and discriminator update from step 0), prepares its batches, warms each variant up, then times the variants
interleaved call by call (harness.interleaved). Timed: the optimizer step (batches are made beforehand). The mode:

- by default, our step (`TrainStep.forward_backward` + `TrainStep.optimizer_step` and `schedule`, as
  `vae_trainer.loop` runs them). Peak RSS: after the warm-up and at the end; "busy": the threads that did work;
- `--breakdown`: our step with parts switched off (the adaptive weight, LPIPS, the whole GAN), and the
  optimizer-step block alone; the differences to the full step are the parts' costs;
- `--rae DECODER...`: our step for RAE's decoders (the sizes of the authors' configs/decoder) on a DINOv2-B encoder
  with registers (86.6 M parameters, frozen, its forward at 224 px in the step), L1 (--pixel_weight 0.5) + LPIPS,
  with `--gan dino` RAE's DINO discriminator (a ViT-S/8) from the first step, or without a GAN; random images.

The designs the step was chosen over (a second VAE forward for the discriminator, LPIPS as one VGG16 batch with a
graph, the heads' gradients by plain autograd) and the VF loss's cost (`--vf`) were timed by this file up to commit
e199ef0; their figures are settled and reproduce there (docs/benchmarks.md says how). Networks that would be
downloaded (DINOv2-B, DINO) are timm files of seeded random weights: a network's cost does not depend on its
weights. Prints a markdown table; nothing is asserted. Whole runs: whole_runs.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from typing import Callable, Dict, List, Optional

import harness

# --breakdown: our step with parts switched off (loss-argument overrides), the full step first. The adaptive weight
# reuses the gradients of LPIPS and the discriminator at the reconstruction, so its own cost is two small
# convolutions and two norms.
BREAKDOWN_VARIANTS = {
    "full step": {},
    "without the adaptive weight": {"adaptive_disc_weight": False},
    "without LPIPS": {"perceptual_weight": 0.0},
    "without the GAN": {"disc_start": 10**9},
    "VAE, pixel and KL only": {"perceptual_weight": 0.0, "disc_start": 10**9},
}
# RAE's decoders (configs/decoder/ViT*/config.json of bytetriper/RAE): width, layers, heads, MLP width.
RAE_DECODERS = {"ViTB": (768, 12, 12, 3072), "ViTL": (1024, 24, 16, 4096), "ViTXL": (1152, 28, 16, 4096)}
DINOV2_B = dict(width=768, depth=12, patch=14, grid=37, registers=4)  # dinov2_vitb14_reg: 518 px stored
DINO_VITS8 = dict(width=384, depth=12, patch=8, grid=28, layer_scale=False)  # dino_vits8: 224 px


def parse_args(argv: Optional[List[str]]):
    """The options and the settings they give: one per config (or RAE decoder and GAN) x threads."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", help="VAE configs (default: vae_tiny 64 px b4, vae_micro 32 px b8).")
    parser.add_argument("--resolution", nargs="+", type=int,
                        help="One value for all configs or one per config (default 64 with --configs).")
    parser.add_argument("--batch_size", nargs="+", type=int,
                        help="One value for all configs or one per config (default 4 with --configs).")
    parser.add_argument("--threads", default="1,2", help="Comma-separated CPU thread counts to measure.")
    parser.add_argument("--steps", type=int, default=5, help="Timed calls per variant.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed calls per variant before timing.")
    parser.add_argument("--data", choices=("photos", "random"), default="photos",
                        help="Batches of crops of photos, or uniform noise in [-1, 1].")
    parser.add_argument("--breakdown", action="store_true", help="Our step with parts switched off.")
    parser.add_argument("--rae", nargs="+", choices=tuple(RAE_DECODERS), help="Our step for these RAE decoders.")
    parser.add_argument("--gan", nargs="+", default=["none", "dino"], choices=("none", "dino"), help="--rae: its GANs.")
    parser.add_argument("--json", help="Also write the raw results (per-call times) to this JSON file.")
    args = parser.parse_args(argv)
    args.mode = next((mode for mode in ("breakdown", "rae") if getattr(args, mode)), "step")
    count = len(args.rae or args.configs or [None])

    def per_config(values: Optional[List[int]], default: int) -> List[int]:
        values = values or [default]
        if len(values) not in (1, count):
            parser.error(f"--resolution, --batch_size: give one value or one per config ({count})")
        return values * count if len(values) == 1 else values

    resolutions, batches = per_config(args.resolution, 64), per_config(args.batch_size, 4)
    if args.rae:
        triples = [((decoder, gan), resolution, batch) for (decoder, resolution, batch), gan in
                   itertools.product(zip(args.rae, resolutions, batches), args.gan)]
    else:
        triples = list(zip(args.configs, resolutions, batches)) if args.configs else [
            ("configs/vae_tiny.json", 64, 4), ("configs/vae_micro.json", 32, 8)]
    settings = [{"config": config, "resolution": resolution, "batch_size": batch, "threads": int(threads),
                 "warmup": args.warmup, "steps": args.steps, "data": "random" if args.rae else args.data, "seed": 0,
                 "mode": args.mode}
                for config, resolution, batch in triples for threads in args.threads.split(",")]
    return args, settings


# ---------------------------------------------------------------- the worker (a fresh process per setting)
def run_of(setting: Dict, **flags) -> harness.Run:
    """The setting's run, with these extra entry-point flags."""
    config = flags.pop("vae_config_file", None) or os.path.join(harness.REPO_ROOT, setting["config"])
    return harness.build({"vae_config_file": config, "disc_start": 0, "resolution": setting["resolution"],
                          "per_device_train_batch_size": setting["batch_size"], "seed": setting["seed"],
                          "max_steps": 2 * (setting["warmup"] + setting["steps"]), **flags})


def our_step(setting: Dict, blocks: List[float]):
    run = run_of(setting)
    return run, {"our step": run.train_step}


def breakdown(setting: Dict, blocks: List[float]):
    """The variants of BREAKDOWN_VARIANTS; the full step's optimizer-step blocks go to `blocks`."""
    run = run_of(setting)

    def variant(values: Dict) -> Callable:
        def step(x, global_step):
            with run.losses(**values):
                block = run.train_step(x, global_step)
            if not values:
                blocks.append(block)
        return step

    return run, {name: variant(values) for name, values in BREAKDOWN_VARIANTS.items()}


def rae_step(setting: Dict, blocks: List[float]):
    (decoder, gan), config = setting["config"], os.path.join(setting["folder"], "rae.json")
    width, layers, heads, hidden = RAE_DECODERS[decoder]
    with open(config, "w") as handle:
        json.dump({"_class_name": "AutoencoderRAE", "encoder_input_size": 224, "patch_size": 16, "noise_tau": 0.8,
                   "decoder_hidden_size": width, "decoder_num_hidden_layers": layers,
                   "decoder_num_attention_heads": heads, "decoder_intermediate_size": hidden}, handle)
    folder = setting["folder"]
    gan_flags = {"disc_type": "dino", "disc_backbone_path": random_vit_file(folder, "dino.safetensors", **DINO_VITS8)} \
        if gan == "dino" else {"disc_start": 10**9}
    run = run_of(setting, vae_config_file=config, rae_encoder_path=random_vit_file(folder, "dinov2.safetensors",
                                                                                   **DINOV2_B),
                 disc_weight=0.75, adaptive_disc_weight_max=1e4, pixel_weight=0.5, learning_rate=2e-4, adam_beta1=0.9,
                 adam_beta2=0.95, max_steps=setting["warmup"] + setting["steps"], **gan_flags)
    return run, {"our step": run.train_step}


MODES = {"step": our_step, "breakdown": breakdown, "rae": rae_step}


def measure(setting: Dict) -> Dict:
    """Build, warm up, time the mode's variants interleaved, one global step counter over them all. Written files
(random weights, an RAE config) live in a folder of the worker's that goes with it."""
    blocks: List[float] = []
    with tempfile.TemporaryDirectory(prefix="training_step_") as folder:
        run, variants = MODES[setting["mode"]]({**setting, "folder": folder}, blocks)
        batches, global_steps = photo_batches(setting), itertools.count()

        def call(variant: Callable) -> Callable:
            def one():
                step = next(global_steps)
                variant(batches[step % len(batches)], step)
            return one

        timed = harness.interleaved({name: call(v) for name, v in variants.items()}, setting["steps"],
                                    setting["warmup"])
    first = next(iter(timed.values()))
    result = {"vae_params": harness.parameter_count(run.vae), "disc_params": harness.parameter_count(run.discriminator),
              "decoder_params": harness.parameter_count(getattr(run.vae, "decoder", run.vae)),
              "peak_rss_mib": first["rss_after_warmup_bytes"] / 2**20,
              "peak_rss_mib_end": harness.peak_rss_bytes() / 2**20,
              "busy_threads": harness.busy_threads(), **timed}
    if setting["mode"] == "breakdown":
        result["optimizer_block_s"] = statistics.median(blocks[setting["warmup"]:])
    return result


def photo_batches(setting: Dict, count: int = 4) -> List:
    """`count` float32 [B, 3, H, W] batches in [-1, 1]: crops (flipped at random) of the photos shipped in installed
    packages (harness.photo_files), cut by the trainer's own `crop` and `to_float`, or (data "random") uniform noise."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(setting["seed"])
    shape = (setting["batch_size"], 3, setting["resolution"], setting["resolution"])
    if setting["data"] == "random":
        return [paddle.to_tensor(rng.uniform(-1, 1, shape).astype("float32")) for _ in range(count)]
    from PIL import Image

    from vae_trainer.data.images import crop, to_float

    photos = [Image.open(path).convert("RGB") for path in harness.photo_files()]
    size = (setting["resolution"], setting["resolution"])
    crops = [to_float(crop(photos[i % len(photos)], size, rng, random_flip=True))
             for i in range(count * setting["batch_size"])]
    return [paddle.to_tensor(np.stack(crops[i::count])) for i in range(count)]


def random_vit_file(folder: str, name: str, width: int, depth: int, patch: int, grid: int, registers: int = 0,
                    layer_scale: bool = True) -> str:
    """A timm-layout ViT state dict of seeded random weights (the trainer's own `Dinov2`, whose parameters have timm's
    names; DINOv2: layer scales, registers if any; DINO v1: no layer scale), laid out as a user's downloaded file:
    FOLDER/NAME."""
    import paddle
    from safetensors.numpy import save_file

    from vae_trainer.models.dinov2 import Dinov2

    paddle.seed(0)
    vit = Dinov2(width, depth, width // 64, patch, registers, positions=grid * grid + (0 if registers else 1))
    state = {key: value.numpy().T.copy() if value.ndim == 2 and key.endswith(".weight") else value.numpy()
             for key, value in vit.state_dict().items() if layer_scale or ".ls" not in key}  # Linear: [out, in]
    path = os.path.join(folder, name)
    save_file(state, path)
    return path


# ---------------------------------------------------------------- the tables
def describe(setting: Dict) -> str:
    config = setting["config"]
    name = " ".join(config) if isinstance(config, (list, tuple)) else os.path.basename(config).removesuffix(".json")
    return f"{name} {setting['resolution']} px b{setting['batch_size']} {setting['threads']} thr"


def rows(results: List[Dict], width: int, row: Callable[[Dict, Dict], List[List]]) -> List[List]:
    """Each result's rows; a failed setting's, its error."""
    out = []
    for result in results:
        s = result["setting"]
        out += [[describe(s), harness.failed(result)] + [""] * (width - 2)] if "error" in result else row(result, s)
    return out


def breakdown_table(results: List[Dict]) -> str:
    def row(result, s):
        full, full_cpu, parts = result["full step"]["median_s"], result["full step"]["cpu_median_s"], []
        for name in BREAKDOWN_VARIANTS:
            median, cpu = result[name]["median_s"], result[name]["cpu_median_s"]
            if name == "full step":
                part, cost, cpu_cost = "all", full, full_cpu
            elif name.startswith("without "):
                part, cost, cpu_cost = name.removeprefix("without "), full - median, full_cpu - cpu
            else:  # the VAE-only step: what remains with every optional part off
                part, cost, cpu_cost = "VAE, pixel, KL, optimizers", median, cpu
            parts.append([describe(s), name, f"{median:.3f}", part, f"{cost:.3f}", f"{100 * cost / full:.0f}%",
                          f"{100 * cpu_cost / full_cpu:.0f}%"])
        block = result["optimizer_block_s"]
        return parts + [[describe(s), "(optimizer-step block alone)", "", "sync, norms, finite check, clip, both "
                         "optimizers, EMA", f"{block:.3f}", f"{100 * block / full:.0f}%", ""]]

    return harness.markdown(["config px batch threads", "step variant", "s/step", "part", "part's cost s/step",
                             "share of full step", "share by CPU time"], rows(results, 7, row))


def steps_table(results: List[Dict]) -> str:
    """Our step's figures per setting (the default, --rae)."""
    def row(result, s):
        step, gib = result["our step"], 2**10
        return [[f"{describe(s)} ({result['busy_threads']} busy)",
                 " / ".join(f"{result[k] / 1e6:.2f} M" for k in ("vae_params", "decoder_params", "disc_params")),
                 f"{step['median_s']:.3f}", " ".join(f"{t:.2f}" for t in step["times_s"]),
                 f"{s['batch_size'] / step['median_s']:.2f}", f"{result['peak_rss_mib'] / gib:.2f}",
                 f"{result['peak_rss_mib_end'] / gib:.2f}"]]

    return harness.markdown(["config px batch threads", "params VAE / decoder / D", "s/step", "the timed steps",
                             "img/s", "peak RSS GiB after warm-up", "at the end"], rows(results, 7, row))


def main(argv: Optional[List[str]] = None) -> None:
    if harness.serve_worker(argv, measure):
        return
    args, settings = parse_args(argv)
    harness.header(__file__, argv)
    results = [harness.in_fresh_process(__file__, s, s["threads"], without_torch=s["mode"] == "rae", label=describe(s))
               for s in settings]
    print(f"\n{breakdown_table(results) if args.mode == 'breakdown' else steps_table(results)}")
    print(f"\nMedian of {args.steps} timed optimizer steps per variant after {args.warmup} warm-up ones, interleaved, "
          f"{settings[0]['data']} batches. Load average after: {harness.load()}.")
    harness.save_json(args.json, results)


if __name__ == "__main__":
    sys.exit(main())
