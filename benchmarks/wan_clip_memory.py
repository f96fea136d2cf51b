"""A video VAE fine-tuned decoder-only at its real architecture (issues 43, 52): peak memory and time of a training
step on clips (5, 9, 17 frames: Wan 2.1's default table) or on one image (--frames 1), with and without --recompute.

    python benchmarks/wan_clip_memory.py                                  # Wan 2.1, decoder-only, 128 px, 5 / 9 / 17
    python benchmarks/wan_clip_memory.py --modes decoder full --resolution 64 --threads 2
    python benchmarks/wan_clip_memory.py --config configs/ltx2_vae.json --resolution 256 --frames 1 9 17 \
        --recompute off on --optimizer --lpips                            # LTX-2: a whole fine-tuning step

The network is the real architecture of --config (default configs/wan21_vae.json: AutoencoderKLWan, base_dim 96,
dim_mult [1, 2, 4, 4], 127 M parameters; any video family's, or an image family's at --frames 1) with random weights,
built by the trainer's own `build_vae`, --recompute applied by its own `enable_recompute` (the family's segments:
Wan's chunk passes re-run whole, LTX-2's and HunyuanVideo 1.5's blocks), clips (N, C, T, H, W; one frame: an image,
N, C, H, W, as the trainer gives images) through the family's `encode` / `decode` as the trainer calls them. A step,
batch 1, random pixels in [-1, 1]:
- `decoder` (the recommended fine-tune): the frozen encoder's posterior mode without a graph, then decode and an L1
  loss against the clip (--lpips: plus LPIPS on every frame, the trainer's VGG16 with weights/lpips_vgg16.pdparams),
  backward (gradients of the decoder side);
- `full`: encode and decode with a graph, L1 + 1e-6 KL, backward through both;
- --optimizer: then AdamW's step over the trained weights (its two moments allocated at the first step) and the
  gradients cleared, inside the step: what a fine-tuning step holds. Without it, no optimizer (its state is the
  same whatever the clip length).

Each setting is a fresh process, run one after another. Reported per step (the last of --steps): seconds (the
frozen encoder's share apart); the memory of Paddle's tensors, before the step (weights, and gradients or AdamW's
moments after a first step) and at its peak (Paddle's host allocator statistics, reset before the step: what sizes a
GPU, whose allocator counts the same tensors); and the process's resident set at its peak during the step (Linux
VmHWM, reset before the step through /proc/self/clear_refs), which glibc's heap keeps above the tensors' peak when
freed blocks are not returned; the JSON also holds the whole process's peak (`ru_maxrss`, building included).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Dict, List, Optional

import harness


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/wan21_vae.json")
    parser.add_argument("--frames", nargs="+", type=int, default=[5, 9, 17])
    parser.add_argument("--modes", nargs="+", default=["decoder"], choices=("decoder", "full"))
    parser.add_argument("--recompute", nargs="+", default=["off", "on"], choices=("off", "on"))
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="Steps per setting; the last one is reported.")
    parser.add_argument("--optimizer", action="store_true", help="AdamW's step over the trained weights in the step.")
    parser.add_argument("--lpips", action="store_true", help="LPIPS (every frame) in the decoder-only loss.")
    parser.add_argument("--json", help="Also write the results to this JSON file.")
    return parser.parse_args(argv)


def memory_kib(field: str) -> int:
    """A `Vm...` line of /proc/self/status (KiB)."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field + ":"))


def reset_peaks() -> None:
    import paddle

    paddle.base.core.host_memory_stat_reset_peak_value("Allocated", 0)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS


def tensor_bytes(peak: bool = False) -> int:
    """What Paddle's CPU allocator has handed out to tensors (now, or at its peak since the last reset)."""
    import paddle

    stat = paddle.base.core.host_memory_stat_peak_value if peak else paddle.base.core.host_memory_stat_current_value
    return stat("Allocated", 0)


