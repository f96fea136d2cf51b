"""Peak memory (and step time) of whole training runs: config x resolution x batch x options, ours beside the
reference.

    python benchmarks/benchmark_memory.py --configs configs/sd_vae.json --resolution 128 256 --batch_size 1 \
        --options "" "--recompute true"                                   # the README's CPU table
    python benchmarks/benchmark_memory.py ... --reference /path/to/PaddleMIX  # + the reference trainer's figure
    python benchmarks/benchmark_memory.py ... --device gpu                    # GPU: paddle.device.cuda peak

Every cell is one fresh process running a whole run as a user starts it (`train_vae_no_trainer.py` by
default, `--entry_points` for the other): start-up, `--steps` optimizer steps, the final checkpoint and the
export with its latent statistics (their batch follows the training batch, evaluation.py). Reported:

- the peak RSS before the final checkpoint is written (start-up and the training steps: what a longer run
  with rare checkpoints holds), beside that of the whole run;
- the median compute seconds of an optimizer step after the first (our entry points log them to VisualDL
  every step here: `perf/compute_seconds_per_step`);

- CPU: the peak resident set size of that process (`ru_maxrss`, a high-water mark of the whole run, so
  the biggest moment wins, wherever it is). Dataloader workers are off (`--workers 0`), so the process is
  the whole run.
- GPU (`--device gpu`): also `paddle.device.cuda.max_memory_allocated()` at the end of the run, the peak of
  Paddle's allocator (the figure to size a GPU by); RSS is then host memory only.

The process is this script in `--measure` mode, which runs the entry point in-process (`runpy`, as
`python train_vae_no_trainer.py ...` would) and writes its own peaks when the run ends. Settings beside the
options: LPIPS on, the discriminator starting at `--disc_start` (default: after the last step, as in the
issue-17 measurement the reference figure comes from), no evaluation, no image logging, no intermediate
checkpoint, `--threads` OpenMP threads, the dataset of benchmarks/benchmark_reference.py (JPEG crops of
scikit-image photos).

`--reference PADDLEMIX_DIR` also runs the PaddleMIX reference `train_vae.py` on the same settings, through
benchmarks/benchmark_reference.py (which serves it our LPIPS weights offline); of the options, it understands
`--recompute true` (its `--recompute`, ppdiffusers' block-level `enable_gradient_checkpointing()`); cells
with other options show "n/a" for it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from benchmark_reference import Comparison, reference_arguments, write_dataset
from common import REPO_ROOT, machine_description

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
NEVER = 10**9


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["configs/sd_vae.json"])
    parser.add_argument("--resolution", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--batch_size", nargs="+", type=int, default=[1])
    parser.add_argument("--options", nargs="+", default=["", "--recompute true"],
                        help='Extra flags of our entry point, one string per column set ("" = none).')
    parser.add_argument("--entry_points", nargs="+", default=["train_vae_no_trainer.py"])
    parser.add_argument("--steps", type=int, default=2, help="Optimizer steps per run.")
    parser.add_argument("--disc_start", type=int, default=None,
                        help="Step the discriminator starts at (default: never within the run).")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run.")
    parser.add_argument("--latent_stats_num_images", type=int, default=None,
                        help="Our runs' --latent_stats_num_images (default: theirs). The export measures them at the "
                             "training batch, so fewer images save time, not memory.")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--reference", metavar="PADDLEMIX_DIR", help="Also run the PaddleMIX reference trainer.")
    parser.add_argument("--json", help="Also write the results to this JSON file.")
    parser.add_argument("--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # internal: RESULT SCRIPT ARGS
    return parser.parse_args(argv)


# ---------------------------------------------------------------- one measured run (child process)
def measure(result_path: str, script: str, arguments: List[str]) -> None:
    """Run `script` as `python script arguments...` would, in this process; write its peaks to result_path."""
    import runpy

    sys.argv = [script, *arguments]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code, result = 0, {}
    if "train_vae" in os.path.basename(script):  # the peak before the final checkpoint: start-up and the steps
        from vae_trainer import checkpoint

        save = checkpoint.save_checkpoint

        def save_checkpoint(*args, **kwargs):
            result.setdefault("training_peak_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            return save(*args, **kwargs)

        checkpoint.save_checkpoint = save_checkpoint
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        result.update(peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, exit_code=code)
        paddle = sys.modules.get("paddle")
        if paddle is not None and paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu"):
            result["gpu_peak_bytes"] = int(paddle.device.cuda.max_memory_allocated())
        with open(result_path, "w") as handle:
            json.dump(result, handle)


def step_seconds(output_dir: str) -> Optional[float]:
    """The median compute seconds of optimizer steps 2.. (the first warms up), as the run logged them to VisualDL
    (`perf/compute_seconds_per_step`, data loading excluded); None without such steps."""
    logs = os.path.join(output_dir, "logs")
    files = [name for name in os.listdir(logs) if name.startswith("vdlrecords")] if os.path.isdir(logs) else []
    if not files:
        return None
    from visualdl import LogReader

    records = LogReader(file_path=os.path.join(logs, files[0])).get_data("scalar", "perf/compute_seconds_per_step")
    values = sorted(record.value for record in records if record.id >= 2)
    return values[len(values) // 2] if values else None


def measured_run(command: List[str], env: Dict[str, str]) -> Dict:
    """Run `python benchmark_memory.py --measure RESULT command...`: peaks, wall seconds, exit code."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        result_path = handle.name
    started = time.perf_counter()
    process = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", result_path, *command],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    try:
        with open(result_path) as handle:
            result = json.load(handle)
    except (OSError, ValueError):
        result = {"exit_code": process.returncode}
    os.unlink(result_path)
    result["wall_seconds"] = wall
    if process.returncode != 0 or result.get("exit_code"):
        result["error"] = process.stderr[-2000:]
    return result


