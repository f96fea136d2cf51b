"""Train an AutoencoderKL with LPIPS and a PatchGAN in a plain loop (no PaddleNLP Trainer).

    python train_vae_no_trainer.py --file_list data/filelist/demo.filelist.list \
        --vae_config_file configs/vae_tiny.json --resolution 64 --max_steps 1000 --device cpu

Flags: `python train_vae_no_trainer.py --help` (the same as train_vae_trainer.py).
"""

import sys

from vae_trainer.arguments import parse_arguments
from vae_trainer.distributed import rank
from vae_trainer.loop import train


def main(argv=None):
    model_args, data_args, loss_args, training_args = parse_arguments(argv)
    outputs = train(model_args, data_args, loss_args, training_args)
    if rank() == 0:
        print(f"VAE saved to {outputs['vae']}\nVisualDL logs: {outputs['logs']}")


if __name__ == "__main__":
    main(sys.argv[1:])
