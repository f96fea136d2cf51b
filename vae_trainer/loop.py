"""The plain training loop (train_vae_no_trainer.py): the whole run on one screen, nothing hidden.

It drives the same `TrainStep`, optimizers, schedules, checkpoints and telemetry as the Trainer
subclass, in the same order, so the two entry points produce the same numbers.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional

from paddlenlp.trainer import TrainerState
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .build import build_components, seed_training, setup_runtime
from .data.dataset import StreamPosition, build_train_dataloader
from .distributed import rank, world_size
from .optim import build_disc_optimizer, build_vae_optimizer
from .step import TrainStep
from .train_logging import TrainMonitor, format_scalars

logger = logging.getLogger("vae_trainer")


def train(model_args, data_args, loss_args, args) -> Dict[str, str]:
    """Train until --max_steps; return the paths of the exported VAE and discriminator."""
    setup_runtime(args)
    parts = build_components(model_args, loss_args, args)
    model = parts.model
    vae_optimizer, vae_scheduler = build_vae_optimizer(args, model)
    disc_optimizer, disc_scheduler = build_disc_optimizer(args, model, loss_args.disc_start)
    stateful = {
        "optimizer.pdopt": vae_optimizer, "scheduler.pdparams": vae_scheduler,
        "disc_optimizer.pdopt": disc_optimizer, "disc_scheduler.pdparams": disc_scheduler,
    }
    state = TrainerState(max_steps=args.max_steps)
    resume = ckpt.resolve_resume(args.output_dir, args.resume_from_checkpoint)
    rank_state: Optional[dict] = None
    if resume:
        ckpt.load_model_state(resume, model)
        ckpt.load_stateful(resume, stateful)
        state = TrainerState.load_from_json(os.path.join(resume, ckpt.TRAINER_STATE_NAME))
        rank_state = ckpt.load_rank_state(resume)
        logger.info("resuming from %s at step %d", resume, state.global_step)
    else:
        seed_training(args.seed)

    dataloader = build_train_dataloader(
        data_args.file_list, data_args.resolution, args.per_device_train_batch_size, args.dataloader_num_workers,
        args.seed, rank(), world_size(), resume_state=rank_state["data"] if rank_state else None,
        image_column=data_args.image_column, random_flip=data_args.random_flip,
        random_crop=data_args.random_crop, min_image_size=data_args.min_image_size,
    )
    position = StreamPosition.from_state(rank_state["data"]) if rank_state else StreamPosition(
        args.dataloader_num_workers, world_size())
    if rank_state:
        ckpt.set_rng_state(rank_state["rng"])
    step_fn = TrainStep(model, parts.lpips, loss_args, disc_optimizer, disc_scheduler, args.gradient_accumulation_steps)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size()
    monitor = TrainMonitor(args, global_batch, is_main_process=rank() == 0)
    progress = tqdm(total=args.max_steps, initial=state.global_step, disable=rank() != 0 or args.disable_tqdm,
                    desc="train", dynamic_ncols=True)

    batches = iter(dataloader)
    while state.global_step < args.max_steps:
        for micro in range(args.gradient_accumulation_steps):
            batch = next(batches)
            monitor.micro_step_begin()
            logs = step_fn(batch["pixel_values"], state.global_step, micro == args.gradient_accumulation_steps - 1)
            position.update(batch["position"])
            monitor.micro_step_end(logs)
        learning_rate = vae_optimizer.get_lr()
        vae_optimizer.step()
        vae_scheduler.step()
        vae_optimizer.clear_grad()
        state.global_step += 1
        progress.update(1)

        scalars = monitor.optimizer_step_end(state.global_step, learning_rate, step_fn)
        if scalars is not None:
            state.log_history.append({"step": state.global_step, **scalars})
            progress.set_postfix_str(format_scalars(scalars))
        if args.save_steps > 0 and state.global_step % args.save_steps == 0:
            ckpt.save_checkpoint(args.output_dir, state.global_step, model=model, stateful=stateful,
                                 trainer_state=state, rank_state=ckpt.make_rank_state(model, position),
                                 save_total_limit=args.save_total_limit)
    progress.close()
    monitor.close()
    vae_dir, disc_dir = ckpt.export_final(args.output_dir, model.vae, model.discriminator, parts.discriminator_config)
    return {"vae": vae_dir, "discriminator": disc_dir, "logs": args.logging_dir}
