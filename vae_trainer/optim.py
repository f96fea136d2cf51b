"""Optimizers, LR schedules and gradient clipping of the VAE and the discriminator, the same in both drivers:
AdamW without decay on biases and norms, PaddleNLP's schedules (the discriminator's counted from --disc_start),
and the step's own global-norm clipping (docs/training.md, "One block per optimizer step").
"""

from __future__ import annotations

from typing import List, Sequence

import paddle
from paddlenlp.trainer.trainer_utils import get_scheduler

from .distributed import world_size
from .precision import uses_master_weights


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


def build_optimizer(args, named_parameters: List, lr_scheduler) -> paddle.optimizer.AdamW:
    """AdamW over `named_parameters` [(name, param)], decaying all but biases and norm weights."""
    params = [p for _, p in named_parameters if not p.stop_gradient]
    no_decay = {p.name for n, p in named_parameters if "bias" in n or "norm" in n}
    return paddle.optimizer.AdamW(
        learning_rate=lr_scheduler,
        parameters=params,
        beta1=args.adam_beta1,
        beta2=args.adam_beta2,
        epsilon=args.adam_epsilon,
        weight_decay=args.weight_decay,
        apply_decay_param_fun=lambda name: name not in no_decay,
        multi_precision=uses_master_weights(args),
    )


def scaled_learning_rate(args, learning_rate: float) -> float:
    """--scale_lr: LDM's rule, lr x per-device batch x accumulation x processes."""
    if not getattr(args, "scale_lr", False):
        return learning_rate
    return learning_rate * args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size()


def build_vae_optimizer(args, model):
    """Scheduler and optimizer of the VAE (and the learnable log-variance, when enabled)."""
    scheduler = build_scheduler(args, scaled_learning_rate(args, args.learning_rate), args.max_steps)
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("discriminator.")]
    return build_optimizer(args, named, scheduler), scheduler


def build_disc_optimizer(args, model, disc_start: int):
    """Scheduler and optimizer of the discriminator; its schedule covers the steps after disc_start."""
    lr = args.disc_learning_rate if args.disc_learning_rate is not None else args.learning_rate
    lr = scaled_learning_rate(args, lr)
    scheduler = build_scheduler(args, lr, args.max_steps - min(disc_start, args.max_steps))
    named = [(n, p) for n, p in model.named_parameters() if n.startswith("discriminator.")]
    return build_optimizer(args, named, scheduler), scheduler


@paddle.no_grad()
def grad_norm(parameters: Sequence[paddle.Tensor]) -> paddle.Tensor:
    """Global L2 norm of the gradients, a 0-d float32 tensor on the device; squares summed in float32 (unlike
    `paddle.nn.utils.clip_grad_norm_`), so fp16 gradients do not overflow it."""
    squares = [p.grad.astype("float32").square().sum() for p in parameters if p.grad is not None]
    if not squares:
        return paddle.zeros([], "float32")
    return paddle.stack(squares).sum().sqrt()


@paddle.no_grad()
def clip_grads(parameters: Sequence[paddle.Tensor], norm: paddle.Tensor, max_norm: float) -> None:
    """Scale the gradients in place to a global norm (`norm`, from `grad_norm`) of at most `max_norm`, the rule
    of `paddle.nn.ClipGradByGlobalNorm`; `max_norm` <= 0 disables clipping."""
    if max_norm <= 0:
        return
    scale = max_norm / paddle.clip(norm, min=max_norm)
    for p in parameters:
        if p.grad is not None:
            p.grad.multiply_(scale.astype(p.grad.dtype))
