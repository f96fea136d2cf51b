"""The flags refused at parse time, before anything is built, in both entry points.

`REFUSALS` is the one table of refusals, checked by `refuse` on the flags a user gave (a --recipe's values never
count) and on PaddleNLP's inherited flags by value; `check_sizes` checks sizes against the VAE's config file.
Importing this module stays free of Paddle (evaluation.py and scripts/eval_vae.py share the tiling checks).
"""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Set, Tuple

from .data.buckets import BUCKET_MULTIPLE, bucket_shapes

DEFAULT_TILE_SIZE = 512  # --eval_tile_size's default: the SD VAE's sample_size
CLIPS_NO_RFID = ("rFID is defined on images and clips are evaluated (--num_frames > 1); rFVD is not provided (it needs "
                 "I3D weights, which nothing here downloads): drop it")
CLIPS_NO_INPUT_SIZE = "the encoder's input size is for images; clips are encoded at --resolution: drop it"


def downsampling_factor(config: Mapping[str, Any]) -> int:
    """The encoder's downsampling factor, as the config's family says (models/family.py)."""
    from .models.families import family_for_config

    return family_for_config(config).geometry(config).factor


def vae_config(model_args) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """(path, contents) of the config of the VAE the flags build: --vae_config_file, else the pretrained folder's or
    the --init_from_ckpt checkpoint's; (path or None, None) when there is none to read (a single file)."""
    from .checkpoint import checkpoint_vae_config

    path, derived = model_args.vae_config_file, derived_student_config(model_args)
    if derived:
        return f"the student of {model_args.teacher_model_name_or_path}", derived
    if path is None and model_args.pretrained_model_name_or_path:
        path = os.path.join(model_args.pretrained_model_name_or_path, model_args.subfolder or "", "config.json")
    elif path is None and model_args.init_from_ckpt:
        path = checkpoint_vae_config(model_args.init_from_ckpt)
    if path is None or not os.path.isfile(path):
        return path, None
    with open(path) as handle:
        return path, {key: value for key, value in json.load(handle).items() if value is not None}


def derived_student_config(model_args) -> Optional[Dict[str, Any]]:
    """A distillation's student config from its teacher's geometry (--student_width, --student_depth), when no flag
    gives the student (--vae_config_file, --pretrained_model_name_or_path, --init_from_ckpt); else None."""
    from .models.teacher import student_of

    given = model_args.vae_config_file or model_args.pretrained_model_name_or_path or model_args.init_from_ckpt
    teacher = getattr(model_args, "teacher_model_name_or_path", None)
    return None if given or not teacher else student_of(teacher, model_args.teacher_subfolder,
                                                        model_args.student_width, model_args.student_depth)


def check_sizes(model_args, data_args) -> None:
    """--resolution, --input_size, bucket shapes and tiles against the VAE's config file (none: checked once built)."""
    from .models.families import check_reconstruction_shape

    path, config = vae_config(model_args)
    check_tiling_flags(model_args, data_args, config, path if config is not None else "no config file")
    if config is None:
        return
    resolution, factor = data_args.resolution, downsampling_factor(config)
    check_reconstruction_shape(config, model_args.input_size, resolution, path)
    if data_args.aspect_ratio_buckets and _family_of_flags(model_args).geometry(config).output_size:
        raise ValueError(f"--aspect_ratio_buckets: this VAE ({path}) decodes square images only; drop it")
    bad = _misfit_bucket(resolution, factor) if data_args.aspect_ratio_buckets else None
    if bad:
        fits = next(size for size in range(resolution + BUCKET_MULTIPLE, 64 * resolution, BUCKET_MULTIPLE)
                    if size % factor == 0 and not _misfit_bucket(size, factor))
        raise ValueError(f"--aspect_ratio_buckets at --resolution {resolution} makes buckets such as "
                         f"{bad[0]}x{bad[1]}, whose sides are not multiples of the VAE's downsampling factor {factor} "
                         f"({path}): use e.g. --resolution {fits}, or drop --aspect_ratio_buckets.")


