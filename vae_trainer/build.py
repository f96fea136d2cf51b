"""What both drivers build from the parsed arguments, in the same order (same seed, same numbers): seed -> VAE ->
discriminator -> container -> LPIPS, then `seed_training` right before the first step."""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np
import paddle
from paddlenlp.trainer.trainer_utils import set_seed

from .data.dataset import build_train_dataloader
from .disk import warn_if_short
from .distributed import all_ranks_agree, broadcast_parameters, from_rank_0, init_distributed, rank, world_size
from .ema import EMA_NAME, TrainableEMA
from .evaluation import TrainingEvaluator
from .flag_checks import derived_student_config
from .models import latent_scale
from .models.trainable import VAEWithDiscriminator
from .models.discriminator import PATCH_TYPES, build_discriminator, convert_batchnorm_to_sync, init_discriminator_from
from .models.dinov2 import load_dinov2
from .models.inception import load_fid_inception
from .models.lpips import DEFAULT_LPIPS_WEIGHTS, LPIPS
from .models.teacher import check_student, load_teacher
from .models.families import check_reconstruction_shape, image_channels
from .models.recompute import enable_recompute
from .models.vae_loading import build_vae
from .optim import build_optimizer
from .precision import LossScaler, setup_precision, uses_master_weights
from .objectives.gan import FakeReplay
from .step import Network, NonFiniteGuard, TrainStep

logger = logging.getLogger("vae_trainer")
VIDEO_ENCODER_TRAINED = "%s: its encoder is being trained on %s. Its latents encode video too (an image " \
    "is a one-frame clip)"
LOADED_LATENTS_CHANGE = (", and a diffusion model was trained on them: training the encoder changes them, for video "
                         "as well. To keep them, fine-tune the decoder only (--freeze_encoder); docs/fine-tuning.md, "
                         "\"Qwen-Image / Wan VAEs\".")
FRESH_VIDEO_UNTRAINED = (": images never reach its temporal weights, so its latents of clips of more than one frame "
                         "are not trained.")


@dataclass
class Networks:
    """A run's networks, identical on every rank, and what the final save needs to know of how they were built."""

    model: VAEWithDiscriminator
    lpips: Optional[LPIPS]
    discriminator_config: Dict[str, Any]
    lpips_weights: Optional[str] = None
    scaling_factor_mode: Any = "measure"  # latent_scale.scaling_factor_mode: "keep", "measure" or a number
    resolution: Optional[int] = None
    vf_model: Any = None  # the frozen foundation model of --vf_model_path (models/dinov2.py), outside `model`
    teacher: Any = None  # distillation's frozen VAE (models/teacher.py), outside `model`
    clips: bool = False  # clips train (--num_frames > 1, --video_image_ratio < 1): batches of one frame and of
    # clips then meet in one step over the ranks


