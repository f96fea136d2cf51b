"""Networks: the autoencoder families, discriminators, LPIPS, DINOv2 and the FID InceptionV3. Importing any of them
first gives Paddle's SiLU a correct backward (activations.py)."""

from . import activations  # noqa: F401  (importing it rebinds paddle.nn.functional.silu)
