"""What does our training step cost on CPU, against the designs it was chosen over, part by part, with the VF loss,
and for RAE's decoders? Seconds per optimizer step, images/s, peak memory, parameters.

    python benchmarks/training_step.py                  # vae_tiny 64 px b4 and vae_micro 32 px b8, 1 and 2 threads
    python benchmarks/training_step.py --configs configs/sd_vae.json --resolution 64 --batch_size 1 --threads 2
    python benchmarks/training_step.py --breakdown      # where our step's time goes
    python benchmarks/training_step.py --lpips          # LPIPS: our design against the rejected ones
    python benchmarks/training_step.py --heads          # the heads on a leaf of the reconstruction, or plain autograd
    python benchmarks/training_step.py --vf --configs configs/vae_tiny.json --resolution 256 --batch_size 1
    python benchmarks/training_step.py --rae ViTB ViTXL --gan none dino --resolution 256 --batch_size 1 --threads 2

Every setting (config or RAE decoder, resolution, batch size, threads) runs in a fresh process that builds the real
components with the package's builders (harness.build: LPIPS on, the default PatchGAN, the GAN with its adaptive
weight and discriminator update from step 0), prepares its batches, warms each variant up, then times the variants
interleaved call by call (harness.interleaved). Timed: the optimizer step (batches are made beforehand). The mode:

- by default, two schemes: "one forward" (ours: `TrainStep.forward_backward` + `TrainStep.optimizer_step`, as
  `vae_trainer.loop` runs it) and "two forwards" (`Run.two_forward_step` in harness.py: the scheme of the public
  ppdiffusers / taming-style VAE trainers, which run the VAE a second time to produce reconstructions for the
  discriminator update). Peak RSS: after our warm-up, before the two-forward scheme ran; "busy": the threads that
  did work; speedup: the median over step pairs of two-forward time / ours;
- `--breakdown`: our step with parts switched off (the adaptive weight, LPIPS, the whole GAN), and the
  optimizer-step block alone; the differences to the full step are the parts' costs;
- `--lpips`: LPIPS alone, forward and (training) backward: our design against one VGG16 batch with a graph
  (training) and two passes (evaluation);
- `--heads`: our step (the heads' gradients taken once at a leaf copy of the reconstruction, the adaptive weight's
  at the last layer from there: objectives/__init__.py) against plain autograd (`Run.plain_autograd_step`: the
  adaptive weight by paddle.grad of the nll and of the GAN term at the last layer through LPIPS and the
  discriminator, then one backward of the weighted sum, as taming's LPIPSWithDiscriminator);
- `--vf`: our step without the VF loss (VA-VAE), with it, and with it but --adaptive_vf false, one run each;
- `--rae DECODER...`: our step for RAE's decoders (the sizes of the authors' configs/decoder) on a DINOv2-B encoder
  with registers (86.6 M parameters, frozen, its forward at 224 px in the step), L1 (--pixel_weight 0.5) + LPIPS,
  with `--gan dino` RAE's DINO discriminator (a ViT-S/8) from the first step, or without a GAN; random images.

Networks that would be downloaded (DINOv2, DINO) are timm files of seeded random weights: a network's cost does not
depend on its weights. Prints a markdown table; nothing is asserted. Whole runs beside the reference trainer's:
whole_runs.py.
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
DINOV2_S = dict(width=384, depth=12, patch=14, grid=16)  # the VF loss's stand-in for dinov2-small, 224 px


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
                        help="Batches of crops of scikit-image photos, or uniform noise in [-1, 1].")
    parser.add_argument("--breakdown", action="store_true", help="Our step with parts switched off.")
    parser.add_argument("--lpips", action="store_true", help="LPIPS alone: our design against the rejected ones.")
    parser.add_argument("--heads", action="store_true", help="The heads on a leaf copy against plain autograd.")
    parser.add_argument("--vf", action="store_true", help="Our step without the VF loss, with it, and with it but "
                                                          "--adaptive_vf false.")
    parser.add_argument("--vf_model_path", help="--vf: the foundation model (default: a random DINOv2-small file).")
    parser.add_argument("--rae", nargs="+", choices=tuple(RAE_DECODERS), help="Our step for these RAE decoders.")
    parser.add_argument("--gan", nargs="+", default=["none", "dino"], choices=("none", "dino"), help="--rae: its GANs.")
    parser.add_argument("--json", help="Also write the raw results (per-call times) to this JSON file.")
    args = parser.parse_args(argv)
    args.mode = next((mode for mode in ("breakdown", "lpips", "heads", "vf", "rae") if getattr(args, mode)), "schemes")
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
                 "mode": args.mode, "vf_model_path": args.vf_model_path}
                for config, resolution, batch in triples for threads in args.threads.split(",")]
    return args, settings


# ---------------------------------------------------------------- the worker (a fresh process per setting)
def run_of(setting: Dict, **flags) -> harness.Run:
    """The setting's run, with these extra entry-point flags."""
    config = flags.pop("vae_config_file", None) or os.path.join(harness.REPO_ROOT, setting["config"])
    return harness.build({"vae_config_file": config, "disc_start": 0, "resolution": setting["resolution"],
                          "per_device_train_batch_size": setting["batch_size"], "seed": setting["seed"],
                          "max_steps": 2 * (setting["warmup"] + setting["steps"]), **flags})


