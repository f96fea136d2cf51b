"""CPU benchmark of the training step: seconds per optimizer step, images/s, peak memory, parameters.

    python benchmarks/benchmark.py                      # vae_tiny 64 px b4 and vae_micro 32 px b8, 1 and 2 threads
    python benchmarks/benchmark.py --configs configs/sd_vae.json --resolution 64 --batch_size 1 --threads 2

For every setting (config, resolution, batch size, threads) a fresh worker process (this script with
--worker) builds the real networks with `build_networks` / `build_optimization` (GAN active from step 0,
LPIPS on, default PatchGAN), runs warm-up steps, then times optimizer steps of two schemes, interleaved
step by step so that load from other processes hits both alike:

- "one forward" (ours): `TrainStep.forward_backward` + `TrainStep.optimizer_step`, as `vae_trainer.loop` runs it;
- "two forwards": `two_forward_step` below, the scheme of the public ppdiffusers / taming-style VAE
  trainers, which run the VAE a second time to produce reconstructions for the discriminator update.

One process per setting because the thread count must be in the environment before Paddle is imported,
and because peak RSS (`ru_maxrss`) is a high-water mark of the whole process.

Threads: Paddle 3.3.1 forces OMP_NUM_THREADS=1 when it is imported unless it is already set, and its
dygraph CPU kernels take their threads from OpenMP; FLAGS_paddle_num_threads (environment variable or
paddle.set_flags) does not add compute threads in dygraph. So the worker's environment gets both
OMP_NUM_THREADS and FLAGS_paddle_num_threads, and the worker reports how many of its threads did work.

Timed: the optimizer step only (batches are prepared beforehand), median over the timed steps.
Prints a markdown table; nothing is asserted.

Two more modes:

    python benchmarks/benchmark.py --breakdown          # where our step's time goes
    python benchmarks/benchmark.py --reference /work/ext/PaddleMIX [--threads 1]

- `--breakdown` times our step with parts switched off (the adaptive weight, LPIPS, the whole GAN),
  interleaved step by step, and `TrainStep.optimizer_step` alone; the differences are the parts' costs.
- `--reference PADDLEMIX_DIR` times the public reference trainer's own script against our entry points
  on identical settings, excluding start-up: see benchmarks/benchmark_reference.py.
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
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

from benchmark_reference import Comparison, compare, markdown_table as reference_table
from common import PHOTOS, REPO_ROOT, machine_description


DEFAULT_SETTINGS = [("configs/vae_tiny.json", 64, 4), ("configs/vae_micro.json", 32, 8)]


@dataclass
class Setting:
    config: str
    resolution: int
    batch_size: int
    threads: int
    warmup: int
    steps: int
    data: str
    seed: int = 0
    mode: str = "schemes"  # "schemes" (ours vs two forwards), "breakdown" or "lpips"


# ---------------------------------------------------------------- command line (parent process)
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", help="VAE configs (default: vae_tiny at 64 px b4, vae_micro at 32 px b8).")
    parser.add_argument("--resolution", nargs="+", type=int,
                        help="One value for all configs or one per config (default 64 with --configs).")
    parser.add_argument("--batch_size", nargs="+", type=int,
                        help="One value for all configs or one per config (default 4 with --configs).")
    parser.add_argument("--threads", default="1,2",
                        help="Comma-separated CPU thread counts to measure (--reference: 0 = each trainer's default).")
    parser.add_argument("--steps", type=int, default=5, help="Timed optimizer steps per scheme.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps per scheme before timing.")
    parser.add_argument("--data", choices=("photos", "random"), default="photos",
                        help="Batches of crops of scikit-image photos, or uniform noise in [-1, 1].")
    parser.add_argument("--json", help="Also write the raw results (per-step times) to this JSON file.")
    parser.add_argument("--breakdown", action="store_true",
                        help="Time our step with parts switched off (adaptive weight, LPIPS, GAN) instead of the two schemes.")
    parser.add_argument("--lpips", action="store_true",
                        help="Time LPIPS alone: our design against one VGG16 batch with a graph (training) "
                             "and two passes (evaluation).")
    parser.add_argument("--reference", metavar="PADDLEMIX_DIR",
                        help="Time the reference trainer (ppdiffusers/examples/autoencoder/vae/train_vae.py of this "
                             "PaddleMIX checkout, e.g. commit 6afaf05) against our entry points; see benchmark_reference.py.")
    parser.add_argument("--reference_steps", default="3,13",
                        help="--reference: the two run lengths whose wall-time difference gives s/step.")
    parser.add_argument("--repeats", type=int, default=3, help="--reference: alternating repeats.")
    parser.add_argument("--workers", type=int, default=0, help="--reference: dataloader workers of both trainers.")
    parser.add_argument("--disc_start", type=int, default=0,
                        help="--reference: discriminator start of both (0: the GAN runs at every step).")
    parser.add_argument("--entry_points", nargs="+", default=["train_vae_no_trainer.py", "train_vae_trainer.py"],
                        help="--reference: our entry points to time.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: JSON of a Setting
    parser.add_argument("--worker_output", help=argparse.SUPPRESS)  # internal: where the worker writes its result
    return parser.parse_args(argv)


def _per_config(values: Optional[List[int]], default: int, count: int, flag: str) -> List[int]:
    values = values or [default]
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise SystemExit(f"--{flag}: give one value or one per config ({count})")
    return values


def settings_from_args(args: argparse.Namespace) -> List[Setting]:
    if args.configs:
        resolutions = _per_config(args.resolution, 64, len(args.configs), "resolution")
        batch_sizes = _per_config(args.batch_size, 4, len(args.configs), "batch_size")
        triples = list(zip(args.configs, resolutions, batch_sizes))
    else:
        triples = DEFAULT_SETTINGS
    thread_counts = [int(t) for t in args.threads.split(",")]
    mode = "breakdown" if args.breakdown else "lpips" if args.lpips else "schemes"
    return [Setting(config, resolution, batch, threads, args.warmup, args.steps, args.data, mode=mode)
            for config, resolution, batch in triples for threads in thread_counts]


def run_in_worker(setting: Setting) -> Dict:
    """Measure one setting in a fresh process whose environment carries the thread count."""
    env = dict(os.environ, OMP_NUM_THREADS=str(setting.threads), FLAGS_paddle_num_threads=str(setting.threads))
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(asdict(setting)),
                   "--worker_output", output]
        started = time.perf_counter()
        process = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
        if process.returncode != 0 or not os.path.isfile(output):
            return {"setting": asdict(setting), "error": process.stderr.strip().splitlines()[-3:]}
        with open(output) as handle:
            result = json.load(handle)
    result["wall_seconds"] = time.perf_counter() - started
    return result


# ---------------------------------------------------------------- the report
def markdown_table(results: List[Dict]) -> str:
    header = ("| config | px | batch | threads (busy) | VAE params | D params | ours s/step | ours img/s "
              "| two-forward s/step | two-forward img/s | speedup | peak RSS MiB |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for result in results:
        s = result["setting"]
        name = os.path.basename(s["config"]).removesuffix(".json")
        if "error" in result:
            lines.append(f"| {name} | {s['resolution']} | {s['batch_size']} | {s['threads']} | failed: "
                         f"{' '.join(result['error'])[-120:]} |" + " |" * 8)
            continue
        ours, theirs = result["one_forward"], result["two_forwards"]
        lines.append(
            f"| {name} | {s['resolution']} | {s['batch_size']} | {s['threads']} ({result['busy_threads']}) "
            f"| {result['vae_params'] / 1e6:.2f} M | {result['disc_params'] / 1e6:.2f} M "
            f"| {ours['median_s']:.3f} | {s['batch_size'] / ours['median_s']:.2f} "
            f"| {theirs['median_s']:.3f} | {s['batch_size'] / theirs['median_s']:.2f} "
            f"| {result['speedup']:.2f}x | {result['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(Setting(**json.loads(args.worker)), args.worker_output)
        return
    if args.reference:
        run_reference_comparison(args)
        return
    settings = settings_from_args(args)
    print(f"$ python benchmarks/benchmark.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {machine_description()}; "
          f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    for setting in settings:
        results.append(run_in_worker(setting))
        done = results[-1]
        status = "failed" if "error" in done else f"done in {done['wall_seconds']:.0f} s"
        print(f"  {os.path.basename(setting.config)} {setting.resolution} px b{setting.batch_size} "
              f"{setting.threads} thread(s): {status}", file=sys.stderr, flush=True)
    print()
    table = {"breakdown": breakdown_table, "lpips": lpips_table, "schemes": markdown_table}[settings[0].mode]
    print(table(results))
    print()
    what = "optimizer steps per scheme" if settings[0].mode != "lpips" else "LPIPS calls per variant"
    print(f"Median of {args.steps} timed {what} after {args.warmup} warm-up ones, interleaved, {args.data} batches"
          + ("; speedup = median over step pairs of two-forward time / ours" if settings[0].mode == "schemes" else "")
          + f". Load average after: {os.getloadavg()[0]:.2f}.")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


def run_reference_comparison(args: argparse.Namespace) -> None:
    """--reference: our entry points against the reference trainer's script, per thread count."""
    config = (args.configs or ["configs/vae_tiny.json"])[0]
    steps = tuple(int(n) for n in args.reference_steps.split(","))
    print(f"$ python benchmarks/benchmark.py {' '.join(sys.argv[1:])}")
    print(f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {machine_description()}; "
          f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        comparison = Comparison(args.reference, config=config, resolution=(args.resolution or [64])[0],
                                batch_size=(args.batch_size or [4])[0], threads=threads, workers=args.workers,
                                steps=steps, repeats=args.repeats, disc_start=args.disc_start,
                                entry_points=args.entry_points)
        results.append(compare(comparison))
        print()
        print(reference_table(results[-1]), flush=True)
    print(f"\nLoad average after: {os.getloadavg()[0]:.2f}.")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


# ---------------------------------------------------------------- the worker (child process)
def make_batches(setting: Setting, count: int = 4) -> List:
    """A few float32 [B,3,H,W] batches in [-1, 1], prepared before timing."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(setting.seed)
    shape = (setting.batch_size, 3, setting.resolution, setting.resolution)
    if setting.data == "random":
        return [paddle.to_tensor(rng.uniform(-1, 1, shape).astype("float32")) for _ in range(count)]
    from PIL import Image
    from skimage import data as skimage_data

    from vae_trainer.data.images import preprocess

    photos = [Image.fromarray(getattr(skimage_data, name)()) for name in PHOTOS]
    crops = [preprocess(photos[i % len(photos)], setting.resolution, rng, random_flip=True)
             for i in range(count * setting.batch_size)]
    return [paddle.to_tensor(np.stack(crops[i::count])) for i in range(count)]


def build_run(setting: Setting, output_dir: str):
    """Model, LPIPS, optimizers and TrainStep, built by the package exactly as the drivers build them."""
    from vae_trainer.arguments import LossArguments, ModelArguments, VAETrainingArguments
    from vae_trainer.build import build_networks, build_optimization, seed_training, init_process

    model_args = ModelArguments(vae_config_file=os.path.join(REPO_ROOT, setting.config))
    loss_args = LossArguments(disc_start=0)  # GAN (adaptive weight, discriminator update) from the first step
    total_steps = 2 * (setting.warmup + setting.steps)
    training_args = VAETrainingArguments(
        output_dir=output_dir, report_to=[], device="cpu", max_steps=total_steps, seed=setting.seed,
        per_device_train_batch_size=setting.batch_size, disable_tqdm=True)
    init_process(training_args)
    networks = build_networks(model_args, loss_args, training_args)
    optimization = build_optimization(networks, loss_args, training_args)
    seed_training(setting.seed)
    return networks, loss_args, optimization


def one_forward_step(optimization, pixel_values, global_step: int, optimizer_times: Optional[List[float]] = None) -> None:
    """Our optimizer step, as `vae_trainer.loop.train` runs it (one micro-batch)."""
    optimization.forward_backward(pixel_values, global_step, 0)
    started = time.perf_counter()
    optimization.optimizer_step(global_step)
    if optimizer_times is not None:
        optimizer_times.append(time.perf_counter() - started)


def two_forward_step(networks, loss_args, optimization, pixel_values, global_step: int) -> None:
    """BASELINE, not used in training: the "two VAE forwards per step" scheme of public VAE trainers.

    As in ppdiffusers' examples/autoencoder/vae/train_vae.py (and taming / LDM under Lightning): for
    optimizer 0 the VAE runs, its loss is backpropagated and the VAE optimizer steps; for optimizer 1 the
    VAE runs AGAIN on the same batch to produce reconstructions for the discriminator loss. Their
    `toggle_optimizer` marks the VAE weights stop_gradient for that second pass, so it records no graph:
    the same cost as `paddle.no_grad()` here. Same losses, optimizers (with clipping) and schedules as
    ours; no NaN guard (they have none), which only favours the baseline.
    """
    import paddle

    from vae_trainer.objectives.gan import discriminator_objective
    from vae_trainer.objectives import vae_objective
    from vae_trainer.models.families import family_of
    from vae_trainer.optim import clip_grads, grad_norm

    model = networks.model
    model.train()
    recon, post_mean, post_logvar = model(pixel_values, sample_posterior=loss_args.sample_posterior)
    vae_objective(pixel_values, recon, post_mean, post_logvar, model.logvar, loss_args=loss_args,
                  lpips=networks.lpips, discriminator=model.discriminator,
                  last_layer=family_of(model.vae).last_layers(model.vae)[0],
                  gan_weight=loss_args.disc_weight).backward(recon)
    clip_grads(model.vae_parameters(), grad_norm(model.vae_parameters()), optimization.max_grad_norm)
    optimization.vae_optimizer.step()
    optimization.vae_scheduler.step()
    optimization.vae_optimizer.clear_grad()

    with paddle.no_grad():  # the second VAE forward, with the freshly updated weights
        recon, _, _ = model(pixel_values, sample_posterior=loss_args.sample_posterior)
    d_loss, _ = discriminator_objective(model.discriminator, pixel_values, recon, loss_args.disc_loss)
    d_loss.backward()
    clip_grads(model.discriminator_parameters(), grad_norm(model.discriminator_parameters()), optimization.max_grad_norm)
    optimization.disc_optimizer.step()
    optimization.disc_scheduler.step()
    optimization.disc_optimizer.clear_grad()


# --breakdown: our step with parts switched off (LossArguments overrides), the full step first. The
# differences to the full step are the parts' costs. The adaptive weight reuses the gradients of LPIPS and
# the discriminator at the reconstruction, so its own cost is two small convolutions and two norms.
BREAKDOWN_VARIANTS = {
    "full step": {},
    "without the adaptive weight": {"adaptive_disc_weight": False},
    "without LPIPS": {"perceptual_weight": 0.0},
    "without the GAN": {"disc_start": 10**9},
    "VAE, pixel and KL only": {"perceptual_weight": 0.0, "disc_start": 10**9},
}


class overridden:
    """Context manager: attributes of `target` temporarily set to `values`."""

    def __init__(self, target, values: Dict):
        self.target, self.values = target, values

    def __enter__(self):
        self.saved = {name: getattr(self.target, name) for name in self.values}
        for name, value in self.values.items():
            setattr(self.target, name, value)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(self.target, name, value)


def breakdown_schemes(optimization, loss_args, optimizer_times: List[float]) -> Dict[str, Callable]:
    def variant(values: Dict) -> Callable:
        def step(x, global_step):
            with overridden(loss_args, values):
                one_forward_step(optimization, x, global_step, optimizer_times if not values else None)
        return step

    return {name: variant(values) for name, values in BREAKDOWN_VARIANTS.items()}


def breakdown_table(results: List[Dict]) -> str:
    lines = []
    for result in results:
        s = result["setting"]
        lines.append(f"{os.path.basename(s['config'])}, {s['resolution']} px, batch {s['batch_size']}, "
                     f"{s['threads']} thread(s):\n")
        if "error" in result:
            lines.append(f"failed: {' '.join(result['error'])}\n")
            continue
        full = result["full step"]["median_s"]
        full_cpu = result["full step"]["cpu_median_s"]
        lines += ["| step variant | s/step | part | part's cost s/step | share of full step | share by CPU time |",
                  "|---|---|---|---|---|---|"]
        for name in BREAKDOWN_VARIANTS:
            median, cpu = result[name]["median_s"], result[name]["cpu_median_s"]
            if name == "full step":
                part, cost, cpu_cost = "all", full, full_cpu
            elif name.startswith("without "):
                part, cost, cpu_cost = name.removeprefix("without "), full - median, full_cpu - cpu
            else:  # the VAE-only step: what remains with every optional part off
                part, cost, cpu_cost = "VAE, pixel, KL, optimizers", median, cpu
            lines.append(f"| {name} | {median:.3f} | {part} | {cost:.3f} | {100 * cost / full:.0f}% "
                         f"| {100 * cpu_cost / full_cpu:.0f}% |")
        block = result["optimizer_block_s"]
        lines.append(f"| (optimizer-step block alone) | | sync, norms, finite check, clip, both optimizers, EMA "
                     f"| {block:.3f} | {100 * block / full:.0f}% | |")
        lines.append("")
    return "\n".join(lines)


def lpips_schemes(lpips) -> Dict[str, Callable]:
    """--lpips: our LPIPS against the designs it rejected, on the batch and a slightly changed copy of it."""
    import paddle

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
        def run(x, step):
            with paddle.no_grad():
                distance_fn(x, 0.9 * x)
        return run

    return {
        "training: ours (graph on the reconstruction only)": training(lpips),
        "training: one batch with a graph": training(one_batch_with_graph),
        "evaluation: ours (one batch)": evaluation(lpips),
        "evaluation: two passes": evaluation(two_passes),
    }


def lpips_table(results: List[Dict]) -> str:
    lines = ["| config px batch threads | LPIPS (forward; backward in training) | s/call | ratio to ours | CPU ratio to ours |",
             "|---|---|---|---|---|"]
    for result in results:
        s = result["setting"]
        label = f"{s['resolution']} px b{s['batch_size']} {s['threads']} thr"
        if "error" in result:
            lines.append(f"| {label} | failed: {' '.join(result['error'])[-120:]} | | |")
            continue
        for name in result["ratio_to_first"]:
            ours = "training: ours" if name.startswith("training") else "evaluation: ours"
            ours_result = next(value for key, value in result.items() if key.startswith(ours))
            lines.append(f"| {label} | {name} | {result[name]['median_s']:.3f} | "
                         f"{result[name]['median_s'] / ours_result['median_s']:.2f}x | "
                         f"{result[name]['cpu_median_s'] / ours_result['cpu_median_s']:.2f}x |")
    return "\n".join(lines)


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def busy_thread_count(min_share: float = 0.1) -> Optional[int]:
    """Threads of this process that used at least `min_share` of the busiest one's CPU time (Linux)."""
    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):
        return None
    cpu_ticks = []
    for task in os.listdir(task_dir):
        with open(os.path.join(task_dir, task, "stat")) as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        cpu_ticks.append(int(fields[11]) + int(fields[12]))  # utime + stime
    busiest = max(cpu_ticks)
    return sum(ticks >= min_share * busiest for ticks in cpu_ticks)


