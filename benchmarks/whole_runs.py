"""Whole training runs, ours beside the public Paddle reference trainer's own script on identical settings: seconds
per optimizer step with start-up excluded, or (`--memory`) the peak memory and step time of a run.

    python benchmarks/whole_runs.py --reference ../PaddleMIX --threads 1,2,0 --repeats 3    # speed, vae_tiny 64 px b4
    python benchmarks/whole_runs.py --memory --configs configs/sd_vae.json --resolution 128 256 --batch_size 1 \
        --options "" "--recompute true" [--reference ../PaddleMIX] [--device gpu]

Every run is a fresh process running a whole run as a user starts it: start-up, the optimizer steps, the final
checkpoint and the export with its latent statistics (their batch follows the training batch, evaluation.py). The
process is this script's `measure`, which runs the entry point in-process (`runpy`, as `python SCRIPT ...` would)
and returns its peaks when the run ends (a constant start-up, which the speed difference cancels). Both read one
LAION-style part file of JPEG crops of scikit-image photos written for the benchmark (`caption<TAB>-<TAB>base64`;
its name contains "laion400m", which the reference's parser requires). Settings beside a cell's options, identical
for both: the config, resolution and batch size, the same OMP_NUM_THREADS (`--threads`; 0: unset, each one's
default), dataloader workers, learning rate and discriminator start, no evaluation, no image logging, no
intermediate checkpoint.

Speed (the default; needs --reference): each system runs once for n1 and once for n2 optimizer steps
(`--reference_steps`), and s/step = (wall(n2) - wall(n1)) / (n2 - n1), so start-up and teardown cancel. Runs
alternate between the systems (the order reversed every repeat), `--repeats` times; the ratio is the median of the
per-repeat ratios, so that load which changes between repeats hits both alike. The discriminator starts at 0 by
default: the GAN runs from the first step, as the reference always computes it. CPU s/step counts user + system
time of the process and its workers.

Memory (`--memory`): one run per cell (config x resolution x batch x options) and system, `--steps` steps, the
discriminator after the last step by default (as in the issue-17 measurement the reference figure comes from),
dataloader workers off (the process is the whole run). Reported: on CPU the peak resident set of that process
(`ru_maxrss`, a high-water mark of the whole run, so the biggest moment wins, wherever it is), beside the peak
before the final checkpoint is written (start-up and the steps: what a longer run with rare checkpoints holds); on
a GPU (`--device gpu`) also `paddle.device.cuda.max_memory_allocated()`, the peak of Paddle's allocator (the figure
to size a GPU by); and the median compute seconds of an optimizer step after the first (our entry points log them
to VisualDL every step here: `perf/compute_seconds_per_step`). Of the options, the reference understands
`--recompute true` (its `--recompute`, ppdiffusers' block-level `enable_gradient_checkpointing()`); cells with other
options show "n/a" for it.

The reference is `ppdiffusers/examples/autoencoder/vae/train_vae.py` inside a local PaddleMIX checkout (tested at
commit 6afaf05): two VAE forwards per step (the second for the discriminator update), LPIPS computed in both, the
adaptive weight at every step. It runs unchanged, in a process of its own (`--run_reference`), with our Python
environment; its code is never copied here. This file only gives it the LPIPS weights it would download (from
`paddlenlp.bj.bcebos.com`, unreachable here: `get_weights_path_from_url` is pointed at the ImageNet VGG16 + LPIPS
v0.1 weights ours uses, rewritten in its layout, and the first speed run checks that its LPIPS then gives our
numbers), and puts an empty `albumentations` module in place when that package is missing (its `ldm/__init__.py`
imports it for an ImageNet dataset this benchmark does not use).
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import types
from typing import Dict, List, Optional

import harness

REFERENCE_EXAMPLE = os.path.join("ppdiffusers", "examples", "autoencoder", "vae")
REFERENCE_URLS = {"lpips_vgg16.pdparams": "vgg", "vgg_netlin.pdparams": "netlin"}  # URL file name -> ours
REFERENCE_OPTIONS = {(): [], ("--recompute", "true"): ["--recompute"], ("--recompute",): ["--recompute"]}
LPIPS_WEIGHTS = os.path.join(harness.REPO_ROOT, "weights", "lpips_vgg16.pdparams")
CELL = ("config", "resolution", "batch_size", "options")


# The defaults of the two benchmarks: speed (vae_tiny at 64 px, as issue 12.4 measured) and --memory (the SD VAE).
SPEED = {"configs": ["configs/vae_tiny.json"], "resolution": [64], "batch_size": [4], "options": [""],
         "threads": "1,2", "entry_points": ["train_vae_no_trainer.py", "train_vae_trainer.py"], "disc_start": 0}
MEMORY = {"configs": ["configs/sd_vae.json"], "resolution": [128, 256], "batch_size": [1],
          "options": ["", "--recompute true"], "threads": "1", "entry_points": ["train_vae_no_trainer.py"]}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="Peak memory of runs instead of seconds per step.")
    parser.add_argument("--reference", metavar="PADDLEMIX_DIR", help="A PaddleMIX checkout (e.g. commit 6afaf05) "
                                                                     "holding the reference's train_vae.py.")
    parser.add_argument("--configs", nargs="+")
    parser.add_argument("--resolution", nargs="+", type=int)
    parser.add_argument("--batch_size", nargs="+", type=int)
    parser.add_argument("--options", nargs="+", help='Extra flags of our entry point, one string per cell ("" = none).')
    parser.add_argument("--threads", help="Comma-separated OMP_NUM_THREADS; 0 = each trainer's default.")
    parser.add_argument("--entry_points", nargs="+", help="Our entry points.")
    parser.add_argument("--reference_steps", default="3,13", help="The two run lengths whose wall-time difference "
                                                                  "gives s/step.")
    parser.add_argument("--repeats", type=int, default=3, help="Alternating repeats.")
    parser.add_argument("--workers", type=int, default=0, help="Dataloader workers of both trainers (speed).")
    parser.add_argument("--steps", type=int, default=2, help="Optimizer steps per run (--memory).")
    parser.add_argument("--disc_start", type=int, help="Default: 0 (speed), after the last step (--memory).")
    parser.add_argument("--latent_stats_num_images", type=int, help="--memory: our runs' --latent_stats_num_images "
                        "(default: theirs). The export measures them at the training batch: fewer save time, not "
                        "memory.")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--json", help="Also write the raw results to this JSON file.")
    args = parser.parse_args(argv)
    for name, value in ({**MEMORY, "disc_start": args.steps + 1} if args.memory else SPEED).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not (args.memory or args.reference):
        parser.error("give --reference PADDLEMIX_DIR (or --memory)")
    return args


# ---------------------------------------------------------------- the runs' inputs and commands
def write_dataset(root: str, images: int = 64, seed: int = 0) -> str:
    """One part file of JPEG crops (80-128 px) of scikit-image photos; returns the .filelist.list path."""
    import numpy as np
    from PIL import Image
    from skimage import data as skimage_data

    rng = np.random.default_rng(seed)
    photos = [getattr(skimage_data, name)() for name in harness.PHOTOS]
    lines = []
    for index in range(images):
        photo = photos[index % len(photos)]
        photo = np.stack([photo] * 3, axis=-1) if photo.ndim == 2 else photo[..., :3]
        size = int(rng.integers(80, 129))
        y, x = (int(rng.integers(0, photo.shape[axis] - size)) for axis in (0, 1))
        buffer = io.BytesIO()
        Image.fromarray(photo[y:y + size, x:x + size]).save(buffer, "JPEG", quality=90)
        lines.append(f"crop {index}\t-\t{base64.b64encode(buffer.getvalue()).decode()}\n")
    part, filelist, filelist_list = (os.path.join(root, name) for name in (
        "laion400m_benchmark_part-00000", "laion400m_benchmark.filelist", "train.filelist.list"))
    for path, content in ((part, lines), (filelist, [part + "\n"]), (filelist_list, [filelist + "\n"])):
        with open(path, "w") as handle:
            handle.writelines(content)
    return filelist_list


def our_command(args: argparse.Namespace, entry_point: str, cell: Dict, steps: int, file_list: str,
                output_dir: str) -> List[str]:
    flags = {"file_list": file_list, "vae_config_file": os.path.join(harness.REPO_ROOT, cell["config"]),
             "resolution": cell["resolution"], "per_device_train_batch_size": cell["batch_size"], "max_steps": steps,
             "disc_start": args.disc_start, "seed": 0, "output_dir": output_dir, "image_logging_steps": 0,
             "save_steps": harness.NEVER, "device": args.device, "disable_tqdm": "true"}
    if args.memory:  # every step's compute seconds logged; the export's latent statistics as the user's
        flags.update(logging_steps=1, dataloader_num_workers=0)
        if args.latent_stats_num_images:
            flags["latent_stats_num_images"] = args.latent_stats_num_images
    else:  # no logging; the export's latent statistics (teardown) kept small
        flags.update(logging_steps=harness.NEVER, learning_rate=1e-4, dataloader_num_workers=args.workers,
                     latent_stats_num_images=cell["batch_size"])
    return [os.path.join(harness.REPO_ROOT, entry_point), *harness.argv(flags), *shlex.split(cell["options"])]


def their_command(args: argparse.Namespace, cell: Dict, steps: int, file_list: str, output_dir: str,
                  verify: bool) -> Optional[List[str]]:
    """This script with --run_reference for the cell's run, or None if its options have no counterpart there."""
    extra = REFERENCE_OPTIONS.get(tuple(shlex.split(cell["options"])))
    if extra is None:
        return None
    flags = {"vae_config_file": os.path.join(harness.REPO_ROOT, cell["config"]), "file_list": file_list,
             "resolution": cell["resolution"], "batch_size": cell["batch_size"], "max_train_steps": steps,
             "num_workers": 0 if args.memory else args.workers, "disc_start": args.disc_start, "learning_rate": 1e-4,
             "seed": 0, "output_dir": output_dir, "logging_steps": harness.NEVER,
             "image_logging_steps": harness.NEVER, "save_steps": harness.NEVER,
             "buffer_size": cell["batch_size"]}  # its shuffle buffer is filled before the first step
    run = {"paddlemix_dir": os.path.abspath(args.reference), "arguments": ["--from_scratch", *harness.argv(flags),
                                                                           *extra], "verify_lpips": verify}
    return [os.path.abspath(__file__), "--run_reference", json.dumps(run)]


