"""The shared flags: typed choices, --help groups, refused PaddleNLP flags, the reference scripts' aliases,
and a sample of the allowed PaddleNLP flags having the same effect in both entry points (run for real)."""

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np
import pytest
from conftest import DRIVERS, REPO, read_scalars, run_each_driver, run_entry_point, tiny_args, vae_weights
from paddlenlp.trainer import TrainingArguments
from paddlenlp.trainer.trainer_utils import SchedulerType

from vae_trainer import argument_parser
from vae_trainer.argument_parser import GROUPS, VAEArgumentParser, parse_arguments
from vae_trainer.arguments import (ALIASES, ALL_ARGUMENT_CLASSES, PADDLENLP_FLAGS, DataArguments,
                                   LossArguments, ModelArguments, VAETrainingArguments)
from vae_trainer.objectives.gan import DISCRIMINATOR_FLAGS

PADDLENLP_GROUP = GROUPS["paddlenlp"]
BASE = ["--file_list", "x.filelist", "--vae_config_file", "configs/vae_micro.json", "--max_steps", "2",
        "--output_dir", "/tmp/vae_trainer_args"]


# ---------------------------------------------------------------- --help
def help_sections(parser) -> dict:
    """{group title: [flags listed under it]} in the order --help shows them."""
    sections, current = {}, None
    for line in parser.format_help().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = []
        elif current and line.startswith("  --"):
            sections[current] += re.findall(r"--\w+", line.split("  ")[1])
    return sections


def test_help_lists_our_groups_in_order_before_paddlenlp_and_hides_refused_flags():
    sections = help_sections(VAEArgumentParser())
    titles = [t for t in sections if t not in ("options", "optional arguments")]
    assert titles == list(GROUPS.values()) and titles[-1] == PADDLENLP_GROUP
    where = {flag: title for title, flags in sections.items() for flag in flags}
    expected = {
        "--file_list": "data", "--resolution": "data", "--vae_config_file": "model", "--posterior_std": "model",
        "--kl_weight": "loss", "--lpips_weights": "loss", "--disc_norm": "discriminator", "--disc_start": "discriminator",
        "--lecam_weight": "discriminator", "--disc_learning_rate": "discriminator", "--eval_file_list": "evaluation",
        "--eval_steps": "evaluation", "--metric_for_best_model": "evaluation", "--use_ema": "training",
        "--image_logging_steps": "training", "--freeze_encoder": "model", "--init_from_ckpt": "model",
        "--discriminator_path": "discriminator", "--scale_lr": "training",
    }
    for flag, group in expected.items():
        assert where[flag] == GROUPS[group], flag
    # Every field of ours is listed once, in one of our groups; every allowed PaddleNLP flag in PaddleNLP's group.
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    for cls in (ModelArguments, DataArguments, LossArguments, VAETrainingArguments):
        for f in dataclasses.fields(cls):
            if f.name in inherited:
                continue
            assert where[f"--{f.name}"] in titles[:-1], f.name
    for name in PADDLENLP_FLAGS - {"eval_steps", "metric_for_best_model"}:
        assert where[f"--{name}"] == PADDLENLP_GROUP, name
    # Refused flags are not advertised; choices and aliases are.
    for refused in ("--optim", "--num_train_epochs", "--save_strategy", "--logging_strategy", "--to_static",
                    "--amp_master_grad", "--greater_is_better", "--sharding"):
        assert refused not in where, refused
    text = VAEArgumentParser().format_help()
    assert "--pixel_loss {l1,l2}" in text and "--disc_norm {batch,group,spectral_group,none}" in text
    assert "--lr_scheduler_type {linear,cosine,constant,constant_with_warmup,polynomial}" in text
    assert "--max_steps MAX_STEPS, --max_train_steps MAX_STEPS" in text
    # The refusal "with --disc_weight 0 the discriminator never trains" names every flag of that group.
    discriminator = {f.name for cls in ALL_ARGUMENT_CLASSES for f in dataclasses.fields(cls)
                     if f.metadata.get("group", getattr(cls, "_group", None)) == "discriminator"}
    assert set(DISCRIMINATOR_FLAGS) == discriminator - {"disc_weight"}


