"""Optimizers, LR schedules and gradient clipping of the VAE and the discriminator (docs/training.md): AdamW
without decay on biases and norms, PaddleNLP's schedules (the discriminator's counted from --disc_start)."""

from typing import Optional, Sequence

import paddle
from paddlenlp.trainer.trainer_utils import get_scheduler

from .distributed import world_size
from .precision import uses_master_weights

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("num_cycles",), lambda f: f.scheduler != "cosine", "only --lr_scheduler_type cosine reads it: drop it"),
    (("lr_end", "power"), lambda f: f.scheduler != "polynomial",
     "only --lr_scheduler_type polynomial reads it: drop it"),
    (("warmup_steps", "warmup_ratio"), lambda f: f.scheduler == "constant",
     "--lr_scheduler_type constant has no warm-up (constant_with_warmup has): drop it"),
    (("warmup_ratio",), lambda f: f.warmup_steps > 0, "--warmup_steps > 0 wins over it: drop one"),
)


def build_scheduler(args, learning_rate: float, num_training_steps: int) -> paddle.optimizer.lr.LRScheduler:
    warmup = args.warmup_steps if args.warmup_steps > 0 else int(args.warmup_ratio * num_training_steps)
    return get_scheduler(args.lr_scheduler_type, learning_rate=learning_rate, num_warmup_steps=warmup,
                         num_training_steps=max(num_training_steps, 1), num_cycles=args.num_cycles,
                         lr_end=args.lr_end, power=args.power)


def build_optimizer(args, model, disc_start: Optional[int] = None):
    """(AdamW, schedule) of the VAE (and the learnable log-variance, when enabled), or given `disc_start` of the
    discriminator (--disc_learning_rate if set; its schedule covers the steps after disc_start); no decay on biases
    and norms."""
    discriminator = disc_start is not None
    rate = args.disc_learning_rate if discriminator and args.disc_learning_rate is not None else args.learning_rate
    if args.scale_lr:  # LDM's rule: x per-device batch x accumulation x processes
        rate = rate * args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size()
    scheduler = build_scheduler(args, rate, args.max_steps - min(disc_start or 0, args.max_steps))
    named = [(n, p) for n, p in model.named_parameters() if n.startswith("discriminator.") == discriminator]
    no_decay = {p.name for n, p in named if "bias" in n or "norm" in n}
    return paddle.optimizer.AdamW(
        learning_rate=scheduler, parameters=[p for _, p in named if not p.stop_gradient], beta1=args.adam_beta1,
        beta2=args.adam_beta2, epsilon=args.adam_epsilon, weight_decay=args.weight_decay,
        apply_decay_param_fun=lambda name: name not in no_decay, multi_precision=uses_master_weights(args)), scheduler


@paddle.no_grad()
def grad_norm(parameters: Sequence[paddle.Tensor]) -> paddle.Tensor:
    """Global L2 norm of the gradients (0-d float32, on the device); squares summed in float32: fp16 cannot overflow."""
    squares = [p.grad.astype("float32").square().sum() for p in parameters if p.grad is not None]
    return paddle.stack(squares).sum().sqrt() if squares else paddle.zeros([], "float32")


@paddle.no_grad()
def clip_grads(parameters: Sequence[paddle.Tensor], norm: paddle.Tensor, max_norm: float) -> None:
    """Scale the gradients in place to a global norm (`norm`, `grad_norm`'s) of at most `max_norm` (<= 0: no clip)."""
    if max_norm <= 0:
        return
    scale = max_norm / paddle.clip(norm, min=max_norm)
    for p in parameters:
        if p.grad is not None:
            p.grad.multiply_(scale.astype(p.grad.dtype))
