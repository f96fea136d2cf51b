"""`build_vae`, the VAE constructor of both drivers and the scripts: fresh from a config JSON (its family's class:
families/), or a LOCAL pretrained one (ppdiffusers or PyTorch diffusers folder, original LDM / SD / SDXL / FLUX single
file), then --init_from_ckpt's weights. Nothing is downloaded; PyTorch files are read without torch (torch_files.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import numpy as np
import paddle
from ppdiffusers import AutoencoderKL
from ppdiffusers.models.modeling_utils import faster_set_state_dict
from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle
from ppdiffusers.pipelines.stable_diffusion.convert_from_ckpt import convert_ldm_vae_checkpoint
from ppdiffusers.utils import _add_variant
from ppdiffusers.utils import constants as names
from safetensors import safe_open

from . import latent_scale, rgba
from ..checkpoint import (EXPORT_CONFIG_NAME, TRAINER_STATE_NAME, VAE_CONFIG_NAME, checkpoint_vae_config,
                          list_checkpoints, read_json, read_model_state)
from .families import family_for_config, family_of
from .family import constructor_defaults
from .families.flux2 import FLUX2
from .families.kl import KL
from .torch_files import read_state_dict
from ..refusals import FROZEN_LATENT

logger = logging.getLogger("vae_trainer")

PADDLE_WEIGHT_FILES = (names.PADDLE_SAFETENSORS_WEIGHTS_NAME, names.PADDLE_SAFETENSORS_WEIGHTS_NAME_INDEX_NAME,
                       names.PADDLE_WEIGHTS_NAME, names.PADDLE_WEIGHTS_NAME_INDEX_NAME)
TORCH_WEIGHT_FILES = (names.TORCH_SAFETENSORS_WEIGHTS_NAME, names.TORCH_SAFETENSORS_WEIGHTS_NAME_INDEX_NAME,
                      names.TORCH_WEIGHTS_NAME, names.TORCH_WEIGHTS_NAME_INDEX_NAME)
# Also read: `diffusion_pytorch_model.fp16.safetensors` (all an fp16 pipeline download holds), cast to float32.
WEIGHT_VARIANTS = ("fp16", "fp32")
TRAINING_RUN_FILES = {TRAINER_STATE_NAME, VAE_CONFIG_NAME, EXPORT_CONFIG_NAME}  # a checkpoint-N's, not a VAE folder's
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
SD_NORM_GROUPS = 32  # a single file's GroupNorm groups: not in its tensors
COUNTER_SUFFIX = ".num_batches_tracked"  # BatchNorm's counter, which ppdiffusers' PyTorch conversion drops

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("ignore_keys",), lambda f: f.ignore_keys and not f.loads_weights,
     "it names weights not to load: add --pretrained_model_name_or_path or --init_from_ckpt, or drop it"),
    (("ignore_keys",), lambda f: f.frozen_latent and latent_scale.reinitialises_encoder(f.ignore_keys, f.family),
     f"{FROZEN_LATENT}: re-initialised, it would stay random; leave the encoder's weights out of it"),
    (("rae_encoder_path",), lambda f: f.rae_encoder_path and (f.loads_weights or not f.vae_config_file),
     "it is the encoder of an RAE decoder trained from scratch (--vae_config_file): a VAE folder or a "
     "checkpoint holds its own encoder; drop it"),
    (("noise_tau",), lambda f: f.noise_tau is not None and f.noise_tau < 0, "it is a noise level: >= 0"),
    (("subfolder",), lambda f: not f.pretrained_model_name_or_path,
     "it is a folder inside --pretrained_model_name_or_path: add that, or drop it"),
)


def build_vae(vae_config_file: Optional[str] = None, pretrained_model_name_or_path: Optional[str] = None,
              subfolder: Optional[str] = None, ignore_keys: Sequence[str] = (),
              init_from_ckpt: Optional[str] = None, encoder_path: Optional[str] = None,
              noise_tau: Optional[float] = None, config: Optional[Dict[str, Any]] = None,
              expand_to_rgba: bool = False) -> paddle.nn.Layer:
    """The VAE to train (fresh weights from Paddle's global RNG: seed first), with its sources' latent scale;
    `encoder_path` (--rae_encoder_path): the weights of a fresh RAE's encoder; `noise_tau` (--noise_tau): the config's
    noise_tau (RAE's training noise) in place of the source's; `config`: a fresh VAE of that config (a distilled
    student's, derived from its teacher); `expand_to_rgba`: the loaded VAE grown from RGB to RGBA (rgba.py)."""
    overrides = {} if noise_tau is None else {"noise_tau": float(noise_tau)}
    if vae_config_file is None and pretrained_model_name_or_path is None and init_from_ckpt is None and not config:
        raise ValueError("Give a VAE source: vae_config_file (a config JSON, e.g. "
                         "configs/vae_tiny.json) and/or pretrained_model_name_or_path (a local folder or file)")
    ignore_keys = tuple(ignore_keys or ())
    config_file = vae_config_file or checkpoint_vae_config(init_from_ckpt)  # a fresh VAE's architecture
    source = weights = None
    if pretrained_model_name_or_path is not None:
        source, weights = find_pretrained(pretrained_model_name_or_path, subfolder)
    single_file = source is not None and weights is None
    if single_file:
        state = _read_single_file(source)
        vae = vae_from_config_file(vae_config_file, overrides=overrides) if vae_config_file else KL.build(
            infer_single_file_config(state, source), source)
        assign_weights(vae, _convert_single_file(vae, state), ignore_keys, source)
    elif source:  # in its own architecture or that of vae_config_file
        vae = vae_from_config_file(vae_config_file or source, overrides=overrides)
        shards = (sorted(set(read_json(os.path.join(source, weights))["weight_map"].values()))
                  if weights.endswith(".json") else [weights])
        state = {k: v for shard in shards for k, v in _read_weight_file(vae, os.path.join(source, shard)).items()}
        assign_weights(vae, state, ignore_keys, source)
    elif config:
        vae = family_for_config(config).build(config, "the student config derived from the teacher", fresh=True)
    elif config_file:  # fresh unless a checkpoint's weights follow
        vae = vae_from_config_file(config_file, not init_from_ckpt, encoder_path, overrides)
    else:
        hint = _not_a_checkpoint_hint(init_from_ckpt)
        raise FileNotFoundError(f"--init_from_ckpt {init_from_ckpt} is not a checkpoint-N.{hint}" if hint else
                                f"--init_from_ckpt {init_from_ckpt} holds no vae_config.json (not a checkpoint of "
                                "this version): give the architecture with --vae_config_file")
    if init_from_ckpt:
        load_vae_weights(vae, init_from_ckpt, ignore_keys)
    if expand_to_rgba:  # after every weight is loaded (a checkpoint's too): it grows the source
        rgba.expand_to_rgba(vae, family_of(vae))
    latent_scale.settle(vae, vae_config_file, source, single_file, init_from_ckpt, ignore_keys)
    # Refuse an --ignore_keys prefix that names no weight (a typo such as `decoders.` would load everything).
    weight_names = list(vae.state_dict())
    unmatched = [prefix for prefix in ignore_keys if not any(name.startswith(prefix) for name in weight_names)]
    if unmatched:
        tops = sorted({name.split(".")[0] + "." for name in weight_names})
        raise ValueError(f"--ignore_keys {' '.join(unmatched)}: no weight of this VAE starts with that; its weight "
                         f"names start with {', '.join(tops)} (e.g. --ignore_keys decoder.)")
    return vae


def find_pretrained(path: str, subfolder: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """(the VAE's folder or single file, the folder's weight file), or one clear error if nothing loadable is there."""
    location = os.path.join(path, subfolder) if subfolder else path
    if os.path.isfile(location):
        if location.endswith(SINGLE_FILE_SUFFIXES):
            return location, None
        raise ValueError(f"{location}: a single-file VAE checkpoint must end with one of {SINGLE_FILE_SUFFIXES}")
    if not os.path.isdir(location):
        raise FileNotFoundError(
            f"No pretrained VAE at {location}: --pretrained_model_name_or_path must be a local folder or a "
            "single-file checkpoint (with --subfolder, e.g. 'vae', when the VAE sits inside a pipeline "
            "folder); nothing is downloaded.")
    present = set(os.listdir(location))
    if present & TRAINING_RUN_FILES:
        raise FileNotFoundError(
            f"{location} is a checkpoint of a training run ({', '.join(sorted(present & TRAINING_RUN_FILES))}), not a "
            f"VAE folder: start from its weights with --init_from_ckpt {location} (continue that run with "
            "--resume_from_checkpoint), or fine-tune the VAE that run exported, OUTPUT_DIR/vae.")
    found = [name for name in with_variants(PADDLE_WEIGHT_FILES) + with_variants(TORCH_WEIGHT_FILES)
             if name in present]  # our export holds both: Paddle's is read
    if found and names.CONFIG_NAME not in present:
        raise FileNotFoundError(f"{location} holds {found[0]} but no {names.CONFIG_NAME}")
    if found:
        return location, found[0]
    hint = ""
    if not subfolder and os.path.isdir(os.path.join(location, "vae")):
        hint = " It has a 'vae' folder: add --subfolder vae."
    raise FileNotFoundError(
        f"No loadable VAE in {location}: looked for {names.CONFIG_NAME} with one of "
        f"{', '.join(PADDLE_WEIGHT_FILES + TORCH_WEIGHT_FILES)} (or their {'/'.join(WEIGHT_VARIANTS)} variants, "
        f"e.g. {with_variants(TORCH_WEIGHT_FILES[:1])[1]}). A single-file checkpoint "
        f"({'/'.join(SINGLE_FILE_SUFFIXES)}) is given as the path of the file itself.{hint}")


def with_variants(files: Sequence[str]) -> Tuple[str, ...]:
    """`files` and their WEIGHT_VARIANTS names (ppdiffusers' spelling: name.fp16.ext)."""
    return tuple(files) + tuple(_add_variant(name, variant) for variant in WEIGHT_VARIANTS for name in files)


def _not_a_checkpoint_hint(path: str) -> str:
    """What a folder given to --init_from_ckpt is instead of a checkpoint-N, when it is something we know."""
    if not os.path.isdir(path):
        return ""
    checkpoints = list_checkpoints(path)
    if checkpoints:
        return (f" It is a run's output folder: give one of its checkpoints, e.g. --init_from_ckpt "
                f"{checkpoints[-1][1]}.")
    try:
        find_pretrained(path)
    except (FileNotFoundError, ValueError):
        return ""
    return f" It is a VAE folder: fine-tune it with --pretrained_model_name_or_path {path}."


def vae_from_config_file(config_file: str, fresh: bool = False, encoder_path: Optional[str] = None,
                         overrides: Optional[Dict[str, Any]] = None) -> paddle.nn.Layer:
    """A new VAE of the family and architecture of a config JSON, or of a VAE folder's config.json, with `overrides`
    of its entries; `fresh`: to train from scratch (no weights follow), with the weights of `encoder_path` for a
    family whose encoder never trains."""
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"VAE config file {config_file} does not exist")
    config = {**AutoencoderKL.load_config(config_file), **(overrides or {})}
    where = os.path.join(config_file, names.CONFIG_NAME) if os.path.isdir(config_file) else config_file
    family = family_for_config(config, where)
    if "noise_tau" in (overrides or {}) and "noise_tau" not in constructor_defaults(family):
        raise ValueError(f"--noise_tau {overrides['noise_tau']}: {family.class_name} adds no noise to its latents in "
                         "training; drop it")
    if encoder_path and family.geometry(config).encoder_trains:
        raise ValueError(f"--rae_encoder_path {encoder_path}: {family.class_name} ({where}) trains its own encoder; "
                         "drop it")
    return family.build(config, where, fresh, encoder_path)


def assign_weights(vae: paddle.nn.Layer, state: Dict[str, object], ignore_keys: Sequence[str], source: str) -> None:
    """Load a Paddle-layout state dict into `vae`: every weight not ignored there with its shape, none left over."""
    expected = vae.state_dict()
    state = {k: v for k, v in state.items() if not k.startswith(tuple(ignore_keys))}
    mismatched = [f"{k}: {list(v.shape)} in the file, {list(expected[k].shape)} here"
                  for k, v in state.items() if k in expected and list(v.shape) != list(expected[k].shape)]
    if mismatched:
        raise ValueError(f"{source}: {len(mismatched)} weights have other shapes than this VAE's, e.g. "
                         f"{mismatched[:3]}. Give the matching --vae_config_file, or --ignore_keys PREFIX.")
    missing = [k for k in expected if k not in state and not k.startswith(tuple(ignore_keys))]
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} of this VAE's weights, e.g. {missing[:5]}: a different "
                         "architecture? Give the matching --vae_config_file, or --ignore_keys PREFIX to leave "
                         "those weights freshly initialised.")
    unexpected = sorted(set(state) - set(expected))
    if any(key.startswith("bn.") for key in unexpected):
        raise ValueError(
            f"{source} holds {', '.join(k for k in unexpected if k.startswith('bn.'))}: the latent normalisation "
            f"(BatchNorm statistics) of a FLUX.2 VAE ({FLUX2.class_name}), which this VAE ({type(vae).__name__}) has "
            f"no place for. Give a config of class {FLUX2.class_name} (\"_class_name\": \"{FLUX2.class_name}\", e.g. "
            "configs/flux2_vae.json), or none: the source's own config is used.")
    if unexpected:
        raise ValueError(f"{source} holds {len(unexpected)} weights this VAE has no place for, e.g. {unexpected[:5]}: "
                         "a different architecture? Give the matching --vae_config_file.")
    # ppdiffusers' own loader: each weight cast to the VAE's dtype and copied in; ignored ones keep their fresh values.
    faster_set_state_dict(vae, state)


def _read_single_file(path: str) -> Dict[str, np.ndarray]:
    try:
        state = read_state_dict(path)
    except Exception as error:  # e.g. a .ckpt pickling training objects, which the tensors-only reader refuses
        raise ValueError(f"cannot read {path} ({error}); a .safetensors export of the VAE always loads") from error
    state = state.get("state_dict", state)
    if any(k.startswith("first_stage_model.") for k in state):  # a whole SD checkpoint: its VAE part
        state = {k[len("first_stage_model."):]: v for k, v in state.items() if k.startswith("first_stage_model.")}
    if any(k.startswith("encoder.down_blocks.") for k in state):  # diffusers' names, not LDM's
        folder = os.path.dirname(path) or "."
        raise ValueError(f"{path} is the weight file of a diffusers / ppdiffusers VAE folder, not an original LDM "
                         f"single file: give the folder, --pretrained_model_name_or_path {folder}")
    if "encoder.conv_in.weight" not in state or "decoder.conv_out.weight" not in state:
        raise ValueError(f"{path} is not an original LDM/SD VAE checkpoint (no encoder.conv_in / decoder.conv_out "
                         "weights); a diffusers VAE is a folder with config.json")
    return state


def infer_single_file_config(state: Dict[str, np.ndarray], path: str) -> dict:
    """The architecture from an LDM VAE's tensor shapes, with SD's 32 GroupNorm groups and no latent scale."""
    levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down.")})
    widths = [int(state[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]) for i in levels]
    layers = len({k.split(".")[4] for k in state if k.startswith("encoder.down.0.block.")})
    latent_channels = int(state["decoder.conv_in.weight"].shape[1])
    if latent_channels != 4:
        raise ValueError(f"{path}: a {latent_channels}-channel VAE; its scaling factor is not in the file. Give "
                         "its config with --vae_config_file (e.g. configs/flux_vae.json for FLUX).")
    if any(width % SD_NORM_GROUPS for width in widths):
        raise ValueError(f"{path}: block widths {widths} are not SD's (GroupNorm of {SD_NORM_GROUPS} groups); give "
                         "the VAE's config with --vae_config_file")
    logger.info("%s: architecture inferred from the tensor shapes (block widths %s, %d latent channels; SD's %d "
                "GroupNorm groups)", path, widths, latent_channels, SD_NORM_GROUPS)
    return dict(in_channels=int(state["encoder.conv_in.weight"].shape[1]),
                out_channels=int(state["decoder.conv_out.weight"].shape[0]), block_out_channels=widths,
                down_block_types=["DownEncoderBlock2D"] * len(widths), layers_per_block=layers,
                up_block_types=["UpDecoderBlock2D"] * len(widths), latent_channels=latent_channels,
                norm_num_groups=SD_NORM_GROUPS, sample_size=512, use_quant_conv="quant_conv.weight" in state,
                use_post_quant_conv="post_quant_conv.weight" in state)


def _convert_single_file(vae: paddle.nn.Layer, ldm_state: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """LDM names -> diffusers names (ppdiffusers' converter), then torch -> Paddle layout (Linear transposed)."""
    # The converter expects quant_conv/post_quant_conv, which FLUX-style VAEs do not have: stand-ins, dropped after.
    stand_ins = {k: np.zeros([1], "float32") for k in ("quant_conv.weight", "quant_conv.bias", "post_quant_conv.weight",
                                                       "post_quant_conv.bias") if k not in ldm_state}
    converted = convert_ldm_vae_checkpoint({**ldm_state, **stand_ins}, dict(vae.config))
    return convert_pytorch_state_dict_to_paddle(vae, {k: v for k, v in converted.items() if k not in stand_ins})


def load_vae_weights(vae: paddle.nn.Layer, path: str, ignore_keys: Iterable[str] = ()) -> None:
    """Weights only into `vae`, from a checkpoint-N of ours (its `vae.` weights) or a VAE weight file."""
    file = os.path.join(path, names.PADDLE_WEIGHTS_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--init_from_ckpt {path}: no such file (expected a checkpoint-N folder or a weight "
                                f"file).{_not_a_checkpoint_hint(path)}")
    state = _read_weight_file(vae, file)
    if any(k.startswith("vae.") for k in state):  # our checkpoint: the VAE part of VAEWithDiscriminator
        state = {k[len("vae."):]: v for k, v in state.items() if k.startswith("vae.")}
    assign_weights(vae, state, ignore_keys, file)
    logger.info("initialised the VAE weights from %s", file)


def _read_weight_file(vae: paddle.nn.Layer, file: str) -> Dict[str, object]:
    """A weight file's state in Paddle's layout (a PyTorch one converted, keeping its BatchNorm counters)."""
    if file.endswith(".pdparams"):
        return read_model_state(file)
    state = read_state_dict(file)
    if file.endswith(".safetensors"):
        with safe_open(file, framework="np") as handle:
            if (handle.metadata() or {}).get("format", "pt") != "pt":  # ppdiffusers writes "pd"
                return state
    counters = {k: np.asarray(v, np.int64).reshape([1]) for k, v in state.items() if k.endswith(COUNTER_SUFFIX)}
    return {**convert_pytorch_state_dict_to_paddle(vae, state), **counters}
