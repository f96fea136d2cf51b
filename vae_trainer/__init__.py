"""vae_trainer: train the AutoencoderKL of latent diffusion models on PaddlePaddle.

The package holds the real code; the two entry points at the repository root are thin drivers.
"""