def test_a_field_added_to_a_dataclass_lands_in_its_group():
    @dataclass
    class MoreModelArguments(ModelArguments):
        new_model_flag: bool = field(default=False, metadata={"help": "A flag added later."})

    @dataclass
    class MoreDataArguments(DataArguments):
        eval_extra: int = field(default=0, metadata={"help": "x", "group": "evaluation"})

    parser = VAEArgumentParser((MoreModelArguments, MoreDataArguments, LossArguments, VAETrainingArguments))
    sections = help_sections(parser)
    assert "--new_model_flag" in sections[GROUPS["model"]]
    assert "--eval_extra" in sections[GROUPS["evaluation"]]


# ---------------------------------------------------------------- typed choices
@pytest.mark.parametrize("flag,value", [
    ("--pixel_loss", "l3"), ("--disc_loss", "wasserstein"), ("--disc_norm", "layer"), ("--recipe", "magic"),
    ("--gen_loss", "soft"), ("--lr_scheduler_type", "cosine_with_restarts"), ("--lr_scheduler", "piecewise_constant"),
    ("--report_to", "wandb"), ("--report_to", "tensorboard"), ("--metric_for_best_model", "fid"),
    ("--fp16_opt_level", "O3"), ("--loss_balancing", "softadapt"),
])
def test_bad_choices_fail_at_parse_time_naming_the_choices(flag, value, capsys):
    with pytest.raises(SystemExit):
        parse_arguments(BASE + [flag, value])
    err = capsys.readouterr().err
    assert "invalid choice" in err and value in err


def test_choices_hold_in_code_too():
    arguments = (ModelArguments(vae_config_file="c.json"), DataArguments(file_list="x"), LossArguments(pixel_loss="l3"),
                 VAETrainingArguments(output_dir="/tmp/x", max_steps=1))
    with pytest.raises(ValueError, match="--pixel_loss"):
        argument_parser.validate(arguments, given=set())


# ---------------------------------------------------------------- refused PaddleNLP flags
@pytest.mark.parametrize("extra,reason", [
    (["--num_train_epochs", "3"], "--max_steps"),
    (["--save_strategy", "epoch"], "--save_steps"),
    (["--logging_strategy", "no"], "--logging_steps"),
    (["--optim", "adafactor"], "AdamW"),
    (["--greater_is_better", "false"], "--metric_for_best_model decides"),
    (["--to_static", "true"], "dynamic-graph"),
    (["--amp_master_grad", "true"], "master weights"),
    (["--tensor_parallel_degree", "2"], "only data parallelism"),
    (["--do_eval", "true"], "--eval_steps"),
    (["--logging_first_step", "true"], "--logging_steps"),
    (["--no_cuda", "true"], "--device cpu"),
    (["--max_evaluate_steps", "3"], "--eval_steps"),
    (["--save_on_each_node", "true"], "not honoured"),
])
def test_refused_paddlenlp_flags_name_the_flag_and_the_alternative(extra, reason):
    with pytest.raises(ValueError, match="refused PaddleNLP") as refused:
        parse_arguments(BASE + extra)
    assert extra[0] in str(refused.value) and reason in str(refused.value)