def schemes(setting: Dict, blocks: List[float]):
    run = run_of(setting)
    return run, {"one_forward": run.train_step, "two_forwards": run.two_forward_step}


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


def lpips_designs(setting: Dict, blocks: List[float]):
    """Our LPIPS against the designs it rejected, on the batch and a slightly changed copy of it."""
    import paddle

    run = run_of(setting)
    lpips = run.lpips

    def one_batch_with_graph(x, y):
        """BASELINE, not used: input and reconstruction as ONE VGG16 batch, which then carries a graph."""
        features = lpips.vgg(paddle.concat([x, y]))
        return lpips.distance([f[: x.shape[0]] for f in features], [f[x.shape[0]:] for f in features])

    def two_passes(x, y):
        """BASELINE, not used: the two VGG16 passes of the earlier implementation (evaluation)."""
        return lpips.distance(lpips.vgg(x), lpips.vgg(y))

    def reconstruction(x):
        y = (0.9 * x).detach()
        y.stop_gradient = False
        return y

    def training(distance_fn):
        return lambda x, step: distance_fn(x, reconstruction(x)).mean().backward()

    def evaluation(distance_fn):
        def run_it(x, step):
            with paddle.no_grad():
                distance_fn(x, 0.9 * x)
        return run_it

    return run, {"training: ours (graph on the reconstruction only)": training(lpips),
                 "training: one batch with a graph": training(one_batch_with_graph),
                 "evaluation: ours (one batch)": evaluation(lpips), "evaluation: two passes": evaluation(two_passes)}


def heads(setting: Dict, blocks: List[float]):
    run = run_of(setting)
    return run, {"heads on a leaf": run.train_step, "plain autograd": run.plain_autograd_step}


def vf_costs(setting: Dict, blocks: List[float]):
    vf_model = setting["vf_model_path"] or random_vit_file(setting["folder"], "dinov2_small.safetensors", **DINOV2_S)
    runs = {"no VF": run_of(setting), "VF": run_of(setting, vf_model_path=vf_model),
            "VF, --adaptive_vf false": run_of(setting, vf_model_path=vf_model, adaptive_vf="false")}
    return runs["no VF"], {name: run.train_step for name, run in runs.items()}


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
    return run, {"step": run.train_step}


MODES = {"schemes": schemes, "breakdown": breakdown, "lpips": lpips_designs, "heads": heads, "vf": vf_costs,
         "rae": rae_step}


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
              "peak_rss_mib": first["rss_after_warmup_bytes"] / 2**20,
              "peak_rss_mib_end": harness.peak_rss_bytes() / 2**20,
              "busy_threads": harness.busy_threads(), **timed}
    if setting["mode"] == "breakdown":
        result["optimizer_block_s"] = statistics.median(blocks[setting["warmup"]:])
    elif setting["mode"] == "schemes":
        result["speedup"] = timed["two_forwards"]["ratio_to_first"]
    elif setting["mode"] == "rae":
        result["decoder_params"] = harness.parameter_count(run.vae.decoder)
    return result


