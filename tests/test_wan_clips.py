"""--recompute over clips for the causal video VAEs (issue 43, memory; vae_trainer/models/autoencoder_kl_wan.py's
ChunkPass): each chunk's encoder and decoder pass is re-run whole in the backward, the causal cache entering and
leaving it as tensors, and the loss and every gradient are bit-identical to the one-shot computation's.

Tiny Wan 2.1-, Wan 2.2- (residual, 2x2 patchify) and Qwen-Image-shaped models with random weights, clips of 5 and 9
frames at 32 px, run through the family as the trainer runs them (models/families/wan.py: NCTHW clips in, NCTHW out). That
the clip forward itself is diffusers' is tests/test_autoencoder_kl_wan.py's (clips of 5 and 9 frames)."""

from __future__ import annotations

import json
import os

import numpy as np
import paddle
import pytest
from conftest import REPO, assert_same_tensor

from vae_trainer.models.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from vae_trainer.models.autoencoder_kl_wan import AutoencoderKLWan, encoder_chunks
from vae_trainer.models.families import family_of
from vae_trainer.models.family import holds_batch_norm
from vae_trainer.models.recompute import enable_recompute

STATS = dict(latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 1.0])
CONFIGS = {
    # Wan 2.1: a temporal first stage (a latent frame per 2 frames), attention in the encoder's second stage.
    "wan21": (AutoencoderKLWan, dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[0.5],
                                     temperal_downsample=[True, False], scale_factor_temporal=2,
                                     scale_factor_spatial=4, **STATS)),
    # Wan 2.2's TI2V layout: residual stages, 2x2 patchify, a wider decoder.
    "wan22": (AutoencoderKLWan, dict(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                     temperal_downsample=[False, True], is_residual=True, patch_size=2,
                                     in_channels=12, out_channels=12, scale_factor_temporal=2,
                                     scale_factor_spatial=8, **STATS)),
    # Qwen-Image: both stage boundaries temporal (9 frames are 3 latent frames).
    "qwen": (AutoencoderKLQwenImage, dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                          temperal_downsample=[True, True], **STATS)),
}


def build(name: str, **changes):
    """The seeded model of `name`, moved off Paddle's initialisation (its zero biases, unit norms)."""
    cls, config = CONFIGS[name]
    paddle.seed(3)
    vae = cls(**{**config, **changes})
    with paddle.no_grad():
        for param in vae.parameters():
            param.set_value(param + paddle.randn(param.shape) * 0.05)
    return vae


def clip(frames: int, size: int = 32) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(frames).uniform(-1, 1, (1, 3, frames, size, size)).astype("float32"))


class ForwardCounter:
    """How many times each of the encoder and decoder ran its forward (a chunk each time)."""

    def __init__(self, vae):
        self.counts = {"encoder": 0, "decoder": 0}
        self.handles = [getattr(vae, name).register_forward_pre_hook(self._hook(name)) for name in self.counts]

    def _hook(self, name):
        def count(layer, inputs):
            self.counts[name] += 1
        return count

    def remove(self):
        for handle in self.handles:
            handle.remove()


def clip_step(vae, x: paddle.Tensor) -> tuple:
    """A training step's loss on a clip (sampled posterior, unclamped decode, L1 + KL + a frame-difference term),
    the family's encode / decode as the trainer calls them; returns the loss, every gradient and the forward
    counts."""
    family = family_of(vae)
    counter = ForwardCounter(vae)
    paddle.seed(7)
    posterior = family.encode(vae, x)
    recon = family.decode(vae, posterior.sample())
    flicker = ((recon[:, :, 1:] - recon[:, :, :-1]) - (x[:, :, 1:] - x[:, :, :-1])).abs().mean()
    loss = (recon - x).abs().mean() + 1e-3 * posterior.kl().mean() + flicker
    vae.clear_gradients(set_to_zero=False)
    loss.backward()
    counter.remove()
    grads = {name: None if p.grad is None else p.grad.numpy() for name, p in vae.named_parameters()}
    return loss.item(), grads, counter.counts


def latent_frames(vae, frames: int) -> int:
    return 1 + (frames - 1) // 2 ** sum(vae.temperal_downsample)


