"""What does a whole training run hold in memory at its peak, and what does its step take? Peak memory and step time
of whole runs of our entry points, start-up to export, per config, resolution, batch size and options.

    python benchmarks/whole_runs.py --configs configs/sd_vae.json --resolution 128 256 --batch_size 1 \
        --options "" "--recompute true"
    python benchmarks/whole_runs.py --device gpu --configs configs/sd_vae.json --resolution 256 512 1024 \
        --batch_size 1 4 --options "" "--recompute true"

Every run is a fresh process running a whole run as a user starts it: start-up, the optimizer steps, the final
checkpoint and the export with its latent statistics (their batch follows the training batch, evaluation.py). The
process is this script's `measure`, which runs the entry point in-process (`runpy`, as `python SCRIPT ...` would)
and returns its peaks when the run ends. It reads one LAION-style gzip part of 64 JPEG crops (shorter side 80-128
px) of photos, written for the benchmark (harness.laion_parts). Settings beside a cell's options: the config, resolution
and batch size, OMP_NUM_THREADS (`--threads`; 0: unset, the entry point's default), `--steps` steps, the
discriminator not started (`--options "--disc_start 0"` starts it), dataloader workers off (the process is the
whole run), no evaluation, no image logging, no intermediate checkpoint.

Reported: on CPU the peak resident set of that process (`ru_maxrss`, a high-water mark of the whole run, so the
biggest moment wins, wherever it is), beside the peak before the final checkpoint is written (start-up and the
steps: what a longer run with rare checkpoints holds); on a GPU (`--device gpu`) also
`paddle.device.cuda.max_memory_allocated()`, the peak of Paddle's allocator (the figure to size a GPU by); and the
median compute seconds of an optimizer step after the first (our entry points log them to VisualDL every step here:
`perf/compute_seconds_per_step`).

This file also ran the public Paddle reference trainer (PaddleMIX's train_vae.py) beside ours, for seconds per step
and for memory, up to commit e199ef0; those comparisons are settled and reproduce there (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
import tempfile
from typing import Dict, List, Optional

import harness

CELL = ("config", "resolution", "batch_size", "options")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["configs/sd_vae.json"])
    parser.add_argument("--resolution", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--batch_size", nargs="+", type=int, default=[1])
    parser.add_argument("--options", nargs="+", default=["", "--recompute true"],
                        help='Extra flags of our entry point, one string per cell ("" = none).')
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS; 0 = the entry point's default.")
    parser.add_argument("--entry_points", nargs="+", default=["train_vae_no_trainer.py"], help="Our entry points.")
    parser.add_argument("--steps", type=int, default=2, help="Optimizer steps per run.")
    parser.add_argument("--latent_stats_num_images", type=int, help="Our runs' --latent_stats_num_images (default: "
                        "the entry point's). The export measures them at the training batch: fewer save time, not "
                        "memory.")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--json", help="Also write the raw results to this JSON file.")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the run's command
def our_command(args: argparse.Namespace, entry_point: str, cell: Dict, file_list: str, output_dir: str) -> List[str]:
    """The entry point's command line for the cell's run: every step's compute seconds logged."""
    flags = {"file_list": file_list, "vae_config_file": os.path.join(harness.REPO_ROOT, cell["config"]),
             "resolution": cell["resolution"], "per_device_train_batch_size": cell["batch_size"],
             "max_steps": args.steps, "disc_start": args.steps + 1, "seed": 0, "output_dir": output_dir,
             "image_logging_steps": 0, "save_steps": harness.NEVER, "device": args.device, "disable_tqdm": "true",
             "logging_steps": 1, "dataloader_num_workers": 0}
    if args.latent_stats_num_images:
        flags["latent_stats_num_images"] = args.latent_stats_num_images
    return [os.path.join(harness.REPO_ROOT, entry_point), *harness.argv(flags), *shlex.split(cell["options"])]


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


# ---------------------------------------------------------------- the cells
def memory(args: argparse.Namespace, cell: Dict, file_list: str, root: str) -> List[Dict]:
    """One run per entry point of the cell: its peaks and step seconds."""
    rows = []
    for entry_point in args.entry_points:
        output_dir = tempfile.mkdtemp(dir=root)
        command = our_command(args, entry_point, cell, file_list, output_dir)
        rows.append({**cell, "system": entry_point, **whole_run(command, args.threads, output_dir)})
        done = rows[-1]
        status = ("FAILED: " + " ".join(done["error"]) if "error" in done else
                  f"peak RSS {gib(done.get('peak_rss_bytes'))} GiB, {done['step_seconds'] or 0:.1f} s/step")
        print(f"  {os.path.basename(cell['config'])} {cell['resolution']} px b{cell['batch_size']} "
              f"[{cell['options'] or '-'}] {entry_point}: {status} ({done['wall_seconds']:.0f} s)", file=sys.stderr,
              flush=True)
    return rows


def gib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def memory_table(args: argparse.Namespace, results: List[Dict]) -> str:
    key, rows = "gpu_peak_bytes" if args.device == "gpu" else "peak_rss_bytes", []
    for row in results:
        step = "" if row.get("step_seconds") is None else f"{row['step_seconds']:.1f}"
        rows.append([os.path.basename(row["config"]), row["resolution"], row["batch_size"],
                     f"`{row['options'] or '-'}`", row["system"], "failed" if "error" in row else gib(row.get(key)),
                     gib(row.get("training_peak_rss_bytes")), step, f"{row['wall_seconds']:.0f}"])
    return harness.markdown(["config", "px", "batch", "options", "entry point", "GPU peak allocated GiB" if
                             args.device == "gpu" else "peak RSS GiB", "peak RSS GiB before the final save", "s/step",
                             "wall s"], rows) + (
        f"\n\n{args.steps} optimizer steps per run, whole run (start-up to export), OMP_NUM_THREADS={args.threads}, "
        "the discriminator not started (unless --options start it), LPIPS on.")


def main(argv: Optional[List[str]] = None) -> None:
    if harness.serve_worker(argv, measure):
        return
    args = parse_args(argv)
    harness.header(__file__, argv)
    results = []
    with tempfile.TemporaryDirectory() as root:
        file_list = harness.laion_parts(root, 64, shorter_side=(80, 128))[0]
        for values in itertools.product(args.configs, args.resolution, args.batch_size, args.options):
            results += memory(args, dict(zip(CELL, values)), file_list, root)
    print(f"\n{memory_table(args, results)}\n\nLoad average after: {harness.load()}.")
    harness.save_json(args.json, results)


if __name__ == "__main__":
    main()
