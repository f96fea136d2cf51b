"""The PaddleNLP Trainer driver (train_vae_trainer.py): the Trainer's loop, progress bar, console log and
`--save_steps` timing around the same step and bookkeeping as the plain loop (`loop.Run`).

`training_step` runs `TrainStep.forward_backward` on each micro-batch and `TrainStep.optimizer_step` on the last
one of an optimizer step; a callback then runs `Run.after_step`. `get_train_dataloader`, `_save_checkpoint` and
`_load_from_checkpoint` are `Run`'s; `_wrap_model` adds no `paddle.DataParallel` (distributed.py). After each
optimizer step the Trainer steps its `optimizer` and `lr_scheduler` itself, with no hook to replace that: it holds
`AlreadyStepped`, whose calls do nothing.
"""

from __future__ import annotations

import copy
import logging
from typing import Dict, Optional

import paddle
from paddlenlp.trainer import Trainer, TrainerCallback
from paddlenlp.trainer.trainer_utils import TrainOutput

from . import checkpoint as ckpt
from . import watchdog
from .build import seed_training
from .distributed import rank
from .loop import Run, start
from .step import NonFiniteError
from .user_errors import start_up

logger = logging.getLogger("vae_trainer")


class AlreadyStepped:
    """The Trainer's `optimizer` and `lr_scheduler`: step() and clear_grad() do nothing, since
    `TrainStep.optimizer_step` did them for both networks; get_lr() is the VAE optimizer's (the console's)."""

    def __init__(self, vae_optimizer):
        self._vae_optimizer = vae_optimizer

    def step(self) -> None:
        pass

    def clear_grad(self, set_to_zero: bool = True) -> None:
        pass

    def get_lr(self) -> float:
        return self._vae_optimizer.get_lr()


class _AfterOptimizerStep(TrainerCallback):
    def __init__(self, trainer: "VAETrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.run.after_step(state, self.trainer.step_report, self.trainer.micro)


class VAETrainer(Trainer):
    def __init__(self, run: Run):
        # The Trainer's copy of the flags: VisualDL is written by TrainMonitor, mixed precision set up by precision.py.
        args = copy.copy(run.args)
        args.report_to, args.fp16, args.bf16 = [], False, False
        args.ignore_data_skip = True  # the stream resumes at its saved position instead of replaying
        super().__init__(model=run.networks.model, args=args)
        self.run = run
        self.resume_rank_state: Optional[dict] = None
        self.micro_steps = 0
        self.micro = None  # the last micro-batch's MicroBatch
        self.step_report = None  # the last optimizer step's StepReport
        self.add_callback(_AfterOptimizerStep(self))

    def train(self, resume_from_checkpoint: Optional[str] = None, **kwargs) -> Optional[TrainOutput]:
        """The Trainer's training; from a checkpoint at --max_steps, nothing (the Trainer checks for the end only
        after a step, so it would train one more): the checkpoint's state is restored for the save and export."""
        if resume_from_checkpoint and (ckpt.checkpoint_step(resume_from_checkpoint) or 0) >= self.args.max_steps:
            self.state, self.resume_rank_state = self.run.load(resume_from_checkpoint)
            self.run.build_data(self.resume_rank_state)
            ckpt.set_rng_state(self.resume_rank_state["rng"])
            return None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def create_optimizer_and_scheduler(self, num_training_steps: int):
        watchdog.start(self.args.stall_timeout, rank())  # from the first batch's wait on (watchdog.py)
        self.optimizer = self.lr_scheduler = AlreadyStepped(self.run.optimization.vae_optimizer)

    def _wrap_model(self, model, training=True):
        return model

    def get_train_dataloader(self):
        return self.run.build_data(self.resume_rank_state)

    def training_step(self, model, inputs):
        micro_batch = self.micro_steps % self.args.gradient_accumulation_steps
        step = self.run.optimization.step
        self.micro = step.forward_backward(inputs["pixel_values"], self.state.global_step, micro_batch)
        self.run.position.update(inputs["position"])
        self.run.monitor.micro_step_end(self.micro.logs)
        self.micro_steps += 1
        if micro_batch == self.args.gradient_accumulation_steps - 1:
            self.step_report = step.optimizer_step(self.state.global_step)
        # The Trainer sums this for its console "loss"; a skipped non-finite step must not poison the sum.
        loss = self.micro.logs["loss/total"] / self.args.gradient_accumulation_steps
        return paddle.where(paddle.isfinite(loss), loss, paddle.zeros_like(loss))

    def _save_checkpoint(self, model, metrics=None) -> str:
        return self.run.save(self.state)

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if resume_from_checkpoint is not None:
            self.resume_rank_state = self.run.load(resume_from_checkpoint)[1]

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None:  # the weights and optimization state were loaded by _load_from_checkpoint
            ckpt.set_rng_state(self.resume_rank_state["rng"])


def train(model_args, data_args, loss_args, args) -> Dict[str, str]:
    """Train with the PaddleNLP Trainer until --max_steps; return the paths of the exported VAE, discriminator
    and logs."""
    run, resume = start(model_args, data_args, loss_args, args)
    with start_up():
        trainer = VAETrainer(run)  # seeds everything with --seed, as the Trainer does
    seed_training(args.seed)
    try:
        trainer.train(resume_from_checkpoint=resume)
        run.save(trainer.state)  # always a checkpoint at the end (kept as is if just written)
    except NonFiniteError:
        run.save(trainer.state)  # the weights are those of the last good step: a checkpoint to go back to
        raise
    finally:
        run.close()
    return run.export(trainer.state.global_step)