def parameter_count(layer) -> int:
    return sum(int(p.size) for p in layer.parameters())


def timed(step: Callable[[], None], cpu_times: List[float]) -> float:
    """Wall time of `step`; its CPU time (all threads of this process) is appended to `cpu_times`."""
    started, cpu_started = time.perf_counter(), time.process_time()
    step()
    cpu_times.append(time.process_time() - cpu_started)
    return time.perf_counter() - started


def run_worker(setting: Setting, output_path: str) -> None:
    sys.path.insert(0, REPO_ROOT)
    with tempfile.TemporaryDirectory() as output_dir:
        networks, loss_args, optimization = build_run(setting, output_dir)
        batches = make_batches(setting)
        optimizer_times: List[float] = []
        if setting.mode == "breakdown":
            schemes = breakdown_schemes(optimization, loss_args, optimizer_times)
        elif setting.mode == "lpips":
            schemes = lpips_schemes(networks.lpips)
        else:
            schemes = {
                "one_forward": lambda x, step: one_forward_step(optimization, x, step),
                "two_forwards": lambda x, step: two_forward_step(networks, loss_args, optimization, x, step),
            }
        global_step = 0
        # Our (full) step's warm-up first, so the peak RSS below is that of our step alone.
        for index, name in enumerate(schemes):
            for _ in range(setting.warmup):
                schemes[name](batches[global_step % len(batches)], global_step)
                global_step += 1
            if index == 0:
                rss_ours = peak_rss_mib()
        optimizer_times.clear()
        times: Dict[str, List[float]] = {name: [] for name in schemes}
        cpu_times: Dict[str, List[float]] = {name: [] for name in schemes}
        for _ in range(setting.steps):  # interleaved: background load hits both schemes alike
            for name, scheme in schemes.items():
                x, step = batches[global_step % len(batches)], global_step
                times[name].append(timed(lambda: scheme(x, step), cpu_times[name]))
                global_step += 1
    model = networks.model
    result = {
        "setting": asdict(setting),
        "vae_params": parameter_count(model.vae),
        "disc_params": parameter_count(model.discriminator),
        "peak_rss_mib": rss_ours,
        "peak_rss_mib_both": peak_rss_mib(),
        "busy_threads": busy_thread_count(),
        **{name: {"median_s": statistics.median(t), "min_s": min(t), "times_s": t,
                  "cpu_median_s": statistics.median(cpu_times[name])} for name, t in times.items()},
    }
    first = next(iter(times))
    # Ratios of adjacent calls to the first scheme's: robust to background load that changes during the run.
    result["ratio_to_first"] = {name: statistics.median(b / a for a, b in zip(times[first], t)) for name, t in times.items()}
    if setting.mode == "breakdown":
        result["optimizer_block_s"] = statistics.median(optimizer_times)
    elif setting.mode == "schemes":
        result["speedup"] = result["ratio_to_first"]["two_forwards"]
    with open(output_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