def measure(setting: Dict) -> Dict:
    import paddle

    from vae_trainer.metrics import fold_frames
    from vae_trainer.models.families import encoder_parameters, family_of
    from vae_trainer.models.lpips import LPIPS
    from vae_trainer.models.recompute import enable_recompute
    from vae_trainer.models.vae_loading import build_vae

    paddle.seed(0)
    vae = build_vae(os.path.join(harness.REPO_ROOT, setting["config"]))
    family, decoder_only = family_of(vae), setting["mode"] == "decoder"
    if decoder_only:
        for param in encoder_parameters(vae):
            param.stop_gradient = True
    if setting["recompute"] == "on":
        enable_recompute(vae)
    trained = [p for p in vae.parameters() if not p.stop_gradient]
    optimizer = paddle.optimizer.AdamW(1e-5, parameters=trained) if setting.get("optimizer") else None
    lpips = LPIPS() if setting.get("lpips") and decoder_only else None
    size, frames = setting["resolution"], setting["frames"]
    shape = [1, family.geometry(vae.config).channels] + ([frames] if frames > 1 else []) + [size, size]
    clip = paddle.uniform(shape, min=-1.0, max=1.0)  # one frame: an image, as the trainer gives it
    steps = []
    for _ in range(setting["steps"]):
        reset_peaks()
        before, started = tensor_bytes(), time.perf_counter()
        if decoder_only:
            with paddle.no_grad():
                latents = family.encode(vae, clip).mode()
            encoded = time.perf_counter()
            decoded = family.decode(vae, latents)
            loss = (decoded - clip).abs().mean()
            if lpips is not None:
                loss = loss + lpips(fold_frames(decoded), fold_frames(clip)).mean()
        else:
            encoded = started
            posterior = family.encode(vae, clip)
            loss = (family.decode(vae, posterior.mode()) - clip).abs().mean() + 1e-6 * posterior.kl().mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.clear_grad()
        steps.append({"seconds": time.perf_counter() - started, "encoder_seconds": encoded - started,
                      "tensors_before_gib": before / 2**30, "tensors_peak_gib": tensor_bytes(peak=True) / 2**30,
                      "rss_peak_gib": memory_kib("VmHWM") / 2**20, "loss": loss.item()})
        del loss
    return {"steps": steps, "parameters": harness.parameter_count(vae), "trained_parameters": harness.parameter_count(
            trained), "busy_threads": harness.busy_threads(), "process_peak_rss_gib": harness.peak_rss_bytes() / 2**30,
            "recomputed": {name: getattr(layer.forward, "calls", 0) for name, layer in family.recompute_segments(vae)}
            if setting["recompute"] == "on" else {}}


def table_row(result: Dict) -> List[str]:
    s = result["setting"]
    cells = [s["mode"], str(s["frames"]), s["recompute"]]
    if "error" in result:
        return cells + [harness.failed(result)] + [""] * 5
    last = result["steps"][-1]
    before, peak = last["tensors_before_gib"], last["tensors_peak_gib"]
    share = f" ({last['encoder_seconds']:.1f})" if s["mode"] == "decoder" else ""
    return cells + [f"{last['seconds']:.1f}{share}", f"{before:.2f}", f"{peak:.2f}", f"{peak - before:.2f}",
                    f"{last['rss_peak_gib']:.2f}", result["load_after"]]


def main(argv: Optional[List[str]] = None) -> None:
    if harness.serve_worker(argv, measure):
        return
    args = parse_args(argv)
    harness.header(__file__, argv)
    settings = [{"config": args.config, "mode": mode, "frames": frames, "recompute": recompute,
                 "resolution": args.resolution, "threads": args.threads, "steps": args.steps,
                 "optimizer": args.optimizer, "lpips": args.lpips}
                for mode in args.modes for frames in args.frames for recompute in args.recompute]
    results = [harness.in_fresh_process(__file__, s, s["threads"], without_torch=True,
                                        label=f"{s['mode']} {s['frames']} frames, recompute {s['recompute']}")
               for s in settings]
    harness.save_json(args.json, results)
    columns = ["step", "frames", "recompute", "s/step (frozen encoder's)", "tensors before GiB", "tensors' peak GiB",
               "peak - before GiB", "peak RSS GiB", "load after"]
    print(f"\n{harness.markdown(columns, [table_row(r) for r in results])}\n\n{args.config}, {args.resolution} px, "
          f"batch 1, {args.threads} thread(s), the last of {args.steps} steps per fresh process; random weights and "
          f"pixels; {'AdamW stepped' if args.optimizer else 'no optimizer'}, {'L1 + LPIPS' if args.lpips else 'L1'}.")


if __name__ == "__main__":
    main()
