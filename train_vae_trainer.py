"""Train an AutoencoderKL with LPIPS and a PatchGAN using the PaddleNLP Trainer.

    python train_vae_trainer.py --file_list data/filelist/demo.filelist.list \
        --vae_config_file configs/vae_tiny.json --resolution 64 --max_steps 1000 --device cpu

Flags: `python train_vae_trainer.py --help` (the same as train_vae_no_trainer.py).
"""

import sys

from vae_trainer.console import quiet_third_party

quiet_third_party()  # before Paddle, PaddleNLP and ppdiffusers are imported
if __name__ == "__main__":  # first: Paddle, imported below, reads OMP_NUM_THREADS only once
    from vae_trainer.threads import set_default_threads

    set_default_threads(sys.argv[1:])

from vae_trainer import loop  # noqa: E402
from vae_trainer.distributed import run_and_exit  # noqa: E402
from vae_trainer.trainer import train  # noqa: E402


def main(argv=None) -> None:
    loop.main(train, argv)


if __name__ == "__main__":
    # A signal saves and stops; a multi-process run ends in a defined order (both: distributed.py).
    run_and_exit(lambda: main(sys.argv[1:]), stop_signals=True)
