"""The PaddleNLP Trainer subclass (train_vae_trainer.py).

The Trainer keeps its own loop, progress bar, VAE optimizer step, LR schedule, clipping and
`--save_steps` timing. We replace the pieces a two-optimizer GAN needs:
- `create_optimizer_and_scheduler`: everything from `build.build_training` (the loop builds the same);
- `training_step`: the shared `TrainStep` (which also steps the discriminator on the last micro-step);
- `_wrap_model`: no `paddle.DataParallel` (see distributed.py); the step all-reduces gradients itself,
  and mixed precision is set up by `precision.py` for both drivers;
- `get_train_dataloader`: our streaming reader, resumed at the saved data position;
- `_save_checkpoint` / `_load_from_checkpoint` / `_load_optimizer_and_scheduler`: `checkpoint.py`, so the
  discriminator, its optimizer, scalers, EMA, RNG states and data position are saved and restored too.
After each optimizer step a callback runs the same bookkeeping as the loop (EMA, telemetry).
"""

from __future__ import annotations

import logging
from typing import Optional

import paddle
from paddlenlp.trainer import Trainer, TrainerCallback

from . import checkpoint as ckpt
from .build import build_train_data, build_training
from .distributed import rank, world_size
from .export import checkpoint_configs
from .step import NonFiniteError
from .train_logging import TrainMonitor

logger = logging.getLogger("vae_trainer")


class _AfterOptimizerStep(TrainerCallback):
    def __init__(self, trainer: "VAETrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.after_optimizer_step()


class VAETrainer(Trainer):
    def __init__(self, model, args, components, data_args, loss_args, evaluator):
        # Hidden from the Trainer's __init__: VisualDL is written by TrainMonitor (shared with the loop),
        # and mixed precision is set up by precision.py (two scalers, decoration only on GPU).
        hidden = {"report_to": [], "fp16": False, "bf16": False}
        saved = {name: getattr(args, name) for name in hidden}
        for name, value in hidden.items():
            setattr(args, name, value)
        args.ignore_data_skip = True  # the stream resumes at its saved position instead of replaying
        super().__init__(model=model, args=args)
        for name, value in saved.items():
            setattr(args, name, value)
        self.components, self.data_args, self.loss_args, self.evaluator = components, data_args, loss_args, evaluator
        self.saved_at_step = None
        self.run = None
        self.resume_rank_state: Optional[dict] = None
        self.position = None
        self.micro_steps = 0
        self.learning_rate_of_step = 0.0
        global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size()
        self.monitor = TrainMonitor(args, global_batch, is_main_process=rank() == 0)
        self.add_callback(_AfterOptimizerStep(self))

    # ---- building
    def create_optimizer_and_scheduler(self, num_training_steps: int):
        self.run = build_training(self.components, self.loss_args, self.args)
        self.optimizer, self.lr_scheduler = self.run.vae_optimizer, self.run.vae_scheduler

    def _wrap_model(self, model, training=True):
        return model

    def get_train_dataloader(self):
        data_state = self.resume_rank_state["data"] if self.resume_rank_state else None
        loader, self.position = build_train_data(self.data_args, self.args, data_state)
        return loader

    # ---- the step
    def training_step(self, model, inputs):
        self.micro_steps += 1
        last = self.micro_steps % self.args.gradient_accumulation_steps == 0
        if last:  # the Trainer steps the VAE optimizer and then the schedule right after this returns
            self.learning_rate_of_step = self.optimizer.get_lr()
        self.monitor.micro_step_begin()
        try:
            logs = self.run.step(inputs["pixel_values"], self.state.global_step, last)
        except NonFiniteError:
            self._save_checkpoint(model)  # the weights are those of the last good step
            raise
        self.position.update(inputs["position"])
        self.monitor.micro_step_end(logs)
        # The Trainer sums this for its console "loss"; a skipped non-finite step must not poison the sum.
        loss = logs["loss/total"]
        return paddle.where(paddle.isfinite(loss), loss, paddle.zeros_like(loss)) / self.args.gradient_accumulation_steps

    def after_optimizer_step(self) -> None:
        self.run.step.after_optimizer_step()
        scalars = self.monitor.optimizer_step_end(self.state.global_step, self.learning_rate_of_step, self.run.step)
        if scalars is not None:
            self.state.log_history.append({"step": self.state.global_step, **scalars})
        step = self.state.global_step
        if self.evaluator.due(step) and self.evaluator.run(step, self.model.vae, self.run.ema, self.monitor, self.state):
            self.state.best_model_checkpoint = ckpt.checkpoint_path(self.args.output_dir, step)
            self._save_checkpoint(self.model)  # the best checkpoint so far, kept by rotation

    # ---- checkpoints
    def _save_checkpoint(self, model, metrics=None):
        if self.saved_at_step == self.state.global_step:
            return
        ckpt.save_checkpoint(self.args.output_dir, self.state.global_step, model=self.model,
                             stateful=self.run.stateful(), trainer_state=self.state,
                             rank_state=ckpt.make_rank_state(self.model, self.position),
                             save_total_limit=self.args.save_total_limit, keep=self.state.best_model_checkpoint,
                             configs=checkpoint_configs(self.components))
        self.saved_at_step = self.state.global_step

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if resume_from_checkpoint is None:
            return
        ckpt.load_model_state(resume_from_checkpoint, self.model)
        self.resume_rank_state = ckpt.load_rank_state(resume_from_checkpoint)
        logger.info("resuming from %s", resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        ckpt.load_stateful(checkpoint, self.run.stateful())
        ckpt.set_rng_state(self.resume_rank_state["rng"])
