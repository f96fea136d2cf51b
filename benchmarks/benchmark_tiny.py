"""What a tiny student decoder saves: per teacher family, the teacher VAE's decoder against a TAESD-shaped
`AutoencoderTiny` with the teacher's latent channels: parameters, decode time and peak memory on CPU.

    python benchmarks/benchmark_tiny.py                                       # SDXL, FLUX.1, FLUX.2, Qwen-Image, 512 px
    python benchmarks/benchmark_tiny.py --families sd dc_ae --resolution 256 --runs 5

The teacher is the family's real architecture (its config under configs/) with seeded random weights, built by the
trainer's own `build_vae` and decoded through its family's `decode` (families.py), as the trainer calls it. The
student is ppdiffusers' `AutoencoderTiny` in TAESD's layout: width 64 everywhere, ReLU, one stage per factor of 2 of
the teacher's decoder plus one (f8: 4 stages, f32: 6), encoder blocks (1, 3, ..., 3), decoder blocks (3, ..., 3, 1),
latent_channels the teacher's. Random weights: the figures are the architectures', whatever was trained.

Each (family, network) is one fresh process (OpenMP threads are fixed when Paddle loads; RSS peaks are per process):
it builds the network, decodes one image's latent (batch 1, seeded normal latents of the teacher's shape at
--resolution, float32, `paddle.no_grad`), reads its peak RSS (`ru_maxrss`: the build and that one decode), then
decodes --runs more times; the time is their median (the first decode is the warm-up, never timed). Parameters: the
decoder side is everything the family does not count as its encoder (AutoencoderKL: post_quant_conv and decoder;
Qwen-Image: post_quant_conv and decoder; FLUX.2's bn has statistics, no parameters).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional

from common import REPO_ROOT, machine_description, run_setting

FAMILIES = {  # name: (label, config)
    "sdxl": ("SDXL", "configs/sdxl_vae.json"),
    "flux": ("FLUX.1", "configs/flux_vae.json"),
    "flux2": ("FLUX.2", "configs/flux2_vae.json"),
    "qwen_image": ("Qwen-Image", "configs/qwen_image_vae.json"),
    "sd": ("SD", "configs/sd_vae.json"),
    "dc_ae": ("DC-AE f32c32 (SANA)", "configs/dc_ae_f32c32_sana.json"),
}
DEFAULT_FAMILIES = ["sdxl", "flux", "flux2", "qwen_image"]
STUDENT_WIDTH = 64  # TAESD's


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=DEFAULT_FAMILIES, choices=sorted(FAMILIES))
    parser.add_argument("--resolution", type=int, default=512, help="Side of the square image the latent is of.")
    parser.add_argument("--runs", type=int, default=3, help="Timed decodes per network, after one warm-up decode.")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process.")
    parser.add_argument("--json", help="Also write the results to this JSON file.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: JSON of one setting
    parser.add_argument("--worker_output", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the networks (worker process)
def student_config(latent_channels: int, decoder_factor: int) -> Dict:
    """TAESD's layout for a decoder that upsamples by `decoder_factor` (a power of 2)."""
    stages = int(math.log2(decoder_factor)) + 1
    if 2 ** (stages - 1) != decoder_factor:
        raise ValueError(f"a tiny student needs a power-of-2 factor, not {decoder_factor}")
    return {"encoder_block_out_channels": [STUDENT_WIDTH] * stages,
            "decoder_block_out_channels": [STUDENT_WIDTH] * stages,
            "num_encoder_blocks": [1] + [3] * (stages - 1), "num_decoder_blocks": [3] * (stages - 1) + [1],
            "latent_channels": latent_channels}


def count(parameters) -> int:
    return sum(int(p.size) for p in parameters)


def build(setting: Dict):
    """(decode function, latents, encoder parameters, decoder parameters) of the setting's teacher or student."""
    import paddle

    sys.path.insert(0, REPO_ROOT)
    from vae_trainer.models.families import encoder_parameters, family_for_config, family_of
    from vae_trainer.models.vae_loading import build_vae

    paddle.seed(0)
    with open(os.path.join(REPO_ROOT, setting["config"])) as handle:
        config = json.load(handle)
    geometry = family_for_config(config, setting["config"]).geometry(config)
    side = setting["resolution"] // geometry.factor
    latents = paddle.randn([1, geometry.latent_channels, side, side])
    if setting["network"] == "teacher":
        vae = build_vae(vae_config_file=os.path.join(REPO_ROOT, setting["config"]))
        family = family_of(vae)
        encoder = {id(p) for p in encoder_parameters(vae)}
        decoder = [p for p in vae.parameters() if id(p) not in encoder]
        return (lambda: family.decode(vae, latents)), latents, encoder_parameters(vae), decoder
    from ppdiffusers import AutoencoderTiny

    student = AutoencoderTiny(**student_config(geometry.latent_channels, geometry.decoder_factor))
    return (lambda: student.decode(latents).sample), latents, student.encoder.parameters(), \
        student.decoder.parameters()


