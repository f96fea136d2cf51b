"""VA-VAE's VF loss and the vf_alignment_cka diagnostic (issue 31, items 2-3): the formulas against hand
computations, the step's adaptive weight against autograd on the full graph, the flags, and runs of both entry
points (same numbers, exact resume, two ranks, eval_vae.py)."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, EVAL_FLAGS, run_entry_point, run_in_process, tiny_args
from safetensors.numpy import save_file

from vae_trainer.metrics import MetricAccumulator
from vae_trainer.objectives.alignment import add_cka_tokens, linear_cka, to_token_grid, vf_loss
from vae_trainer.argument_parser import parse_arguments


def tiny_dinov2(path, width: int = 64, seed: int = 0) -> str:
    """A seeded one-block DINOv2 ViT-S/14-like state dict with timm's key names (1 head of 64), 224 px grid."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"patch_embed.proj.weight": normal(width, 3, 14, 14), "patch_embed.proj.bias": normal(width),
               "cls_token": normal(1, 1, width), "pos_embed": normal(1, 257, width),
               "norm.weight": 1 + normal(width), "norm.bias": normal(width)}
    for name, shape in {"norm1.weight": (width,), "norm1.bias": (width,), "attn.qkv.weight": (3 * width, width),
                        "attn.qkv.bias": (3 * width,), "attn.proj.weight": (width, width), "attn.proj.bias": (width,),
                        "ls1.gamma": (width,), "norm2.weight": (width,), "norm2.bias": (width,),
                        "mlp.fc1.weight": (4 * width, width), "mlp.fc1.bias": (4 * width,),
                        "mlp.fc2.weight": (width, 4 * width), "mlp.fc2.bias": (width,), "ls2.gamma": (width,)}.items():
        tensors[f"blocks.0.{name}"] = normal(*shape) + (1.0 if name.endswith(("gamma", "norm1.weight", "norm2.weight"))
                                                        else 0.0)
    save_file(tensors, str(path))
    return str(path)


@pytest.fixture(scope="module")
def dino_file(tmp_path_factory) -> str:
    return tiny_dinov2(tmp_path_factory.mktemp("dino") / "dinov2.safetensors")


def _cos(a, b):
    return (a / np.linalg.norm(a, axis=-1, keepdims=True)) @ (b / np.linalg.norm(b, axis=-1, keepdims=True)).T


@pytest.mark.parametrize("m1,m2", [(0.0, 0.0), (0.25, 0.5)])
def test_vf_loss_is_vavae_distance_matrix_and_cosine_terms(m1, m2):
    rng = np.random.default_rng(1)
    p, f = rng.standard_normal((2, 9, 5)), rng.standard_normal((2, 9, 5))
    mdms, mcos = vf_loss(paddle.to_tensor(p, "float32"), paddle.to_tensor(f, "float32"), m1, m2)
    expected_mdms = np.mean([np.maximum(np.abs(_cos(p[b], p[b]) - _cos(f[b], f[b])) - m1, 0) for b in range(2)])
    expected_mcos = np.mean([np.maximum(1 - m2 - np.diag(_cos(p[b], f[b])), 0) for b in range(2)])
    assert mdms.item() == pytest.approx(expected_mdms, rel=1e-5)
    assert mcos.item() == pytest.approx(expected_mcos, rel=1e-5)
    assert vf_loss(paddle.to_tensor(f, "float32"), paddle.to_tensor(3 * f, "float32"))[1].item() == pytest.approx(0, abs=1e-6)


def test_tokens_are_the_area_average_of_the_latent_on_the_token_grid():
    z = paddle.arange(2 * 3 * 4 * 4, dtype="float32").reshape([2, 3, 4, 4])
    tokens = to_token_grid(z, (2, 2))
    assert tokens.shape == [2, 4, 3]
    np.testing.assert_allclose(tokens[0, 0].numpy(), z[0, :, :2, :2].mean(axis=[1, 2]).numpy())


