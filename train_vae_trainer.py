"""Train an AutoencoderKL with LPIPS and a PatchGAN using the PaddleNLP Trainer.

    python train_vae_trainer.py --file_list data/filelist/demo.filelist.list \
        --vae_config_file configs/vae_tiny.json --resolution 64 --max_steps 1000 --device cpu

Flags: `python train_vae_trainer.py --help` (the same as train_vae_no_trainer.py).
"""

import sys

if __name__ == "__main__":  # first: Paddle, imported below, reads OMP_NUM_THREADS only once
    from vae_trainer.threads import set_default_threads

    set_default_threads(sys.argv[1:])

from vae_trainer import checkpoint as ckpt  # noqa: E402
from vae_trainer.argument_parser import parse_arguments  # noqa: E402
from vae_trainer.build import build_evaluator, build_networks, init_process, seed_training  # noqa: E402
from vae_trainer.distributed import rank, run_and_exit  # noqa: E402
from vae_trainer.final_save import save_final_models  # noqa: E402
from vae_trainer.output_dir import prepare_output_dir, run_inputs  # noqa: E402
from vae_trainer.step import NonFiniteError  # noqa: E402
from vae_trainer.trainer import VAETrainer  # noqa: E402
from vae_trainer.user_errors import exit_on_user_error, start_up  # noqa: E402
from vae_trainer import watchdog  # noqa: E402


@exit_on_user_error
def main(argv=None):
    with start_up():  # bad flags or files: one `error: ...` line, no traceback
        model_args, data_args, loss_args, training_args = parse_arguments(argv)
        watchdog.start(training_args.stall_timeout, rank(), "starting up")  # stopped as main ends (exit_on_user_error)
        init_process(training_args)
        prepare_output_dir(training_args, run_inputs(model_args, data_args))  # nor an input
        networks = build_networks(model_args, loss_args, training_args, resolution=data_args.resolution)
        evaluator = build_evaluator(data_args, training_args, networks)
        trainer = VAETrainer(networks.model, training_args, networks, data_args, loss_args, evaluator)
    seed_training(training_args.seed)
    with start_up():
        resume = ckpt.resolve_resume(training_args.output_dir, training_args.resume_from_checkpoint)
        ckpt.set_aside_later(training_args.output_dir, resume)  # rolling back is a branch
    try:
        trainer.train(resume_from_checkpoint=resume)
        trainer._save_checkpoint(trainer.model)  # always a checkpoint at the end (no-op if just saved)
    except NonFiniteError as error:
        sys.exit(f"error: {error} Last good weights: {ckpt.list_checkpoints(training_args.output_dir)[-1][1]}")
    finally:
        trainer.close()  # data loader workers joined, logs closed (the process group ends in run_and_exit)
    trainer.optimization.restore_float32(networks.model)  # O2: evaluate and export the float32 master weights
    watchdog.start(training_args.stall_timeout, trainer.args.process_index, "exporting")
    try:
        vae_dir, _ = save_final_models(training_args.output_dir, networks, trainer.optimization.ema, evaluator, trainer.state.global_step)
    finally:
        watchdog.stop()
    if trainer.is_world_process_zero():
        print(f"VAE saved to {vae_dir}\nVisualDL logs: {training_args.logging_dir}")


if __name__ == "__main__":
    # A signal saves and stops (preemption.py); a multi-process run ends in a defined order (distributed.py).
    run_and_exit(lambda: main(sys.argv[1:]), stop_signals=True)
