"""The PaddleNLP Trainer driver (train_vae_trainer.py): the Trainer's loop, progress bar, console log and
`--save_steps` timing around the plain loop's step and bookkeeping (`loop.Run`). The Trainer's own places hold the
real update: `training_step` is the step's forward and backward of one micro-batch; after the last one, the Trainer
calls its `optimizer.step()`, the update of both networks (`TrainStep.optimizer_step`), and its
`lr_scheduler.step()`, their learning rates (`TrainStep.schedule`)."""

import copy
from types import SimpleNamespace
from typing import Dict

import paddle
from paddlenlp.trainer import Trainer, TrainerCallback

from .loop import Run, start
from .user_errors import start_up


class VAETrainer(Trainer, TrainerCallback):
    """The Trainer around `run`, and its own callback: `on_step_end` runs `Run.after_step`."""

    def __init__(self, run: Run):
        # The Trainer's copy of the flags: VisualDL is written by TrainMonitor, mixed precision set up by precision.py.
        args = copy.copy(run.args)
        args.report_to, args.fp16, args.bf16 = [], False, False
        args.ignore_data_skip = True  # the stream resumes at its saved position instead of replaying
        # What the Trainer calls its optimizer: `step` is both networks' update after the last micro-batch (all-reduce,
        # unscale, finite check, clip, step, loss scales, EMA), whose report the callback logs; nothing left for
        # `clear_grad` (the update freed the gradients); `get_lr` the console's learning rate. Its lr_scheduler:
        # `step` moves both networks' learning rates on.
        step = run.step
        optimizer = SimpleNamespace(step=self._update, clear_grad=lambda set_to_zero=True: None,
                                    get_lr=step.networks[0].optimizer.get_lr)
        schedule = SimpleNamespace(step=lambda: step.schedule(self.state.global_step))
        super().__init__(model=run.networks.model, args=args, optimizers=(optimizer, schedule))
        self.run, self.micro_steps = run, 0
        self.report = None  # the last optimizer step's (scalars, stop)
        self.add_callback(self)

    def on_step_end(self, args, state, control, **kwargs):
        self.run.after_step(state, self.report)

    def _update(self) -> None:
        self.report = self.run.step.optimizer_step(self.state.global_step)

    def _wrap_model(self, model, training=True):
        return model  # no paddle.DataParallel: distributed.py syncs the gradients

    def get_train_dataloader(self):
        return self.run.batches

    def training_step(self, model, inputs):
        micro_batch = self.micro_steps % self.args.gradient_accumulation_steps
        logs = self.run.micro_step(inputs, self.state.global_step, micro_batch)
        self.micro_steps += 1
        # The Trainer sums this for its console "loss"; a skipped non-finite step must not poison the sum.
        loss = logs["loss/total"] / self.args.gradient_accumulation_steps
        return paddle.where(paddle.isfinite(loss), loss, paddle.zeros_like(loss))

    def _save_checkpoint(self, model, metrics=None) -> str:
        return self.run.save(self.state)

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        pass  # Run.begin loaded the checkpoint, optimizers and schedules included

    _load_optimizer_and_scheduler = _load_from_checkpoint


def train(model_args, data_args, loss_args, args) -> Dict[str, str]:
    """Train with the PaddleNLP Trainer until --max_steps; return the exported VAE's, discriminator's, logs' paths."""
    run, resume = start(model_args, data_args, loss_args, args)
    with start_up():
        trainer = VAETrainer(run)  # seeds everything with --seed, as the Trainer does (Run.begin seeds training)
    with run.training(lambda: trainer.state):
        trainer.state = run.begin(resume)  # then the Trainer's (none at --max_steps already: it would train one more)
        if trainer.state.global_step < args.max_steps:
            trainer.train(resume_from_checkpoint=resume)
    return run.export(trainer.state.global_step)
