"""Train an AutoencoderKL with LPIPS and a PatchGAN in a plain loop (no PaddleNLP Trainer).

    python train_vae_no_trainer.py --file_list data/filelist/demo.filelist.list \
        --vae_config_file configs/vae_tiny.json --resolution 64 --max_steps 1000 --device cpu

Flags: `python train_vae_no_trainer.py --help` (the same as train_vae_trainer.py).
"""

import sys

if __name__ == "__main__":  # first: Paddle, imported below, reads OMP_NUM_THREADS only once
    from vae_trainer.threads import set_default_threads

    set_default_threads(sys.argv[1:])

from vae_trainer.arguments import parse_arguments  # noqa: E402
from vae_trainer.distributed import rank  # noqa: E402
from vae_trainer.checkpoint import list_checkpoints  # noqa: E402
from vae_trainer.loop import train  # noqa: E402
from vae_trainer.step import NonFiniteError  # noqa: E402


def main(argv=None):
    try:
        model_args, data_args, loss_args, training_args = parse_arguments(argv)
    except ValueError as error:  # refused or contradictory flags: a message, not a traceback
        sys.exit(f"error: {error}")
    try:
        outputs = train(model_args, data_args, loss_args, training_args)
    except FileExistsError as error:  # an --output_dir holding an earlier run (checkpoint.prepare_output_dir)
        sys.exit(f"error: {error}")
    except NonFiniteError as error:
        latest = list_checkpoints(training_args.output_dir)[-1][1]
        sys.exit(f"error: {error} Last good weights: {latest}")
    if rank() == 0:
        print(f"VAE saved to {outputs['vae']}\nVisualDL logs: {outputs['logs']}")


if __name__ == "__main__":
    main(sys.argv[1:])
