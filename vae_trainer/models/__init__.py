"""Networks: the autoencoder families, discriminators, LPIPS, DINOv2 and the FID InceptionV3. Importing any of them
first gives Paddle's SiLU a correct backward (activations.py)."""

from .activations import use_swish_for_silu

use_swish_for_silu()