def _misfit_bucket(resolution: int, factor: int) -> Optional[Tuple[int, int]]:
    return next((shape for shape in bucket_shapes(resolution) if shape[0] % factor or shape[1] % factor), None)


def check_eval_batch_size(given: Optional[int], flag: str = "--per_device_eval_batch_size") -> None:
    """An evaluation batch the user gave (`flag`: --per_device_eval_batch_size, the scripts' --batch_size)."""
    if given is not None and given < 1:
        raise ValueError(f"{flag} must be >= 1, got {given}")


def check_tile_size(tile_size: int, config: Optional[Mapping[str, Any]], input_size: Optional[Sequence[int]] = None,
                    where: str = "the VAE's config") -> None:
    """Tiles ppdiffusers' tiled encode/decode gets right (`config` None: the VAE's factor is not known yet)."""
    if input_size is not None:
        raise ValueError("--eval_tiled cannot be combined with --input_size: ppdiffusers' tiles assume the decoder "
                         "returns the size the encoder saw. Drop --eval_tiled.")
    if config is None:
        return
    from .models.families import family_for_config

    family = family_for_config(config, where)
    if not family.tiling:
        raise ValueError(f"--eval_tiled: {family.class_name} has no tiled encode/decode here; drop --eval_tiled")
    multiple = 4 * downsampling_factor(config)  # the tile starts must fall on latent pixels
    if tile_size < multiple or tile_size % multiple:
        fits = max(multiple, round(tile_size / multiple) * multiple)
        raise ValueError(f"--eval_tile_size {tile_size} must be a multiple of {multiple} (4 x the VAE's "
                         f"downsampling factor {multiple // 4}, {where}) for the tiled encode/decode to "
                         f"stitch the tiles back to the image's size: use e.g. --eval_tile_size {fits}")


def check_tiling_flags(model_args, data_args, config: Optional[Mapping[str, Any]], where: str) -> None:
    """--eval_tile_size needs --eval_tiled and is >= 1; `check_tile_size` (`config`: the VAE's, None if unknown)."""
    eval_tiled, tile_size = data_args.eval_tiled, data_args.eval_tile_size
    if tile_size is not None and not eval_tiled:
        raise ValueError("--eval_tile_size does nothing without --eval_tiled: add --eval_tiled, or drop it")
    if tile_size is not None and tile_size < 1:
        raise ValueError(f"--eval_tile_size must be >= 1, got {tile_size}")
    if eval_tiled:
        check_tile_size(tile_size or DEFAULT_TILE_SIZE, config, model_args.input_size, where)


def flag_values(arguments: Sequence[Any]) -> SimpleNamespace:
    """Every flag of the argument dataclasses as an attribute, plus the facts the rows read from several flags
    (raises on a bad --scaling_factor or --equivariance_transforms)."""
    from .equivariance import parse_transforms
    from .models.latent_scale import reinitialises_encoder, scaling_factor_mode
    from .models.lpips import DEFAULT_LPIPS_WEIGHTS
    from .models.teacher import STUDENT

    f = SimpleNamespace(**{field.name: getattr(a, field.name) for a in arguments for field in dataclasses.fields(a)})
    f.measures_scale = scaling_factor_mode(f) == "measure"
    f.uses_scale = "scale" in parse_transforms(f.equivariance_transforms)
    f.evaluates = bool(f.eval_file_list) and bool(f.eval_steps)  # as evaluation.TrainingEvaluator.enabled
    f.loads_weights = bool(f.pretrained_model_name_or_path or f.init_from_ckpt)
    f.metric = (f.metric_for_best_model or "").replace("eval_", "")
    f.lpips_missing = not os.path.isfile(f.lpips_weights or DEFAULT_LPIPS_WEIGHTS)
    f.scheduler = getattr(f.lr_scheduler_type, "value", f.lr_scheduler_type)  # PaddleNLP makes it a SchedulerType
    f.visualdl = bool({"visualdl", "all"} & set(f.report_to or []))
    f.family = _family_of_flags(f)
    path, config = vae_config(f)
    f.geometry = f.family.geometry(config or {})
    f.deterministic, f.frozen_latent, f.video = f.geometry.deterministic, not f.geometry.encoder_trains, f.geometry.frames
    f.reinitialises_encoder = reinitialises_encoder(f.ignore_keys, f.family)
    f.family_known = config is not None or os.path.isfile(f.pretrained_model_name_or_path or "")
    f.single_frames = f.num_frames == 1 or f.video_image_ratio == 1
    f.distils, f.student = bool(f.teacher_model_name_or_path), f.family is STUDENT
    return f


