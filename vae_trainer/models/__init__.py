"""Networks: the ppdiffusers AutoencoderKL, discriminators, LPIPS and the FID InceptionV3."""