def _non_default(f: dataclasses.Field):
    """A value of the field's type that differs from PaddleNLP's default."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(default, bool) or "bool" in str(f.type):
        return not default
    if hasattr(f.type, "__members__"):  # an Enum: another member
        return next(m.value for m in f.type if m.value != default)
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default + 3
    if "List" in str(f.type):
        return ["x"]
    if "int" in str(f.type):
        return 3
    return "x"


def test_every_inherited_flag_outside_the_allow_list_is_refused_even_from_code():
    refused = 0
    for f in dataclasses.fields(TrainingArguments):
        if not f.init or f.name in PADDLENLP_FLAGS:  # (--do_train among them: accepted, ignored)
            continue
        with pytest.raises(ValueError, match=f"--{f.name} "):
            VAETrainingArguments(output_dir="/tmp/vae_trainer_args", max_steps=1, **{f.name: _non_default(f)})
        refused += 1
    assert refused > 50  # the ~90 inherited flags minus the allow-list


def test_refused_flags_in_a_json_args_file(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"file_list": "x", "vae_config_file": "c.json", "max_steps": 1,
                                  "output_dir": str(tmp_path), "num_train_epochs": 2}))
    with pytest.raises(ValueError, match="--num_train_epochs"):
        parse_arguments([str(config)])


@pytest.mark.parametrize("extra,message", [
    (["--ignore_keys", "decoder."], "--ignore_keys decoder.: .*--pretrained_model_name_or_path or --init_from_ckpt"),
    (["--pretrained_model_name_or_path", "/vae", "--input_size", "16"], "--input_size 16: .*two positive numbers"),
    (["--scaling_factor", "big"], "--scaling_factor must be"),
    (["--overwrite_output_dir", "--resume_from_checkpoint", "latest"], "give one of them"),
])
def test_contradictory_flags_fail_early(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_arguments(BASE + extra)


def test_max_steps_is_required():
    with pytest.raises(ValueError, match="--max_steps"):
        parse_arguments(BASE[:4] + ["--output_dir", "/tmp/vae_trainer_args"])


def test_fine_tuning_flags_parse_with_the_reference_trainers_spelling():
    model_args, data_args, _, training_args = parse_arguments(
        BASE[:2] + ["--pretrained_model_name_or_path", "/sd/vae", "--vae_config_file", "configs/vae_micro.json",
                    "--ignore_keys", "decoder.", "post_quant_conv.", "--input_size", "16", "16", "--freeze_encoder",
                    "--scale_lr", "--init_from_ckpt", "/run/checkpoint-10", "--discriminator_path", "/run/discriminator",
                    "--latent_stats_num_images", "256", "--scaling_factor", "measure", "--resolution", "16"] + BASE[4:])
    assert model_args.ignore_keys == ["decoder.", "post_quant_conv."] and model_args.input_size == [16, 16]
    assert model_args.freeze_encoder and training_args.scale_lr and data_args.latent_stats_num_images == 256
    assert (model_args.init_from_ckpt, model_args.discriminator_path) == ("/run/checkpoint-10", "/run/discriminator")


# ---------------------------------------------------------------- the reference scripts' spellings
def test_reference_aliases_set_our_flags_from_the_command_line_and_json(tmp_path):
    given = {"train_batch_size": 3, "max_train_steps": 7, "adam_weight_decay": 0.05, "lr_scheduler": "cosine",
             "lr_warmup_steps": 2, "num_workers": 1}
    _, _, _, args = parse_arguments(BASE + [item for k, v in given.items() for item in (f"--{k}", str(v))])
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"file_list": "x", "vae_config_file": "c.json", "output_dir": str(tmp_path),
                                  "batch_size": 3, **{k: v for k, v in given.items() if k != "train_batch_size"}}))
    _, _, _, from_json = parse_arguments([str(config)])
    for parsed in (args, from_json):
        assert (parsed.per_device_train_batch_size, parsed.max_steps, parsed.weight_decay, parsed.lr_scheduler_type,
                parsed.warmup_steps, parsed.dataloader_num_workers) == (3, 7, 0.05, SchedulerType.COSINE, 2, 1)
    assert {alias for names in ALIASES.values() for alias in names} == {
        "train_batch_size", "batch_size", "max_train_steps", "adam_weight_decay", "lr_scheduler", "lr_warmup_steps",
        "num_workers", "gradient_checkpointing"}


def test_gradient_checkpointing_is_recompute(tmp_path):
    """diffusers' --gradient_checkpointing is accepted as --recompute (command line and JSON)."""
    assert parse_arguments(BASE + ["--gradient_checkpointing"])[3].recompute is True
    assert parse_arguments(BASE + ["--gradient_checkpointing", "false"])[3].recompute is False
    assert parse_arguments(BASE)[3].recompute is False
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"file_list": "x", "vae_config_file": "c.json", "output_dir": str(tmp_path),
                                  "max_steps": 2, "gradient_checkpointing": True}))
    assert parse_arguments([str(config)])[3].recompute is True


def test_lr_scheduler_names_mean_what_they_mean_in_ppdiffusers():
    """--lr_scheduler NAME gives the LR sequence of ppdiffusers.optimization.get_scheduler(NAME)."""
    from ppdiffusers.optimization import get_scheduler

    from vae_trainer.optim import build_scheduler

    for name in (s.value for s in SchedulerType):
        warm_up = [] if name == "constant" else ["--lr_warmup_steps", "3"]  # constant has none (refused with it)
        _, _, _, args = parse_arguments(BASE + ["--lr_scheduler", name, *warm_up, "--max_train_steps", "10"])
        ours = build_scheduler(args, 1.0, args.max_steps)
        reference = get_scheduler(name, learning_rate=1.0, num_warmup_steps=3, num_training_steps=10)
        sequence = []
        for _ in range(12):
            sequence.append((ours.get_lr(), reference.get_lr()))
            ours.step(), reference.step()
        np.testing.assert_allclose(*zip(*sequence), rtol=1e-12, err_msg=name)
        assert len({round(a, 9) for a, _ in sequence}) > 1 or name == "constant"  # the schedule does something


