"""VAE builder: the shipped configs, local-only loading, save/load round trips, error messages."""

import json
import os

import numpy as np
import paddle
import pytest
from ppdiffusers import AutoencoderKL

from vae_trainer.models.vae import build_vae, decoder_last_layer, save_vae

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# Parameter count of the Stable Diffusion f8c4 VAE (diffusers AutoencoderKL, SD 1.x/2.x, SDXL).
SD_VAE_PARAMETERS = 83_653_863

paddle.set_device("cpu")


def config_path(name: str) -> str:
    return os.path.join(CONFIG_DIR, f"{name}.json")


def num_parameters(model) -> int:
    return sum(int(np.prod(p.shape)) for p in model.parameters())


def fixed_latents(vae, size: int) -> paddle.Tensor:
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    rng = np.random.default_rng(0)
    return paddle.to_tensor(rng.standard_normal((1, vae.config.latent_channels, size // factor, size // factor)).astype("float32"))


@pytest.mark.parametrize("name, size, factor", [("vae_micro", 32, 2), ("vae_tiny", 64, 4)])
def test_small_configs_encode_and_decode(name, size, factor):
    vae = build_vae(config_path(name))
    assert vae.config.sample_size == size
    x = paddle.rand([2, 3, size, size]) * 2 - 1
    posterior = vae.encode(x).latent_dist
    assert list(posterior.mean.shape) == [2, 4, size // factor, size // factor]
    assert list(vae.decode(posterior.sample()).sample.shape) == [2, 3, size, size]


def test_micro_is_smaller_than_tiny_and_keeps_two_down_blocks():
    micro, tiny = build_vae(config_path("vae_micro")), build_vae(config_path("vae_tiny"))
    assert len(micro.config.down_block_types) == 2
    assert num_parameters(micro) < num_parameters(tiny) / 10


def test_sd_config_is_the_stable_diffusion_architecture():
    vae = build_vae(config_path("sd_vae"))
    assert num_parameters(vae) == SD_VAE_PARAMETERS
    assert vae.config.scaling_factor == 0.18215 and vae.config.sample_size == 512


def test_sdxl_config_differs_from_sd_only_in_scaling_and_upcast():
    with open(config_path("sd_vae")) as a, open(config_path("sdxl_vae")) as b:
        sd, sdxl = json.load(a), json.load(b)
    differing = {k for k in sd.keys() | sdxl.keys() if sd.get(k) != sdxl.get(k)}
    assert differing <= {"scaling_factor", "force_upcast", "sample_size"}
    assert sdxl["scaling_factor"] == 0.13025 and sdxl["force_upcast"] is True


def test_flux_config_has_sixteen_latent_channels_and_no_quant_convs():
    vae = build_vae(config_path("flux_vae"))
    assert vae.quant_conv is None and vae.post_quant_conv is None
    assert vae.encoder.conv_out.weight.shape[0] == 2 * 16  # mean and log-variance
    assert vae.decoder.conv_in.weight.shape[1] == 16
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (0.3611, 0.1159)


def test_save_and_from_pretrained_round_trip(tmp_path):
    vae = build_vae(config_path("vae_micro"))
    vae.eval()
    save_vae(vae, str(tmp_path), scaling_factor=0.5, shift_factor=0.25)
    loaded = AutoencoderKL.from_pretrained(str(tmp_path), local_files_only=True)
    loaded.eval()
    z = fixed_latents(vae, 32)
    np.testing.assert_array_equal(loaded.decode(z).sample.numpy(), vae.decode(z).sample.numpy())
    assert (loaded.config.scaling_factor, loaded.config.shift_factor) == (0.5, 0.25)


def test_pretrained_subfolder_and_saved_config_as_config_file(tmp_path):
    vae = build_vae(config_path("vae_micro"))
    vae.eval()
    save_vae(vae, str(tmp_path / "vae"))
    loaded = build_vae(pretrained_model_name_or_path=str(tmp_path), subfolder="vae")
    loaded.eval()
    z = fixed_latents(vae, 32)
    np.testing.assert_array_equal(loaded.decode(z).sample.numpy(), vae.decode(z).sample.numpy())
    # A checkpoint's vae/config.json describes the same architecture when used as --vae_config_file.
    fresh = build_vae(str(tmp_path / "vae" / "config.json"))
    assert {k: v.shape for k, v in fresh.state_dict().items()} == {k: v.shape for k, v in vae.state_dict().items()}


def test_decoder_last_layer_is_the_output_conv_and_receives_gradients():
    vae = build_vae(config_path("vae_micro"))
    weight = decoder_last_layer(vae)
    assert weight is vae.decoder.conv_out.weight and weight.shape[0] == 3
    (grad,) = paddle.grad(vae.decode(fixed_latents(vae, 32)).sample.mean(), [weight])
    assert grad.abs().sum().item() > 0


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        build_vae()
    with pytest.raises(ValueError, match="exactly one"):
        build_vae(config_path("vae_micro"), pretrained_model_name_or_path=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="local folder"):
        build_vae(pretrained_model_name_or_path="stabilityai/sd-vae-ft-mse")
    save_vae(build_vae(config_path("vae_micro")), str(tmp_path / "vae"))
    with pytest.raises(FileNotFoundError, match="subfolder"):
        build_vae(pretrained_model_name_or_path=str(tmp_path))  # forgot subfolder="vae"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_vae(str(tmp_path / "missing.json"))
