"""The shared flags: both entry points parse the same set, and contradictory flags fail before any work."""

import subprocess
import sys

import pytest
from conftest import REPO

from vae_trainer.arguments import parse_arguments

BASE = ["--file_list", "x.filelist", "--vae_config_file", "configs/vae_micro.json", "--max_steps", "2",
        "--output_dir", "/tmp/vae_trainer_args"]


def flags_of(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True).stdout
    return {word for word in out.split() if word.startswith("--")}


def test_both_entry_points_accept_the_same_flags():
    trainer, loop = flags_of("train_vae_trainer.py"), flags_of("train_vae_no_trainer.py")
    assert trainer == loop
    for flag in ("--output_dir", "--per_device_train_batch_size", "--gradient_accumulation_steps", "--learning_rate",
                 "--max_steps", "--logging_steps", "--save_steps", "--save_total_limit", "--seed",
                 "--dataloader_num_workers", "--device", "--report_to", "--file_list", "--resolution",
                 "--vae_config_file", "--pretrained_model_name_or_path", "--disc_start", "--kl_weight",
                 "--disc_weight", "--perceptual_weight", "--disc_loss", "--use_ema", "--eval_file_list",
                 "--freeze_encoder", "--ignore_keys", "--input_size", "--init_from_ckpt", "--scale_lr",
                 "--discriminator_path", "--scaling_factor", "--latent_stats_num_images"):
        assert flag in trainer, flag


@pytest.mark.parametrize("extra,message", [
    (["--tensor_parallel_degree", "2"], "only data parallelism"),
    (["--do_eval", "true"], "evaluation is ours"),
    (["--disc_loss", "wasserstein"], "--disc_loss"),
    (["--ignore_keys", "decoder."], "--ignore_keys needs"),
    (["--pretrained_model_name_or_path", "/vae", "--input_size", "16"], "--input_size takes two"),
    (["--scaling_factor", "big"], "--scaling_factor must be"),
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
                    "--latent_stats_num_images", "256"] + BASE[4:])
    assert model_args.ignore_keys == ["decoder.", "post_quant_conv."] and model_args.input_size == [16, 16]
    assert model_args.freeze_encoder and training_args.scale_lr and data_args.latent_stats_num_images == 256
    assert (model_args.init_from_ckpt, model_args.discriminator_path) == ("/run/checkpoint-10", "/run/discriminator")