def test_linear_cka_is_the_formula_over_all_tokens_summed_in_batches():
    rng = np.random.default_rng(2)
    x, noise = rng.standard_normal((60, 4)), rng.standard_normal((60, 6))
    y = np.concatenate([x, x[:, :2]], axis=1) @ rng.standard_normal((6, 6)) + 0.5 * noise

    def cka(a, b):
        a, b = a - a.mean(0), b - b.mean(0)
        return np.sum((b.T @ a) ** 2) / (np.linalg.norm(a.T @ a) * np.linalg.norm(b.T @ b))

    accumulator = MetricAccumulator()
    for start in (0, 25):  # two batches of [B, N, C] tokens
        stop = 60 if start else 25
        add_cka_tokens(accumulator, paddle.to_tensor(x[start:stop][None]), paddle.to_tensor(y[start:stop][None]))
    assert linear_cka(accumulator.reduce()) == pytest.approx(cka(x, y), rel=1e-9)
    rotation = np.linalg.qr(rng.standard_normal((4, 4)))[0]
    same = MetricAccumulator()
    add_cka_tokens(same, paddle.to_tensor(x[None]), paddle.to_tensor(3 * x[None] @ rotation + 1))
    assert linear_cka(same.reduce()) == pytest.approx(1.0, rel=1e-9)  # invariant to rotation, scale and offset
    assert 0.2 < cka(x, y) < 0.99 and cka(x, noise) < 0.2


def test_the_step_adds_the_vf_term_with_the_adaptive_weight_autograd_gives(dino_file, tmp_path):
    """The step's logged vf_loss / vf_weight and the encoder's gradients against the objective written out on the
    full graph: nll + kl_weight * kl + w * vf, w = vf_weight * min(||dnll/dE|| / (||dvf/dE|| + 1e-4), 1e8 / N)."""
    from vae_trainer.build import build_networks, build_optimization

    flags = tiny_args("unused", tmp_path, perceptual_weight=0, disc_start=100, use_ema="false", seed=5,
                      vf_model_path=dino_file, vf_weight=0.3, distmat_margin=0.1, cos_margin=0.2)
    model_args, _, loss_args, args = parse_arguments([str(flag) for flag in flags])
    networks = build_networks(model_args, loss_args, args)
    step = build_optimization(networks, loss_args, args)
    reference = copy.deepcopy(networks.model)
    x = paddle.to_tensor(np.random.default_rng(0).uniform(-1, 1, (2, 3, 32, 32)).astype("float32"))
    paddle.seed(9)
    logs = step.forward_backward(x, 0, 0)

    paddle.seed(9)  # the same posterior sample
    recon, mean, logvar, z = reference(x, return_latent=True)
    nll = (recon - x).abs().mean()
    kl = 0.5 * (mean.square() + logvar.exp() - 1 - logvar).sum(axis=[1, 2, 3]).mean() / (3 * 32 * 32)
    features, grid = networks.vf_model.patch_tokens(x)
    mdms, mcos = vf_loss(to_token_grid(reference.vf_projection(z), grid), features, 0.1, 0.2)
    vf = mdms + mcos
    encoder_layer = reference.vae.encoder.conv_out.weight
    grad_nll = paddle.grad(nll, encoder_layer, retain_graph=True)[0]
    grad_vf = paddle.grad(vf, encoder_layer, retain_graph=True)[0]
    ratio = min(np.linalg.norm(grad_nll.numpy()) / (np.linalg.norm(grad_vf.numpy()) + 1e-4), 1e8 / (3 * 32 * 32))
    weight = 0.3 * ratio
    assert logs["train/vf_loss"].item() == pytest.approx(vf.item(), rel=1e-5)
    assert logs["train/vf_weight"].item() == pytest.approx(weight, rel=1e-4)
    assert logs["loss/total"].item() == pytest.approx((nll + loss_args.kl_weight * kl + weight * vf).item(), rel=1e-5)
    (nll + loss_args.kl_weight * kl + weight * vf).backward()
    trained = dict(networks.model.named_parameters())
    for name, param in reference.named_parameters():
        if name.startswith(("vae.encoder.conv_out", "vae.quant_conv", "vf_projection", "vae.decoder.conv_out")):
            np.testing.assert_allclose(trained[name].grad.numpy(), param.grad.numpy(), rtol=2e-4, atol=1e-8,
                                       err_msg=name)


