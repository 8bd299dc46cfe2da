"""Normalisation layers shared by the attention mechanisms and the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimkv.ops.native import decode_kernel
from slimkv.ops.native_rows import native_rms_norm, supports_norm


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learnable gain.

    Computes in float32 (float64 for float64 inputs) and returns the input dtype. One row (a
    decode step) takes the native kernel's norm where it can (``slimkv.ops.native_rows.native_rms_norm``:
    the same float32 arithmetic in one call instead of torch's half-dozen); ``F.rms_norm`` is the
    reference it is tested against.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] and supports_norm(x, self.weight):
            library = decode_kernel(self.weight.dtype)
            if library is not None:
                return native_rms_norm(x, self.weight, self.eps, library)
        work = compute_dtype(x.dtype)
        y = F.rms_norm(x.to(work), (x.shape[-1],), self.weight.to(work), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
