"""Export any checkpoint-N of a run as a VAE folder that ppdiffusers and PyTorch diffusers both load.

    python scripts/export_vae.py outputs/sd_vae/checkpoint-6000 exported/sd_vae_6000 [--ema]

Writes OUT_DIR exactly as a run writes OUTPUT_DIR/vae: `diffusion_paddle_model.safetensors` (ppdiffusers),
`diffusion_pytorch_model.safetensors` (PyTorch diffusers; not for a super-resolving VAE, which diffusers
cannot describe), `config.json` and `latent_stats.json`, with the run's --posterior_std applied.
`--ema` exports the checkpoint's EMA weights (runs with --use_ema). A checkpoint of an O2 (half-precision)
run is exported from the float32 master weights its optimizer.pdopt holds.

The latent scale follows the run (its `export_config.json`): kept as in the VAE's config, a given number,
or measured on the images the run measures on (its --latent_stats_num_images of --eval_file_list, else of
--file_list). `--scaling_factor keep|measure|<number>`, `--data`, `--num_images` and `--resolution`
override. Checkpoints written before these files existed need `--vae_config_file` (the run's VAE config),
and `--data` and `--resolution` to measure.

CPU threads: all usable cores unless OMP_NUM_THREADS is set (vae_trainer/threads.py). Device: the GPU
when Paddle is built with CUDA, else the CPU (`--device`).
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

if __name__ == "__main__":  # first: Paddle, imported below, reads OMP_NUM_THREADS only once
    from vae_trainer.threads import set_default_threads

    set_default_threads(sys.argv[1:])

import paddle  # noqa: E402

from vae_trainer import checkpoint as ckpt  # noqa: E402
from vae_trainer.ema import EMA_NAME, load_ema  # noqa: E402
from vae_trainer.evaluation import measure_latents_of  # noqa: E402
from vae_trainer.export import export_vae_folder  # noqa: E402
from vae_trainer.latent_scale import decide, parse_scaling_factor  # noqa: E402
from vae_trainer.models.vae_loading import load_vae_weights, vae_from_config_file  # noqa: E402
from vae_trainer.models.vae_saving import diffusers_can_load  # noqa: E402
from vae_trainer.user_errors import exit_on_user_error, start_up  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", help="a checkpoint-N folder of a run")
    parser.add_argument("out_dir", help="the VAE folder to write")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (ema.pdparams)")
    parser.add_argument("--scaling_factor", default=None,
                        help="keep | measure | a number > 0 (default: what the run used)")
    parser.add_argument("--data", default=None,
                        help="images to measure the latent statistics on, a filelist or a folder (default: the run's)")
    parser.add_argument("--num_images", type=int, default=None, help="images measured (default: the run's, else 64)")
    parser.add_argument("--resolution", type=int, default=None, help="crop size (default: the run's --resolution)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--vae_config_file", default=None,
                        help="the VAE config, for checkpoints that do not hold vae_config.json")
    parser.add_argument("--device", default=None, help="gpu or cpu (default: gpu when Paddle has CUDA)")
    return parser.parse_args(argv)


def load_checkpoint_vae(checkpoint_dir: str, vae_config_file: str | None, use_ema: bool):
    """(vae with the checkpoint's float32 raw weights, its EMA or None)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"{checkpoint_dir}: no such checkpoint folder")
    config = vae_config_file or ckpt.checkpoint_vae_config(checkpoint_dir)
    if config is None:
        raise FileNotFoundError(f"{checkpoint_dir} holds no {ckpt.VAE_CONFIG_NAME} (an older checkpoint): pass "
                                "--vae_config_file with the run's VAE config")
    vae = vae_from_config_file(config)
    load_vae_weights(vae, checkpoint_dir)
    if not use_ema:
        return vae, None
    ema_file = os.path.join(checkpoint_dir, EMA_NAME)
    if not os.path.isfile(ema_file):
        raise FileNotFoundError(f"--ema: {ema_file} does not exist (the run did not use --use_ema)")
    return vae, load_ema(vae, ema_file)


def scaling_factor_mode(args: argparse.Namespace, export_config: dict):
    """--scaling_factor, else the run's, else keep."""
    given = parse_scaling_factor(args.scaling_factor)
    if given is not None:
        return given
    return parse_scaling_factor(export_config.get("scaling_factor")) or "keep"


def measured_stats(vae, ema, args: argparse.Namespace, export_config: dict):
    """The latent statistics of the exported weights over the run's images (or --data)."""
    data = args.data or export_config.get("latent_stats_data")
    num_images = args.num_images or export_config.get("latent_stats_num_images") or 64
    resolution = args.resolution or export_config.get("resolution")
    if not data or not resolution:
        raise ValueError("measuring the scaling factor needs images: this checkpoint does not name the run's "
                         "(written before export_config.json held them); pass --data (and --resolution), or "
                         "--scaling_factor keep or a number")
    if num_images < 1:
        raise ValueError(f"--num_images must be at least 1, got {num_images}")
    return measure_latents_of(vae, ema, data, resolution, args.batch_size, num_images,
                              export_config.get("input_size"), export_config.get("posterior_std", 0.0))


@exit_on_user_error
def main(argv=None) -> str:
    args = parse_args(argv)
    paddle.set_device(args.device or ("gpu" if paddle.is_compiled_with_cuda() else "cpu"))
    with start_up():
        export_config = ckpt.checkpoint_export_config(args.checkpoint_dir) or {}
        mode = scaling_factor_mode(args, export_config)
        vae, ema = load_checkpoint_vae(args.checkpoint_dir, args.vae_config_file, args.ema)
        stats, source = measured_stats(vae, ema, args, export_config) if mode == "measure" else (None, None)
    weights = "the EMA weights (ema.pdparams)" if ema is not None else "the raw weights"
    updates, record = decide(mode, vae.config, stats, source, f"{weights} of {args.checkpoint_dir}",
                             "scripts/export_vae.py measures with --scaling_factor measure (the factor then changes); "
                             "scripts/eval_vae.py --vae on this folder measures the statistics alone")
    export_vae_folder(vae, args.out_dir, ema, export_config.get("posterior_std", 0.0), updates, record)
    readers = ("ppdiffusers.AutoencoderKL.from_pretrained and diffusers.AutoencoderKL.from_pretrained"
               if diffusers_can_load(vae) else "ppdiffusers.AutoencoderKL.from_pretrained (PyTorch diffusers cannot "
               "describe this VAE's separate decoder widths)")
    print(f"exported {args.checkpoint_dir} ({weights}) to {args.out_dir}: loads with {readers}")
    if ema is None and os.path.isfile(os.path.join(args.checkpoint_dir, EMA_NAME)):
        print(f"note: {args.checkpoint_dir} also holds EMA weights ({EMA_NAME}); the run's own vae/ holds those, "
              "and --ema exports them")
    return args.out_dir


if __name__ == "__main__":
    main()
