"""Two models with a planted precision problem, for demonstrating and checking the advisor
(``mixprec advise --model planted-overflow``, the evidence in docs/precision-advisor.md).

* :func:`overflow_case`: a Linear layer whose outputs reach ~1e5, past fp16's 65504 (a
  LayerNorm after it brings them back): unsafe in fp16, fine in bf16.
* :func:`outlier_case`: a Linear layer that reads one feature ~1e5x larger than the rest (a
  "massive activation"; its weights on that feature are ~1e-5x the others', so the feature adds
  an ordinary amount to its output): with one FP8 scale for its whole input, the other features
  flush to zero. Its neighbours see ordinary tensors.
* :func:`block_outlier_case`: a massive activation normalised by an RMSNorm before a wide layer
  (4096 input features, 128 blocks of 32): per-tensor FP8 flushes nearly all the layer's other
  inputs to zero, MXFP8's block scales only the outlier's block (under 1%): unsafe in
  ``fp8_e4m3``, safe in ``mxfp8``. It trains (the massive feature reaches the layer at ~64).

Each returns ``(model, batch, loss_fn)`` with a fixed seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Massive", "overflow_case", "outlier_case", "block_outlier_case", "CASES"]


class Massive(nn.Module):
    """Adds ``value`` to feature ``feature`` of its input (a parameter-free layer)."""

    def __init__(self, value: float = 1e5, feature: int = 3):
        super().__init__()
        self.value, self.feature = value, feature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device)
        offset[self.feature] = self.value
        return x + offset


def _batch(features: int, classes: int, n: int = 64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def overflow_case():
    """Layer "2" (Linear 64->64, weights x1e5) outputs up to ~1e5; layer "3" is a LayerNorm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
                          nn.Linear(64, 8))
    with torch.no_grad():
        model[2].weight.mul_(1e5)
    return model, _batch(16, 8), F.cross_entropy


def outlier_case():
    """Layer "2" (Linear 64->64) reads feature 3 at ~1e5; "0", "4" and "6" are ordinary."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), Massive(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        model[2].weight[:, 3].mul_(1e-5)
    return model, _batch(32, 10), F.cross_entropy


def block_outlier_case():
    """Layer "3" (Linear 4096->64) reads, after an RMSNorm, one feature at ~64 and the others
    at ~4e-5 (the norm of a massive activation, 1e6, at feature 3; the layer's weights on the
    other features are 1e4x larger, so they carry a fifth of its output). Per-tensor FP8 flushes
    nearly all of its inputs; MXFP8 flushes only the 31 other values of feature 3's block (under
    1%). "0", "5" and "7" are ordinary Linear layers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 4096), Massive(1e6), nn.RMSNorm(4096),
                          nn.Linear(4096, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    with torch.no_grad():
        model[3].weight.mul_(1e4)
        model[3].weight[:, 3].mul_(1e-4)
    return model, _batch(32, 10), F.cross_entropy


CASES = {"planted-overflow": overflow_case, "planted-outlier": outlier_case,
         "planted-block-outlier": block_outlier_case}
