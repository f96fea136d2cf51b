"""ppdiffusers' `AutoencoderTiny` (TAESD) as a family (family.py), the student of a distillation: a deterministic
encoder (no posterior) whose latents live in its teacher's pipeline latent space (so its scale is fixed: scaling_factor
1.0, never measured: a latent_normalisation.Scale of a fixed `origin`), the layers training reads, and
`student_config`, a TAESD-shaped config following a teacher's geometry, and a fresh decoder's mid-grey start.

The classes map the ranges themselves: EncoderTiny takes [-1, 1] images to [0, 1] before its layers, DecoderTiny
soft-clamps the latents (3 * tanh(z / 3)) and maps its [0, 1] output back to [-1, 1]. Their own gradient
checkpointing skips the encoder's range map (ppdiffusers 0.29 and diffusers 0.42.1 alike), so --recompute re-runs
the blocks instead (`recompute_segments`)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import paddle
from ppdiffusers import AutoencoderTiny

from ..family import Deterministic, Family, Geometry, Layer, Tensor, check_config_keys, constructor_defaults
from ..initialisation import init_like_pytorch
from ..latent_normalisation import Scale

A_STUDENT = ("it is a distillation student (docs/distillation.md), and it learns its teacher's RGB images and "
             "latents")
# diffusers 0.42.1's keys ppdiffusers 0.29 lacks, read at their only value it builds (the defaults); the saved config
# always holds block_out_channels (both constructors register the decoder's widths under it).
NEWER_KEYS = {"upsample_fn": "nearest", "shift_factor": 0.0}
RETIRED_KEYS = ("block_out_channels", *NEWER_KEYS)  # read, not built


class TinyFamily(Family):
    network = AutoencoderTiny
    normalisation = Scale(origin="fixed: a student lives in its teacher's normalised latent space")

    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        """The encoder: a stride-2 conv at the start of every stage but the first; the decoder: an upsampling by
        upsampling_scaling_factor after every stage but the last."""
        config = {**constructor_defaults(self), **config}
        return Geometry(2 ** (len(config["num_encoder_blocks"]) - 1),
                        int(config["upsampling_scaling_factor"]) ** (len(config["num_decoder_blocks"]) - 1),
                        int(config["latent_channels"]), "2 ** (encoder stages - 1)", deterministic=True,
                        rgba_refusal=A_STUDENT)

    def build(self, config: Mapping[str, Any], where: str, fresh: bool = False,
              encoder_path: Optional[str] = None) -> Layer:
        check_config_keys(config, self, where, retired=RETIRED_KEYS)
        for key, value in NEWER_KEYS.items():
            if config.get(key, value) not in (value, None):
                raise ValueError(f"{where}: {key} {config[key]!r}: ppdiffusers' {self.class_name} builds only "
                                 f"{value!r}")
        vae = self.network.from_config({k: v for k, v in config.items() if k not in RETIRED_KEYS})
        if fresh:
            # PyTorch's spread, not Paddle's Kaiming-normal one: with that, a fresh encoder's output RMS is ~37 for
            # normalised latents of RMS ~0.3, and its first steps only shrink it (docs/distillation.md, issue 53).
            init_like_pytorch(vae)
            # A fresh student's first decodes about mid-grey (0 on [-1, 1]), not anywhere in several units: DecoderTiny
            # returns 2 * conv_out - 1, so its output conv gets bias 0.5. Its weights keep PyTorch's small draw (the
            # conv's input has RMS ~0.03, the output is grey within a few hundredths). Zero weights would be exactly
            # grey, but they leave every earlier layer without a gradient at the first step, and Adam's first steps
            # then overshoot as that gradient grows (a pooled MSE of 29 at step 4 against 0.35 at the start, measured
            # at lr 1e-3; docs/distillation.md, issue 53).
            conv = vae.decoder.layers[-1]
            conv.bias.set_value(paddle.full_like(conv.bias, 0.5))
        return vae

    def encode(self, vae: Layer, images: Tensor) -> Deterministic:
        return Deterministic(vae.encode(images).latents)

    def last_layers(self, vae: Layer) -> Tuple[Tensor, Optional[Tensor]]:
        return vae.decoder.layers[-1].weight, vae.encoder.layers[-1].weight

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """The AutoencoderTinyBlocks of encoder and decoder (not the convs in and out)."""
        return [(f"{coder}.layers.{i}", layer) for coder in ("encoder", "decoder")
                for i, layer in enumerate(getattr(vae, coder).layers) if type(layer).__name__ == "AutoencoderTinyBlock"]


def student_config(teacher_geometry: Geometry, width: int = 64, depth: int = 3) -> Dict[str, Any]:
    """A TAESD-shaped AutoencoderTiny config for a teacher of `teacher_geometry`: log2(factor) + 1 stages of `width`
    channels, `depth` blocks each but the encoder's first and the decoder's last (1): TAESD's own at f8, 64, 3."""
    factor = teacher_geometry.factor
    if teacher_geometry.output_size is not None:
        raise ValueError(f"the teacher's decoder returns a fixed {teacher_geometry.output_size} px whatever its "
                         "latents (RAE's): a tiny autoencoder's decoder upsamples its latents, so it cannot stand in")
    if factor < 2 or factor & (factor - 1):
        raise ValueError(f"the teacher's factor is {factor} ({teacher_geometry.rule}): a tiny autoencoder halves each "
                         "side per stage, so its factor is a power of two >= 2")
    if teacher_geometry.decoder_factor != factor:
        raise ValueError(f"the teacher's decoder upsamples by {teacher_geometry.decoder_factor}, its encoder "
                         f"downsamples by {factor}: a tiny autoencoder's encoder and decoder mirror each other")
    stages = int(math.log2(factor)) + 1
    return {"_class_name": TINY.class_name, "in_channels": 3, "out_channels": 3, "act_fn": "relu",
            "latent_channels": teacher_geometry.latent_channels, "upsampling_scaling_factor": 2,
            "encoder_block_out_channels": [width] * stages, "decoder_block_out_channels": [width] * stages,
            "num_encoder_blocks": [1] + [depth] * (stages - 1), "num_decoder_blocks": [depth] * (stages - 1) + [1],
            "latent_magnitude": 3, "latent_shift": 0.5, "force_upcast": False, "scaling_factor": 1.0}


TINY = TinyFamily()