def test_a_logging_dir_that_holds_the_output_dir_is_refused():
    """--overwrite_output_dir deletes the log folder: it must never be the run's folder or hold it."""
    for logging_dir in (".", "/tmp", "/tmp/vae_trainer_args"):
        with pytest.raises(ValueError, match="is --output_dir or a folder that contains it"):
            parse_arguments(BASE + ["--logging_dir", logging_dir])


def test_logging_dir_is_relative_to_output_dir_as_in_ppdiffusers():
    _, _, _, args = parse_arguments(BASE + ["--logging_dir", "runs"])
    assert args.logging_dir == os.path.join("/tmp/vae_trainer_args", "runs")
    _, _, _, args = parse_arguments(BASE + ["--logging_dir", "/abs/logs"])
    assert args.logging_dir == "/abs/logs"
    _, _, _, args = parse_arguments(BASE)
    assert args.logging_dir == os.path.join("/tmp/vae_trainer_args", "logs")


# ---------------------------------------------------------------- the same effect in both drivers
STEPS = 3


def reference_style_args(file_list, output_dir):
    """A reference-script command: aliases plus a sample of the allowed PaddleNLP flags (not their defaults)."""
    flags = tiny_args(file_list, output_dir, perceptual_weight=0, use_ema="false", image_logging_steps=0,
                      save_steps=1, save_total_limit=1, logging_steps=1, logging_dir="runlogs", max_grad_norm=0.05,
                      gradient_accumulation_steps=2, adam_epsilon=1e-6)
    renamed = {"--max_steps": "--max_train_steps", "--per_device_train_batch_size": "--train_batch_size",
               "--dataloader_num_workers": "--num_workers"}
    flags = [renamed.get(item, item) for item in flags]
    flags[flags.index("--max_train_steps") + 1] = STEPS
    return flags + ["--lr_scheduler", "linear", "--lr_warmup_steps", "1", "--adam_weight_decay", "0.1"]


@pytest.fixture(scope="module")
def reference_style_runs(photo_filelist, tmp_path_factory):
    return run_each_driver(tmp_path_factory, lambda output_dir: reference_style_args(photo_filelist, output_dir))


