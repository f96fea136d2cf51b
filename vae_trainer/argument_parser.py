"""The command line of both entry points: `parse_arguments` (flags or one JSON file -> the four dataclasses of
arguments.py, --recipe under the flags given, then `validate`) with PaddleNLP's `PdArgumentParser`, --help grouped
by concern (the refused PaddleNLP flags parsed but hidden), `Literal` fields as choices, the ppdiffusers aliases."""

import argparse
import copy
import dataclasses
import sys
from typing import Any, List, Literal, Optional, Sequence, Set, Tuple, Union, get_args, get_origin, get_type_hints

from paddlenlp.trainer import PdArgumentParser, TrainingArguments

from .arguments import ALIASES, ALL_ARGUMENT_CLASSES, PADDLENLP_FLAGS, RECIPES
from . import ema, evaluation, optim, precision, train_logging
from .data import buckets
from .flag_checks import check_sizes, flag_values
from .models import latent_scale, rgba, trainable, vae_loading
from .objectives import alignment, clips, distillation, equivariance, gan, reconstruction
from .refusals import refuse

GROUPS = {"data": "data: training images and preprocessing", "model": "model: the VAE to train",
          "loss": "loss: the VAE objective", "discriminator": "discriminator: the adversarial term and its network",
          "evaluation": "evaluation: held-out metrics during training",
          "distillation": "distillation: a tiny autoencoder from a teacher VAE (docs/distillation.md)",
          "training": "training: run-time options of both entry points",
          "paddlenlp": "PaddleNLP TrainingArguments honoured identically by both entry points "
                       "(every other PaddleNLP flag is refused)"}
USAGE = ("%(prog)s --file_list FILE (--vae_config_file JSON | --pretrained_model_name_or_path DIR) --max_steps N "
         "[--output_dir DIR] [flags below] | %(prog)s ARGS.json")
Arguments = Tuple[ALL_ARGUMENT_CLASSES]  # (ModelArguments, DataArguments, LossArguments, VAETrainingArguments)
# Every parse-time refusal, each table beside what it guards (the refused PaddleNLP flags' are checked by value in
# VAETrainingArguments: arguments.INHERITED_REFUSALS).
REFUSALS = sum((part.REFUSALS for part in (vae_loading, trainable, buckets, reconstruction, clips, equivariance,
                                           alignment, evaluation, gan, latent_scale, ema, train_logging, precision,
                                           optim, distillation, rgba)), ())


class VAEArgumentParser(PdArgumentParser):
    """PdArgumentParser with --help groups by concern, Literal choices, reference aliases, hidden refused flags."""

    def __init__(self, dataclass_types=ALL_ARGUMENT_CLASSES, **kwargs):
        self._groups = {}
        super().__init__(dataclass_types, usage=USAGE, **kwargs)
        self.allow_abbrev = False  # an abbreviated flag would not count as given under --recipe

    def _add_dataclass_arguments(self, dtype) -> None:
        if not self._groups:  # created in a fixed order, so --help lists them in that order
            self._groups = {name: self.add_argument_group(title) for name, title in GROUPS.items()}
        hints, inherited = get_type_hints(dtype), {f.name for f in dataclasses.fields(TrainingArguments)}
        for f in dataclasses.fields(dtype):
            if not f.init:
                continue
            metadata = dict(f.metadata)
            paddlenlp = issubclass(dtype, TrainingArguments) and f.name in inherited
            group = metadata.pop("group", None) or ("paddlenlp" if paddlenlp else getattr(dtype, "_group", "training"))
            if paddlenlp and f.name not in PADDLENLP_FLAGS:  # parsed (to refuse it with a reason), never advertised
                metadata["help"] = argparse.SUPPRESS
            spec, choices = copy.copy(f), _literal_choices(hints[f.name])
            spec.type = metadata.pop("parse", hints[f.name])
            if choices is not None:  # PdArgumentParser knows Enums, not Literals: the values' type, and choices
                metadata["choices"] = list(choices)
                listed = any(get_origin(a) is list for a in (spec.type, *get_args(spec.type)))
                spec.type = List[type(choices[0])] if listed else type(choices[0])
            spec.metadata = metadata  # (PdArgumentParser copies it into add_argument's keywords)
            self._parse_dataclass_field(self._groups[group], spec)
            action = self._option_string_actions[f"--{f.name}"]
            for alias in ALIASES.get(f.name, ()):  # the same action, listed after the name in --help
                action.option_strings.append(f"--{alias}")
                self._option_string_actions[f"--{alias}"] = action


def _literal_choices(annotation: Any) -> Optional[Tuple[Any, ...]]:
    """The values of a Literal type, also inside Optional[...] or List[...]; else None."""
    while get_origin(annotation) in (Union, list):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    return get_args(annotation) if get_origin(annotation) is Literal else None


def parse_arguments(argv: Optional[Sequence[str]] = None) -> Arguments:
    """Flags (or one .json file of them) as the four argument dataclasses, --recipe under those not given, validated."""
    parser = VAEArgumentParser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        argv = parser.read_json(argv[0])  # the file's flags, parsed as if given on the command line
    arguments = parser.parse_args_into_dataclasses(args=argv)
    actions = parser._option_string_actions  # each spelling (an alias, --no_name of a boolean) -> its field's action
    spelled = (token.split("=", 1)[0] for token in argv if token.startswith("--"))  # --name value, --name=value
    given = {actions[name].dest for name in spelled if name in actions}
    recipe = arguments[2].recipe or ("tiny" if arguments[0].teacher_model_name_or_path else None)
    for name, value in RECIPES.get(recipe, {}).items():  # explicit flags win over the recipe
        if name not in given:
            setattr(next(a for a in arguments if hasattr(a, name)), name, value)  # the dataclass holding the flag
    validate(arguments, given=given)
    return arguments


def validate(arguments: Arguments, given: Set[str]) -> None:
    """Refuse, before anything is built, a missing VAE or data, values outside their choices, sizes the VAE cannot
    take and the rows of `REFUSALS` for the flags the user gave (`given`, field names)."""
    model_args, data_args, loss_args, training_args = arguments
    if not (model_args.vae_config_file or model_args.pretrained_model_name_or_path or model_args.init_from_ckpt
            or model_args.teacher_model_name_or_path):
        raise ValueError("Give the VAE: --vae_config_file (train from scratch) and/or --pretrained_model_name_or_path "
                         "(fine-tune), or --init_from_ckpt CHECKPOINT_DIR.")
    if data_args.file_list is None:
        raise ValueError("--file_list is required (a folder of images, WebDataset tar shards, a .filelist or a "
                         ".filelist.list).")
    for objects in arguments[:3]:  # the parser checks typed choices; this covers code and JSON files
        hints = get_type_hints(type(objects))
        for f in dataclasses.fields(objects):
            choices, value = _literal_choices(hints[f.name]), getattr(objects, f.name)
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"--{f.name} must be one of {choices}, got {value!r}")
    flags = flag_values(arguments)  # raises on a bad --scaling_factor
    equivariance.parse_transforms(loss_args.equivariance_transforms)  # raises on a bad list
    evaluation.eval_batch_size(data_args.resolution, training_args.per_device_eval_batch_size)  # raises on one < 1
    refuse(flags, given, REFUSALS)
    check_sizes(flags)