def _family_of_flags(f):
    """The family (models/family.py) of the VAE the flags build: its config's, else AutoencoderKL's (a single file)."""
    from .models.families import family_for_config
    from .models.families.kl import KL

    path, config = vae_config(f)
    return KL if config is None else family_for_config(config, path)


# Every flag of the --help group "discriminator" but --disc_weight, which switches the discriminator on.
DISCRIMINATOR_FLAGS = ("discriminator_path", "disc_type", "disc_norm", "disc_num_layers", "disc_base_channels",
                       "disc_start", "disc_loss", "adaptive_disc_weight", "gen_loss", "relative_hinge_margin",
                       "lecam_weight", "lecam_decay", "disc_learning_rate", "disc_backbone_path", "disc_update_start",
                       "adaptive_disc_weight_max", "disc_weight_warmup_steps", "disc_replay_size")
SINGLE_FRAMES = "it applies to clips, and every sample is one frame (--num_frames 1, or --video_image_ratio 1): "
FAMILY = "{family}"  # in a refusal's reason: the class of the VAE the flags give (its family's), named by `refuse`
FRAMES, FRAME_COUNTS = "{frames}", "{frame_counts}"  # and its temporal factor k, the first clip lengths 1 + k n
FROZEN_LATENT = f"the latent is {FAMILY}'s frozen representation encoder's tokens (DINOv2's), which no flag trains"