def photo_batches(setting: Dict, count: int = 4) -> List:
    """`count` float32 [B, 3, H, W] batches in [-1, 1]: crops (flipped at random) of the photos shipped with
    scikit-image, cut by the trainer's own `preprocess`, or (data "random") uniform noise."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(setting["seed"])
    shape = (setting["batch_size"], 3, setting["resolution"], setting["resolution"])
    if setting["data"] == "random":
        return [paddle.to_tensor(rng.uniform(-1, 1, shape).astype("float32")) for _ in range(count)]
    from PIL import Image
    from skimage import data as skimage_data

    from vae_trainer.data.images import preprocess

    photos = [Image.fromarray(getattr(skimage_data, name)()) for name in harness.PHOTOS]
    crops = [preprocess(photos[i % len(photos)], setting["resolution"], rng, random_flip=True)
             for i in range(count * setting["batch_size"])]
    return [paddle.to_tensor(np.stack(crops[i::count])) for i in range(count)]


def random_vit_file(folder: str, name: str, width: int, depth: int, patch: int, grid: int, registers: int = 0,
                    layer_scale: bool = True) -> str:
    """A timm-layout ViT state dict of seeded random weights (DINOv2: layer scales, registers if any; DINO v1: no
    layer scale), laid out as a user's downloaded file: FOLDER/NAME."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    ones = np.ones(width, np.float32)
    state = {"cls_token": normal(1, 1, width), "pos_embed": normal(1, grid * grid + (0 if registers else 1), width),
             "patch_embed.proj.weight": normal(width, 3, patch, patch), "patch_embed.proj.bias": normal(width),
             "norm.weight": ones, "norm.bias": normal(width), **({"reg_token": normal(1, registers, width)} if registers
                                                              else {})}
    for i in range(depth):
        block = {"norm1.weight": ones, "norm1.bias": normal(width), "attn.qkv.weight": normal(3 * width, width),
                 "attn.qkv.bias": normal(3 * width), "attn.proj.weight": normal(width, width),
                 "attn.proj.bias": normal(width), "norm2.weight": ones, "norm2.bias": normal(width),
                 "mlp.fc1.weight": normal(4 * width, width), "mlp.fc1.bias": normal(4 * width),
                 "mlp.fc2.weight": normal(width, 4 * width), "mlp.fc2.bias": normal(width),
                 **({"ls1.gamma": ones, "ls2.gamma": ones} if layer_scale else {})}
        state.update({f"blocks.{i}.{k}": v for k, v in block.items()})
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


def schemes_table(results: List[Dict]) -> str:
    def row(result, s):
        ours, theirs = result["one_forward"], result["two_forwards"]
        return [[os.path.basename(s["config"]).removesuffix(".json"), s["resolution"], s["batch_size"],
                 f"{s['threads']} ({result['busy_threads']})", f"{result['vae_params'] / 1e6:.2f} M",
                 f"{result['disc_params'] / 1e6:.2f} M", f"{ours['median_s']:.3f}",
                 f"{s['batch_size'] / ours['median_s']:.2f}", f"{theirs['median_s']:.3f}",
                 f"{s['batch_size'] / theirs['median_s']:.2f}", f"{result['speedup']:.2f}x",
                 f"{result['peak_rss_mib']:.0f}"]]

    return harness.markdown(["config", "px", "batch", "threads (busy)", "VAE params", "D params", "ours s/step",
                             "ours img/s", "two-forward s/step", "two-forward img/s", "speedup", "peak RSS MiB"],
                            rows(results, 12, row))


