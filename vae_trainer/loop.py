"""The plain training loop (train_vae_no_trainer.py), and what both drivers share around the step: `start` builds
a `Run` (resume, save, each optimizer step's bookkeeping, export); `main` is both entry points' main."""

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from paddlenlp.trainer import TrainerState
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import watchdog
from .argument_parser import parse_arguments
from .build import (Networks, build_evaluator, build_networks, build_optimization, build_train_data, init_process,
                    seed_training, stateful)
from .distributed import (PREEMPTED_EXIT_CODE, Preempted, all_ranks_agree, assert_parameters_in_sync, rank, stop_signal,
                          world_size)
from .final_save import checkpoint_configs, save_final_models
from .models.families import image_channels
from .output_dir import prepare_output_dir, run_inputs
from .precision import restore_float32
from .step import NonFiniteError, TrainStep, logged_images
from .train_logging import TrainMonitor, format_scalars
from .user_errors import exit_on_user_error, start_up

logger = logging.getLogger("vae_trainer")


@dataclass
class Run:
    """A run's parts besides the data, and the checkpoint bookkeeping both drivers share."""

    args: Any
    data_args: Any
    networks: Networks
    step: TrainStep
    evaluator: Any
    monitor: TrainMonitor
    batches: Any = None  # the timed training batches (TrainMonitor.timed), once the loader is built
    saved_at: Optional[int] = None  # the step whose checkpoint was last written (or resumed from, in OUTPUT_DIR)

    def begin(self, resume: Optional[str]) -> TrainerState:
        """A new run's state, or checkpoint `resume`'s (weights, optimization and this rank's random and data
        state); the training batches built. The stall watchdog runs from here on (watchdog.py)."""
        seed_training(self.args.seed)
        state, rank_state = TrainerState(max_steps=self.args.max_steps), None
        if resume:
            with all_ranks_agree(f"loading {resume}"):
                ckpt.load_model_state(resume, self.networks.model)
                ckpt.load_stateful(resume, stateful(self.step))
                state = TrainerState.load_from_json(os.path.join(resume, ckpt.TRAINER_STATE_NAME))
                rank_state = ckpt.load_rank_state(resume)
            saved = os.path.realpath(ckpt.checkpoint_path(self.args.output_dir, state.global_step))
            if os.path.realpath(resume) == saved:  # this very state: the final save must not rewrite it
                self.saved_at = state.global_step
            logger.info("resuming from %s at step %d", resume, state.global_step)
        with start_up():
            # this rank's data position: the monitor logs its skip counts, a checkpoint saves it
            loader, self.monitor.data_position = build_train_data(self.data_args, self.args,
                                                                  rank_state["data"] if rank_state else None,
                                                                  image_channels(self.networks.model.vae))
        self.batches = self.monitor.timed(loader)
        if rank_state:
            ckpt.set_rng_state(rank_state["rng"])
            if self.step.replay is not None and "replay" in rank_state:
                self.step.replay.set_state_dict(rank_state["replay"])
        watchdog.start(self.args.stall_timeout, rank())
        return state

    def micro_step(self, batch: Dict[str, Any], global_step: int, micro_batch: int) -> Dict[str, Any]:
        """Forward and backward of one micro-batch (gradients accumulate); its data position and telemetry noted."""
        logs = self.step.forward_backward(batch["pixel_values"], global_step, micro_batch)
        self.monitor.data_position.update(batch["position"])
        self.monitor.micro_step_end(logs)
        return logs

    def save(self, state: TrainerState) -> str:
        """checkpoint-N of `state.global_step` (kept as is if already written); returns its path."""
        step = state.global_step
        if self.saved_at == step:
            return ckpt.checkpoint_path(self.args.output_dir, step)
        watchdog.doing(f"saving checkpoint-{step}")
        model = self.networks.model
        rank_state = {"rng": ckpt.rng_state(), "data": self.monitor.data_position.state_dict(),  # this rank's share
                      "parameter_fingerprint": assert_parameters_in_sync(model),  # raises if the ranks' weights differ
                      **({"replay": self.step.replay.state_dict()} if self.step.replay is not None else {})}
        path = ckpt.save_checkpoint(self.args.output_dir, step, model=model, stateful=stateful(self.step),
                                    trainer_state=state, rank_state=rank_state,
                                    save_total_limit=self.args.save_total_limit, keep=state.best_model_checkpoint,
                                    configs=checkpoint_configs(self.networks, self.evaluator))
        self.saved_at = step
        watchdog.beat(f"saving checkpoint-{step}", step)
        return path

    def after_step(self, state: TrainerState, report: Tuple[Dict[str, object], bool]) -> Optional[Dict[str, float]]:
        """After optimizer step `state.global_step` (`report`: `TrainStep.optimizer_step`'s numbers and stop):
        telemetry, evaluation (and the best checkpoint), the periodic save, and a stop on a signal (distributed.py).
        Returns the logged numbers at logging steps."""
        step, (logged, stop) = state.global_step, report
        watchdog.beat(f"step {step}", step)
        scalars = self.monitor.optimizer_step_end(step, logged, lambda: logged_images(self.step))
        if scalars is not None:
            state.log_history.append({"step": step, **scalars})
        if self.evaluator.due(step) and self.evaluator.run(step, self.networks.model.vae, self.step.ema, self.monitor,
                                                           state):
            state.best_model_checkpoint = ckpt.checkpoint_path(self.args.output_dir, step)
            self.save(state)  # the best checkpoint so far, kept by rotation
        if self.args.save_steps > 0 and step % self.args.save_steps == 0:
            self.save(state)
        if stop:  # some rank was signalled, agreed by the step: saved, then stopped
            checkpoint = self.save(state)
            stopped = Preempted(f"stopped by {stop_signal() or 'a signal to another rank'} after step {step}: saved "
                                f"{checkpoint}; the same command with --resume_from_checkpoint latest continues "
                                f"exactly from there (exit code {PREEMPTED_EXIT_CODE})")
            logger.warning("%s", stopped)
            raise stopped
        return scalars

    @contextmanager
    def training(self, state: Callable[[], TrainerState]) -> Iterator[None]:
        """Around training: a checkpoint at the end, also at a non-finite stop (then exit naming the last good one)."""
        try:
            yield
        except NonFiniteError as error:
            sys.exit(f"error: {error} Last good weights: {self.save(state())}")
        else:
            self.save(state())
        finally:  # the loader's workers stopped and joined, the logs closed
            watchdog.stop()
            if self.batches is not None:
                self.batches.close()
            self.monitor.close()

    def export(self, step: int) -> Dict[str, str]:
        """The final VAE and discriminator (float32 master weights under O2); returns their paths and the logs'."""
        restore_float32(self.networks.model, [net.optimizer for net in self.step.networks])
        watchdog.start(self.args.stall_timeout, rank(), "exporting")
        try:
            vae_dir, disc_dir = save_final_models(self.args.output_dir, self.networks, self.step.ema, self.evaluator,
                                                  step)
        finally:  # (train() may be called again in this process: benchmarks/rgba_views.py)
            watchdog.stop()
        return {"vae": vae_dir, "discriminator": disc_dir, "logs": self.args.logging_dir}


