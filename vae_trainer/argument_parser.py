"""The command-line parser of both entry points: PaddleNLP's `PdArgumentParser` with our --help layout, and
`parse_arguments` (flags or one JSON file -> the four dataclasses, --recipe applied, flag_checks.validate).

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
from typing import Any, Dict, List, Optional, Sequence, Tuple, get_args, get_origin, get_type_hints

from paddlenlp.trainer import PdArgumentParser, TrainingArguments

from .arguments import (ALL_ARGUMENT_CLASSES, DataArguments, LossArguments, ModelArguments, VAETrainingArguments,
                        literal_choices, strip_optional)
from .flag_checks import validate
from .flag_policy import ALIASES, IGNORED_FLAGS, PADDLENLP_FLAGS, inherited_fields
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
