"""Which inherited PaddleNLP flags the two entry points accept, and the reference scripts' spellings.

Owns the flag policy, not the parsing (argument_parser.py) nor our own flags (arguments.py):

- `PADDLENLP_FLAGS`: of PaddleNLP's ~90 `TrainingArguments`, the allow-list that both drivers honour with
  the same meaning (each is read by our shared code: optim.py, checkpoint.py, train_logging.py,
  evaluation.py, build.py; the Trainer's own loop adds nothing the plain loop lacks).
- `IGNORED_FLAGS`: inherited flags accepted and ignored, because what they ask is what both drivers always
  do (`--do_train`, which every ppdiffusers trainer command passes: we always train).
- `refuse_unsupported_flags`: any other inherited flag set to a non-default value, on the command line,
  in a JSON args file or in code, is refused with the reason from `REFUSAL_REASONS` (and the parser hides
  it from `--help`).
- `ALIASES`: the ppdiffusers reference scripts' spellings accepted for our flags (README "Flags from the
  ppdiffusers scripts").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from paddlenlp.trainer import TrainingArguments

# PaddleNLP TrainingArguments that both drivers honour with the same meaning.
PADDLENLP_FLAGS = frozenset({
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint",
    "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "max_steps",
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "lr_scheduler_type", "warmup_steps", "warmup_ratio", "num_cycles", "lr_end", "power",
    "logging_dir", "logging_steps", "report_to", "disable_tqdm",
    "save_steps", "save_total_limit",
    "seed", "device", "dataloader_num_workers",
    "fp16", "bf16", "fp16_opt_level", "scale_loss", "recompute",
    "eval_steps", "metric_for_best_model",
})

# Accepted and ignored -> the --help text saying why: the flag asks for what both drivers do anyway, so
# refusing it would only break command lines copied from the ppdiffusers examples.
IGNORED_FLAGS = {
    "do_train": "Accepted and ignored (the ppdiffusers commands pass it): both entry points always train.",
}

# Why a well-known refused flag is refused, and what to use instead.
_EVALUATION_IS_OURS = ("evaluation is the same code in both drivers: use --eval_file_list with --eval_steps "
                       "(and --metric_for_best_model)")
_DATA_PARALLEL_ONLY = "only data parallelism is supported (paddle.distributed.launch); drop it"
REFUSAL_REASONS = {
    "num_train_epochs": "the training stream is infinite: set the run's length with --max_steps",
    "save_strategy": "checkpoints are saved every --save_steps optimizer steps (0: only at the end)",
    "logging_strategy": "scalars are logged every --logging_steps optimizer steps",
    "logging_first_step": "scalars are logged every --logging_steps optimizer steps",
    "optim": "the optimizer is AdamW in both drivers (--adam_beta1, --adam_beta2, --adam_epsilon, --weight_decay)",
    "greater_is_better": "--metric_for_best_model decides it (psnr, ssim: higher is better; lpips, rfid: lower)",
    "to_static": "both drivers train in dynamic-graph mode",
    "amp_master_grad": "--fp16_opt_level O2 keeps float32 master weights in both optimizers",
    "no_cuda": "use --device cpu",
    "do_eval": _EVALUATION_IS_OURS, "do_predict": _EVALUATION_IS_OURS, "evaluation_strategy": _EVALUATION_IS_OURS,
    "load_best_model_at_end": _EVALUATION_IS_OURS, "eval_accumulation_steps": _EVALUATION_IS_OURS,
    "max_evaluate_steps": _EVALUATION_IS_OURS, "prediction_loss_only": _EVALUATION_IS_OURS,
    "dataloader_drop_last": "training batches are always full (the stream is infinite)",
    "ignore_data_skip": "the data stream always resumes at its saved position",
    "run_name": "only VisualDL logs are written (--report_to visualdl|none)",
    "wandb_api_key": "only VisualDL logs are written (--report_to visualdl|none)",
    **{name: _DATA_PARALLEL_ONLY for name in (
        "sharding", "sharding_degree", "sharding_parallel_degree", "tensor_parallel_degree",
        "pipeline_parallel_degree", "sep_parallel_degree", "data_parallel_config", "tensor_parallel_config",
        "pipeline_parallel_config", "sharding_parallel_config", "use_expert_parallel", "enable_auto_parallel")},
}

# The ppdiffusers reference scripts' spellings -> our flag (meanings checked against their sources; README).
ALIASES = {
    "per_device_train_batch_size": ("train_batch_size", "batch_size"),
    "max_steps": ("max_train_steps",),
    "weight_decay": ("adam_weight_decay",),
    "lr_scheduler_type": ("lr_scheduler",),
    "warmup_steps": ("lr_warmup_steps",),
    "dataloader_num_workers": ("num_workers",),
    "recompute": ("gradient_checkpointing",),  # diffusers' / ppdiffusers' trainers' name
}


def inherited_fields() -> Dict[str, dataclasses.Field]:
    """PaddleNLP's TrainingArguments fields that are flags, by name."""
    return {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def refuse_unsupported_flags(args: TrainingArguments) -> None:
    """Raise if any inherited PaddleNLP flag outside `PADDLENLP_FLAGS` differs from PaddleNLP's default."""
    refused = [name for name, f in inherited_fields().items()
               if name not in PADDLENLP_FLAGS and name not in IGNORED_FLAGS and getattr(args, name) != _default(f)]
    if not refused:
        return
    lines = [f"--{name}: {REFUSAL_REASONS.get(name, 'not honoured the same way by both entry points')}"
             for name in refused]
    raise ValueError("refused PaddleNLP flag(s); train_vae_trainer.py and train_vae_no_trainer.py honour only the "
                     "PaddleNLP flags listed under --help:\n  " + "\n  ".join(lines))