@pytest.mark.parametrize("frames", [5, 9])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_clip_recompute_gives_the_one_shot_loss_and_gradients_bit_for_bit(name, frames):
    """Before the cache was explicit, Paddle's recompute over a clip raised in the backward (its re-run claimed
    cache slots again); now each chunk's pass runs twice and the numbers are those of the one-shot pass exactly."""
    vae, x = build(name), clip(frames)
    one_shot_loss, one_shot, counts = clip_step(vae, x)
    encoder_chunks_run, decoder_chunks_run = len(list(encoder_chunks(frames))), latent_frames(vae, frames)
    assert counts == {"encoder": encoder_chunks_run, "decoder": decoder_chunks_run}
    names = enable_recompute(vae)
    loss, grads, counts = clip_step(vae, x)
    assert names[-2:] == ["encoder.chunk", "decoder.chunk"]
    # Each chunk's encoder and decoder pass ran again in the backward, under one recompute per chunk.
    assert counts == {"encoder": 2 * encoder_chunks_run, "decoder": 2 * decoder_chunks_run}
    assert (vae.encoder_pass.forward.calls, vae.decoder_pass.forward.calls) == (encoder_chunks_run, decoder_chunks_run)
    assert loss == one_shot_loss
    assert grads.keys() == one_shot.keys() and all(grad is not None for grad in one_shot.values())
    for param, grad in one_shot.items():
        assert np.abs(grad).max() > 0, param  # every weight is live on a clip, the temporal ones included
        assert_same_tensor(grads[param], grad, param)


def test_decoder_only_recomputes_the_decoder_and_leaves_the_frozen_encoder_alone():
    """The recommended fine-tune: a frozen encoder builds no graph, so nothing of it is recomputed; the decoder's
    chunks are, with the one-shot gradients. Recomputing is exact as the networks hold no BatchNorm (RMS norms) and
    the published configs no dropout; a dropout would be replayed exactly too (the recompute restores the random
    state), as here."""
    for config in ("wan21_vae.json", "wan22_vae.json", "qwen_image_vae.json"):
        with open(os.path.join(REPO, "configs", config)) as handle:
            assert json.load(handle).get("dropout", 0.0) == 0.0, config
    vae, x = build("wan21", dropout=0.2), clip(9)
    assert not holds_batch_norm(vae)
    for param in vae.encoder.parameters() + vae.quant_conv.parameters():
        param.stop_gradient = True
    one_shot_loss, one_shot, _ = clip_step(vae, x)
    enable_recompute(vae)
    loss, grads, counts = clip_step(vae, x)
    chunks = latent_frames(vae, 9)
    assert counts == {"encoder": len(list(encoder_chunks(9))), "decoder": 2 * chunks}
    assert (vae.encoder_pass.forward.calls, vae.decoder_pass.forward.calls) == (0, chunks)
    assert loss == one_shot_loss
    for param, grad in one_shot.items():
        assert (grad is None) == param.startswith(("encoder.", "quant_conv.")), param
        if grad is not None:
            assert_same_tensor(grads[param], grad, param)


def test_a_chunk_pass_is_a_function_of_its_tensors():
    """A chunk's pass reads only the chunk and the cache tensors given, leaves new compact tensors (two frames at
    most, its own memory: a view would keep the chunk's whole activation alive), and gives the same again."""
    vae = build("qwen")
    with paddle.no_grad():
        z = vae.post_quant_conv(paddle.randn([1, 4, 2, 8, 8]))
        first, *state = vae.decoder_pass(z[:, :, :1], *(None,) * vae.decoder.cache_slots, first_chunk=True)
        out, *after = vae.decoder_pass(z[:, :, 1:], *state, first_chunk=False)
        again, *after_again = vae.decoder_pass(z[:, :, 1:], *state, first_chunk=False)
    tensors = [t for t in state if isinstance(t, paddle.Tensor)]
    assert len(tensors) == len(state) - sum(vae.temperal_upsample)  # a temporal upsampler's first mark is no tensor
    assert all(t.is_contiguous() and t.shape[2] <= 2 for t in tensors)
    assert_same_tensor(again.numpy(), out.numpy(), "output")
    for a, b in zip(after, after_again):
        assert_same_tensor(a.numpy(), b.numpy(), "cache")
    assert_same_tensor(paddle.concat([first, out], axis=2).numpy(), vae.run_decoder(z).numpy(), "a whole decode")


def test_the_backward_re_runs_one_chunk_at_a_time_last_first():
    """A chunk re-runs only once the chunk after it has finished its backward (which hands it its cache's gradients),
    so one chunk's activations are held at a time. Paddle re-runs a segment when the backward first needs it: the
    loss gives every chunk's frames their gradient at once, and unjoined (autoencoder_kl_wan.joined_in_backward)
    every chunk re-ran at that moment, all their activations held together."""
    vae, x = build("wan21"), clip(9)
    for param in vae.encoder.parameters() + vae.quant_conv.parameters():
        param.stop_gradient = True
    enable_recompute(vae)
    events, backward = [], []

    def chunk_starts(layer, inputs):
        if backward:
            events.append("re-run")
        else:  # the chunk's gradient is in once its backward is through (conv_in takes it first)
            inputs[0].register_hook(lambda grad: events.append("done"))
    vae.decoder.register_forward_pre_hook(chunk_starts)
    family = family_of(vae)
    loss = (family.decode(vae, family.encode(vae, x).mode()) - x).abs().mean()
    backward.append(True)
    loss.backward()
    assert events == ["re-run", "done"] * latent_frames(vae, 9)
