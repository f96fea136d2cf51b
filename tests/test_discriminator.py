"""PatchGAN discriminator: shapes, taming init, spectral norm, save/load, training, SyncBatchNorm."""

import numpy as np
import paddle
import pytest
from skimage import data, transform

from vae_trainer.models.discriminator import (
    NORM_TYPES,
    PatchDiscriminator,
    build_discriminator,
    convert_batchnorm_to_sync,
    init_discriminator_from,
    save_discriminator,
)

paddle.set_device("cpu")


def convs(disc):
    return [layer for layer in disc.sublayers() if isinstance(layer, paddle.nn.Conv2D)]


def conv_weight(conv) -> np.ndarray:
    """The trainable weight: `weight_orig` under spectral norm, else `weight`."""
    return getattr(conv, "weight_orig", conv.weight).numpy()


def real_photo_crops(count: int, size: int = 32, seed: int = 0) -> paddle.Tensor:
    image = transform.resize(data.astronaut(), (128, 128), anti_aliasing=True).astype("float32") * 2 - 1
    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 128 - size, (count, 2))
    crops = [image[r : r + size, c : c + size].transpose(2, 0, 1) for r, c in corners]
    return paddle.to_tensor(np.stack(crops))


@pytest.mark.parametrize("norm", NORM_TYPES)
@pytest.mark.parametrize("size", [32, 64])
def test_patch_logits_shape(norm, size):
    disc = build_discriminator(norm=norm, base_channels=8)
    # Three stride-2 convs halve the size; the two stride-1 4x4 convs (padding 1) each take one off.
    assert list(disc(paddle.randn([2, 3, size, size])).shape) == [2, 1, size // 8 - 2, size // 8 - 2]


def test_channel_widths_follow_pix2pix():
    disc = PatchDiscriminator(in_channels=3, base_channels=64, num_layers=3)
    widths = [(3, 64), (64, 128), (128, 256), (256, 512), (512, 1)]
    assert [(c._in_channels, c._out_channels) for c in convs(disc)] == widths
    assert [c._stride for c in convs(disc)] == [[2, 2], [2, 2], [2, 2], [1, 1], [1, 1]]
    deeper = PatchDiscriminator(base_channels=64, num_layers=5)
    assert max(c._out_channels for c in convs(deeper)) == 512  # channel multiplier capped at 8


@pytest.mark.parametrize("norm", NORM_TYPES)
def test_init_statistics_match_taming(norm):
    paddle.seed(0)
    disc = build_discriminator(norm=norm, base_channels=64)
    weights = np.concatenate([conv_weight(c).ravel() for c in convs(disc)])
    assert abs(weights.mean()) < 1e-3 and weights.std() == pytest.approx(0.02, rel=0.02)
    for conv in convs(disc):
        if conv.bias is not None:
            assert np.all(conv.bias.numpy() == 0)
    norms = [l for l in disc.sublayers() if isinstance(l, (paddle.nn.BatchNorm2D, paddle.nn.GroupNorm))]
    assert len(norms) == (0 if norm == "none" else 3)
    if norms:
        scales = np.concatenate([n.weight.numpy() for n in norms])
        assert abs(scales.mean() - 1) < 3e-3 and scales.std() == pytest.approx(0.02, rel=0.15)
        assert all(np.all(n.bias.numpy() == 0) for n in norms)
    # Only layers without a following normalisation carry a bias.
    assert sum(c.bias is not None for c in convs(disc)) == (5 if norm == "none" else 2)


def test_spectral_norm_bounds_the_largest_singular_value():
    disc = build_discriminator(norm="spectral_group", base_channels=16)
    disc.train()
    x = paddle.randn([2, 3, 32, 32])
    u_before = convs(disc)[2].weight_u.numpy().copy()
    for _ in range(30):
        disc(x)
    for conv in convs(disc):
        effective = conv.weight.numpy().reshape(conv.weight.shape[0], -1)
        assert np.linalg.svd(effective, compute_uv=False)[0] == pytest.approx(1.0, abs=0.02)
    assert not np.allclose(convs(disc)[2].weight_u.numpy(), u_before)
    disc.eval()
    u_trained = convs(disc)[2].weight_u.numpy().copy()
    disc(x)
    np.testing.assert_array_equal(convs(disc)[2].weight_u.numpy(), u_trained)  # frozen in eval
    assert {"main.2.weight_u", "main.2.weight_v", "main.2.weight_orig"} <= set(disc.state_dict())


@pytest.mark.parametrize("norm", NORM_TYPES)
def test_save_load_round_trip(norm, tmp_path):
    config = {"disc_type": "patch", "norm": norm, "num_layers": 2, "base_channels": 8}
    disc = build_discriminator(**config)
    disc.train()
    optimizer = paddle.optimizer.Adam(1e-2, parameters=disc.parameters())
    for _ in range(3):  # move weights, BatchNorm statistics and power-iteration vectors off their init
        disc(paddle.randn([4, 3, 32, 32])).mean().backward()
        optimizer.step()
        optimizer.clear_grad()
    disc.eval()
    x = paddle.randn([2, 3, 32, 32])
    save_discriminator(disc, config, str(tmp_path / "discriminator"))
    loaded = build_discriminator(**config)
    init_discriminator_from(loaded, config, str(tmp_path / "discriminator"))  # as --discriminator_path does
    loaded.eval()
    np.testing.assert_array_equal(loaded(x).numpy(), disc(x).numpy())


@pytest.mark.parametrize("norm", NORM_TYPES)
def test_each_norm_learns_real_versus_fake(norm):
    paddle.seed(0)
    disc = build_discriminator(norm=norm, base_channels=16)
    disc.train()
    optimizer = paddle.optimizer.Adam(1e-3, beta1=0.5, parameters=disc.parameters())
    fake = paddle.to_tensor(np.random.default_rng(1).uniform(-1, 1, (8, 3, 32, 32)).astype("float32"))
    losses = []
    for step in range(20):
        real = real_photo_crops(8, seed=step)
        # Hinge loss, as LDM trains its discriminator.
        loss = paddle.nn.functional.relu(1 - disc(real)).mean() + paddle.nn.functional.relu(1 + disc(fake)).mean()
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_factory_rejects_unknown_types():
    with pytest.raises(ValueError, match="disc_type"):
        build_discriminator(disc_type="stylegan")
    with pytest.raises(ValueError, match="norm"):
        build_discriminator(norm="layer")


def test_batchnorm_to_sync_conversion():
    disc = build_discriminator(norm="batch", base_channels=8)
    converted = convert_batchnorm_to_sync(disc, device="gpu:0")
    kinds = [type(layer) for layer in converted.sublayers()]
    assert kinds.count(paddle.nn.SyncBatchNorm) == 3 and paddle.nn.BatchNorm2D not in kinds
    # CPU has no sync_batch_norm kernel: the layer is left as it is and keeps working.
    cpu_disc = build_discriminator(norm="batch", base_channels=8)
    with pytest.warns(UserWarning, match="CPU"):
        assert convert_batchnorm_to_sync(cpu_disc, device="cpu") is cpu_disc
    assert list(cpu_disc(paddle.randn([1, 3, 32, 32])).shape) == [1, 1, 2, 2]


def test_a_conditioned_patchgan_round_trips_and_its_condition_must_agree(tmp_path):
    config = {"disc_type": "patch", "norm": "group", "num_layers": 2, "base_channels": 8, "condition_channels": 4}
    paddle.seed(0)
    disc = build_discriminator(**config)
    folder = str(tmp_path / "discriminator")
    save_discriminator(disc, config, folder)
    loaded = build_discriminator(**config)
    init_discriminator_from(loaded, config, folder)
    x, latents = paddle.randn([2, 3, 32, 32]), paddle.randn([2, 4, 4, 4])
    np.testing.assert_array_equal(loaded(x, latents).numpy(), disc(x, latents).numpy())
    unconditioned = {**config, "condition_channels": 0}
    with pytest.raises(ValueError, match=r"latent channels it is conditioned on .* 4 \(this run: 0\)"):
        init_discriminator_from(build_discriminator(**unconditioned), unconditioned, folder)
    # a config saved before the key existed is an unconditioned one
    old = {k: v for k, v in unconditioned.items() if k != "condition_channels"}
    save_discriminator(build_discriminator(**old), old, str(tmp_path / "old"))
    init_discriminator_from(build_discriminator(**unconditioned), unconditioned, str(tmp_path / "old"))
