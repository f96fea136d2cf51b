"""Optimizers and LR schedules for the VAE and the discriminator, built the same way by both drivers.

AdamW (betas from --adam_beta1/--adam_beta2, LDM uses 0.5/0.9), no weight decay on biases and norms,
global-norm clipping (--max_grad_norm), and PaddleNLP's `get_scheduler` (--lr_scheduler_type with
--warmup_steps / --warmup_ratio). The discriminator's schedule starts counting at --disc_start, so its
warm-up happens when it actually starts training. With --scale_lr both peak rates are multiplied by the
global batch (`scaled_learning_rate`).
"""

from __future__ import annotations

from typing import List

import paddle
from paddlenlp.trainer.trainer_utils import get_scheduler

from .precision import uses_master_weights


class GuardedAdamW(paddle.optimizer.AdamW):
    """AdamW whose next `step()` can be cancelled by the training step (non-finite gradients).

    Both drivers call `step()` unconditionally (the PaddleNLP Trainer does so in its own loop), so
    cancelling here is the one place a bad step is skipped for either driver.
    """

    skip_next_step = False

    def step(self):
        if self.skip_next_step:
            self.skip_next_step = False
            return
        super().step()


def build_scheduler(args, learning_rate: float, num_training_steps: int) -> paddle.optimizer.lr.LRScheduler:
    warmup = args.warmup_steps if args.warmup_steps > 0 else int(args.warmup_ratio * num_training_steps)
    return get_scheduler(
        args.lr_scheduler_type,
        learning_rate=learning_rate,
        num_warmup_steps=warmup,
        num_training_steps=max(num_training_steps, 1),
        num_cycles=args.num_cycles,
        lr_end=args.lr_end,
        power=args.power,
    )


def build_optimizer(args, named_parameters: List, lr_scheduler) -> GuardedAdamW:
    """AdamW over `named_parameters` [(name, param)], decaying all but biases and norm weights."""
    params = [p for _, p in named_parameters if not p.stop_gradient]
    no_decay = {p.name for n, p in named_parameters if "bias" in n or "norm" in n}
    return GuardedAdamW(
        learning_rate=lr_scheduler,
        parameters=params,
        beta1=args.adam_beta1,
        beta2=args.adam_beta2,
        epsilon=args.adam_epsilon,
        weight_decay=args.weight_decay,
        apply_decay_param_fun=lambda name: name not in no_decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(args.max_grad_norm) if args.max_grad_norm > 0 else None,
        multi_precision=uses_master_weights(args),
    )


def scaled_learning_rate(args, learning_rate: float) -> float:
    """--scale_lr: LDM's rule, lr x per-device batch x accumulation x processes (the reference trainer's
    ngpu x batch_size x lr, which has no accumulation)."""
    if not getattr(args, "scale_lr", False):
        return learning_rate
    from .distributed import world_size

    return learning_rate * args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size()


def build_vae_optimizer(args, model):
    """Scheduler and optimizer of the VAE (and the learnable log-variance, when enabled)."""
    scheduler = build_scheduler(args, scaled_learning_rate(args, args.learning_rate), args.max_steps)
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("discriminator.")]
    return build_optimizer(args, named, scheduler), scheduler


def build_disc_optimizer(args, model, disc_start: int):
    """Scheduler and optimizer of the discriminator; its schedule covers the steps after disc_start."""
    lr = scaled_learning_rate(args, args.disc_learning_rate if args.disc_learning_rate is not None else args.learning_rate)
    scheduler = build_scheduler(args, lr, args.max_steps - min(disc_start, args.max_steps))
    named = [(n, p) for n, p in model.named_parameters() if n.startswith("discriminator.")]
    return build_optimizer(args, named, scheduler), scheduler
