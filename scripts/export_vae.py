"""Export any checkpoint-N of a run as a VAE folder that ppdiffusers and PyTorch diffusers both load.

    python scripts/export_vae.py outputs/sd_vae/checkpoint-6000 exported/sd_vae_6000 [--no_ema]

Writes OUT_DIR exactly as a run writes OUTPUT_DIR/vae: `diffusion_paddle_model.safetensors` (ppdiffusers),
`diffusion_pytorch_model.safetensors` (PyTorch diffusers; not for a super-resolving VAE, which diffusers
cannot describe), `config.json` and `latent_stats.json`, with the run's --posterior_std applied.
When the checkpoint holds EMA weights (a run with --use_ema), they are exported, as the run's own vae/
holds them; `--no_ema` (or `--ema false`) exports the raw weights instead, and `--ema` requires the EMA.
The script prints which weights it exported and why. A checkpoint of an O2 (half-precision) run is
exported from the float32 master weights its optimizer.pdopt holds.

The latent scale follows the run (its `export_config.json`): kept as in the VAE's config, a given number,
or measured on the images the run measures on (its --latent_stats_num_images of --eval_file_list, else the
run's random sample of --file_list). `--scaling_factor keep|measure|<number>`, `--data`, `--num_images` and
`--resolution` override. Checkpoints written before these files existed need `--vae_config_file` (the run's
VAE config), and `--data` and `--resolution` to measure.

CPU threads: all usable cores unless OMP_NUM_THREADS is set (vae_trainer/threads.py). Device: the GPU
when Paddle is built with CUDA, else the CPU (`--device`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from vae_trainer.console import quiet_third_party  # noqa: E402

quiet_third_party()  # before Paddle, PaddleNLP and ppdiffusers are imported

if __name__ == "__main__":  # first: Paddle, imported below, reads OMP_NUM_THREADS only once
    from vae_trainer.threads import set_default_threads

    set_default_threads(sys.argv[1:])

import paddle  # noqa: E402

from vae_trainer import checkpoint as ckpt  # noqa: E402
from vae_trainer.ema import EMA_NAME, load_ema  # noqa: E402
from vae_trainer.evaluation import eval_batch_size, measure_latents_of  # noqa: E402
from vae_trainer.final_save import export_vae_folder  # noqa: E402
from vae_trainer.models.latent_scale import EXPORT_ORIGIN_KEY, decide, mode_of_checkpoint  # noqa: E402
from vae_trainer.models.vae_loading import load_vae_weights, vae_from_config_file  # noqa: E402
from vae_trainer.models.families import family_of  # noqa: E402
from vae_trainer.user_errors import exit_on_user_error, start_up  # noqa: E402

# The values `--ema VALUE` / `--ema=VALUE` take, as the training flags' booleans (`_ema_values_as_flags`).
BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
_EMA_VALUES = f"argument --ema: expected no value or one of {', '.join(BOOLEANS)} (--no_ema exports the raw weights)"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", help="a checkpoint-N folder of a run")
    parser.add_argument("out_dir", help="the VAE folder to write")
    parser.add_argument("--ema", dest="ema", action="store_const", const=True, default=None,
                        help="require and export the EMA weights (ema.pdparams); the default when the checkpoint "
                             "holds them (`--ema false` is --no_ema)")
    parser.add_argument("--no_ema", dest="ema", action="store_const", const=False,
                        help="export the raw weights even when the checkpoint holds EMA weights")
    parser.add_argument("--scaling_factor", default=None,
                        help="keep | measure | a number > 0 (default: what the run used)")
    parser.add_argument("--data", default=None,
                        help="images to measure the latent statistics on (a clip run's: videos, as its --num_frames), a "
                             "filelist or a folder (default: the run's)")
    parser.add_argument("--num_images", type=int, default=None, help="images measured (default: the run's, else 64)")
    parser.add_argument("--resolution", type=int, default=None, help="crop size (default: the run's --resolution)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="images per batch of the measurement (default: as many images as hold the pixels of 8 "
                             "images of 256 px, 1 to 8: 8 up to 256 px, 2 from 419 to 512 px, 1 above 512 px; "
                             "vae_trainer.evaluation.eval_batch_size); the numbers do not depend on it")
    parser.add_argument("--vae_config_file", default=None,
                        help="the VAE config, for checkpoints that do not hold vae_config.json")
    parser.add_argument("--device", default=None, help="gpu or cpu (default: gpu when Paddle has CUDA)")
    try:
        flags = _ema_values_as_flags(sys.argv[1:] if argv is None else list(argv))
    except ValueError as error:
        parser.error(str(error))
    args, extras = parser.parse_known_args(flags)
    if extras:  # `--ema maybe`: a bare --ema is a switch, so `maybe` is left over as a third folder
        after_ema = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "--ema"
                     and not flags[i + 1].startswith("-")]
        parser.error(f"{_EMA_VALUES}, got {after_ema[0]!r}" if after_ema
                     else f"unrecognized arguments: {' '.join(extras)}")
    try:
        eval_batch_size(1, args.batch_size, flag="--batch_size")  # refuses a batch < 1 before anything is loaded
    except ValueError as error:
        parser.error(str(error))
    return args


def _ema_values_as_flags(argv: List[str]) -> List[str]:
    """`--ema true|false` / `--ema=...` -> `--ema` / `--no_ema`: the bare `--ema` stays a switch (so that it
    can precede the positional folders) while the spelling with a value, as the training flags take, works.
    `--ema=VALUE` with a VALUE not in BOOLEANS is refused (ValueError) rather than read as either."""
    out, i = [], 0
    while i < len(argv):
        flag, value = argv[i], None
        if flag.startswith("--ema="):
            value = flag.split("=", 1)[1]
            if value.lower() not in BOOLEANS:
                raise ValueError(f"{_EMA_VALUES}, got {value!r}")
        elif flag == "--ema" and i + 1 < len(argv) and argv[i + 1].lower() in BOOLEANS:
            value, i = argv[i + 1], i + 1
        out.append(flag if value is None else ("--ema" if BOOLEANS[value.lower()] else "--no_ema"))
        i += 1
    return out


def load_checkpoint_vae(checkpoint_dir: str, vae_config_file: str | None, use_ema: bool):
    """(vae with the checkpoint's float32 raw weights, its EMA or None; `use_ema` from `choose_ema`)."""
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


def choose_ema(checkpoint_dir: str, ema: Optional[bool]) -> Tuple[bool, str]:
    """(export the EMA weights?, why): the EMA when the checkpoint holds one, as the run's vae/ does, unless
    --no_ema; --ema requires it."""
    held = os.path.isfile(os.path.join(checkpoint_dir, EMA_NAME))
    if ema is None:
        if held:
            return True, f"the checkpoint holds EMA weights ({EMA_NAME}), as the run's vae/ does; --no_ema exports the raw ones"
        return False, f"the checkpoint holds no EMA weights ({EMA_NAME}: the run did not use --use_ema)"
    if ema:
        return True, "--ema"
    return False, f"--no_ema{f' (the checkpoint also holds EMA weights, {EMA_NAME})' if held else ''}"


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
    return measure_latents_of(vae, ema, data, resolution, args.batch_size, num_images,  # None: the default batch
                              export_config.get("input_size"), export_config.get("posterior_std", 0.0),
                              sample_seed=None if args.data else export_config.get("latent_stats_sample_seed"),
                              **export_config.get("latent_stats_frames", {}))  # a clip run's: its clips (--data too)


@exit_on_user_error
def main(argv=None) -> str:
    args = parse_args(argv)
    paddle.set_device(args.device or ("gpu" if paddle.is_compiled_with_cuda() else "cpu"))
    with start_up():
        export_config = ckpt.checkpoint_export_config(args.checkpoint_dir) or {}
        mode = mode_of_checkpoint(args.scaling_factor, export_config)
        use_ema, why = choose_ema(args.checkpoint_dir, args.ema)
        vae, ema = load_checkpoint_vae(args.checkpoint_dir, args.vae_config_file, use_ema)
        stats, source = measured_stats(vae, ema, args, export_config) if mode == "measure" else (None, None)
    weights = "the EMA weights (ema.pdparams)" if ema is not None else "the raw weights"
    updates, record = decide(mode, vae, stats, source, f"{weights} of {args.checkpoint_dir}",
                             "scripts/export_vae.py measures with --scaling_factor measure (the factor then changes); "
                             "scripts/eval_vae.py --vae on this folder measures the statistics alone",
                             export_config.get(EXPORT_ORIGIN_KEY) or f"kept from the checkpoint's {ckpt.VAE_CONFIG_NAME}")
    export_vae_folder(vae, args.out_dir, ema, export_config.get("posterior_std", 0.0), updates, record)
    name = type(vae).__name__  # AutoencoderKL, or a class ppdiffusers 0.29 lacks (ours: vae_trainer.models)
    paddle_class = f"{type(vae).__module__}.{name}" if name != "AutoencoderKL" else "ppdiffusers.AutoencoderKL"
    problem = family_of(vae).diffusers_problem(vae)
    readers = (f"{paddle_class}.from_pretrained and diffusers.{name}.from_pretrained" if problem is None
               else f"{paddle_class}.from_pretrained (not PyTorch diffusers: {problem})")
    print(f"exported {args.checkpoint_dir} ({weights}: {why}) to {args.out_dir}: loads with {readers}")
    return args.out_dir


if __name__ == "__main__":
    main()