# (flags, when they are refused given the other flags, why and what to do instead).
REFUSALS: Tuple[Tuple[Tuple[str, ...], Callable[[Any], bool], str], ...] = (
    # PaddleNLP flags that both drivers do not honour, refused for any value but PaddleNLP's default (any
    # other inherited flag outside arguments.PADDLENLP_FLAGS is too: "not honoured the same way").
    (("num_train_epochs",), lambda f: True, "the training stream is infinite: set the run's length with --max_steps"),
    (("save_strategy",), lambda f: True, "checkpoints are saved every --save_steps optimizer steps (0: at the end)"),
    (("logging_strategy", "logging_first_step"), lambda f: True, "scalars are logged every --logging_steps steps"),
    (("optim",), lambda f: True,
     "the optimizer is AdamW in both drivers (--adam_beta1, --adam_beta2, --adam_epsilon, --weight_decay)"),
    (("greater_is_better",), lambda f: True,
     "--metric_for_best_model decides it (psnr, ssim: higher is better; lpips, rfid: lower)"),
    (("to_static",), lambda f: True, "both drivers train in dynamic-graph mode"),
    (("amp_master_grad",), lambda f: True, "--fp16_opt_level O2 keeps float32 master weights in both optimizers"),
    (("no_cuda",), lambda f: True, "use --device cpu"),
    (("do_eval", "do_predict", "evaluation_strategy", "load_best_model_at_end", "eval_accumulation_steps",
      "max_evaluate_steps", "prediction_loss_only"), lambda f: True,
     "evaluation is the same code in both drivers: use --eval_file_list with --eval_steps (and "
     "--metric_for_best_model)"),
    (("dataloader_drop_last",), lambda f: True, "training batches are always full (the stream is infinite)"),
    (("ignore_data_skip",), lambda f: True, "the data stream always resumes at its saved position"),
    (("run_name", "wandb_api_key"), lambda f: True, "only VisualDL logs are written (--report_to visualdl|none)"),
    (("sharding", "sharding_degree", "sharding_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
      "sep_parallel_degree", "data_parallel_config", "tensor_parallel_config", "pipeline_parallel_config",
      "sharding_parallel_config", "use_expert_parallel", "enable_auto_parallel"), lambda f: True,
     "only data parallelism is supported (paddle.distributed.launch); drop it"),
    # Values a flag cannot take, and flags that contradict or need others.
    (("ignore_keys",), lambda f: f.ignore_keys and not f.loads_weights,
     "it names weights not to load: add --pretrained_model_name_or_path or --init_from_ckpt, or drop it"),
    (("freeze_encoder", "trainable_modules"),
     lambda f: (f.freeze_encoder or f.trainable_modules) and not f.loads_weights and not f.distils,
     "it keeps weights as loaded, and a VAE trained from scratch has only random ones: add "
     "--pretrained_model_name_or_path or --init_from_ckpt, or drop it"),
    (("input_size",), lambda f: f.input_size is not None and (len(f.input_size) != 2 or min(f.input_size) < 1),
     "it takes two positive numbers H W"),
    (("aspect_ratio_buckets",), lambda f: f.aspect_ratio_buckets and f.input_size is not None,
     "it cannot be combined with --input_size (one fixed encoder input; each bucket has its own shape): drop one"),
    (("aspect_ratio_buckets",), lambda f: f.aspect_ratio_buckets and f.resolution % BUCKET_MULTIPLE,
     f"it needs a --resolution that is a multiple of {BUCKET_MULTIPLE} (bucket sides are)"),
    (("kl_weight",), lambda f: f.deterministic, f"{FAMILY}'s encoder is deterministic: no posterior, so no KL term "
     "to weigh; drop it (--posterior_std S adds noise to its latent in training; for RAE, its own --noise_tau T)"),
    (("learn_logvar", "logvar_init"), lambda f: f.deterministic, f"with {FAMILY}'s deterministic encoder there is no "
     "KL term, and the nll's log-variance would only rescale the VAE's whole gradient, which AdamW undoes: drop it"),
    (("posterior_std",), lambda f: f.deterministic and f.posterior_std > 0 and not f.sample_posterior,
     f"with {FAMILY}'s deterministic encoder it is noise added to the latent in training, and "
     "--sample_posterior false adds none: drop one of them"),
    (("sample_posterior",), lambda f: f.deterministic and f.sample_posterior and f.posterior_std == 0,
     f"{FAMILY}'s encoder is deterministic: there is no posterior to sample; drop it, or "
     "add --posterior_std S to decode the latent plus noise of std S"),
    (("weight_decay",), lambda f: f.video and f.single_frames and f.loads_weights and f.weight_decay > 0,
     "it would shrink the loaded temporal weights of this video VAE that images never train (earlier-frame kernel "
     "taps get a zero gradient, and decay alone would move them), changing its video decoding: drop it (it is the "
     "discriminator's decay too)"),
    (("fp16_opt_level",), lambda f: f.video and f.single_frames and f.loads_weights and f.fp16_opt_level == "O2",
     "O2 keeps the weights in half precision, so the temporal weights of this video VAE that images never train would "
     "come back rounded: use O1 (float32 weights, half-precision compute)"),
    (("pixel_loss_pool",), lambda f: f.pixel_loss_pool < 1, "it must be >= 1"),
    (("posterior_std",), lambda f: f.posterior_std < 0, "it must be >= 0 (0 keeps the encoder's variance)"),
    (("learn_logvar",), lambda f: f.learn_logvar and f.loss_balancing == "gradnorm",
     "it has no effect under --loss_balancing gradnorm (the nll is not used): drop it"),
    (("num_frames", "frame_stride"), lambda f: min(f.num_frames, f.frame_stride) < 1, "it must be >= 1"),
    (("num_frames",), lambda f: f.num_frames > 1 and not f.video and f.family_known,
     f"{FAMILY} encodes images, not clips (a video VAE does: docs/fine-tuning.md, \"Fine-tuning on clips\"); drop it"),
    (("num_frames",), lambda f: f.num_frames > 1 and f.video and (f.num_frames - 1) % f.video,
     f"{FAMILY}'s causal layout codes the first frame alone, then groups of {FRAMES}: it takes 1 + {FRAMES}k frames "
     f"({FRAME_COUNTS})"),
    (("frame_stride", "temporal_loss_weight", "lpips_num_frames"),
     lambda f: f.single_frames and (f.frame_stride != 1 or f.temporal_loss_weight or f.lpips_num_frames),
     SINGLE_FRAMES + "drop it, or train on clips"),
    (("video_image_ratio",), lambda f: f.num_frames == 1 and f.video_image_ratio, SINGLE_FRAMES + "add --num_frames N"),
    (("disc_type",), lambda f: f.single_frames and f.disc_type == "patchgan3d",
     SINGLE_FRAMES + "a 3-D discriminator of them is a 2-D one: use --disc_type patch, or train on clips"),
    (("video_image_ratio",), lambda f: not 0 <= f.video_image_ratio <= 1, "it is a share in [0, 1]"),
    (("temporal_loss_weight",), lambda f: f.temporal_loss_weight < 0, "it must be >= 0 (0: off)"),
    (("lpips_num_frames",), lambda f: not 0 <= f.lpips_num_frames <= f.num_frames,
     "it is a number of frames per clip: 0 (every frame) to --num_frames"),
    (("lpips_num_frames",), lambda f: f.lpips_num_frames and f.perceptual_weight == 0,
     "--perceptual_weight 0 turns LPIPS off: drop it"),
    (("equivariance_prob", "vf_model_path"), lambda f: f.num_frames > 1 and (f.equivariance_prob or f.vf_model_path),
     "EQ-VAE's transforms and the VF alignment are defined on images, not clips: drop it, or --num_frames"),
    (("equivariance_prob",), lambda f: not 0 <= f.equivariance_prob <= 1, "it is a probability in [0, 1]"),
    (("equivariance_min_scale",), lambda f: not 0 < f.equivariance_min_scale < 1,
     "it is the smallest downscale factor, in (0, 1)"),
    (("equivariance_prob",), lambda f: f.equivariance_prob > 0 and f.freeze_encoder,
     "it shapes the latent space, and the latent space belongs to the encoder, which --freeze_encoder keeps as it "
     "is: drop one of them (an equivariance fine-tune trains the encoder and the decoder together)"),
    (("latent_penalty_weight",), lambda f: f.latent_penalty_weight > 0 and f.frozen_latent,
     f"it penalises the latents' magnitude, and {FROZEN_LATENT}: drop it"),
    (("equivariance_prob",), lambda f: f.equivariance_prob > 0 and f.frozen_latent,
     f"it shapes the latent space, and {FROZEN_LATENT}: drop it"),
    (("vf_model_path",), lambda f: f.vf_model_path and f.vf_weight > 0 and f.frozen_latent,
     f"it aligns the latents with a DINOv2, and {FROZEN_LATENT}: drop it (or --vf_weight 0 for the diagnostic only)"),
    (("ignore_keys",), lambda f: f.ignore_keys and f.frozen_latent and f.reinitialises_encoder,
     f"{FROZEN_LATENT}: re-initialised, it would stay random; leave the encoder's weights out of it"),
    (("rae_encoder_path",), lambda f: f.rae_encoder_path and (f.loads_weights or not f.vae_config_file),
     "it is the encoder of an RAE decoder trained from scratch (--vae_config_file): a VAE folder or a "
     "checkpoint holds its own encoder; drop it"),
    (("noise_tau",), lambda f: f.noise_tau is not None and f.noise_tau < 0, "it is a noise level: >= 0"),
    (("vf_weight",), lambda f: f.vf_weight < 0, "it must be >= 0 (0: no VF loss)"),
    (("distmat_margin",), lambda f: f.distmat_margin < 0, "it must be >= 0"),
    (("cos_margin",), lambda f: f.cos_margin < 0, "it must be >= 0"),
    (("vf_model_path",), lambda f: f.vf_model_path and f.vf_weight > 0 and f.freeze_encoder,
     "it aligns the latent space, and the latent space belongs to the encoder, which --freeze_encoder keeps as it "
     "is: drop one of them (or --vf_weight 0 for the diagnostic only)"),
    (("vf_model_path",), lambda f: f.vf_model_path and f.vf_weight > 0 and f.loss_balancing == "gradnorm",
     "its VF loss is weighted against the nll, which --loss_balancing gradnorm replaces: drop one of them"),
    (("eval_steps",), lambda f: f.eval_steps is not None and f.eval_steps < 1,
     "it must be >= 1 (leave it out to not evaluate)"),
    (("eval_steps",), lambda f: f.eval_steps and not f.eval_file_list,
     "it needs --eval_file_list: the held-out images to evaluate on"),
    (("eval_file_list",), lambda f: f.eval_file_list and not f.eval_steps,
     "it is never evaluated without --eval_steps: add --eval_steps N (every N steps and at the end; --eval_steps "
     "equal to --max_steps evaluates once, at the end)"),
    (("metric_for_best_model",), lambda f: f.metric and not f.evaluates,
     "it needs evaluations: add --eval_file_list and --eval_steps"),
    (("metric_for_best_model",), lambda f: f.metric == "rfid" and not f.inception_weights,
     "rFID is measured only with --inception_weights: add them"),
    (("metric_for_best_model",), lambda f: f.metric == "lpips" and f.lpips_missing,
     "LPIPS needs its weights (--lpips_weights; default weights/lpips_vgg16.pdparams, from make setup): give them"),
    (("metric_for_best_model",), lambda f: f.metric == "vf_alignment_cka" and not f.vf_model_path,
     "the alignment is measured only with --vf_model_path: add it"),
    (("metric_for_best_model",), lambda f: f.metric == "flicker" and f.num_frames == 1,
     "flicker is measured on clips: add --num_frames N (> 1), or pick another metric"),
    (("inception_weights",), lambda f: f.inception_weights and f.num_frames > 1, CLIPS_NO_RFID),
    (("input_size",), lambda f: f.input_size is not None and f.num_frames > 1, CLIPS_NO_INPUT_SIZE),
    # Flags that would do nothing with the other flags.
    (("vf_weight", "distmat_margin", "cos_margin", "adaptive_vf", "vf_input_convention"), lambda f: not f.vf_model_path,
     "it shapes the VF loss of --vf_model_path, which is not given: add it, or drop it"),
    (("distmat_margin", "cos_margin", "adaptive_vf"), lambda f: bool(f.vf_model_path) and f.vf_weight == 0,
     "--vf_weight 0 turns the VF loss off: drop it, or give --vf_weight > 0"),
    (DISCRIMINATOR_FLAGS, lambda f: f.disc_weight == 0,
     "with --disc_weight 0 the discriminator never trains: drop it, or set --disc_weight > 0"),
    (("disc_norm", "disc_num_layers"), lambda f: f.disc_type not in ("patch", "patchgan3d"),
     "the VGG16 and DINO discriminators (--disc_type vgg, dino) have no such setting: drop it"),
    (("disc_base_channels",), lambda f: f.disc_type == "dino",
     "the DINO discriminator's heads are as wide as its ViT's tokens: drop it"),
    (("disc_backbone_path",), lambda f: f.disc_type != "dino", "it is the ViT of --disc_type dino: add it, or drop it"),
    (("gen_loss",), lambda f: f.gen_loss == "relative_hinge" and f.disc_type == "dino",
     "the DINO discriminator augments and quantises the real images of its own step only, and relative_hinge scores "
     "real images in the VAE's: use hinge or vanilla with --disc_type dino"),
    (("disc_type",), lambda f: f.disc_type == "dino" and not f.disc_backbone_path,
     "the DINO discriminator needs its frozen ViT-S/8: add --disc_backbone_path (a dino_vits8 state dict, or a "
     "transformers ViTModel folder of facebook/dino-vits8)"),
    (("disc_update_start",),
     lambda f: f.disc_update_start is not None and f.disc_update_start not in range(f.disc_start + 1),
     "it starts the discriminator's training at or before its term enters the loss: 0 <= it <= --disc_start"),
    (("disc_weight_warmup_steps",), lambda f: f.disc_weight_warmup_steps < 0,
     "it is the number of steps the GAN weight takes to rise to --disc_weight: >= 0 (0: at once)"),
    (("adaptive_disc_weight_max",), lambda f: f.adaptive_disc_weight_max is not None and not (
        f.adaptive_disc_weight and f.adaptive_disc_weight_max > 0),
     "it bounds the adaptive GAN weight (--adaptive_disc_weight true): > 0, with that"),
    (("relative_hinge_margin",), lambda f: f.gen_loss != "relative_hinge",
     "it is the margin of --gen_loss relative_hinge: add that, or drop it"),
    (("lecam_decay",), lambda f: f.lecam_weight == 0,
     "it does nothing without --lecam_weight > 0: add that, or drop it"),
    (("gradnorm_scope",), lambda f: f.loss_balancing != "gradnorm",
     "it does nothing without --loss_balancing gradnorm: add that, or drop it"),
    (("adaptive_disc_weight", "adaptive_disc_weight_max", "logvar_init"), lambda f: f.loss_balancing == "gradnorm",
     "--loss_balancing gradnorm replaces the adaptive weight and the nll: drop it"),
    (("pixel_loss_mask_threshold",), lambda f: f.pixel_loss_mask == "none",
     "it does nothing without --pixel_loss_mask lowpass: add that, or drop it"),
    (("equivariance_min_scale", "equivariance_transforms"), lambda f: f.equivariance_prob == 0,
     "it shapes the transforms of --equivariance_prob, which is 0 (off): add --equivariance_prob 0.5, or drop it"),
    (("equivariance_min_scale",), lambda f: f.equivariance_prob > 0 and not f.uses_scale,
     "it is the range of the scale transform, which --equivariance_transforms leaves out: add scale, or drop it"),
    (("subfolder",), lambda f: not f.pretrained_model_name_or_path,
     "it is a folder inside --pretrained_model_name_or_path: add that, or drop it"),
    (("inception_weights",), lambda f: not f.evaluates, "rFID is measured in evaluations: add --eval_file_list and "
     "--eval_steps, or drop it (scripts/eval_vae.py --inception_weights measures a saved VAE)"),
    (("latent_stats_num_images",), lambda f: not f.measures_scale, "it counts the images of a measured scaling "
     "factor, and this run keeps or is given its factor: add --scaling_factor measure, or drop it"),
    (("eval_tiled", "eval_tile_size"), lambda f: not f.evaluates and not f.measures_scale,
     "it tiles evaluations and the measurement of the scaling factor, and this run has neither: add "
     "--eval_file_list and --eval_steps (or --scaling_factor measure), or drop it"),
    (("ema_decay",), lambda f: not f.use_ema, "it does nothing without --use_ema true: add that, or drop it"),
    (("num_logged_images",), lambda f: not (f.visualdl and (f.image_logging_steps > 0 or f.evaluates)),
     "no image grid is logged (it needs VisualDL logs, --report_to visualdl, and --image_logging_steps > 0 or "
     "evaluation): drop it"),
    (("image_logging_steps",), lambda f: f.image_logging_steps > 0 and not f.visualdl,
     "images are logged to VisualDL only: drop it or --report_to none"),
    (("logging_dir",), lambda f: not f.visualdl,
     "it is the VisualDL log folder, and --report_to none writes none: drop one of them"),
    (("fp16_opt_level",), lambda f: not (f.fp16 or f.bf16), "it does nothing without --fp16 or --bf16: add one, or "
                                                             "drop it"),
    (("scale_loss", "min_loss_scale", "max_consecutive_overflow_steps"), lambda f: not f.fp16,
     "only --fp16 scales the loss (bf16 needs no scaling): add --fp16, or drop it"),
    (("num_cycles",), lambda f: f.scheduler != "cosine", "only --lr_scheduler_type cosine reads it: drop it"),
    (("lr_end", "power"), lambda f: f.scheduler != "polynomial",
     "only --lr_scheduler_type polynomial reads it: drop it"),
    (("warmup_steps", "warmup_ratio"), lambda f: f.scheduler == "constant",
     "--lr_scheduler_type constant has no warm-up (constant_with_warmup has): drop it"),
    (("warmup_ratio",), lambda f: f.warmup_steps > 0, "--warmup_steps > 0 wins over it: drop one"),
    # Distillation (docs/distillation.md).
    (("teacher_subfolder", "cache_teacher_latents", "student_width", "student_depth", "latent_distill_weight",
      "latent_distill_loss"), lambda f: not f.distils,
     "it applies to distilling a tiny autoencoder: add --teacher_model_name_or_path, or drop it"),
    (("vae_config_file", "pretrained_model_name_or_path", "init_from_ckpt"),
     lambda f: f.distils and f.family_known and not f.student, f"a distilled student is a tiny autoencoder "
     f"(docs/distillation.md), and this gives a {FAMILY}: drop it (the student then follows the teacher's geometry)"),
    (("student_width", "student_depth"), lambda f: f.distils and (f.vae_config_file or f.loads_weights),
     "the student's architecture is that of --vae_config_file / its weights': drop it"),
    (("num_frames", "equivariance_prob", "vf_model_path", "input_size", "posterior_std", "learn_logvar"),
     lambda f: f.distils, "a tiny autoencoder is distilled on images against its teacher's latents: drop it"),
    (("scaling_factor",), lambda f: f.distils and f.scaling_factor != "keep",
     "a student lives in its teacher's normalised latent space: its scaling_factor is 1 (keep); drop it"),
    (("disc_replay_size",), lambda f: f.disc_replay_size < 0, "it is a number of reconstructions: >= 0 (0: off)"),
    (("disc_replay_size", "aspect_ratio_buckets"), lambda f: f.disc_replay_size > 0 and f.aspect_ratio_buckets,
     "the discriminator's replay (--disc_replay_size; the tiny recipe's: 50) holds one image shape, and buckets make "
     "several: give --disc_replay_size 0, or drop --aspect_ratio_buckets"),
    (("recipe",), lambda f: f.recipe == "tiny" and not f.distils,
     "it is the recipe of distilling a tiny autoencoder: add --teacher_model_name_or_path, or use ldm / balanced"),
    (("latent_distill_weight", "latent_distill_loss"), lambda f: f.distils and f.freeze_encoder,
     "it trains the student's encoder, which --freeze_encoder keeps as it is: drop one of them"),
    (("latent_distill_weight",), lambda f: f.latent_distill_weight < 0, "it is a weight: >= 0 (0: decoder only)"),
    (("student_width", "student_depth"), lambda f: min(f.student_width, f.student_depth) < 1, "it must be >= 1"),
)