def bilinear_224(images):
    """torch's F.interpolate(images, (224, 224), mode="bilinear", align_corners=False) (no antialias, as VA-VAE's
    forward_dinov2 calls it), written out: half-pixel centres, sources below 0 clamped to 0."""
    def weights(size_in):
        source = np.maximum((np.arange(224) + 0.5) * size_in / 224 - 0.5, 0.0)
        low = np.floor(source).astype(int)
        matrix = np.zeros((224, size_in))
        np.add.at(matrix, (np.arange(224), low), 1 - (source - low))
        np.add.at(matrix, (np.arange(224), np.minimum(low + 1, size_in - 1)), source - low)
        return matrix

    return np.einsum("ih,nchw,jw->ncij", weights(images.shape[2]), images, weights(images.shape[3]))


@pytest.mark.parametrize("convention", ["imagenet", "vavae"])
def test_dinov2_is_fed_the_input_convention_by_the_vf_loss_and_the_cka_alike(dino_file, tmp_path, convention):
    """Issue 38.4: VA-VAE's forward_dinov2 feeds the [-1, 1] images, bilinearly resized to 224, without ImageNet
    normalisation; --vf_input_convention vavae does the same, the default maps to [0, 1] and normalises. The tensor
    DINOv2's patch embedding receives, in the training step's VF loss and in the evaluation's CKA."""
    from vae_trainer.build import build_networks, build_optimization
    from vae_trainer.evaluation import evaluate_vae

    given = {} if convention == "imagenet" else {"vf_input_convention": convention}  # imagenet: the default
    flags = tiny_args("unused", tmp_path, perceptual_weight=0, disc_start=100, use_ema="false",
                      vf_model_path=dino_file, **given)
    model_args, _, loss_args, args = parse_arguments([str(flag) for flag in flags])
    networks = build_networks(model_args, loss_args, args)
    step = build_optimization(networks, loss_args, args)
    fed = []
    networks.vf_model.patch_embed.proj.register_forward_pre_hook(lambda layer, inputs: fed.append(inputs[0].numpy()))
    images = np.random.default_rng(3).uniform(-1, 1, (2, 3, 32, 40)).astype("float32")
    step.forward_backward(paddle.to_tensor(images), 0, 0)
    evaluate_vae(networks.model.vae, [{"pixel_values": paddle.to_tensor(images)}], vf_model=networks.vf_model)
    expected = bilinear_224(images.astype(np.float64))
    if convention == "imagenet":
        mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
        expected = ((expected + 1) / 2 - mean.reshape(1, 3, 1, 1)) / std.reshape(1, 3, 1, 1)
    assert len(fed) == 2  # the step's VF loss, the evaluation's CKA
    for tensor in fed:
        np.testing.assert_allclose(tensor, expected, atol=2e-5, rtol=0)


def test_eval_vae_takes_the_input_convention_too(dino_file, held_out_folder, tmp_path, monkeypatch):
    from conftest import load_script

    script, loaded = load_script("eval_vae"), []
    real = script.load_dinov2
    monkeypatch.setattr(script, "load_dinov2", lambda *args: loaded.append(real(*args)) or loaded[-1])
    common = ["--vae", "configs/vae_micro.json", "--data", held_out_folder, "--resolution", "32", "--num_images", "2",
              "--skip_lpips", "--output_dir", str(tmp_path), "--vf_input_convention", "vavae"]
    with pytest.raises(SystemExit):
        script.parse_args(common)  # without --vf_model_path it would do nothing
    assert "vf_alignment_cka" in script.main(common + ["--vf_model_path", dino_file]).metrics
    assert [model.input_convention for model in loaded] == ["vavae"]