def breakdown_table(results: List[Dict]) -> str:
    tables = []
    for result in results:
        s = result["setting"]
        title = (f"{os.path.basename(s['config'])}, {s['resolution']} px, batch {s['batch_size']}, "
                 f"{s['threads']} thread(s):")
        if "error" in result:
            tables.append(f"{title}\n\n{harness.failed(result)}\n")
            continue
        full, full_cpu, parts = result["full step"]["median_s"], result["full step"]["cpu_median_s"], []
        for name in BREAKDOWN_VARIANTS:
            median, cpu = result[name]["median_s"], result[name]["cpu_median_s"]
            if name == "full step":
                part, cost, cpu_cost = "all", full, full_cpu
            elif name.startswith("without "):
                part, cost, cpu_cost = name.removeprefix("without "), full - median, full_cpu - cpu
            else:  # the VAE-only step: what remains with every optional part off
                part, cost, cpu_cost = "VAE, pixel, KL, optimizers", median, cpu
            parts.append([name, f"{median:.3f}", part, f"{cost:.3f}", f"{100 * cost / full:.0f}%",
                          f"{100 * cpu_cost / full_cpu:.0f}%"])
        block = result["optimizer_block_s"]
        parts.append(["(optimizer-step block alone)", "", "sync, norms, finite check, clip, both optimizers, EMA",
                      f"{block:.3f}", f"{100 * block / full:.0f}%", ""])
        tables.append(f"{title}\n\n" + harness.markdown(["step variant", "s/step", "part", "part's cost s/step",
                                                         "share of full step", "share by CPU time"], parts) + "\n")
    return "\n".join(tables)


def lpips_table(results: List[Dict]) -> str:
    def row(result, s):
        label = f"{s['resolution']} px b{s['batch_size']} {s['threads']} thr"
        names = [key for key in result if key.startswith(("training:", "evaluation:"))]
        ours = {name: result[next(k for k in names if k.startswith(name.split(":")[0] + ": ours"))] for name in names}
        return [[label, name, f"{result[name]['median_s']:.3f}",
                 f"{result[name]['median_s'] / ours[name]['median_s']:.2f}x",
                 f"{result[name]['cpu_median_s'] / ours[name]['cpu_median_s']:.2f}x"] for name in names]

    return harness.markdown(["config px batch threads", "LPIPS (forward; backward in training)", "s/call",
                             "ratio to ours", "CPU ratio to ours"], rows(results, 5, row))


def variants_table(results: List[Dict]) -> str:
    """Each variant's s/step and its ratio to the first's (--heads, --vf)."""
    def row(result, s):
        names = [name for name, value in result.items() if isinstance(value, dict) and "median_s" in value]
        first = result[names[0]]["median_s"]
        return [[describe(s), name, f"{result[name]['median_s']:.2f}", f"{result[name]['median_s'] / first:.2f}"]
                for name in names]

    return harness.markdown(["config px batch threads", "step", "s/step", "ratio"], rows(results, 4, row))


def rae_table(results: List[Dict]) -> str:
    def row(result, s):
        step = result["step"]
        return [[*s["config"], s["resolution"], s["batch_size"], f"{s['threads']} ({result['busy_threads']})",
                 f"{result['decoder_params'] / 1e6:.1f} M", f"{step['median_s']:.2f}",
                 " ".join(f"{t:.1f}" for t in step["times_s"]), f"{result['peak_rss_mib'] / 1024:.2f}",
                 f"{result['peak_rss_mib_end'] / 1024:.2f}"]]

    return harness.markdown(["decoder", "GAN", "px", "batch", "threads (busy)", "decoder params", "s/step",
                             "the timed steps", "peak RSS GiB after warm-up", "at the end"], rows(results, 10, row))


def main(argv: Optional[List[str]] = None) -> None:
    if harness.serve_worker(argv, measure):
        return
    args, settings = parse_args(argv)
    harness.header(__file__, argv)
    results = [harness.in_fresh_process(__file__, s, s["threads"], without_torch=s["mode"] == "rae", label=describe(s))
               for s in settings]
    tables = {"schemes": schemes_table, "breakdown": breakdown_table, "lpips": lpips_table, "heads": variants_table,
              "vf": variants_table, "rae": rae_table}
    print(f"\n{tables[args.mode](results)}")
    what = {"lpips": "LPIPS calls per variant", "schemes": "optimizer steps per scheme"}
    what = what.get(args.mode, "optimizer steps per variant")
    speedup = "; speedup = median over step pairs of two-forward time / ours" if args.mode == "schemes" else ""
    print(f"\nMedian of {args.steps} timed {what} after {args.warmup} warm-up ones, interleaved, {settings[0]['data']} "
          f"batches{speedup}. Load average after: {harness.load()}.")
    harness.save_json(args.json, results)


if __name__ == "__main__":
    sys.exit(main())