def run_worker(setting: Dict, output_path: str) -> None:
    import paddle

    decode, latents, encoder, decoder = build(setting)
    built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    with paddle.no_grad():
        for run in range(setting["runs"] + 1):  # run 0: the warm-up and the memory figure
            started = time.perf_counter()
            image = decode()
            float(image.abs().mean())  # the result is read: nothing left pending
            seconds.append(time.perf_counter() - started)
            if run == 0:
                peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"setting": setting, "encoder_parameters": count(encoder), "decoder_parameters": count(decoder),
              "latent_shape": list(latents.shape), "image_shape": list(image.shape), "warmup_seconds": seconds[0],
              "seconds": seconds[1:], "median_seconds": statistics.median(seconds[1:]),
              "built_rss_bytes": built_rss, "peak_rss_bytes": peak_rss}
    with open(output_path, "w") as handle:
        json.dump(result, handle)


# ---------------------------------------------------------------- driver
def load() -> str:
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def measured(family: str, network: str, args: argparse.Namespace) -> Dict:
    setting = {"family": family, "config": FAMILIES[family][1], "network": network, "resolution": args.resolution,
               "runs": args.runs}
    started = time.perf_counter()
    result = run_setting(__file__, setting, args.threads)
    result.update(wall_seconds=time.perf_counter() - started, load_after=load())
    status = ("failed: " + " ".join(result["error"])[-300:] if "error" in result else
              f"{result['median_seconds'] * 1e3:.0f} ms, peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MB")
    print(f"  {FAMILIES[family][0]} {network}: {status} ({result['wall_seconds']:.0f} s, load after "
          f"{result['load_after']})", file=sys.stderr, flush=True)
    return result


def millions(value: int) -> str:
    return f"{value / 1e6:.2f} M"


def ratio(teacher: float, student: float) -> str:
    return f"{teacher / student:.0f}x" if teacher / student >= 10 else f"{teacher / student:.1f}x"


def table_row(teacher: Dict, student: Dict) -> List[str]:
    family = teacher["setting"]["family"]
    name = FAMILIES[family][0]
    if "error" in teacher or "error" in student:
        failed = teacher if "error" in teacher else student
        return [name, "failed: " + " ".join(failed["error"])[-120:]] + [""] * 10
    latent = "x".join(str(n) for n in teacher["latent_shape"][1:])
    mib = 2**20
    return [name, latent,
            f"{millions(teacher['decoder_parameters'])} / {millions(student['decoder_parameters'])}",
            ratio(teacher["decoder_parameters"], student["decoder_parameters"]),
            f"{millions(teacher['encoder_parameters'])} / {millions(student['encoder_parameters'])}",
            f"{teacher['median_seconds'] * 1e3:.0f} / {student['median_seconds'] * 1e3:.1f}",
            ratio(teacher["median_seconds"], student["median_seconds"]),
            f"{teacher['peak_rss_bytes'] / mib:.0f} / {student['peak_rss_bytes'] / mib:.0f}",
            ratio(teacher["peak_rss_bytes"], student["peak_rss_bytes"]),
            f"{teacher['built_rss_bytes'] / mib:.0f} / {student['built_rss_bytes'] / mib:.0f}"]


def markdown_table(pairs: List[List[Dict]]) -> str:
    header = ["family", "latent (C x h x w)", "decoder params teacher / student", "ratio",
              "encoder params teacher / student", "decode ms teacher / student", "ratio",
              "peak RSS MB teacher / student", "ratio", "RSS MB after the build teacher / student"]
    rows = [header, ["---"] * len(header)] + [table_row(teacher, student) for teacher, student in pairs]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return run_worker(json.loads(args.worker), args.worker_output)
    started = time.perf_counter()
    command = " ".join(["python", "benchmarks/benchmark_tiny.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"$ {command}\n{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {machine_description()}; "
          f"load average before {load()}", flush=True)
    pairs = [[measured(family, network, args) for network in ("teacher", "student")] for family in args.families]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(pairs, handle, indent=1)
    print(f"\n{markdown_table(pairs)}\n\n{args.resolution} px, batch 1, float32, paddle.no_grad, {args.threads} "
          f"thread(s); decode: the median of {args.runs} after a warm-up; peak RSS: the build and one decode, a fresh "
          f"process each; random weights. Load average after {load()}; {time.perf_counter() - started:.0f} s in all.")


if __name__ == "__main__":
    main()
