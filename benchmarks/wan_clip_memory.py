"""Fine-tuning the Wan 2.1 VAE on clips (issue 43, memory): peak memory and time of a training step's forward and
backward at 5, 9 and 17 frames, with and without --recompute's chunk recompute.

    python benchmarks/wan_clip_memory.py                                  # decoder-only, 128 px, 5 / 9 / 17 frames
    python benchmarks/wan_clip_memory.py --modes decoder full --resolution 64 --threads 2

The network is the real architecture (configs/wan21_vae.json: AutoencoderKLWan, base_dim 96, dim_mult [1, 2, 4, 4],
127 M parameters) with random weights, built by the trainer's own `build_vae`, --recompute applied by its own
`enable_recompute` (each chunk's encoder or decoder pass re-run whole in the backward), clips through the family's
`encode` / `decode` as the trainer calls them. A step, batch 1, random pixels in [-1, 1]:
- `decoder` (the recommended fine-tune): the frozen encoder's posterior mode without a graph, then decode and an L1
  loss against the clip, backward (gradients of the decoder side: post_quant_conv and decoder);
- `full`: encode and decode with a graph, L1 + 1e-6 KL, backward through both.
No optimizer (its state, AdamW's two moments of the trained weights, is the same whatever the clip length).

Each setting is a fresh process, run one after another. Reported per step (the last of --steps): seconds (the
frozen encoder's share apart); the memory of Paddle's tensors, before the step (weights, and gradients after a
first step) and at its peak (Paddle's host allocator statistics, reset before the step: what sizes a GPU, whose
allocator counts the same tensors); and the process's resident set at its peak (Linux VmHWM, reset before the step
through /proc/self/clear_refs), which glibc's heap keeps above the tensors' peak when freed blocks are not returned.
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

    from vae_trainer.models.families import encoder_parameters, family_of
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
    size = setting["resolution"]
    clip = paddle.uniform([1, 3, setting["frames"], size, size], min=-1.0, max=1.0)
    steps = []
    for _ in range(setting["steps"]):
        reset_peaks()
        before, started = tensor_bytes(), time.perf_counter()
        if decoder_only:
            with paddle.no_grad():
                latents = family.encode(vae, clip).mode()
            encoded = time.perf_counter()
            loss = (family.decode(vae, latents) - clip).abs().mean()
        else:
            encoded = started
            posterior = family.encode(vae, clip)
            loss = (family.decode(vae, posterior.mode()) - clip).abs().mean() + 1e-6 * posterior.kl().mean()
        loss.backward()
        steps.append({"seconds": time.perf_counter() - started, "encoder_seconds": encoded - started,
                      "tensors_before_gib": before / 2**30, "tensors_peak_gib": tensor_bytes(peak=True) / 2**30,
                      "rss_peak_gib": memory_kib("VmHWM") / 2**20, "loss": loss.item()})
        del loss
    return {"steps": steps, "parameters": harness.parameter_count(vae),
            "trained_parameters": sum(int(p.size) for p in vae.parameters() if not p.stop_gradient),
            "busy_threads": harness.busy_threads(),
            "recomputed_chunks": {name: getattr(getattr(vae, name).forward, "calls", 0)
                                  for name in ("encoder_pass", "decoder_pass")}}


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
                 "resolution": args.resolution, "threads": args.threads, "steps": args.steps}
                for mode in args.modes for frames in args.frames for recompute in args.recompute]
    results = [harness.in_fresh_process(__file__, s, s["threads"], without_torch=True,
                                        label=f"{s['mode']} {s['frames']} frames, recompute {s['recompute']}")
               for s in settings]
    harness.save_json(args.json, results)
    columns = ["step", "frames", "recompute", "s/step (frozen encoder's)", "tensors before GiB", "tensors' peak GiB",
               "peak - before GiB", "peak RSS GiB", "load after"]
    print(f"\n{harness.markdown(columns, [table_row(r) for r in results])}\n\n{args.config}, {args.resolution} px, "
          f"batch 1, {args.threads} thread(s), the last of {args.steps} steps per fresh process; random weights and "
          "pixels.")


if __name__ == "__main__":
    main()
