"""Export any checkpoint-N of a run as a VAE folder that ppdiffusers and PyTorch diffusers both load.

    python scripts/export_vae.py outputs/sd_vae/checkpoint-6000 exported/sd_vae_6000 [--ema]

Writes OUT_DIR exactly as a run writes OUTPUT_DIR/vae: `diffusion_paddle_model.safetensors` (ppdiffusers),
`diffusion_pytorch_model.safetensors` (PyTorch diffusers), `config.json` and `latent_stats.json`, with the
run's --posterior_std applied. `--ema` exports the checkpoint's EMA weights (runs with --use_ema).

The latent scale follows the run (its `export_config.json`): kept as in the VAE's config, a given number,
or measured; measuring needs images: `--data` (a filelist or an image folder), `--num_images`,
`--resolution` (default: the run's). `--scaling_factor keep|measure|<number>` overrides. Checkpoints
written before these files existed need `--vae_config_file` (the run's VAE config).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import paddle  # noqa: E402

from vae_trainer import checkpoint as ckpt  # noqa: E402
from vae_trainer.ema import load_ema  # noqa: E402
from vae_trainer.export import export_vae_folder  # noqa: E402
from vae_trainer.latent_scale import decide  # noqa: E402
from vae_trainer.models.vae_loading import load_vae_weights, vae_from_config_file  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", help="a checkpoint-N folder of a run")
    parser.add_argument("out_dir", help="the VAE folder to write")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (ema.pdparams)")
    parser.add_argument("--scaling_factor", default=None,
                        help="keep | measure | a number (default: what the run used)")
    parser.add_argument("--data", default=None, help="images to measure the latent statistics on (filelist or folder)")
    parser.add_argument("--num_images", type=int, default=64, help="images measured (with --data)")
    parser.add_argument("--resolution", type=int, default=None, help="crop size (default: the run's --resolution)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--vae_config_file", default=None,
                        help="the VAE config, for checkpoints that do not hold vae_config.json")
    return parser.parse_args(argv)


def load_checkpoint_vae(checkpoint_dir: str, vae_config_file: str | None, use_ema: bool):
    """(vae with the checkpoint's raw weights, its EMA or None)."""
    config = vae_config_file or ckpt.checkpoint_vae_config(checkpoint_dir)
    if config is None:
        raise SystemExit(f"{checkpoint_dir} holds no {ckpt.VAE_CONFIG_NAME} (an older checkpoint): pass "
                         "--vae_config_file with the run's VAE config")
    vae = vae_from_config_file(config)
    load_vae_weights(vae, checkpoint_dir)
    if not use_ema:
        return vae, None
    ema_file = os.path.join(checkpoint_dir, "ema.pdparams")
    if not os.path.isfile(ema_file):
        raise SystemExit(f"--ema: {ema_file} does not exist (the run did not use --use_ema)")
    return vae, load_ema(vae, ema_file)


def measured_stats(vae, ema, args, export_config: dict):
    from vae_trainer.data.dataset import build_eval_dataloader
    from vae_trainer.evaluation import measure_latents
    from vae_trainer.ema import ema_weights

    resolution = args.resolution or export_config.get("resolution")
    if not args.data or not resolution:
        raise SystemExit("measuring the scaling factor needs --data (and --resolution for older checkpoints); "
                         "or pass --scaling_factor keep or a number")
    loader = build_eval_dataloader(args.data, resolution, args.batch_size, 0, 1, args.num_images)
    with ema_weights(ema, vae) if ema is not None else contextlib.nullcontext():
        stats = measure_latents(vae, loader, args.num_images, export_config.get("input_size"))
    return stats, f"an encoder-only pass over {stats.num_images} images of {args.data}"


def main(argv=None) -> str:
    args = parse_args(argv)
    paddle.set_device("cpu")
    export_file = os.path.join(args.checkpoint_dir, ckpt.EXPORT_CONFIG_NAME)
    export_config = ckpt.read_json(export_file) if os.path.isfile(export_file) else {}
    vae, ema = load_checkpoint_vae(args.checkpoint_dir, args.vae_config_file, args.ema)
    mode = args.scaling_factor or export_config.get("scaling_factor", "keep")
    if mode not in ("keep", "measure"):
        mode = float(mode)
    stats, source = measured_stats(vae, ema, args, export_config) if mode == "measure" else (None, None)
    updates, record = decide(mode, vae.config, stats, source)
    export_vae_folder(vae, args.out_dir, ema, export_config.get("posterior_std", 0.0), updates, record)
    print(f"exported {args.checkpoint_dir}{' (EMA weights)' if ema is not None else ''} to {args.out_dir}: loads with "
          "ppdiffusers.AutoencoderKL.from_pretrained and diffusers.AutoencoderKL.from_pretrained")
    return args.out_dir


if __name__ == "__main__":
    main()
