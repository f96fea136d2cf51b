"""Latents aligned with a frozen vision foundation model: the token grid matching, VA-VAE's VF loss and the
`vf_alignment_cka` diagnostic (linear CKA). Formulas and the recipe: docs/techniques.md, section 12."""

import numpy as np
import paddle
import paddle.nn.functional as F

from .metrics import all_reduce_sum

Tensor = paddle.Tensor
DEFINITION = ("linear CKA between the posterior modes, area-averaged to the foundation model's token grid, and its "
              "patch tokens, over all tokens of the evaluation images: ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F "
              "||Yc^T Yc||_F), Xc, Yc the token matrices with their column means removed")


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


class CKAAccumulator:
    """Linear CKA between latent tokens X and foundation-model tokens Y, summed over batches and ranks:
    only the sums of X, Y, X^T X, Y^T Y and Y^T X are kept (float64 on the host)."""

    def __init__(self) -> None:
        self.count, self.sums = 0, None

    def add(self, latent_tokens: Tensor, feature_tokens: Tensor) -> None:
        x = latent_tokens.reshape([-1, latent_tokens.shape[-1]]).astype("float64").numpy()
        y = feature_tokens.reshape([-1, feature_tokens.shape[-1]]).astype("float64").numpy()
        parts = [x.sum(0), y.sum(0), x.T @ x, y.T @ y, y.T @ x]
        self.sums = parts if self.sums is None else [a + b for a, b in zip(self.sums, parts)]
        self.count += x.shape[0]

    def result(self) -> float:
        """The CKA over every rank's tokens (a collective: every rank calls it, with or without tokens)."""
        flat = all_reduce_sum(np.concatenate([[self.count]] + [part.ravel() for part in self.sums]))
        ends = np.cumsum([part.size for part in self.sums])[:-1]
        sx, sy, xx, yy, yx = (part.reshape(like.shape) for part, like in zip(np.split(flat[1:], ends), self.sums))
        count = flat[0]
        xx, yy, yx = xx - np.outer(sx, sx) / count, yy - np.outer(sy, sy) / count, yx - np.outer(sy, sx) / count
        return float(np.sum(yx**2) / (np.linalg.norm(xx) * np.linalg.norm(yy)))
