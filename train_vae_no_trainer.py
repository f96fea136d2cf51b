"""Train an AutoencoderKL with LPIPS and a PatchGAN in a plain loop (no PaddleNLP Trainer).

    python train_vae_no_trainer.py --file_list data/filelist/demo.filelist.list \
        --vae_config_file configs/vae_tiny.json --resolution 64 --max_steps 1000 --device cpu

Flags: `python train_vae_no_trainer.py --help` (the same as train_vae_trainer.py).
"""

import sys

if __name__ == "__main__":  # first: Paddle, imported below, reads OMP_NUM_THREADS only once
    from vae_trainer.threads import set_default_threads

    set_default_threads(sys.argv[1:])

from vae_trainer.argument_parser import parse_arguments  # noqa: E402
from vae_trainer.distributed import rank, run_and_exit  # noqa: E402
from vae_trainer.checkpoint import list_checkpoints  # noqa: E402
from vae_trainer.loop import train  # noqa: E402
from vae_trainer.step import NonFiniteError  # noqa: E402
from vae_trainer.user_errors import exit_on_user_error, start_up  # noqa: E402


@exit_on_user_error
def main(argv=None):
    with start_up():  # bad flags: one `error: ...` line, no traceback (and for files: loop.train's start-up)
        model_args, data_args, loss_args, training_args = parse_arguments(argv)
    try:
        outputs = train(model_args, data_args, loss_args, training_args)
    except NonFiniteError as error:
        latest = list_checkpoints(training_args.output_dir)[-1][1]
        sys.exit(f"error: {error} Last good weights: {latest}")
    if rank() == 0:
        print(f"VAE saved to {outputs['vae']}\nVisualDL logs: {outputs['logs']}")


if __name__ == "__main__":
    # A signal saves and stops (preemption.py); a multi-process run ends in a defined order (distributed.py).
    run_and_exit(lambda: main(sys.argv[1:]), stop_signals=True)
