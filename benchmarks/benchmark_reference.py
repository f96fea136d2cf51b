"""Our trainer against the public Paddle reference trainer's own script, on identical settings (CPU).

    python benchmarks/benchmark.py --reference /work/ext/PaddleMIX             # what users run
    python benchmarks/benchmark_reference.py --run_reference SETTINGS_JSON     # internal: one reference run

The reference is `ppdiffusers/examples/autoencoder/vae/train_vae.py` inside a local PaddleMIX checkout
(tested at commit 6afaf05): two VAE forwards per step (the second for the discriminator update), LPIPS
computed in both, the adaptive weight at every step. It is run unchanged, as a process of its own, with
the same Python environment as ours. Its code is never copied here; this harness only

- writes a shared LAION-style dataset (one part file of JPEG crops of scikit-image photos, in the
  `caption<TAB>-<TAB>base64` format both read; the file name contains "laion400m" because the
  reference's parser only accepts such files);
- gives it the LPIPS weights it would download (from `paddlenlp.bj.bcebos.com`, unreachable here):
  `get_weights_path_from_url` is pointed at the same ImageNet VGG16 + LPIPS v0.1 weights ours uses,
  rewritten in its layout, and the first run checks that its LPIPS then gives ours's numbers;
- puts an empty `albumentations` module in place when that package is missing: the reference's
  `ldm/__init__.py` imports it for its ImageNet dataset, which this benchmark does not use.

Timing excludes start-up and teardown: each system runs once for `n1` and once for `n2` optimizer steps
(separate processes, same settings), and s/step = (wall(n2) - wall(n1)) / (n2 - n1). Runs alternate
between the systems, repeated `--repeats` times; the ratio is the median of the per-repeat ratios, so
that load which changes between repeats hits both alike. Settings (identical for both): the config,
resolution and batch size given, the same OMP_NUM_THREADS, dataloader workers, learning rate and
discriminator start (default 0: the GAN runs from the first step, as the reference always computes it),
no evaluation, no image logging, no intermediate checkpoint.
"""

from __future__ import annotations

import base64
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

from common import PHOTOS, REPO_ROOT

REFERENCE_EXAMPLE = os.path.join("ppdiffusers", "examples", "autoencoder", "vae")
REFERENCE_URLS = {"lpips_vgg16.pdparams": "vgg", "vgg_netlin.pdparams": "netlin"}  # URL file name -> ours
NEVER = 10**9  # a step interval that is never reached: no logging, image logging or saving


@dataclass
class Comparison:
    paddlemix_dir: str
    config: str = "configs/vae_tiny.json"
    resolution: int = 64
    batch_size: int = 4
    threads: int = 1  # 0: leave OMP_NUM_THREADS unset, each trainer's default
    workers: int = 0
    steps: Sequence[int] = (3, 13)
    repeats: int = 3
    disc_start: int = 0
    learning_rate: float = 1e-4
    entry_points: Sequence[str] = ("train_vae_no_trainer.py", "train_vae_trainer.py")
    lpips_weights: str = os.path.join(REPO_ROOT, "weights", "lpips_vgg16.pdparams")
    seed: int = 0


# ---------------------------------------------------------------- shared inputs
def write_dataset(root: str, images: int = 64, seed: int = 0) -> str:
    """One part file of JPEG crops (80-128 px) of scikit-image photos; returns the .filelist.list path."""
    import numpy as np
    from PIL import Image
    from skimage import data as skimage_data

    rng = np.random.default_rng(seed)
    photos = [getattr(skimage_data, name)() for name in PHOTOS]
    lines = []
    for index in range(images):
        photo = photos[index % len(photos)]
        photo = np.stack([photo] * 3, axis=-1) if photo.ndim == 2 else photo[..., :3]
        size = int(rng.integers(80, 129))
        y, x = (int(rng.integers(0, photo.shape[axis] - size)) for axis in (0, 1))
        buffer = io.BytesIO()
        Image.fromarray(photo[y:y + size, x:x + size]).save(buffer, "JPEG", quality=90)
        lines.append(f"crop {index}\t-\t{base64.b64encode(buffer.getvalue()).decode()}\n")
    part = os.path.join(root, "laion400m_benchmark_part-00000")
    with open(part, "w") as handle:
        handle.writelines(lines)
    filelist = os.path.join(root, "laion400m_benchmark.filelist")
    with open(filelist, "w") as handle:
        handle.write(part + "\n")
    filelist_list = os.path.join(root, "train.filelist.list")
    with open(filelist_list, "w") as handle:
        handle.write(filelist + "\n")
    return filelist_list


def ours_command(comparison: Comparison, entry_point: str, steps: int, file_list: str, output_dir: str) -> List[str]:
    flags = {
        "file_list": file_list, "vae_config_file": os.path.join(REPO_ROOT, comparison.config),
        "resolution": comparison.resolution, "per_device_train_batch_size": comparison.batch_size,
        "max_steps": steps, "disc_start": comparison.disc_start, "learning_rate": comparison.learning_rate,
        "dataloader_num_workers": comparison.workers, "seed": comparison.seed, "output_dir": output_dir,
        "logging_steps": NEVER, "image_logging_steps": 0, "save_steps": NEVER, "device": "cpu",
        "disable_tqdm": "true",
        "latent_stats_num_images": comparison.batch_size,  # the export's latent statistics: teardown, kept small
    }
    return [sys.executable, os.path.join(REPO_ROOT, entry_point),
            *[item for key, value in flags.items() for item in (f"--{key}", str(value))]]