def start(model_args, data_args, loss_args, args) -> Tuple[Run, Optional[str]]:
    """Both drivers' start-up (process, OUTPUT_DIR, networks, optimization, evaluation): the run, the resume or None."""
    watchdog.start(args.stall_timeout, rank(), "starting up")  # stopped by the entry point (exit_on_user_error)
    with start_up():  # bad files or flags: `UserError`, one line from the entry point
        init_process(args)
        prepare_output_dir(args, run_inputs(model_args, data_args))  # never eats an earlier run or an input
        clips = data_args.num_frames > 1 and data_args.video_image_ratio < 1  # (else: every sample one frame)
        networks = build_networks(model_args, loss_args, args, resolution=data_args.resolution, clips=clips)
        step = build_optimization(networks, loss_args, args)
        evaluator = build_evaluator(data_args, args, networks)
        resume = ckpt.resolve_resume(args.output_dir, args.resume_from_checkpoint)
        ckpt.set_aside_later(args.output_dir, resume)  # rolling back is a branch
    monitor = TrainMonitor(args, args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size(),
                           is_main_process=rank() == 0)
    return Run(args, data_args, networks, step, evaluator, monitor), resume


@exit_on_user_error
def main(train: Callable[..., Dict[str, str]], argv=None) -> None:
    """An entry point: parse the flags, `train`, print where the VAE and the logs are."""
    with start_up():  # bad flags: one `error: ...` line, no traceback
        model_args, data_args, loss_args, training_args = parse_arguments(argv)
    outputs = train(model_args, data_args, loss_args, training_args)
    if rank() == 0:
        print(f"VAE saved to {outputs['vae']}\nVisualDL logs: {outputs['logs']}")


def train(model_args, data_args, loss_args, args) -> Dict[str, str]:
    """Train until --max_steps; return the paths of the exported VAE, discriminator and logs."""
    run, resume = start(model_args, data_args, loss_args, args)
    state = run.begin(resume)
    with run.training(lambda: state), tqdm(total=args.max_steps, initial=state.global_step, desc="train",
                                            disable=rank() != 0 or args.disable_tqdm, dynamic_ncols=True) as progress:
        while state.global_step < args.max_steps:
            for micro_batch in range(args.gradient_accumulation_steps):
                run.micro_step(next(run.batches), state.global_step, micro_batch)
            report = run.step.optimizer_step(state.global_step)  # all-reduce, unscale, check, clip, steps, EMA
            run.step.schedule(state.global_step)  # the learning rates
            state.global_step += 1
            progress.update(1)
            scalars = run.after_step(state, report)
            if scalars is not None:
                progress.set_postfix_str(format_scalars(scalars))
    return run.export(state.global_step)
