"""Named presets of the training techniques (`--recipe ldm|balanced`), applied under explicit flags.

Owns: the recipe tables and `apply_recipe`, which sets a recipe's values on the parsed argument
dataclasses for every field the user did not give explicitly, and `flags_given`, which reads the
explicitly given field names off the command line. Explicit flags therefore always win, whatever
their position relative to `--recipe`. Formulas and rationale: docs/techniques.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Sequence, Set

# The LDM objective (taming-transformers' LPIPSWithDiscriminator), i.e. the flags' defaults.
LDM = {
    "disc_type": "patch",
    "posterior_std": 0.0,
    "loss_balancing": "none",
    "pixel_weight": 1.0,
    "perceptual_weight": 1.0,
    "disc_weight": 0.5,
    "adaptive_disc_weight": True,
    "kl_weight": 1e-6,
    "latent_penalty_weight": 0.0,
    "pixel_loss_pool": 1,
    "pixel_loss_mask": "none",
    "disc_loss": "hinge",
    "gen_loss": None,
    "lecam_weight": 0.0,
}

# Gradient-normalised branches + constant variance + low-pass pixel loss + VGG16-feature discriminator.
BALANCED = {
    **LDM,
    "disc_type": "vgg",
    "posterior_std": 0.1,
    "loss_balancing": "gradnorm",
    "gradnorm_scope": "global",
    "disc_weight": 0.1,  # adversarial gradient norm, relative to pixel and LPIPS at 1.0
    "kl_weight": 0.0,
    "latent_penalty_weight": 1e-3,
    "pixel_loss_mask": "lowpass",
}

RECIPES: Dict[str, Dict[str, Any]] = {"ldm": LDM, "balanced": BALANCED}


def flags_given(argv: Sequence[str]) -> Set[str]:
    """Field names given on a command line: `--name value`, `--name=value` and `--no_name` (booleans)."""
    names = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0]
        names.add(name)
        if name.startswith("no_"):
            names.add(name[3:])
    return names


def apply_recipe(argument_objects: Iterable[Any], explicit: Set[str]) -> None:
    """Set the chosen recipe's values (the `recipe` field of any object) on fields not in `explicit`."""
    argument_objects = list(argument_objects)
    recipe = next((obj.recipe for obj in argument_objects if getattr(obj, "recipe", None)), None)
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise ValueError(f"--recipe must be one of {tuple(RECIPES)}, got {recipe!r}")
    for name, value in RECIPES[recipe].items():
        if name in explicit:
            continue
        owner = next((obj for obj in argument_objects if name in _field_names(obj)), None)
        if owner is None:
            raise AssertionError(f"recipe {recipe!r} sets unknown field {name!r}")
        setattr(owner, name, value)


def _field_names(obj: Any) -> Set[str]:
    return {f.name for f in dataclasses.fields(obj)}