def reference_arguments(comparison: Comparison, steps: int, file_list: str, output_dir: str) -> List[str]:
    """The reference script's own flags for the same run."""
    flags = {
        "vae_config_file": os.path.join(REPO_ROOT, comparison.config), "file_list": file_list,
        "resolution": comparison.resolution, "batch_size": comparison.batch_size, "max_train_steps": steps,
        "num_workers": comparison.workers, "disc_start": comparison.disc_start,
        "learning_rate": comparison.learning_rate, "seed": comparison.seed, "output_dir": output_dir,
        "logging_steps": NEVER, "image_logging_steps": NEVER, "save_steps": NEVER,
        "buffer_size": comparison.batch_size,  # its shuffle buffer is filled before the first step
    }
    return ["--from_scratch", *[item for key, value in flags.items() for item in (f"--{key}", str(value))]]


def reference_command(comparison: Comparison, steps: int, file_list: str, output_dir: str, verify: bool) -> List[str]:
    run = {"paddlemix_dir": os.path.abspath(comparison.paddlemix_dir), "lpips_weights": comparison.lpips_weights,
           "arguments": reference_arguments(comparison, steps, file_list, output_dir), "verify_lpips": verify}
    return [sys.executable, os.path.abspath(__file__), "--run_reference", json.dumps(run)]


# ---------------------------------------------------------------- timing (parent process)
def timed_run(command: List[str], env: Dict[str, str]) -> Dict[str, float]:
    """Wall time and CPU time (user + system, the process and its dataloader workers) of one run."""
    cpu_before, started = _children_cpu_seconds(), time.perf_counter()
    process = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({process.returncode}):\n{process.stderr[-3000:]}")
    return {"wall": elapsed, "cpu": _children_cpu_seconds() - cpu_before}


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def compare(comparison: Comparison) -> Dict:
    """Alternating runs of the reference and our entry points; per-repeat s/step and their ratios."""
    example = os.path.join(comparison.paddlemix_dir, REFERENCE_EXAMPLE, "train_vae.py")
    if not os.path.isfile(example):
        raise SystemExit(f"--reference: {example} not found (give the root of a PaddleMIX checkout)")
    if not os.path.isfile(comparison.lpips_weights):
        raise SystemExit(f"LPIPS weights {comparison.lpips_weights} not found: run `make setup`")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FLAGS_paddle_num_threads")}
    env["PYTHONPATH"] = REPO_ROOT
    if comparison.threads > 0:  # 0: each system's default (Paddle's 1 for the reference, all cores for ours)
        env.update(OMP_NUM_THREADS=str(comparison.threads), FLAGS_paddle_num_threads=str(comparison.threads))
    systems = ["reference", *comparison.entry_points]
    n1, n2 = comparison.steps
    per_step: Dict[str, List[float]] = {name: [] for name in systems}
    cpu_per_step: Dict[str, List[float]] = {name: [] for name in systems}
    with tempfile.TemporaryDirectory() as root:
        file_list = write_dataset(root, seed=comparison.seed)
        verified = False
        for repeat in range(comparison.repeats):
            runs: Dict[str, Dict[int, Dict[str, float]]] = {name: {} for name in systems}
            order = systems if repeat % 2 == 0 else systems[::-1]
            for steps in (n1, n2):
                for name in order:
                    output_dir = tempfile.mkdtemp(dir=root)
                    if name == "reference":
                        command = reference_command(comparison, steps, file_list, output_dir, verify=not verified)
                        verified = True
                    else:
                        command = ours_command(comparison, name, steps, file_list, output_dir)
                    runs[name][steps] = timed_run(command, env)
                    print(f"  repeat {repeat + 1}: {name} {steps} steps {runs[name][steps]['wall']:.1f} s "
                          f"(CPU {runs[name][steps]['cpu']:.1f} s)", file=sys.stderr, flush=True)
            for name in systems:
                per_step[name].append((runs[name][n2]["wall"] - runs[name][n1]["wall"]) / (n2 - n1))
                cpu_per_step[name].append((runs[name][n2]["cpu"] - runs[name][n1]["cpu"]) / (n2 - n1))
    return {
        "settings": {**asdict(comparison), "steps": list(comparison.steps), "entry_points": list(comparison.entry_points)},
        "seconds_per_step": per_step,
        "cpu_seconds_per_step": cpu_per_step,
        "ratio_to_reference": _ratios(per_step, comparison.entry_points),
        "cpu_ratio_to_reference": _ratios(cpu_per_step, comparison.entry_points),
    }


