"""The command-line parser of both entry points: PaddleNLP's `PdArgumentParser` with our --help layout, and
`parse_arguments` (flags or one JSON file -> the four dataclasses, --recipe applied, then `validate`: the
VAE source, choices and technique values here, the combinations of flag_checks.py).

Owns how the dataclasses of arguments.py become flags (not which flags exist, nor the PaddleNLP flag
policy of flag_policy.py):

- `--help` groups flags by concern, in the order of `GROUPS`, before PaddleNLP's. A field's group is its
  metadata "group", else its dataclass's `_group`, so a field added to a dataclass lands in a group
  without further work. Inherited PaddleNLP flags outside `flag_policy.PADDLENLP_FLAGS` are parsed (so
  that they can be refused with a reason) but hidden from `--help`, but for `flag_policy.IGNORED_FLAGS`,
  listed with why they are ignored.
- Choice flags are typed `Literal[...]`: their choices show in `--help` and a bad value fails at parse
  time (a Literal becomes argparse `choices`). A field whose values are not a fixed list gives its own
  checking function as metadata "parse" (e.g. --device: cpu, gpu or gpu:N).
- `flag_policy.ALIASES` are added as further spellings of their flags.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import types
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, get_args, get_origin, get_type_hints

from paddlenlp.trainer import PdArgumentParser, TrainingArguments

from .arguments import (ALL_ARGUMENT_CLASSES, DataArguments, LossArguments, ModelArguments, VAETrainingArguments,
                        literal_choices, strip_optional)
from . import flag_checks
from .flag_policy import ALIASES, IGNORED_FLAGS, PADDLENLP_FLAGS, inherited_fields
from .equivariance import parse_transforms
from .latent_scale import scaling_factor_mode
from .recipes import apply_recipe, flags_given

GROUPS = {
    "data": "data: training images and preprocessing",
    "model": "model: the VAE to train",
    "loss": "loss: the VAE objective",
    "discriminator": "discriminator: the adversarial term and its network",
    "evaluation": "evaluation: held-out metrics during training",
    "training": "training: run-time options of both entry points",
}
PADDLENLP_GROUP = ("PaddleNLP TrainingArguments honoured identically by both entry points "
                   "(every other PaddleNLP flag is refused)")
USAGE = ("%(prog)s --file_list FILE (--vae_config_file JSON | --pretrained_model_name_or_path DIR) --max_steps N "
         "[--output_dir DIR] [flags below] | %(prog)s ARGS.json")


class _FlagTarget:
    """Where PdArgumentParser adds one field's flags: an argparse group, plus the field's aliases."""

    def __init__(self, group: argparse._ArgumentGroup, name: str, aliases: Sequence[str]):
        self.group, self.name, self.aliases = group, name, aliases

    def add_argument(self, *names: str, **kwargs):
        if names == (f"--{self.name}",):
            names = names + tuple(f"--{alias}" for alias in self.aliases)
        return self.group.add_argument(*names, **kwargs)


class VAEArgumentParser(PdArgumentParser):
    """PdArgumentParser with --help groups by concern, Literal choices, reference aliases, hidden refused flags.

    `dataclass_types` defaults to arguments.ALL_ARGUMENT_CLASSES."""

    def __init__(self, dataclass_types=ALL_ARGUMENT_CLASSES, **kwargs):
        self._groups: Dict[str, argparse._ArgumentGroup] = {}
        kwargs.setdefault("usage", USAGE)
        super().__init__(dataclass_types, **kwargs)
        self.allow_abbrev = False  # an abbreviated flag would not be recognised as explicit by the recipes

    def _group(self, key: str) -> argparse._ArgumentGroup:
        if not self._groups:  # created in a fixed order, so --help lists them in that order
            for name, title in GROUPS.items():
                self._groups[name] = self.add_argument_group(title)
            self._groups["paddlenlp"] = self.add_argument_group(PADDLENLP_GROUP)
        return self._groups[key]

    def _add_dataclass_arguments(self, dtype) -> None:
        hints = get_type_hints(dtype)
        inherited = inherited_fields() if issubclass(dtype, TrainingArguments) else {}
        for f in dataclasses.fields(dtype):
            if not f.init:
                continue
            metadata = dict(f.metadata)
            group = metadata.pop("group", None) or ("paddlenlp" if f.name in inherited
                                                     else getattr(dtype, "_group", "training"))
            if f.name in IGNORED_FLAGS:
                metadata["help"] = IGNORED_FLAGS[f.name]
            elif f.name in inherited and f.name not in PADDLENLP_FLAGS:
                metadata["help"] = argparse.SUPPRESS  # parsed (to refuse it with a reason), never advertised
            spec = copy.copy(f)
            spec.type, choices = _argparse_type(hints[f.name])
            if "parse" in metadata:
                spec.type = metadata.pop("parse")
            if choices is not None:
                metadata["choices"] = list(choices)
            spec.metadata = types.MappingProxyType(metadata)
            self._parse_dataclass_field(_FlagTarget(self._group(group), f.name, ALIASES.get(f.name, ())), spec)


def _argparse_type(annotation: Any) -> Tuple[Any, Optional[Tuple[Any, ...]]]:
    """(type for PdArgumentParser, choices): Literal[...] and List[Literal[...]] become their value type + choices."""
    choices = literal_choices(annotation)
    if choices is not None:
        return type(choices[0]), choices
    inner = strip_optional(annotation)
    if get_origin(inner) is list and literal_choices(get_args(inner)[0]) is not None:
        choices = literal_choices(get_args(inner)[0])
        return List[type(choices[0])], choices
    return annotation, None


def parse_arguments(
    argv: Optional[Sequence[str]] = None,
) -> Tuple[ModelArguments, DataArguments, LossArguments, VAETrainingArguments]:
    """Parse flags (or a single .json file of them) into the four argument dataclasses."""
    parser = VAEArgumentParser()
    if argv is not None and len(argv) == 1 and argv[0].endswith(".json"):
        model_args, data_args, loss_args, training_args = parser.parse_json_file(json_file=argv[0])
        with open(argv[0]) as handle:
            explicit = set(json.load(handle))
    else:
        model_args, data_args, loss_args, training_args = parser.parse_args_into_dataclasses(args=argv)
        explicit = flags_given(sys.argv[1:] if argv is None else argv)
    apply_recipe((model_args, data_args, loss_args, training_args), explicit)
    validate(model_args, data_args, loss_args, training_args, given=explicit)
    return model_args, data_args, loss_args, training_args


# ---------------------------------------------------------------------------------------------- validation
def validate(model_args: ModelArguments, data_args: DataArguments, loss_args: LossArguments,
             training_args: Optional[VAETrainingArguments] = None, given: Optional[Set[str]] = None) -> None:
    """Reject contradictory or unknown choices, sizes the VAE cannot take, and flags that would do nothing,
    before anything is built. `given`: the flags the user gave (default: the fields that differ from their
    defaults, for arguments made in code)."""
    _validate_vae_source(model_args)
    if data_args.file_list is None:
        raise ValueError("--file_list is required (a folder of images, WebDataset tar shards, a .filelist or a .filelist.list).")
    for arguments in (model_args, data_args, loss_args):
        _check_choices(arguments)
    _validate_techniques(model_args, loss_args)
    flag_checks.check_sizes(model_args, data_args)
    if training_args is None:
        return
    flag_checks.check_evaluation(model_args, data_args, training_args)
    if given is None:
        given = flag_checks.given_by_default_difference((model_args, data_args, loss_args, training_args))
    flag_checks.refuse_idle_flags(flag_checks.Flags(model_args, data_args, loss_args, training_args), flag_checks.canonical_names(given))


def _validate_vae_source(model_args: ModelArguments) -> None:
    """Which VAE, loaded how (models/vae_loading.py): the fine-tuning flags of docs and README "Fine-tune"."""
    if not (model_args.vae_config_file or model_args.pretrained_model_name_or_path or model_args.init_from_ckpt):
        raise ValueError("Give the VAE: --vae_config_file (train from scratch) and/or --pretrained_model_name_or_path "
                         "(fine-tune), or --init_from_ckpt CHECKPOINT_DIR.")
    if model_args.ignore_keys and not (model_args.pretrained_model_name_or_path or model_args.init_from_ckpt):
        raise ValueError("--ignore_keys needs --pretrained_model_name_or_path or --init_from_ckpt (weights to skip).")
    if model_args.freeze_encoder and not (model_args.pretrained_model_name_or_path or model_args.init_from_ckpt):
        # A frozen encoder of a VAE trained from scratch stays at its random initialisation for the whole run.
        raise ValueError("--freeze_encoder keeps the encoder's weights, and a VAE trained from scratch has only random "
                         "ones: give --pretrained_model_name_or_path or --init_from_ckpt, or drop --freeze_encoder.")
    if model_args.input_size is not None and (len(model_args.input_size) != 2 or min(model_args.input_size) < 1):
        raise ValueError(f"--input_size takes two positive numbers H W, got {model_args.input_size}")
    scaling_factor_mode(model_args)  # raises on a bad --scaling_factor


def _check_choices(arguments: Any) -> None:
    """Literal-typed fields hold one of their values (the parser checks flags; this covers code and recipes)."""
    hints = get_type_hints(type(arguments))
    for f in dataclasses.fields(arguments):
        choices = literal_choices(hints[f.name])
        value = getattr(arguments, f.name)
        if choices is not None and value is not None and value not in choices:
            raise ValueError(f"--{f.name} must be one of {choices}, got {value!r}")


def _validate_techniques(model_args: ModelArguments, loss_args: LossArguments) -> None:
    """The options of docs/techniques.md."""
    if loss_args.pixel_loss_pool < 1:
        raise ValueError("--pixel_loss_pool must be >= 1")
    if model_args.posterior_std < 0:
        raise ValueError("--posterior_std must be >= 0 (0 keeps the encoder's variance)")
    if loss_args.loss_balancing == "gradnorm" and loss_args.learn_logvar:
        raise ValueError("--learn_logvar has no effect under --loss_balancing gradnorm (the nll is not used)")
    _validate_equivariance(model_args, loss_args)
    _validate_vf(model_args, loss_args)


def _validate_vf(model_args: ModelArguments, loss_args: LossArguments) -> None:
    """VA-VAE's flags (alignment.py)."""
    if min(loss_args.vf_weight, loss_args.distmat_margin, loss_args.cos_margin) < 0:
        raise ValueError("--vf_weight, --distmat_margin and --cos_margin must be >= 0")
    if not model_args.vf_model_path or loss_args.vf_weight == 0:
        return
    if model_args.freeze_encoder:
        raise ValueError("--vf_model_path aligns the latent space, and the latent space belongs to the encoder, which "
                         "--freeze_encoder keeps as it is: drop one of them (or --vf_weight 0 for the diagnostic only).")
    if loss_args.loss_balancing == "gradnorm":
        raise ValueError("the VF loss (--vf_model_path) is weighted against the nll, which --loss_balancing gradnorm "
                         "replaces: drop one of them")


def _validate_equivariance(model_args: ModelArguments, loss_args: LossArguments) -> None:
    """EQ-VAE's flags (equivariance.py)."""
    if not 0.0 <= loss_args.equivariance_prob <= 1.0:
        raise ValueError(f"--equivariance_prob is a probability in [0, 1], got {loss_args.equivariance_prob}")
    if not 0.0 < loss_args.equivariance_min_scale < 1.0:
        raise ValueError("--equivariance_min_scale is the smallest downscale factor, in (0, 1), got "
                         f"{loss_args.equivariance_min_scale}")
    parse_transforms(loss_args.equivariance_transforms)
    if loss_args.equivariance_prob > 0 and model_args.freeze_encoder:
        raise ValueError("--equivariance_prob shapes the latent space, and the latent space belongs to the encoder, "
                         "which --freeze_encoder keeps as it is: drop one of them (an equivariance fine-tune "
                         "trains the encoder and the decoder together).")
