"""Mistakes at start-up end as one `error: ...` line (exit status 1), before any training, from both entry
points: a folder with no VAE, a checkpoint given as a pretrained VAE, a VAE folder's weight file given instead
of the folder, a discriminator that does not fit the flags, a --latent_stats_num_images that cannot be
measured (0, or fewer images than ranks)."""

import os
import subprocess
import sys
import warnings

import paddle
import pytest
from conftest import DRIVERS, REPO, run_in_process, tiny_args

from vae_trainer.console import quiet_third_party
from vae_trainer.models.discriminator import build_discriminator, save_discriminator
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.vae_saving import save_vae


def refused(driver, argv) -> str:
    with pytest.raises(SystemExit) as stopped:
        run_in_process(driver, argv)
    message = stopped.value.code
    assert isinstance(message, str) and message.startswith("error: "), message  # sys.exit(str): status 1
    return message


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run") / "checkpoint-4"
    folder.mkdir()
    paddle.save({"vae.encoder.conv_in.weight": paddle.zeros([1])}, str(folder / "model_state.pdparams"))
    (folder / "trainer_state.json").write_text("{}")
    return str(folder)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_vae_source_that_cannot_be_loaded_is_one_line(driver, photo_filelist, checkpoint_folder, tmp_path):
    (tmp_path / "empty").mkdir()
    flags = dict(pretrained_model_name_or_path=str(tmp_path / "empty"), vae_config_file="configs/vae_micro.json")
    message = refused(driver, tiny_args(photo_filelist, tmp_path / "out", **flags))
    assert f"No loadable VAE in {tmp_path / 'empty'}" in message
    flags["pretrained_model_name_or_path"] = checkpoint_folder
    message = refused(driver, tiny_args(photo_filelist, tmp_path / "out", **flags))
    assert "is a checkpoint of a training run" in message and f"--init_from_ckpt {checkpoint_folder}" in message
    assert not os.path.exists(tmp_path / "out" / "vae")
    save_vae(build_vae("configs/vae_micro.json"), str(tmp_path / "exported"))
    flags["pretrained_model_name_or_path"] = tmp_path / "exported" / "diffusion_pytorch_model.safetensors"
    message = refused(driver, tiny_args(photo_filelist, tmp_path / "out", **flags))  # the file, not its folder
    assert message.endswith(f"give the folder, --pretrained_model_name_or_path {tmp_path / 'exported'}")


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_discriminator_that_does_not_fit_the_flags_is_one_line(driver, photo_filelist, tmp_path):
    save_discriminator(build_discriminator(norm="group", num_layers=2, base_channels=8),
                       {"disc_type": "patch", "norm": "group", "num_layers": 2, "base_channels": 8},
                       str(tmp_path / "discriminator"))
    message = refused(driver, tiny_args(photo_filelist, tmp_path / "out", discriminator_path=tmp_path / "discriminator"))
    assert "holds a different discriminator" in message and "--disc_norm 'group' (this run: 'batch')" in message


@pytest.mark.parametrize("driver", DRIVERS)
def test_latent_stats_num_images_is_checked_at_start_up(driver, photo_filelist, tmp_path, monkeypatch):
    message = refused(driver, tiny_args(photo_filelist, tmp_path / "zero", latent_stats_num_images=0))
    assert "--latent_stats_num_images 0 must be at least 1" in message
    import vae_trainer.build
    import vae_trainer.distributed
    import vae_trainer.evaluation

    monkeypatch.setattr(vae_trainer.distributed, "world_size", lambda: 2)  # what the evaluator sees under 2 ranks
    monkeypatch.setattr(vae_trainer.evaluation, "world_size", lambda: 2)  # (imported there by name)
    monkeypatch.setattr(vae_trainer.build, "broadcast_parameters", lambda model: None)  # no second rank to talk to
    monkeypatch.setattr(paddle.distributed, "all_reduce", lambda tensor, *args, **kwargs: None)  # (nor agree with)
    monkeypatch.setattr(paddle.distributed, "broadcast_object_list", lambda objects, *args, **kwargs: None)
    message = refused(driver, tiny_args(photo_filelist, tmp_path / "one", latent_stats_num_images=1))
    assert "at least the number of ranks (2)" in message
    written = os.listdir(tmp_path / "one") if os.path.isdir(tmp_path / "one") else []
    assert not [name for name in written if name.startswith(("checkpoint", "vae"))]  # refused before training


def test_the_message_is_printed_without_a_traceback_or_third_party_noise(tmp_path):
    """Issue 30.5: paddle's ccache warning and OMP_NUM_THREADS notice, setuptools' distutils notice and the
    "PyTorch version ... available" lines are not printed at start-up, by an entry point (this run imports
    everything and builds the networks) or a script."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # (Paddle's import warns about any count above 1)
    out, missing = ["--output_dir", str(tmp_path / "out")], str(tmp_path / "none")
    for command in ([DRIVERS[1], "--file_list", str(tmp_path), "--max_steps", "1", "--device", "cpu", *out,
                     "--pretrained_model_name_or_path", missing],
                    ["scripts/eval_vae.py", "--data", str(tmp_path), *out, "--vae", missing]):
        completed = subprocess.run([sys.executable, os.path.join(REPO, command[0]), *command[1:]], cwd=REPO, env=env,
                                   capture_output=True, text=True, timeout=300)
        assert completed.returncode == 1
        assert "Traceback" not in completed.stderr and f"error: No pretrained VAE at {missing}" in completed.stderr
        for noise in ("No ccache found", "Setuptools is replacing distutils", "PyTorch version", "OMP_NUM_THREADS set"):
            assert noise not in completed.stderr, completed.stderr


def test_only_the_unactionable_warnings_are_silenced():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party()
        warnings.warn("No ccache found. Please be aware ...")
        warnings.warn("--max_steps 1 is shorter than --disc_start 4")  # one of ours
    assert [str(warning.message) for warning in caught] == ["--max_steps 1 is shorter than --disc_start 4"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_freeze_encoder_on_a_vae_trained_from_scratch_is_refused(driver, photo_filelist, tmp_path):
    """Issue 17.7: its encoder would stay at its random initialisation for the whole run (before: it trained)."""
    message = refused(driver, tiny_args(photo_filelist, tmp_path / "out", freeze_encoder="true"))
    assert "\n" not in message and "--freeze_encoder" in message and "--pretrained_model_name_or_path" in message
    assert not os.path.exists(tmp_path / "out")  # refused before anything is built or written
