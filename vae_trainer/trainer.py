"""The PaddleNLP Trainer subclass (train_vae_trainer.py).

The Trainer keeps its own loop, progress bar, console log and `--save_steps` timing. We replace the
pieces a two-optimizer GAN needs:
- `create_optimizer_and_scheduler`: everything from `build.build_optimization` (the loop builds the same);
- `training_step`: `TrainStep.forward_backward` on every micro-batch and, on the last one of an optimizer
  step, `TrainStep.optimizer_step`: the one block that all-reduces, unscales, checks, clips, steps BOTH
  optimizers and BOTH schedules, clears the gradients and updates the EMA (as the plain loop does);
- `_wrap_model`: no `paddle.DataParallel` (see distributed.py); mixed precision is set up by
  `precision.py` for both drivers (the Trainer's own fp16/bf16 handling is kept off);
- `get_train_dataloader`: our streaming reader, resumed at the saved data position, its waits timed;
- `train`: from a checkpoint already at --max_steps, nothing is trained (the Trainer's loop checks for the
  end only after a step, so it would train one step more);
- `_save_checkpoint` / `_load_from_checkpoint` / `_load_optimizer_and_scheduler`: `checkpoint.py`, so the
  discriminator, its optimizer, scalers, EMA, RNG states and data position are saved and restored too.
After each optimizer step a callback runs the same bookkeeping as the loop (telemetry, evaluation).

Why the Trainer does not step twice: right after a `training_step` that ends an optimizer step, the
Trainer's `_inner_training_loop` calls `self.optimizer.step()`, `self.lr_scheduler.step()` and
`self.optimizer.clear_grad()` itself (PaddleNLP 2.8.1; with its grad scaler off, unconditionally). It
has no hook to replace that, so it holds `AlreadyStepped` as both its `optimizer` and its `lr_scheduler`:
those three calls are no-ops, because `TrainStep.optimizer_step` has just done them for both networks, and
`get_lr()` (its console "learning_rate") reads the real VAE optimizer. The real optimizers and schedules
live in `self.optimization` and are what checkpoints save and load (same file names as before), so nothing else
of the Trainer touches them.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import paddle
from paddlenlp.trainer import Trainer, TrainerCallback, TrainerState
from paddlenlp.trainer.trainer_utils import TrainOutput

from . import checkpoint as ckpt
from .build import build_train_data, build_optimization
from .data.position import StreamPosition
from .distributed import rank, world_size
from .final_save import checkpoint_configs
from . import watchdog
from .preemption import stop_after_step
from .step import NonFiniteError, logged_images
from .train_logging import TrainMonitor
from .user_errors import start_up

logger = logging.getLogger("vae_trainer")


class AlreadyStepped:
    """What the PaddleNLP Trainer holds as `optimizer` and `lr_scheduler` (see the module docstring).

    step() and clear_grad() do nothing: `TrainStep.optimizer_step` already stepped both optimizers and
    schedules and cleared the gradients. get_lr() is the real VAE optimizer's. Any other use of the
    Trainer's optimizer fails loudly (AttributeError) rather than silently acting on a second copy.
    """

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
        self.trainer.after_optimizer_step()


class VAETrainer(Trainer):
    def __init__(self, model, args, networks, data_args, loss_args, evaluator):
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
        self.networks, self.data_args, self.loss_args, self.evaluator = networks, data_args, loss_args, evaluator
        self.saved_at_step = None
        self.optimization = None
        self.resume_rank_state: Optional[dict] = None
        self.position = None
        self.train_batches = None  # the training batches, once the Trainer asked for them
        self.micro_steps = 0
        self.step_report = None  # the last optimizer step's StepReport
        self.micro = None  # the last micro-batch's MicroBatch
        global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size()
        self.monitor = TrainMonitor(args, global_batch, is_main_process=rank() == 0)
        self.add_callback(_AfterOptimizerStep(self))

    # ---- training
    def train(self, resume_from_checkpoint: Optional[str] = None, **kwargs) -> Optional[TrainOutput]:
        """The Trainer's training, except from a checkpoint at or past --max_steps: the Trainer's loop checks
        for the end only after a step, so it would train one step more; here nothing is trained (None is
        returned), and the state is restored as for a resume so that the final checkpoint and export are the
        checkpoint's."""
        if resume_from_checkpoint and (ckpt.checkpoint_step(resume_from_checkpoint) or 0) >= self.args.max_steps:
            self._restore_finished(resume_from_checkpoint)
            return None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _restore_finished(self, checkpoint: str) -> None:
        self.create_optimizer_and_scheduler(num_training_steps=self.args.max_steps)
        self._load_from_checkpoint(checkpoint)
        self._load_optimizer_and_scheduler(checkpoint)
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, ckpt.TRAINER_STATE_NAME))
        data = self.resume_rank_state["data"]  # None after a change of world size (ckpt.load_rank_state)
        self.position = StreamPosition.from_state(data) if data else StreamPosition()
        self.monitor.watch_data(self.position)
        if ckpt.is_checkpoint_of(self.args.output_dir, checkpoint, self.state.global_step):
            self.saved_at_step = self.state.global_step  # it is this very state: the final save leaves it alone
        logger.info("%s is at step %d, --max_steps %d: nothing to train", checkpoint, self.state.global_step,
                    self.args.max_steps)

    # ---- building
    def create_optimizer_and_scheduler(self, num_training_steps: int):
        with start_up():  # inside Trainer.train: bad flags still end as one line (train_vae_trainer.py)
            self.optimization = build_optimization(self.networks, self.loss_args, self.args)
        watchdog.start(self.args.stall_timeout, rank())  # from the first batch's wait on (watchdog.py)
        self.optimizer = self.lr_scheduler = AlreadyStepped(self.optimization.vae_optimizer)

    def _wrap_model(self, model, training=True):
        return model

    def get_train_dataloader(self):
        data_state = self.resume_rank_state["data"] if self.resume_rank_state else None
        with start_up():
            loader, self.position = build_train_data(self.data_args, self.args, data_state)
        self.monitor.watch_data(self.position)
        self.train_batches = self.monitor.timed(loader)  # perf/data_seconds_per_step: the Trainer's waits
        return self.train_batches

    def close(self) -> None:
        """End of training, on every exit path: the loader's workers stopped and joined, the logs closed."""
        watchdog.stop()
        if self.train_batches is not None:
            self.train_batches.close()
        self.monitor.close()

    # ---- the step
    def training_step(self, model, inputs):
        micro_batch = self.micro_steps % self.args.gradient_accumulation_steps
        self.micro = self.optimization.step.forward_backward(inputs["pixel_values"], self.state.global_step, micro_batch)
        self.position.update(inputs["position"])
        self.monitor.micro_step_end(self.micro.logs)
        self.micro_steps += 1
        if micro_batch == self.args.gradient_accumulation_steps - 1:
            try:  # the Trainer's optimizer/scheduler calls that follow are no-ops (AlreadyStepped)
                self.step_report = self.optimization.step.optimizer_step(self.state.global_step)
            except NonFiniteError:
                self._save_checkpoint(model)  # the weights are those of the last good step
                raise
        # The Trainer sums this for its console "loss"; a skipped non-finite step must not poison the sum.
        loss = self.micro.logs["loss/total"]
        return paddle.where(paddle.isfinite(loss), loss, paddle.zeros_like(loss)) / self.args.gradient_accumulation_steps

    def after_optimizer_step(self) -> None:
        step = self.state.global_step
        watchdog.beat(f"step {step}", step)
        scalars = self.monitor.optimizer_step_end(step, self.step_report.scalars,
                                                  lambda: logged_images(self.optimization.step, self.micro))
        if scalars is not None:
            self.state.log_history.append({"step": step, **scalars})
        if self.evaluator.due(step) and self.evaluator.run(step, self.model.vae, self.optimization.ema, self.monitor, self.state):
            self.state.best_model_checkpoint = ckpt.checkpoint_path(self.args.output_dir, step)
            self._save_checkpoint(self.model)  # the best checkpoint so far, kept by rotation
        # Before the Trainer's own --save_steps save of this step, which would then find it saved.
        stop_after_step(self.step_report.stop, step, lambda: self._save_checkpoint(self.model))  # a signal (preemption.py)

    # ---- checkpoints
    def _save_checkpoint(self, model, metrics=None) -> str:
        if self.saved_at_step == self.state.global_step:
            return ckpt.checkpoint_path(self.args.output_dir, self.state.global_step)
        watchdog.doing(f"saving checkpoint-{self.state.global_step}")
        path = ckpt.save_checkpoint(self.args.output_dir, self.state.global_step, model=self.model,
                             stateful=self.optimization.stateful(), trainer_state=self.state,
                             rank_state=ckpt.make_rank_state(self.model, self.position),
                             save_total_limit=self.args.save_total_limit, keep=self.state.best_model_checkpoint,
                             configs=checkpoint_configs(self.networks, self.evaluator))
        self.saved_at_step = self.state.global_step
        watchdog.beat(f"saving checkpoint-{self.state.global_step}", self.state.global_step)
        return path

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if resume_from_checkpoint is None:
            return
        ckpt.load_model_state(resume_from_checkpoint, self.model)
        self.resume_rank_state = ckpt.load_rank_state(resume_from_checkpoint)
        logger.info("resuming from %s", resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        ckpt.load_stateful(checkpoint, self.optimization.stateful())
        ckpt.set_rng_state(self.resume_rank_state["rng"])
