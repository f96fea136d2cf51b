"""vae_trainer: train the autoencoders of latent diffusion models on PaddlePaddle (their families: models/families/).

The package holds the real code; the two entry points at the repository root are thin drivers.
"""