# ---------------------------------------------------------------- commands
def our_command(entry_point: str, config: str, resolution: int, batch: int, options: str, steps: int,
                disc_start: int, device: str, file_list: str, output_dir: str,
                latent_stats_num_images: Optional[int] = None) -> List[str]:
    flags = {
        "file_list": file_list, "vae_config_file": os.path.join(REPO_ROOT, config), "resolution": resolution,
        "per_device_train_batch_size": batch, "max_steps": steps, "disc_start": disc_start, "seed": 0,
        "output_dir": output_dir, "logging_steps": 1, "image_logging_steps": 0, "save_steps": NEVER,
        "device": device, "dataloader_num_workers": 0, "disable_tqdm": "true",
    }
    if latent_stats_num_images:
        flags["latent_stats_num_images"] = latent_stats_num_images
    return [os.path.join(REPO_ROOT, entry_point), *[x for k, v in flags.items() for x in (f"--{k}", str(v))],
            *shlex.split(options)]


REFERENCE_OPTIONS = {(): [], ("--recompute", "true"): ["--recompute"], ("--recompute",): ["--recompute"]}


def reference_command(paddlemix_dir: str, config: str, resolution: int, batch: int, options: str, steps: int,
                      disc_start: int, file_list: str, output_dir: str) -> Optional[List[str]]:
    """benchmark_reference.py --run_reference for the same run, or None if the options have no counterpart."""
    extra = REFERENCE_OPTIONS.get(tuple(shlex.split(options)))
    if extra is None:
        return None
    comparison = Comparison(paddlemix_dir, config=config, resolution=resolution, batch_size=batch,
                            disc_start=disc_start)
    run = {"paddlemix_dir": os.path.abspath(paddlemix_dir), "lpips_weights": comparison.lpips_weights,
           "arguments": reference_arguments(comparison, steps, file_list, output_dir) + extra, "verify_lpips": False}
    return [os.path.join(BENCHMARKS, "benchmark_reference.py"), "--run_reference", json.dumps(run)]


# ---------------------------------------------------------------- table
def gib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def markdown_table(results: List[Dict], device: str) -> str:
    memory = "GPU peak allocated GiB" if device == "gpu" else "peak RSS GiB"
    lines = [f"| config | px | batch | options | system | {memory} | ratio to reference | peak RSS GiB before the "
             "final save | s/step | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        key = "gpu_peak_bytes" if device == "gpu" else "peak_rss_bytes"
        reference = next((r for r in results if r["system"] == "reference" and all(
            r[k] == row[k] for k in ("config", "resolution", "batch_size", "options"))), None)
        value = None if "error" in row else row.get(key)
        ratio = (f"{value / reference[key]:.2f}x" if reference and value and reference.get(key)
                 and "error" not in reference and row is not reference else "")
        per_step = "" if row.get("step_seconds") is None else f"{row['step_seconds']:.1f}"
        lines.append(f"| {os.path.basename(row['config'])} | {row['resolution']} | {row['batch_size']} "
                     f"| `{row['options'] or '-'}` | {row['system']} | {gib(value) if 'error' not in row else 'failed'} "
                     f"| {ratio} | {gib(row.get('training_peak_rss_bytes'))} | {per_step} | {row['wall_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.measure:
        measure(args.measure[0], args.measure[1], args.measure[2:])
        return
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FLAGS_paddle_num_threads")}
    env.update(PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS=str(args.threads), FLAGS_paddle_num_threads=str(args.threads))
    disc_start = args.disc_start if args.disc_start is not None else args.steps + 1
    print(f"$ python benchmarks/benchmark_memory.py {' '.join(shlex.quote(a) for a in (argv or sys.argv[1:]))}")
    print(f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {machine_description()}; "
          f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as root:
        file_list = write_dataset(root)
        for config in args.configs:
            for resolution in args.resolution:
                for batch in args.batch_size:
                    for options in args.options:
                        systems = list(args.entry_points) + (["reference"] if args.reference else [])
                        for system in systems:
                            output_dir = tempfile.mkdtemp(dir=root)
                            if system == "reference":
                                command = reference_command(args.reference, config, resolution, batch, options,
                                                            args.steps, disc_start, file_list, output_dir)
                                if command is None:
                                    continue
                            else:
                                command = our_command(system, config, resolution, batch, options, args.steps,
                                                      disc_start, args.device, file_list, output_dir,
                                                      args.latent_stats_num_images)
                            result = measured_run(command, env)
                            if system != "reference":
                                result["step_seconds"] = step_seconds(output_dir)
                            results.append({"config": config, "resolution": resolution, "batch_size": batch,
                                            "options": options, "system": system, **result})
                            status = ("FAILED: " + result["error"][-300:] if "error" in result else
                                      f"peak RSS {gib(result.get('peak_rss_bytes'))} GiB, "
                                      f"{result.get('step_seconds') or 0:.1f} s/step")
                            print(f"  {os.path.basename(config)} {resolution} px b{batch} [{options or '-'}] {system}: "
                                  f"{status} ({result['wall_seconds']:.0f} s)", file=sys.stderr, flush=True)
    print()
    print(markdown_table(results, args.device))
    print(f"\n{args.steps} optimizer steps per run, whole run (start-up to export), OMP_NUM_THREADS={args.threads}, "
          f"discriminator from step {disc_start}, LPIPS on. Load average after: {os.getloadavg()[0]:.2f}.")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
