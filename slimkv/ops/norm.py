"""Normalisation layers shared by the attention mechanisms and the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learnable gain.

    Computes in float32 (float64 for float64 inputs) and returns the input dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = compute_dtype(x.dtype)
        y = F.rms_norm(x.to(work), (x.shape[-1],), self.weight.to(work), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
