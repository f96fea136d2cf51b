"""What a tiny student decoder saves: per teacher family, the teacher VAE's decoder against a TAESD-shaped
`AutoencoderTiny` with the teacher's latent channels: parameters, decode time and peak memory on CPU.

    python benchmarks/tiny_students.py                                       # SDXL, FLUX.1, FLUX.2, Qwen-Image, 512 px
    python benchmarks/tiny_students.py --families sd dc_ae --resolution 256 --runs 5

The teacher is the family's real architecture (its config under configs/) with seeded random weights, built by the
trainer's own `build_vae` and decoded through its family's `decode` (families.py), as the trainer calls it. The
student is ppdiffusers' `AutoencoderTiny` in TAESD's layout: width 64 everywhere, ReLU, one stage per factor of 2 of
the teacher's decoder plus one (f8: 4 stages, f32: 6), encoder blocks (1, 3, ..., 3), decoder blocks (3, ..., 3, 1),
latent_channels the teacher's. Random weights: the figures are the architectures', whatever was trained.

Each (family, network) is one fresh process: it builds the network, decodes one image's latent (batch 1, seeded
normal latents of the teacher's shape at --resolution, float32, `paddle.no_grad`), reads its peak RSS (`ru_maxrss`:
the build and that one decode), then decodes --runs more times; the time is their median (the first decode is the
warm-up, never timed). Parameters: the decoder side is everything the family does not count as its encoder
(AutoencoderKL: post_quant_conv and decoder; Qwen-Image: post_quant_conv and decoder; FLUX.2's bn has statistics,
no parameters).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Dict, List, Optional

import harness

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


def build(setting: Dict):
    """(decode function, latents, encoder parameters, decoder parameters) of the setting's teacher or student."""
    import paddle

    from vae_trainer.models.families import encoder_parameters, family_for_config, family_of
    from vae_trainer.models.vae_loading import build_vae

    paddle.seed(0)
    with open(os.path.join(harness.REPO_ROOT, setting["config"])) as handle:
        config = json.load(handle)
    geometry = family_for_config(config, setting["config"]).geometry(config)
    side = setting["resolution"] // geometry.factor
    latents = paddle.randn([1, geometry.latent_channels, side, side])
    if setting["network"] == "teacher":
        vae = build_vae(vae_config_file=os.path.join(harness.REPO_ROOT, setting["config"]))
        family = family_of(vae)
        encoder = {id(p) for p in encoder_parameters(vae)}
        decoder = [p for p in vae.parameters() if id(p) not in encoder]
        return (lambda: family.decode(vae, latents)), latents, encoder_parameters(vae), decoder
    from ppdiffusers import AutoencoderTiny

    student = AutoencoderTiny(**student_config(geometry.latent_channels, geometry.decoder_factor))
    return (lambda: student.decode(latents).sample), latents, student.encoder.parameters(), \
        student.decoder.parameters()


def measure(setting: Dict) -> Dict:
    import paddle

    decode, latents, encoder, decoder = build(setting)
    built_rss, outputs = harness.peak_rss_bytes(), []

    def decoded():
        outputs[:] = [decode()]
        float(outputs[0].abs().mean())  # the result is read: nothing left pending

    with paddle.no_grad():  # the warm-up decode is also the memory figure
        timed = harness.interleaved({"decode": decoded}, setting["runs"], warmup=1)["decode"]
    return {"encoder_parameters": harness.parameter_count(encoder),
            "decoder_parameters": harness.parameter_count(decoder), "latent_shape": list(latents.shape),
            "image_shape": list(outputs[0].shape), "warmup_seconds": timed["warmup_s"][0], "seconds": timed["times_s"],
            "median_seconds": timed["median_s"], "built_rss_bytes": built_rss,
            "peak_rss_bytes": timed["rss_after_warmup_bytes"]}


# ---------------------------------------------------------------- the table
def millions(value: int) -> str:
    return f"{value / 1e6:.2f} M"


def ratio(teacher: float, student: float) -> str:
    return f"{teacher / student:.0f}x" if teacher / student >= 10 else f"{teacher / student:.1f}x"


def table_row(teacher: Dict, student: Dict) -> List[str]:
    name = FAMILIES[teacher["setting"]["family"]][0]
    if "error" in teacher or "error" in student:
        return [name, harness.failed(teacher if "error" in teacher else student)] + [""] * 8
    latent, mib = "x".join(str(n) for n in teacher["latent_shape"][1:]), 2**20
    return [name, latent,
            f"{millions(teacher['decoder_parameters'])} / {millions(student['decoder_parameters'])}",
            ratio(teacher["decoder_parameters"], student["decoder_parameters"]),
            f"{millions(teacher['encoder_parameters'])} / {millions(student['encoder_parameters'])}",
            f"{teacher['median_seconds'] * 1e3:.0f} / {student['median_seconds'] * 1e3:.1f}",
            ratio(teacher["median_seconds"], student["median_seconds"]),
            f"{teacher['peak_rss_bytes'] / mib:.0f} / {student['peak_rss_bytes'] / mib:.0f}",
            ratio(teacher["peak_rss_bytes"], student["peak_rss_bytes"]),
            f"{teacher['built_rss_bytes'] / mib:.0f} / {student['built_rss_bytes'] / mib:.0f}"]


def main(argv: Optional[List[str]] = None) -> None:
    if harness.serve_worker(argv, measure):
        return
    args, started = parse_args(argv), time.perf_counter()
    harness.header(__file__, argv)
    settings = [{"family": family, "config": FAMILIES[family][1], "network": network, "resolution": args.resolution,
                 "runs": args.runs, "threads": args.threads}
                for family in args.families for network in ("teacher", "student")]
    results = [harness.in_fresh_process(__file__, s, s["threads"], without_torch=True,
                                        label=f"{FAMILIES[s['family']][0]} {s['network']}") for s in settings]
    pairs = [results[i:i + 2] for i in range(0, len(results), 2)]
    harness.save_json(args.json, pairs)
    columns = ["family", "latent (C x h x w)", "decoder params teacher / student", "ratio",
               "encoder params teacher / student", "decode ms teacher / student", "ratio",
               "peak RSS MB teacher / student", "ratio", "RSS MB after the build teacher / student"]
    print(f"\n{harness.markdown(columns, [table_row(*pair) for pair in pairs])}\n")
    print(f"{args.resolution} px, batch 1, float32, paddle.no_grad, {args.threads} thread(s); decode: the median of "
          f"{args.runs} after a warm-up; peak RSS: the build and one decode, a fresh process each; random weights. "
          f"Load average after {harness.load()}; {time.perf_counter() - started:.0f} s in all.")


if __name__ == "__main__":
    main()