@pytest.mark.parametrize("flags,refused", [
    ({"vf_weight": 0.1}, "vf_model_path"),  # idle without a model
    ({"vf_input_convention": "vavae"}, "vf_model_path"),
    ({"vf_model_path": "DINO", "freeze_encoder": "true", "pretrained_model_name_or_path": "x"}, "freeze_encoder"),
    ({"vf_model_path": "DINO", "vf_weight": 0, "cos_margin": 0.5}, "vf_weight 0"),
    ({"eval_file_list": "x", "eval_steps": 2, "metric_for_best_model": "vf_alignment_cka"}, "vf_model_path"),
])
def test_vf_flags_that_would_be_ignored_or_cannot_act_are_refused(dino_file, flags, refused):
    flags = {k: (dino_file if v == "DINO" else v) for k, v in flags.items()}
    with pytest.raises((ValueError, SystemExit)) as error:
        parse_arguments([str(a) for a in tiny_args("unused", "/tmp/out", **flags)])
    assert refused in str(error.value)


def test_vf_weight_0_keeps_the_model_for_the_diagnostic_only(dino_file):
    model_args, _, loss_args, _ = parse_arguments([str(a) for a in tiny_args("unused", "/tmp/out", vf_weight=0,
                                                                              vf_model_path=dino_file)])
    assert model_args.vf_model_path == dino_file and loss_args.vf_weight == 0


def _weights(output_dir, step):
    return paddle.load(os.path.join(output_dir, f"checkpoint-{step}", "model_state.pdparams"))


def test_both_entry_points_resume_and_two_ranks_agree_with_the_vf_loss(dino_file, photo_filelist, held_out_folder,
                                                                      tmp_path):
    """Same weights from both entry points (the projection included; with EMA, accumulation and EQ-VAE), an exact
    resume from checkpoint-2, two ranks in sync (every save checks the ranks' parameter fingerprints), vf_alignment_cka in the evaluations, and the
    same number from scripts/eval_vae.py on the exported VAE."""
    # With EMA, two micro-batches per step and EQ-VAE's transforms: the VF loss composes with them.
    flags = dict(vf_model_path=dino_file, max_steps=4, save_steps=2, image_logging_steps=0, gradient_accumulation_steps=2,
                 equivariance_prob=0.5, **EVAL_FLAGS(held_out_folder))
    flags["eval_steps"] = 4
    runs = {driver: str(tmp_path / driver.split(".")[0]) for driver in DRIVERS}
    for driver, out in runs.items():
        run_in_process(driver, tiny_args(photo_filelist, out, **flags))
    a, b = _weights(runs[DRIVERS[0]], 4), _weights(runs[DRIVERS[1]], 4)
    assert "vf_projection.weight" in a and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    resumed = str(tmp_path / "resumed")
    run_in_process(DRIVERS[1], tiny_args(photo_filelist, resumed, **{**flags, "max_steps": 2}))
    run_in_process(DRIVERS[1], tiny_args(photo_filelist, resumed, resume_from_checkpoint="latest", **flags))
    c = _weights(resumed, 4)
    assert all(np.array_equal(b[k].numpy(), c[k].numpy()) for k in b)
    record = json.loads(open(os.path.join(runs[DRIVERS[1]], "eval_metrics.jsonl")).read().splitlines()[-1])
    cka = record["metrics"]["vf_alignment_cka"]
    assert 0 < cka < 1 and "vf_alignment_cka" in record["protocol"]
    assert "vf_projection" not in open(os.path.join(runs[DRIVERS[1]], "vae", "config.json")).read()
    from conftest import load_script

    eval_out = tmp_path / "eval"
    load_script("eval_vae").main(["--vae", os.path.join(runs[DRIVERS[1]], "vae"), "--data", held_out_folder,
                                  "--resolution", "32", "--num_images", "6", "--vf_model_path", dino_file,
                                  "--skip_lpips", "--output_dir", str(eval_out)])
    assert json.load(open(eval_out / "metrics.json"))["metrics"]["vf_alignment_cka"] == pytest.approx(cka, rel=1e-5)
    two = str(tmp_path / "two_ranks")
    run_entry_point(DRIVERS[0], tiny_args(photo_filelist, two, **{**flags, "eval_num_images": 6}), nproc=2,
                    log_dir=tmp_path / "logs")
    assert os.path.isdir(os.path.join(two, "checkpoint-4"))