# A flag given its value that does nothing is never refused as idle: ppdiffusers' commands pass e.g.
# `--lr_scheduler_type constant --warmup_steps 0`. Any other value of these flags stays refused where idle.
INERT_VALUES: Dict[str, Any] = {"warmup_steps": 0, "warmup_ratio": 0.0, "lecam_weight": 0.0, "image_logging_steps": 0,
                                "subfolder": "", "eval_tiled": False, "vf_weight": 0.0, "disc_weight_warmup_steps": 0,
                                "disc_replay_size": 0, "latent_distill_weight": 0.0}


def _shown(value: Any) -> str:
    """A flag's value as typed after it."""
    value = getattr(value, "value", value)  # an Enum
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def refuse(flags: Any, given: Set[str], header: str = "", otherwise: Optional[str] = None) -> None:
    """Raise one ValueError naming each flag in `given` that a row of `REFUSALS` refuses with the values of
    `flags`; `otherwise`: the reason for a given flag no row names."""
    family, frames, lines = getattr(flags, "family", None), getattr(flags, "video", 0) or 4, []
    for names, when, why in REFUSALS:
        why = why.replace(FAMILY, family.class_name if family else "this autoencoder").replace(FRAMES, str(frames))
        why = why.replace(FRAME_COUNTS, ", ".join(str(1 + frames * n) for n in range(1, 5)))
        for name in names:
            if name not in given or (name in INERT_VALUES and getattr(flags, name) == INERT_VALUES[name]):
                continue
            if when(flags):
                lines.append(f"--{name} {_shown(getattr(flags, name))}: {why}")
    if otherwise:
        named = {name for names, _, _ in REFUSALS for name in names}
        lines += [f"--{name} {_shown(getattr(flags, name))}: {otherwise}" for name in sorted(given - named)]
    if lines:
        raise ValueError("\n  ".join([header + ":"] + lines if header else lines))