def init_process(training_args) -> None:
    """Device, process group and readable logs (CPU threads are chosen before Paddle loads: threads.py)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    gpu = training_args.device == "gpu"  # under the launcher, each process drives the GPU it was given
    paddle.set_device(f"gpu:{paddle.distributed.ParallelEnv().device_id}" if gpu else training_args.device)
    init_distributed()


def build_networks(model_args, loss_args, training_args, resolution: Optional[int] = None,
                   clips: bool = False) -> Networks:
    """The VAE (+ discriminator + log-variance) container and the frozen LPIPS, identical on every rank;
    `resolution` (--resolution) is checked against what the decoder returns (--input_size)."""
    set_seed(training_args.seed)
    with all_ranks_agree("building the networks"):  # a file one rank cannot read stops every rank, naming it
        teacher = load_teacher(model_args.teacher_model_name_or_path, model_args.teacher_subfolder,
                               model_args.cache_teacher_latents) if model_args.teacher_model_name_or_path else None
        vae = build_vae(model_args.vae_config_file, model_args.pretrained_model_name_or_path, model_args.subfolder,
                        ignore_keys=model_args.ignore_keys or (), init_from_ckpt=model_args.init_from_ckpt,
                        encoder_path=model_args.rae_encoder_path, noise_tau=model_args.noise_tau,
                        config=derived_student_config(model_args), expand_to_rgba=model_args.expand_to_rgba)
        if resolution is not None:
            check_reconstruction_shape(vae.config, model_args.input_size, resolution)
        if training_args.recompute:  # the family's segments: blocks of the encoder and decoder (models/recompute.py)
            segments = enable_recompute(vae)
            logger.info("--recompute: %d segments of the VAE are recomputed in the backward", len(segments))
        disc_config = {"disc_type": model_args.disc_type, "norm": model_args.disc_norm,
                       "num_layers": model_args.disc_num_layers, "base_channels": model_args.disc_base_channels,
                       **({"condition_channels": teacher.latent_channels} if teacher else {})}
        if model_args.disc_type in PATCH_TYPES and image_channels(vae) == 4:  # it sees alpha (objectives/gan.py)
            disc_config["in_channels"] = 4
        if model_args.disc_type not in PATCH_TYPES:  # its frozen backbone: the LPIPS file's VGG16, or the DINO ViT-S/8
            disc_config["weights_path"] = model_args.lpips_weights if model_args.disc_type == "vgg" else \
                model_args.disc_backbone_path
        discriminator = build_discriminator(**disc_config)
        if model_args.discriminator_path:  # before SyncBatchNorm conversion, which carries the weights over
            init_discriminator_from(discriminator, disc_config, model_args.discriminator_path)
        if world_size() > 1 and model_args.disc_type in PATCH_TYPES and model_args.disc_norm == "batch":
            discriminator = convert_batchnorm_to_sync(discriminator)
        vf_model = (load_dinov2(model_args.vf_model_path, model_args.vf_input_convention) if model_args.vf_model_path
                    else None)
        vf_width = vf_model.feature_dim if vf_model and loss_args.vf_weight > 0 else None  # the VF loss's projection
        model = VAEWithDiscriminator(vae, discriminator, loss_args.logvar_init, loss_args.learn_logvar,
                                     posterior_std=model_args.posterior_std,
                                     freeze_encoder=model_args.freeze_encoder or bool(
                                         teacher and loss_args.latent_distill_weight == 0),  # a decoder-only student
                                     input_size=model_args.input_size, vf_feature_dim=vf_width,
                                     trainable_modules=model_args.trainable_modules)
        model.refuse_frozen_readers(loss_args)
        if teacher:
            check_student(vae, teacher)
        loaded = model_args.pretrained_model_name_or_path or model_args.init_from_ckpt
        video_encoder_trains = model.family.geometry(vae.config).frames and not model.encoder_frozen
        if video_encoder_trains and rank() == 0 and (loaded or not clips):  # once per job: loaded latents, or images
            logger.warning(VIDEO_ENCODER_TRAINED + (LOADED_LATENTS_CHANGE if loaded else FRESH_VIDEO_UNTRAINED),
                           model.family.class_name, "clips" if clips else "still images")
        scaling_factor_mode = latent_scale.scaling_factor_mode(model_args, vae, model.encoder_frozen)  # checked
        lpips = LPIPS(model_args.lpips_weights) if loss_args.perceptual_weight > 0 else None
    broadcast_parameters(model)
    return Networks(model, lpips, disc_config, model_args.lpips_weights, scaling_factor_mode, resolution, vf_model,
                    teacher, clips)


def stateful(step: TrainStep) -> Dict[str, Any]:
    """Checkpoint files -> objects with a state dict (besides the model weights and rank state)."""
    files: Dict[str, Any] = {}
    for net in step.networks:
        files.update({f"{net.prefix}optimizer.pdopt": net.optimizer, f"{net.prefix}scheduler.pdparams": net.scheduler})
    # an fp16 run's scalers, even on CPU (disabled); enabled ones (fp16 with loss scaling) in any case
    if step.precision.dtype == "float16" or step.networks[0].scaler.is_enable():
        files.update({f"{net.prefix or 'vae_'}scaler.pdparams": net.scaler for net in step.networks})
    ema = {EMA_NAME: step.ema} if step.ema is not None else {}
    return {**files, "nonfinite_guard.pdparams": step.guard, **ema}


def train_networks(model: VAEWithDiscriminator, loss_args, args) -> Tuple[Network, Network]:
    """The VAE's and the discriminator's records, built once: parameters, optimizer and schedule (the discriminator's
    over the steps from its start), fp16 loss scaler, first step (the discriminator's: never with --disc_weight 0)."""
    # The discriminator trains from --disc_update_start (RAE's: before its term enters) or from --disc_start.
    start = loss_args.disc_start if loss_args.disc_update_start is None else loss_args.disc_update_start
    scaling = (args.scale_loss, args.min_loss_scale, args.fp16)  # Paddle's scaler: enabled by --fp16 only
    return (Network("vae", "", model.vae_parameters(), *build_optimizer(args, model), LossScaler(*scaling)),
            Network("discriminator", "disc_", list(model.discriminator.parameters()),
                    *build_optimizer(args, model, start), LossScaler(*scaling),
                    start if loss_args.disc_weight > 0 else math.inf))


def build_optimization(networks: Networks, loss_args, training_args) -> TrainStep:
    """The training step, built in this order: the EMA (of the exact float32 weights, not O2's half-precision
    copies), precision (O2 casts the weights, frozen layers excepted), the optimizers over the cast weights."""
    model = networks.model
    ema = TrainableEMA(model.vae, decay=training_args.ema_decay) if training_args.use_ema else None
    frozen = model.frozen_layers() if uses_master_weights(training_args) else []  # O2 casts all the others
    precision = setup_precision(training_args, model, keep_float32=frozen)
    trained = train_networks(model, loss_args, training_args)
    guard = NonFiniteGuard(training_args.max_consecutive_nonfinite_steps, training_args.max_consecutive_overflow_steps)
    replay = FakeReplay(loss_args.disc_replay_size, training_args.seed + rank()) if loss_args.disc_replay_size else None
    if rank() == 0:
        warn_if_short(training_args.output_dir, model, ema, training_args.save_total_limit)
    return TrainStep(networks, loss_args, training_args, trained, precision=precision, ema=ema, guard=guard,
                     replay=replay)


def build_evaluator(data_args, training_args, networks: Networks):
    """The in-training evaluator, the same on every rank: LPIPS (the training one, or loaded if rank 0 has its
    weights) and optional rFID."""
    load_lpips = networks.lpips is None and from_rank_0(os.path.isfile(networks.lpips_weights or DEFAULT_LPIPS_WEIGHTS))
    with all_ranks_agree("loading the evaluation's networks"):  # rank 0 decided: a rank that cannot follow says so
        lpips = LPIPS(networks.lpips_weights) if load_lpips else networks.lpips
        inception = load_fid_inception(data_args.inception_weights) if data_args.inception_weights else None
    return TrainingEvaluator(data_args, training_args, networks, lpips, inception)


def build_train_data(data_args, training_args, data_state: Optional[dict] = None, channels: int = 3):
    """This rank's training DataLoader (resumed at `data_state` if given) of images of `channels` (the VAE's: 4 keeps
    alpha) and its position tracker."""
    stream_flags = ("image_column", "random_flip", "random_crop", "min_image_size", "aspect_ratio_buckets",
                    "shuffle_buffer_size", "num_frames", "frame_stride", "video_image_ratio")  # ImageStream's names
    loader = build_train_dataloader(
        data_args.file_list, data_args.resolution, training_args.per_device_train_batch_size,
        training_args.dataloader_num_workers, training_args.seed, rank(), world_size(), resume_state=data_state,
        channels=channels, **{name: getattr(data_args, name) for name in stream_flags})
    return loader, loader.dataset.position  # (its part paths name the files in the skip summary)


def seed_training(seed: int) -> None:
    """Seed training's random streams: different on every rank, reproducible from --seed (the networks: `seed`)."""
    training_seed = seed + 1_000_003 * (rank() + 1)
    paddle.seed(training_seed)
    np.random.seed(training_seed % 2**32)
    random.seed(training_seed)