@pytest.mark.parametrize("driver", DRIVERS)
def test_allowed_flags_and_aliases_take_effect(reference_style_runs, driver):
    output_dir = reference_style_runs[driver]
    logs = os.path.join(output_dir, "runlogs")  # --logging_dir, relative to --output_dir
    assert not os.path.exists(os.path.join(output_dir, "logs"))
    learning_rate = read_scalars(logs, "train/learning_rate")
    # --lr_scheduler linear --lr_warmup_steps 1 over --max_train_steps 3: 0, then peak, then half the peak.
    assert sorted(learning_rate) == [1, 2, 3]  # --logging_steps 1
    np.testing.assert_allclose([learning_rate[s] for s in (1, 2, 3)], [0.0, 1e-3, 5e-4], rtol=1e-6)
    # --save_steps 1 --save_total_limit 1: only the newest checkpoint remains.
    assert sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint")) == [f"checkpoint-{STEPS}"]
    with open(os.path.join(output_dir, f"checkpoint-{STEPS}", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == STEPS


def test_both_drivers_honour_the_flags_identically(reference_style_runs):
    """Same losses and bit-identical weights: weight decay, clipping, accumulation and the schedule act alike."""
    trainer, loop = (reference_style_runs[d] for d in DRIVERS)
    for tag in ("loss/total", "loss/discriminator"):
        a, b = (read_scalars(os.path.join(run, "runlogs"), tag) for run in (trainer, loop))
        assert a and a == b, tag
    wa, wb = vae_weights(trainer), vae_weights(loop)
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


def test_the_sampled_flags_that_act_through_the_weights_reach_the_optimizers_and_the_step(photo_filelist, tmp_path):
    """Two drivers that both ignored a flag would still agree with each other: --max_grad_norm,
    --gradient_accumulation_steps, --adam_epsilon and --adam_weight_decay must be in the objects of
    build_optimization, which both drivers train with (and reproduce each other bit for bit with, above)."""
    import paddle

    from vae_trainer.build import build_networks, build_optimization

    paddle.set_device("cpu")
    model_args, _, loss_args, args = parse_arguments([str(a) for a in reference_style_args(photo_filelist, tmp_path)])
    optimization = build_optimization(build_networks(model_args, loss_args, args), loss_args, args)
    assert (optimization.args.max_grad_norm, optimization.args.gradient_accumulation_steps) == (0.05, 2)
    for optimizer in (optimization.networks[0].optimizer, optimization.networks[1].optimizer):
        assert (optimizer._epsilon, optimizer._weight_decay) == (1e-6, 0.1)
    defaults = VAETrainingArguments(output_dir=str(tmp_path), max_steps=1)  # so the flags, not these, were read
    assert all(default != given for default, given in zip((defaults.max_grad_norm, defaults.gradient_accumulation_steps,
                                                           defaults.adam_epsilon, defaults.weight_decay),
                                                          (0.05, 2, 1e-6, 0.1)))


# ---------------------------------------------------------------- checked before anything is built
def vae_config(tmp_path, down_blocks: int, name="vae.json") -> str:
    """A VAE config whose encoder downsamples by 2 ** (down_blocks - 1) (nothing is built from it here)."""
    config = json.load(open(os.path.join(REPO, "configs", "vae_micro.json")))
    config.update(down_block_types=["DownEncoderBlock2D"] * down_blocks, up_block_types=["UpDecoderBlock2D"] * down_blocks,
                  block_out_channels=[8] * down_blocks)
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def with_vae(config: str, *extra: str) -> list:
    return ["--file_list", "x.filelist", "--vae_config_file", config, "--max_steps", "2",
            "--output_dir", "/tmp/vae_trainer_args", *extra]


@pytest.mark.parametrize("extra,message", [
    (["--resolution", "100"], "--resolution 100 must be a multiple of the VAE's downsampling factor 8"),
    (["--resolution", "260"], "--resolution 260 must be a multiple of the VAE's downsampling factor 8"),
    (["--resolution", "256", "--input_size", "100", "100"], "--input_size 100 100 must be a multiple of the VAE's "
                                                            "downsampling factor 8"),
    (["--resolution", "100", "--aspect_ratio_buckets"], "--aspect_ratio_buckets true: it needs a --resolution that "
                                                        "is a multiple of 8"),
    (["--input_size", "128", "128", "--aspect_ratio_buckets"], "--aspect_ratio_buckets true: it cannot be combined "
                                                               "with --input_size"),
])
def test_sizes_the_vae_cannot_take_are_refused_when_parsing_with_the_numbers(extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_arguments(with_vae("configs/sd_vae.json", *extra))
    parse_arguments(with_vae("configs/sd_vae.json", "--resolution", "264"))  # a multiple of 8 is fine


def test_the_downsampling_factor_is_read_from_the_vaes_own_config(tmp_path):
    """f16 (5 down blocks): 264 = 8 * 33 is refused; from a pretrained folder's config.json, before any loading."""
    f16 = vae_config(tmp_path, 5)
    with pytest.raises(ValueError, match="--resolution 264 must be a multiple of the VAE's downsampling factor 16"):
        parse_arguments(with_vae(f16, "--resolution", "264"))
    folder = tmp_path / "pretrained"
    folder.mkdir()
    os.rename(f16, folder / "config.json")
    argv = ["--file_list", "x.filelist", "--pretrained_model_name_or_path", str(folder), "--max_steps", "2",
            "--output_dir", "/tmp/vae_trainer_args", "--resolution"]
    with pytest.raises(ValueError, match="factor 16 .*pretrained/config.json"):
        parse_arguments(argv + ["264"])
    parse_arguments(argv + ["272"])


def test_bucket_shapes_must_fit_the_downsampling_factor(tmp_path):
    """At --resolution 176 the buckets step by 8 px (e.g. 168x184): an f16 VAE cannot take them; 192 fits."""
    f16 = vae_config(tmp_path, 5)
    with pytest.raises(ValueError, match=r"buckets such as \d+x\d+, whose sides are not multiples of the VAE's "
                                         r"downsampling factor 16 .*use e.g. --resolution \d+") as refused:
        parse_arguments(with_vae(f16, "--resolution", "176", "--aspect_ratio_buckets"))
    from vae_trainer.data.buckets import bucket_shapes

    suggested = int(re.search(r"use e.g. --resolution (\d+)", str(refused.value)).group(1))
    assert all(w % 16 == 0 and h % 16 == 0 for w, h in bucket_shapes(suggested))
    parse_arguments(with_vae(f16, "--resolution", str(suggested), "--aspect_ratio_buckets"))
    parse_arguments(with_vae("configs/sd_vae.json", "--resolution", "176", "--aspect_ratio_buckets"))  # f8: fine


EVAL = ["--eval_file_list", "held_out", "--eval_steps", "2"]


def refusal_line(argv, flag: str) -> str:
    """The line(s) of parse_arguments(argv)'s refusal that name `flag` (as `--flag VALUE: why`)."""
    with pytest.raises(ValueError) as refused:
        parse_arguments(argv)
    lines = [line.strip() for line in str(refused.value).splitlines()]
    lines = [line for line in lines if re.match(re.escape(flag) + "[ :]", line)]
    assert lines, str(refused.value)
    return " ".join(lines)


@pytest.mark.parametrize("extra,flag,words", [
    (["--eval_file_list", "held_out"], "--eval_file_list", ("never evaluated", "--eval_steps")),
    (["--eval_steps", "2"], "--eval_steps", ("--eval_file_list",)),
    (["--eval_steps", "0", "--eval_file_list", "held_out"], "--eval_steps 0", (">= 1",)),
    (["--metric_for_best_model", "psnr"], "--metric_for_best_model psnr", ("--eval_file_list", "--eval_steps")),
    ([*EVAL, "--metric_for_best_model", "rfid"], "--metric_for_best_model rfid", ("--inception_weights",)),
    (["--inception_weights", "w.pdparams"], "--inception_weights", ("rFID", "--eval_file_list", "--eval_steps")),
    (["--ema_decay", "0.99"], "--ema_decay 0.99", ("--use_ema",)),
    (["--disc_weight", "0", "--disc_start", "10"], "--disc_start 10", ("--disc_weight 0", "never trains")),
    (["--disc_weight", "0", "--disc_learning_rate", "1e-3"], "--disc_learning_rate", ("--disc_weight 0",)),
    (["--disc_weight", "0", "--discriminator_path", "d"], "--discriminator_path", ("--disc_weight 0",)),
    (["--disc_weight", "0", "--disc_weight_warmup_steps", "100"], "--disc_weight_warmup_steps 100",
     ("--disc_weight 0",)),
    (["--disc_weight_warmup_steps", "-1"], "--disc_weight_warmup_steps -1", (">= 0", "0: at once")),
    (["--disc_type", "vgg", "--disc_norm", "group"], "--disc_norm group", ("VGG16", "--disc_type vgg")),
    (["--relative_hinge_margin", "0.2"], "--relative_hinge_margin", ("--gen_loss relative_hinge",)),
    (["--lecam_decay", "0.9"], "--lecam_decay", ("--lecam_weight",)),
    (["--gradnorm_scope", "global"], "--gradnorm_scope", ("--loss_balancing gradnorm",)),
    (["--loss_balancing", "gradnorm", "--no_adaptive_disc_weight"], "--adaptive_disc_weight false",
     ("--loss_balancing gradnorm", "replaces")),
    (["--pixel_loss_mask_threshold", "0.3"], "--pixel_loss_mask_threshold", ("--pixel_loss_mask lowpass",)),
    (["--subfolder", "vae"], "--subfolder vae", ("--pretrained_model_name_or_path",)),
    (["--latent_stats_num_images", "8", "--scaling_factor", "0.2"], "--latent_stats_num_images 8",
     ("measured scaling factor", "--scaling_factor measure")),
    (["--num_logged_images", "8", "--image_logging_steps", "0"], "--num_logged_images", ("no image grid",)),
    (["--report_to", "none", "--image_logging_steps", "10"], "--image_logging_steps 10", ("VisualDL",)),
    (["--report_to", "none", "--logging_dir", "runs"], "--logging_dir", ("VisualDL", "--report_to none")),
    (["--fp16_opt_level", "O2"], "--fp16_opt_level O2", ("--fp16", "--bf16")),
    (["--min_loss_scale", "4"], "--min_loss_scale", ("--fp16",)),
    (["--scale_loss", "1024"], "--scale_loss", ("--fp16",)),
    (["--num_cycles", "2"], "--num_cycles", ("--lr_scheduler_type cosine",)),
    (["--lr_scheduler_type", "cosine", "--power", "2"], "--power", ("--lr_scheduler_type polynomial",)),
    (["--lr_scheduler_type", "constant", "--warmup_steps", "5"], "--warmup_steps 5",
     ("--lr_scheduler_type constant", "warm-up")),
    (["--warmup_steps", "5", "--warmup_ratio", "0.1"], "--warmup_ratio 0.1", ("--warmup_steps",)),
    (["--eval_tiled", "true", "--scaling_factor", "0.2"], "--eval_tiled true", ("evaluations", "scaling factor")),
])
def test_flags_that_would_do_nothing_are_refused_naming_what_to_add_or_drop(extra, flag, words):
    line = refusal_line(BASE + extra, flag)
    assert all(word in line for word in words), line


@pytest.mark.parametrize("extra", [
    [*EVAL, "--inception_weights", "w.pdparams", "--metric_for_best_model", "rfid", "--num_logged_images", "8",
     "--image_logging_steps", "0"],
    ["--use_ema", "true", "--ema_decay", "0.99", "--disc_start", "10", "--disc_type", "vgg", "--lecam_weight", "0.1",
     "--lecam_decay", "0.9", "--gen_loss", "relative_hinge", "--relative_hinge_margin", "0.2"],
    ["--loss_balancing", "gradnorm", "--gradnorm_scope", "global", "--pixel_loss_mask", "lowpass",
     "--pixel_loss_mask_threshold", "0.3", "--lr_scheduler_type", "cosine", "--num_cycles", "2"],
    ["--lr_scheduler_type", "polynomial", "--power", "2", "--lr_end", "1e-6", "--warmup_ratio", "0.1",
     "--report_to", "none", "--image_logging_steps", "0"],
    ["--fp16", "--fp16_opt_level", "O2", "--scale_loss", "1024", "--min_loss_scale", "4", "--device", "gpu:1"],
    ["--recipe", "balanced", "--loss_balancing", "none"],  # the recipe's --gradnorm_scope is not given by the user
    ["--latent_stats_num_images", "8"],  # from scratch: the factor is measured
    ["--eval_tiled", "true", "--eval_tile_size", "32"],  # from scratch: the measured factor is tiled
    [*EVAL, "--eval_tiled", "true", "--scaling_factor", "0.2"],
])
def test_the_same_flags_with_what_they_need_parse(extra):
    parse_arguments(BASE + extra)


@pytest.mark.parametrize("device", ["cuda", "gpu:x", "gpu1", "cpu:0", "GPU"])
def test_a_bad_device_fails_at_parse_time(device, capsys):
    with pytest.raises(SystemExit):
        parse_arguments(BASE + ["--device", device])
    assert f"argument --device: invalid choice: '{device}' (choose from cpu, gpu, gpu:N)" in capsys.readouterr().err


def test_device_choices_and_one_gpu_per_launched_process(monkeypatch):
    for device in ("cpu", "gpu", "gpu:0", "gpu:3"):
        assert parse_arguments(BASE + ["--device", device])[3].device == device
    assert "--device {cpu,gpu,gpu:N}" in VAEArgumentParser().format_help()
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    with pytest.raises(ValueError, match="--device gpu:1 would put every process on that one GPU"):
        parse_arguments(BASE + ["--device", "gpu:1"])
    with pytest.raises(ValueError, match="--device: invalid choice"):  # from code or a JSON file, too
        VAETrainingArguments(output_dir="/tmp/vae_trainer_args", max_steps=1, device="tpu")


@pytest.mark.parametrize("driver", DRIVERS)
def test_each_entry_point_refuses_sizes_idle_and_paddlenlp_flags_and_devices_before_building(driver, tmp_path, capsys):
    """In both entry points, as an `error:` message (exit status 1, no traceback; or argparse's usage error), before
    the VAE is built."""
    from conftest import run_in_process

    for extra, words in ((["--resolution", "100"], ("--resolution 100", "downsampling factor 8")),
                         (["--ema_decay", "0.99"], ("--ema_decay 0.99", "--use_ema")),
                         (["--optim", "sgd"], ("PaddleNLP", "--optim sgd", "AdamW"))):
        with pytest.raises(SystemExit) as stopped:
            run_in_process(driver, with_vae("configs/sd_vae.json", "--device", "cpu", *extra))
        message = str(stopped.value.code)
        assert message.startswith("error: ") and all(word in message for word in words), message
    with pytest.raises(SystemExit) as stopped:
        run_in_process(driver, with_vae("configs/sd_vae.json", "--device", "cuda"))
    assert stopped.value.code == 2 and "invalid choice: 'cuda'" in capsys.readouterr().err
    assert not os.path.exists("/tmp/vae_trainer_args/vae")


# ---------------------------------------------------------------- issue 17.8: ppdiffusers users' command lines
# The TrainingArguments part of ppdiffusers' examples/text_to_image_laion400m README command (1.3.2, the
# Trainer; as written there, quotes removed by the shell).
LAION400M_TRAINING_ARGUMENTS = [
    "--do_train", "--output_dir", "./laion400m_pretrain_output_trainer", "--per_device_train_batch_size", "16",
    "--gradient_accumulation_steps", "2", "--learning_rate", "5e-5", "--weight_decay", "0.02",
    "--max_steps", "1000000000", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
    "--image_logging_steps", "1000", "--logging_steps", "50", "--save_steps", "5000", "--save_total_limit", "50",
    "--seed", "23", "--dataloader_num_workers", "6", "--max_grad_norm", "-1",
]


def _with(flags, **values):
    """`flags` with some values replaced (--name value pairs)."""
    flags = list(flags)
    for name, value in values.items():
        flags[flags.index(f"--{name}") + 1] = str(value)
    return flags


def test_the_ppdiffusers_laion400m_training_arguments_parse_in_each_entry_point():
    """Before: "--do_train: both entry points always train; drop it" and "--warmup_steps: --lr_scheduler_type
    constant has no warm-up"."""
    from vae_trainer import loop

    assert loop.parse_arguments is parse_arguments  # both entry points parse in loop.main
    _, _, _, training_args = parse_arguments(["--file_list", "x.filelist", "--vae_config_file", "configs/vae_micro.json",
                                    *LAION400M_TRAINING_ARGUMENTS])
    assert (training_args.warmup_steps, training_args.max_grad_norm, training_args.gradient_accumulation_steps,
            training_args.per_device_train_batch_size, training_args.seed) == (0, -1, 2, 16, 23)
    assert training_args.do_train  # accepted, and ignored: both always train
    assert "--do_train" in VAEArgumentParser().format_help()  # listed, with why it is ignored


@pytest.mark.parametrize("extra", [
    ["--lr_scheduler_type", "constant", "--warmup_steps", "0"],        # ppdiffusers' commands
    ["--lr_scheduler_type", "constant", "--warmup_ratio", "0"],
    ["--warmup_steps", "5", "--warmup_ratio", "0.0"],
    ["--disc_weight", "0", "--lecam_weight", "0"],                     # no LeCAM term, no discriminator
    ["--disc_weight", "0", "--disc_weight_warmup_steps", "0"],         # no ramp, no discriminator
    ["--report_to", "none", "--image_logging_steps", "0"],             # no image grid, no VisualDL
    ["--eval_tiled", "false", "--scaling_factor", "0.2"],              # no tiling, nothing to tile
])
def test_a_flag_given_its_value_that_does_nothing_is_never_refused(extra):
    parse_arguments(BASE + extra)


@pytest.mark.parametrize("extra,flag,words", [
    (["--lr_scheduler_type", "constant", "--warmup_steps", "500"], "--warmup_steps 500", ("constant", "warm-up")),
    (["--lr_scheduler_type", "constant", "--warmup_ratio", "0.1"], "--warmup_ratio 0.1", ("constant", "warm-up")),
    (["--disc_weight", "0", "--lecam_weight", "0.1"], "--lecam_weight 0.1", ("--disc_weight 0",)),
])
def test_other_values_of_those_flags_stay_refused_where_they_would_be_ignored(extra, flag, words):
    line = refusal_line(BASE + extra, flag)
    assert all(word in line for word in words), line


def test_a_short_run_with_the_ppdiffusers_training_arguments(photo_filelist, tmp_path):
    """The laion400m TrainingArguments, as written but for the run's length and size (2 steps, batch 1, no
    loader workers), train the micro VAE at 32 px on CPU."""
    flags = _with(LAION400M_TRAINING_ARGUMENTS, output_dir=tmp_path / "out", per_device_train_batch_size=1,
                  max_steps=2, dataloader_num_workers=0)
    run_entry_point("train_vae_no_trainer.py", ["--file_list", photo_filelist, "--vae_config_file",
                                                "configs/vae_micro.json", "--resolution", "32", "--device", "cpu",
                                                "--disc_base_channels", "8", *flags])
    assert os.path.isfile(tmp_path / "out" / "vae" / "config.json")
