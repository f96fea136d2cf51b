"""Latents aligned with a frozen vision foundation model: the token grid matching, VA-VAE's VF loss and the
`vf_alignment_cka` diagnostic (linear CKA), the VF term's adaptive weight, and the refusals of its flags. Formulas
and the recipe: docs/techniques.md, section 12."""

from typing import Dict, Tuple

import numpy as np
import paddle
import paddle.nn.functional as F

from ..refusals import FROZEN_LATENT
from ..metrics import MetricAccumulator
from .gan import ADAPTIVE_WEIGHT_EPS, adaptive_weight, last_layer_gradient

Tensor = paddle.Tensor
VF_WEIGHT_MAX = 1e8  # VA-VAE's bound on the adaptive VF weight, in its units: ours is this / N (docs)
DEFINITION = ("linear CKA between the posterior modes, area-averaged to the foundation model's token grid, and its "
              "patch tokens, over all tokens of the evaluation images: ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F "
              "||Yc^T Yc||_F), Xc, Yc the token matrices with their column means removed")


# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("vf_model_path",), lambda f: f.vf_model_path and f.vf_weight > 0 and f.frozen_latent,
     f"it aligns the latents with a DINOv2, and {FROZEN_LATENT}: drop it (or --vf_weight 0 for the diagnostic only)"),
    (("vf_weight",), lambda f: f.vf_weight < 0, "it must be >= 0 (0: no VF loss)"),
    (("distmat_margin",), lambda f: f.distmat_margin < 0, "it must be >= 0"),
    (("cos_margin",), lambda f: f.cos_margin < 0, "it must be >= 0"),
    (("vf_model_path",), lambda f: f.vf_model_path and f.vf_weight > 0 and f.freeze_encoder,
     "it aligns the latent space, and the latent space belongs to the encoder, which --freeze_encoder keeps as it "
     "is: drop one of them (or --vf_weight 0 for the diagnostic only)"),
    (("vf_model_path",), lambda f: f.vf_model_path and f.vf_weight > 0 and f.loss_balancing == "gradnorm",
     "its VF loss is weighted against the nll, which --loss_balancing gradnorm replaces: drop one of them"),
    (("vf_weight", "distmat_margin", "cos_margin", "adaptive_vf", "vf_input_convention"), lambda f: not f.vf_model_path,
     "it shapes the VF loss of --vf_model_path, which is not given: add it, or drop it"),
    (("distmat_margin", "cos_margin", "adaptive_vf"), lambda f: bool(f.vf_model_path) and f.vf_weight == 0,
     "--vf_weight 0 turns the VF loss off: drop it, or give --vf_weight > 0"),
)


def to_token_grid(latents: Tensor, grid: tuple[int, int]) -> Tensor:
    """[B, C, h, w] latents area-averaged to the token grid, as [B, grid_h * grid_w, C] tokens."""
    return F.adaptive_avg_pool2d(latents.astype("float32"), list(grid)).flatten(2).transpose([0, 2, 1])


def vf_loss(projected: Tensor, features: Tensor, distmat_margin: float = 0.0,
            cos_margin: float = 0.0) -> tuple[Tensor, Tensor]:
    """VA-VAE's two VF terms between projected latent tokens p and foundation-model tokens f, both [B, N, C]:
    (L_mdms, L_mcos) = (mean over token pairs of relu(|cos(p_i, p_j) - cos(f_i, f_j)| - m1),
                        mean over tokens of relu(1 - m2 - cos(p_i, f_i))); cosines over channels."""
    p = F.normalize(projected.astype("float32"), axis=-1)
    f = F.normalize(features.astype("float32"), axis=-1)
    distances = (paddle.matmul(p, p, transpose_y=True) - paddle.matmul(f, f, transpose_y=True)).abs()
    return F.relu(distances - distmat_margin).mean(), F.relu(1.0 - cos_margin - (p * f).sum(axis=-1)).mean()


CKA_SUMS = ("count", "x", "y", "xx", "yy", "yx")  # the token count and the sums of X, Y, X^T X, Y^T Y and Y^T X


def add_cka_tokens(sums: MetricAccumulator, latent_tokens: Tensor, feature_tokens: Tensor) -> None:
    """Add latent tokens X and foundation-model tokens Y to the sums (float64 on the host) their linear CKA needs."""
    x = latent_tokens.reshape([-1, latent_tokens.shape[-1]]).astype("float64").numpy()
    y = feature_tokens.reshape([-1, feature_tokens.shape[-1]]).astype("float64").numpy()
    for name, value in zip(CKA_SUMS, ([x.shape[0]], x.sum(0), y.sum(0), x.T @ x, y.T @ y, y.T @ x)):
        sums.add(f"cka.{name}", value)


def linear_cka(sums: dict[str, np.ndarray]) -> float:
    """The CKA of every batch's and every rank's tokens, of `sums` (reduced over ranks)."""
    count, sx, sy, xx, yy, yx = (sums[f"cka.{name}"] for name in CKA_SUMS)
    xx, yy = xx - np.outer(sx, sx) / count, yy - np.outer(sy, sy) / count
    yx = yx - np.outer(sy, sx) / count
    return float(np.sum(yx**2) / (np.linalg.norm(xx) * np.linalg.norm(yy)))


def weighted_vf_term(projected: Tensor, features: Tensor, encoder_last_layer: Tensor, recon: Tensor, nll_grad: Tensor,
                      loss_args, grad_scale, pixels_per_image: float) -> Tuple[Tensor, Dict[str, Tensor]]:
    """w * (L_mdms + L_mcos) of projected latent and foundation-model tokens ([B, N, C] each), and its logs; w
    adaptive from the encoder's last layer with --adaptive_vf (a non-finite w, NaN from `adaptive_weight`, is 0);
    `nll_grad`: nll's scaled gradient at the reconstruction."""
    mdms, mcos = vf_loss(projected, features, loss_args.distmat_margin, loss_args.cos_margin)
    value = mdms + mcos
    weight = paddle.full([], loss_args.vf_weight, "float32")
    if loss_args.adaptive_vf:
        nll_at_encoder = last_layer_gradient(recon, nll_grad, encoder_last_layer)
        vf_at_encoder = paddle.grad(value * grad_scale, encoder_last_layer, retain_graph=True)[0]
        ratio = adaptive_weight(nll_at_encoder, vf_at_encoder, max_weight=VF_WEIGHT_MAX / pixels_per_image,
                                eps=ADAPTIVE_WEIGHT_EPS * grad_scale)
        weight = paddle.nan_to_num(ratio, nan=0.0) * loss_args.vf_weight
    return weight * value, {"train/vf_loss": value, "train/vf_weight": weight, "train/vf_distmat_loss": mdms,
                            "train/vf_cos_loss": mcos}
