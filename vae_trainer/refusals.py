"""The mechanism of the parse-time refusals, which live beside what they guard (each module's `REFUSALS`, gathered
in argument_parser.py): `refuse` checks the rows for the flags a user gave, and what a reason may name."""

from __future__ import annotations

from typing import Any, Callable, Dict, Set, Tuple

# (flags, when they are refused given the other flags, why and what to do instead: a text, or made of the flags).
Rows = Tuple[Tuple[Tuple[str, ...], Callable[[Any], bool], str], ...]
SINGLE_FRAMES = "it applies to clips, and every sample is one frame (--num_frames 1, or --video_image_ratio 1): "
FAMILY = "{family}"  # in a refusal's reason: the class of the VAE the flags give (its family's), named by `refuse`
FROZEN_LATENT = f"the latent is {FAMILY}'s frozen representation encoder's tokens (DINOv2's), which no flag trains"

# A flag given its value that does nothing is never refused as idle: ppdiffusers' commands pass e.g.
# `--lr_scheduler_type constant --warmup_steps 0`. Any other value of these flags stays refused where idle.
INERT_VALUES: Dict[str, Any] = {"warmup_steps": 0, "warmup_ratio": 0.0, "lecam_weight": 0.0, "image_logging_steps": 0,
                                "subfolder": "", "eval_tiled": False, "vf_weight": 0.0, "disc_weight_warmup_steps": 0,
                                "disc_replay_size": 0, "latent_distill_weight": 0.0}


def refuse(flags: Any, given: Set[str], rows: Rows, header: str = "") -> None:
    """Raise one ValueError naming each flag in `given` that one of `rows` refuses with the values of `flags`."""
    family, lines = getattr(flags, "family", None), []
    for names, when, why in rows:
        for name in names:
            if name not in given or (name in INERT_VALUES and getattr(flags, name) == INERT_VALUES[name]):
                continue
            if when(flags):
                reason = why(flags) if callable(why) else why  # a reason the flags' facts word (a family's own)
                reason = reason.replace(FAMILY, family.class_name if family else "this autoencoder")
                value = getattr(getattr(flags, name), "value", getattr(flags, name))  # as typed after it (an Enum's)
                shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
                lines.append(f"--{name} {shown.lower() if isinstance(value, bool) else shown}: {reason}")
    if lines:
        raise ValueError("\n  ".join([header + ":"] + lines if header else lines))