# ---------------------------------------------------------------- one run
def whole_run(command: List[str], threads: int, output_dir: str) -> Dict:
    """`command` (SCRIPT ARGS) run by `measure` in a fresh process: its wall and CPU seconds, peaks, our step seconds
    (the median compute seconds of optimizer steps 2.., as the run logged them to VisualDL; the first warms up)."""
    result = harness.in_fresh_process(__file__, {"command": command}, threads)
    steps = sorted(r.value for step, r in harness.scalars(os.path.join(output_dir, "logs"),
                                                         "perf/compute_seconds_per_step").items() if step >= 2)
    result["step_seconds"] = steps[len(steps) // 2] if steps else None
    if result.get("exit_code"):
        result["error"] = [f"exit {result['exit_code']}"]
    return result


def measure(setting: Dict) -> Dict:
    """Run SCRIPT as `python SCRIPT ARGS` would, in this process: its exit code and peaks."""
    import runpy

    script, result = setting["command"][0], {"exit_code": 0}
    sys.argv = list(setting["command"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    if "train_vae" in os.path.basename(script):  # the peak before the final checkpoint: start-up and the steps
        from vae_trainer import checkpoint

        save = checkpoint.save_checkpoint

        def save_checkpoint(*args, **kwargs):
            result.setdefault("training_peak_rss_bytes", harness.peak_rss_bytes())
            return save(*args, **kwargs)

        checkpoint.save_checkpoint = save_checkpoint
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        result["exit_code"] = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    result["peak_rss_bytes"] = harness.peak_rss_bytes()
    paddle = sys.modules.get("paddle")
    if paddle is not None and paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu"):
        result["gpu_peak_bytes"] = int(paddle.device.cuda.max_memory_allocated())
    return result


# ---------------------------------------------------------------- the two benchmarks
def speed(args: argparse.Namespace, cell: Dict, threads: int, file_list: str, root: str) -> Dict:
    """Alternating runs of the reference and our entry points; per-repeat s/step and their ratios."""
    systems, verified = ["reference", *args.entry_points], False
    n1, n2 = (int(n) for n in args.reference_steps.split(","))
    per_step: Dict[str, List[float]] = {name: [] for name in systems}
    cpu_per_step: Dict[str, List[float]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        runs: Dict[str, Dict[int, Dict]] = {name: {} for name in systems}
        for steps in (n1, n2):
            for name in systems if repeat % 2 == 0 else systems[::-1]:
                output_dir = tempfile.mkdtemp(dir=root)
                command = (their_command(args, cell, steps, file_list, output_dir, verify=not verified)
                           if name == "reference" else our_command(args, name, cell, steps, file_list, output_dir))
                verified = verified or name == "reference"
                run = runs[name][steps] = whole_run(command, threads, output_dir)
                if "error" in run:
                    raise RuntimeError(f"{name} failed: " + "\n".join(run["error"]))
                print(f"  repeat {repeat + 1}: {name} {steps} steps {run['wall_seconds']:.1f} s "
                      f"(CPU {run['cpu_seconds']:.1f} s)", file=sys.stderr, flush=True)
        for name in systems:
            per_step[name].append((runs[name][n2]["wall_seconds"] - runs[name][n1]["wall_seconds"]) / (n2 - n1))
            cpu_per_step[name].append((runs[name][n2]["cpu_seconds"] - runs[name][n1]["cpu_seconds"]) / (n2 - n1))
    ratios = {label: {name: statistics.median(o / r for o, r in zip(values[name], values["reference"]))
                      for name in args.entry_points} for label, values in (("wall", per_step), ("cpu", cpu_per_step))}
    return {**cell, "threads": threads, "steps": [n1, n2], "seconds_per_step": per_step,
            "cpu_seconds_per_step": cpu_per_step, "ratio_to_reference": ratios["wall"],
            "cpu_ratio_to_reference": ratios["cpu"]}


def speed_table(args: argparse.Namespace, result: Dict) -> str:
    rows = []
    for name, values in result["seconds_per_step"].items():
        cpu, reference = result["cpu_seconds_per_step"][name], name == "reference"
        rows.append(["reference (PaddleMIX train_vae.py)" if reference else f"ours: {name}",
                     f"{statistics.median(values):.3f}", " ".join(f"{v:.3f}" for v in values),
                     "1" if reference else f"{result['ratio_to_reference'][name]:.2f}x",
                     f"{statistics.median(cpu):.3f}",
                     "1" if reference else f"{result['cpu_ratio_to_reference'][name]:.2f}x"])
    threads = (f"OMP_NUM_THREADS={result['threads']} for both" if result["threads"] > 0 else
               "OMP_NUM_THREADS unset (each one's default: 1 thread for the reference, all usable CPUs for ours)")
    (n1, n2), cell = result["steps"], f"{os.path.basename(result['config'])}, {result['resolution']} px"
    return harness.markdown(["system", "s/step (median)", "s/step per repeat", "ratio to reference",
                             "CPU s/step (median)", "CPU ratio"], rows) + (
        f"\n\n{cell}, batch {result['batch_size']}, {threads}, {args.workers} dataloader workers, disc_start "
        f"{args.disc_start}; s/step = (wall({n2} steps) - wall({n1} steps)) / {n2 - n1}, {args.repeats} alternating "
        "repeats; ratio = median of per-repeat ratios (target <= 0.35x). CPU s/step counts user + system time of the "
        "process and its workers: with one thread it measures the work and hardly moves with other load; with "
        "several, OpenMP's waiting counts too.")


def memory(args: argparse.Namespace, cell: Dict, threads: int, file_list: str, root: str) -> List[Dict]:
    """One run per system of the cell: its peaks and step seconds."""
    rows = []
    for system in args.entry_points + (["reference"] if args.reference else []):
        output_dir = tempfile.mkdtemp(dir=root)
        command = (their_command(args, cell, args.steps, file_list, output_dir, verify=False) if system == "reference"
                   else our_command(args, system, cell, args.steps, file_list, output_dir))
        if command is None:
            continue
        rows.append({**cell, "system": system, **whole_run(command, threads, output_dir)})
        done = rows[-1]
        status = ("FAILED: " + " ".join(done["error"]) if "error" in done else
                  f"peak RSS {gib(done.get('peak_rss_bytes'))} GiB, {done['step_seconds'] or 0:.1f} s/step")
        print(f"  {os.path.basename(cell['config'])} {cell['resolution']} px b{cell['batch_size']} "
              f"[{cell['options'] or '-'}] {system}: {status} ({done['wall_seconds']:.0f} s)", file=sys.stderr,
              flush=True)
    return rows


def gib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def memory_table(args: argparse.Namespace, results: List[Dict]) -> str:
    key, rows = "gpu_peak_bytes" if args.device == "gpu" else "peak_rss_bytes", []
    for row in results:
        reference = next((r for r in results if r["system"] == "reference" and all(r[k] == row[k] for k in CELL)), None)
        value = None if "error" in row else row.get(key)
        ratio = (f"{value / reference[key]:.2f}x" if reference and value and reference.get(key)
                 and "error" not in reference and row is not reference else "")
        step = "" if row.get("step_seconds") is None or row["system"] == "reference" else f"{row['step_seconds']:.1f}"
        rows.append([os.path.basename(row["config"]), row["resolution"], row["batch_size"],
                     f"`{row['options'] or '-'}`", row["system"], "failed" if "error" in row else gib(value), ratio,
                     gib(row.get("training_peak_rss_bytes")), step, f"{row['wall_seconds']:.0f}"])
    return harness.markdown(["config", "px", "batch", "options", "system", "GPU peak allocated GiB" if args.device ==
                             "gpu" else "peak RSS GiB", "ratio to reference", "peak RSS GiB before the final save",
                             "s/step", "wall s"], rows) + (
        f"\n\n{args.steps} optimizer steps per run, whole run (start-up to export), OMP_NUM_THREADS={args.threads}, "
        f"discriminator from step {args.disc_start}, LPIPS on.")


# ---------------------------------------------------------------- one reference run (child process)
def serve_reference_weights(directory: str) -> None:
    """Our LPIPS file rewritten in the reference's two layouts (paddle.vision VGG16, its `lins` heads), and paddle's
    weight download pointed at them (before the reference imports it)."""
    import paddle
    import paddle.utils.download as download

    state, paths = paddle.load(LPIPS_WEIGHTS), {}
    vgg = {key[len("vgg."):]: value for key, value in state.items() if key.startswith("vgg.")}
    # Its NetLinLayer is Sequential(Dropout, Conv2D): the conv is entry 1.
    netlin = {f"lins.{key.split('.')[1]}.model.1.weight": value for key, value in state.items()
              if key.startswith("heads.")}
    for url_name, layout in REFERENCE_URLS.items():
        paths[url_name] = os.path.join(directory, url_name)
        paddle.save(vgg if layout == "vgg" else netlin, paths[url_name])

    def local_weights(url: str, md5sum=None) -> str:
        name = url.rsplit("/", 1)[-1]
        if name not in paths:
            raise RuntimeError(f"the reference asked for {url}, which this benchmark cannot provide offline")
        return paths[name]

    download.get_weights_path_from_url = local_weights


def check_reference_lpips() -> None:
    """The reference's LPIPS, loaded from the served files, must give our LPIPS's numbers."""
    import numpy as np
    import paddle
    from ldm import LPIPS as ReferenceLPIPS

    from vae_trainer.models.lpips import LPIPS

    rng = np.random.default_rng(0)
    x, y = (paddle.to_tensor(rng.uniform(-1, 1, (2, 3, 64, 64)).astype("float32")) for _ in range(2))
    with paddle.no_grad():
        theirs = ReferenceLPIPS(net="vgg", verbose=False)(x, y).reshape([-1]).numpy()
        ours = LPIPS(LPIPS_WEIGHTS)(x, y).numpy()
    if not np.allclose(theirs, ours, rtol=1e-4, atol=1e-6):
        raise RuntimeError(f"the reference's LPIPS differs from ours: {theirs} vs {ours}")
    print(f"reference LPIPS matches ours: {theirs}", file=sys.stderr)


def run_reference(run: Dict) -> None:
    import runpy

    example = os.path.join(run["paddlemix_dir"], REFERENCE_EXAMPLE)
    with tempfile.TemporaryDirectory() as weights_dir:
        serve_reference_weights(weights_dir)
        try:
            import albumentations  # noqa: F401
        except ImportError:  # only the reference's ImageNet dataset uses it
            sys.modules["albumentations"] = types.ModuleType("albumentations")
        sys.path.insert(0, example)
        if run["verify_lpips"]:
            check_reference_lpips()
        sys.argv = [os.path.join(example, "train_vae.py"), *run["arguments"]]
        runpy.run_path(sys.argv[0], run_name="__main__")


def main(argv: Optional[List[str]] = None) -> None:
    words = sys.argv[1:] if argv is None else argv
    if harness.serve_worker(argv, measure):
        return
    if words[:1] == ["--run_reference"]:
        return run_reference(json.loads(words[1]))
    args = parse_args(argv)
    if args.reference and not os.path.isfile(os.path.join(args.reference, REFERENCE_EXAMPLE, "train_vae.py")):
        raise SystemExit(f"--reference: no {REFERENCE_EXAMPLE}/train_vae.py in {args.reference} (give the root of a "
                         "PaddleMIX checkout)")
    if args.reference and not os.path.isfile(LPIPS_WEIGHTS):
        raise SystemExit(f"LPIPS weights {LPIPS_WEIGHTS} not found: run `make setup`")
    harness.header(__file__, argv)
    cells = [dict(zip(CELL, values)) for values in itertools.product(args.configs, args.resolution, args.batch_size,
                                                                    args.options)]
    results = []
    with tempfile.TemporaryDirectory() as root:
        file_list = write_dataset(root)
        for cell in cells:
            for threads in (int(t) for t in args.threads.split(",")):
                if args.memory:
                    results += memory(args, cell, threads, file_list, root)
                else:
                    results.append(speed(args, cell, threads, file_list, root))
                    print(f"\n{speed_table(args, results[-1])}", flush=True)
    if args.memory:
        print(f"\n{memory_table(args, results)}")
    print(f"\nLoad average after: {harness.load()}.")
    harness.save_json(args.json, results)


if __name__ == "__main__":
    main()