def _ratios(per_step: Dict[str, List[float]], names: Sequence[str]) -> Dict[str, float]:
    return {name: statistics.median(o / r for o, r in zip(per_step[name], per_step["reference"])) for name in names}


def markdown_table(result: Dict) -> str:
    s = result["settings"]
    lines = ["| system | s/step (median) | s/step per repeat | ratio to reference | CPU s/step (median) | CPU ratio |",
             "|---|---|---|---|---|---|"]
    for name, values in result["seconds_per_step"].items():
        cpu = result["cpu_seconds_per_step"][name]
        reference = name == "reference"
        ratio = "1" if reference else f"{result['ratio_to_reference'][name]:.2f}x"
        cpu_ratio = "1" if reference else f"{result['cpu_ratio_to_reference'][name]:.2f}x"
        label = "reference (PaddleMIX train_vae.py)" if reference else f"ours: {name}"
        lines.append(f"| {label} | {statistics.median(values):.3f} | {' '.join(f'{v:.3f}' for v in values)} | {ratio} "
                     f"| {statistics.median(cpu):.3f} | {cpu_ratio} |")
    lines.append("")
    lines.append(f"{os.path.basename(s['config'])}, {s['resolution']} px, batch {s['batch_size']}, "
                 f"{threads_label(s['threads'])}, {s['workers']} dataloader workers, disc_start {s['disc_start']}; "
                 f"s/step = (wall({s['steps'][1]} steps) - wall({s['steps'][0]} steps)) / {s['steps'][1] - s['steps'][0]}, "
                 f"{s['repeats']} alternating repeats; ratio = median of per-repeat ratios (target <= 0.35x). "
                 "CPU s/step counts user + system time of the process and its workers: with one thread it measures "
                 "the work and hardly moves with other load; with several, OpenMP's waiting counts too.")
    return "\n".join(lines)


def threads_label(threads: int) -> str:
    if threads > 0:
        return f"OMP_NUM_THREADS={threads} for both"
    return "OMP_NUM_THREADS unset (each one's default: 1 thread for the reference, all usable CPUs for ours)"


# ---------------------------------------------------------------- one reference run (child process)
def write_reference_lpips_weights(our_weights: str, directory: str) -> Dict[str, str]:
    """Our LPIPS file rewritten in the reference's two layouts: paddle.vision VGG16 and its `lins` heads."""
    import paddle

    state = paddle.load(our_weights)
    vgg = {key[len("vgg."):]: value for key, value in state.items() if key.startswith("vgg.")}
    # Its NetLinLayer is Sequential(Dropout, Conv2D): the conv is entry 1.
    netlin = {f"lins.{key.split('.')[1]}.model.1.weight": value for key, value in state.items() if key.startswith("heads.")}
    paths = {}
    for url_name, layout in REFERENCE_URLS.items():
        paths[url_name] = os.path.join(directory, url_name)
        paddle.save(vgg if layout == "vgg" else netlin, paths[url_name])
    return paths


def serve_weights_locally(paths: Dict[str, str]) -> None:
    """Make paddle's weight download return our local files (before the reference imports it)."""
    import paddle.utils.download as download

    def local_weights(url: str, md5sum=None) -> str:
        name = url.rsplit("/", 1)[-1]
        if name not in paths:
            raise RuntimeError(f"the reference asked for {url}, which this benchmark cannot provide offline")
        return paths[name]

    download.get_weights_path_from_url = local_weights


def check_reference_lpips(our_weights: str) -> None:
    """The reference's LPIPS, loaded from the served files, must give our LPIPS's numbers."""
    import numpy as np
    import paddle
    from ldm import LPIPS as ReferenceLPIPS

    sys.path.insert(0, REPO_ROOT)
    from vae_trainer.models.lpips import LPIPS

    rng = np.random.default_rng(0)
    x, y = (paddle.to_tensor(rng.uniform(-1, 1, (2, 3, 64, 64)).astype("float32")) for _ in range(2))
    with paddle.no_grad():
        theirs = ReferenceLPIPS(net="vgg", verbose=False)(x, y).reshape([-1]).numpy()
        ours = LPIPS(our_weights)(x, y).numpy()
    if not np.allclose(theirs, ours, rtol=1e-4, atol=1e-6):
        raise RuntimeError(f"the reference's LPIPS differs from ours: {theirs} vs {ours}")
    print(f"reference LPIPS matches ours: {theirs}", file=sys.stderr)


def run_reference(run: Dict) -> None:
    import runpy

    example = os.path.join(run["paddlemix_dir"], REFERENCE_EXAMPLE)
    with tempfile.TemporaryDirectory() as weights_dir:
        serve_weights_locally(write_reference_lpips_weights(run["lpips_weights"], weights_dir))
        try:
            import albumentations  # noqa: F401
        except ImportError:  # only the reference's ImageNet dataset uses it
            sys.modules["albumentations"] = types.ModuleType("albumentations")
        sys.path.insert(0, example)
        if run["verify_lpips"]:
            check_reference_lpips(run["lpips_weights"])
        sys.argv = [os.path.join(example, "train_vae.py"), *run["arguments"]]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--run_reference":
        run_reference(json.loads(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
