"""The plain training loop (train_vae_no_trainer.py): the whole run on one screen, nothing hidden.

It drives the same `TrainStep` (`forward_backward` per micro-batch, then `optimizer_step`, which updates
both networks and their schedules), checkpoints and telemetry as the Trainer subclass, in the same
order, so the two entry points produce the same numbers.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional

from paddlenlp.trainer import TrainerState
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .build import (build_evaluator, build_networks, build_optimization, build_train_data, init_process,
                    seed_training)
from .distributed import rank, world_size
from .final_save import checkpoint_configs, save_final_models
from .output_dir import prepare_output_dir, run_inputs
from . import watchdog
from .preemption import stop_after_step
from .step import NonFiniteError, logged_images
from .train_logging import TrainMonitor, format_scalars
from .user_errors import start_up

logger = logging.getLogger("vae_trainer")


def train(model_args, data_args, loss_args, args) -> Dict[str, str]:
    """Train until --max_steps; return the paths of the exported VAE, discriminator and logs."""
    watchdog.start(args.stall_timeout, rank(), "starting up")  # stopped by the entry point (exit_on_user_error)
    with start_up():  # bad files or flags: `UserError`, one line from the entry point
        init_process(args)
        prepare_output_dir(args, run_inputs(model_args, data_args))  # never eats an earlier run or an input
        networks = build_networks(model_args, loss_args, args, resolution=data_args.resolution)
        optimization = build_optimization(networks, loss_args, args)
        evaluator = build_evaluator(data_args, args, networks)
        resume = ckpt.resolve_resume(args.output_dir, args.resume_from_checkpoint)
        ckpt.set_aside_later(args.output_dir, resume)  # rolling back is a branch
    model = networks.model
    state = TrainerState(max_steps=args.max_steps)
    rank_state: Optional[dict] = None
    if resume:
        ckpt.load_model_state(resume, model)
        ckpt.load_stateful(resume, optimization.stateful())
        state = TrainerState.load_from_json(os.path.join(resume, ckpt.TRAINER_STATE_NAME))
        rank_state = ckpt.load_rank_state(resume)
        logger.info("resuming from %s at step %d", resume, state.global_step)
    else:
        seed_training(args.seed)

    data_state = rank_state["data"] if rank_state else None
    with start_up():
        dataloader, position = build_train_data(data_args, args, data_state)
    if rank_state:
        ckpt.set_rng_state(rank_state["rng"])
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size()
    monitor = TrainMonitor(args, global_batch, is_main_process=rank() == 0)
    monitor.watch_data(position)
    progress = tqdm(total=args.max_steps, initial=state.global_step, disable=rank() != 0 or args.disable_tqdm,
                    desc="train", dynamic_ncols=True)

    # Resumed from OUTPUT_DIR's own checkpoint of this step (e.g. one already at --max_steps): it is this very
    # state, so the final save must not delete and rewrite it.
    saved_at = [state.global_step if resume and ckpt.is_checkpoint_of(args.output_dir, resume, state.global_step)
                else None]

    def save() -> str:
        if saved_at[0] == state.global_step:
            return ckpt.checkpoint_path(args.output_dir, state.global_step)
        watchdog.doing(f"saving checkpoint-{state.global_step}")
        path = ckpt.save_checkpoint(args.output_dir, state.global_step, model=model, stateful=optimization.stateful(),
                             trainer_state=state, rank_state=ckpt.make_rank_state(model, position),
                             save_total_limit=args.save_total_limit, keep=state.best_model_checkpoint,
                             configs=checkpoint_configs(networks, evaluator))
        saved_at[0] = state.global_step
        watchdog.beat(f"saving checkpoint-{state.global_step}", state.global_step)
        return path

    batches = monitor.timed(dataloader)  # each wait for a batch counts as data time, nothing else
    iteration = iter(batches)
    step = optimization.step
    watchdog.start(args.stall_timeout, rank())  # from the first batch's wait on (watchdog.py)
    try:
        while state.global_step < args.max_steps:
            for micro_batch in range(args.gradient_accumulation_steps):
                batch = next(iteration)
                micro = step.forward_backward(batch["pixel_values"], state.global_step, micro_batch)
                position.update(batch["position"])
                monitor.micro_step_end(micro.logs)
            # all-reduce, unscale, finite check, clip, VAE and discriminator updates, schedules, EMA
            report = step.optimizer_step(state.global_step)
            state.global_step += 1
            watchdog.beat(f"step {state.global_step}", state.global_step)
            progress.update(1)

            scalars = monitor.optimizer_step_end(state.global_step, report.scalars, lambda: logged_images(step, micro))
            if scalars is not None:
                state.log_history.append({"step": state.global_step, **scalars})
                progress.set_postfix_str(format_scalars(scalars))
            if evaluator.due(state.global_step) and evaluator.run(state.global_step, model.vae, optimization.ema, monitor, state):
                state.best_model_checkpoint = ckpt.checkpoint_path(args.output_dir, state.global_step)
                save()  # the best checkpoint so far, kept by rotation
            if args.save_steps > 0 and state.global_step % args.save_steps == 0:
                save()
            stop_after_step(report.stop, state.global_step, save)  # a signal: save and stop (preemption.py)
        save()  # always a checkpoint at the end, to continue training later
    except NonFiniteError:
        save()  # the weights are those of the last good step: a checkpoint to go back to
        raise
    finally:
        watchdog.stop()
        batches.close()  # the loader's workers end here, not while the export runs
        progress.close()
        monitor.close()
    optimization.restore_float32(model)  # O2: evaluate and export the float32 master weights
    watchdog.start(args.stall_timeout, rank(), "exporting")
    try:
        vae_dir, disc_dir = save_final_models(args.output_dir, networks, optimization.ema, evaluator, state.global_step)
    finally:
        watchdog.stop()
    return {"vae": vae_dir, "discriminator": disc_dir, "logs": args.logging_dir}
