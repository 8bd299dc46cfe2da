"""Linear layers whose decode steps take the native kernel.

A decode step multiplies one token's row by every projection's weights: a matrix-vector product
whose time is reading the weights. ``linear`` sends such a call (one row, no autograd, float32 or
bfloat16) to the native kernel's loop (``slimkv.ops.native.native_linear``, csrc/decode_linear.h),
which reads the weights at about twice the rate torch's one-row matmul was measured at on the
development machine; every other call (prefill, training, batches, other dtypes, no kernel) is
``torch.nn.functional.linear``, the plain reference the tests compare it with. ``Linear`` is
``nn.Linear`` with that forward: the same parameters, state dict and ``isinstance``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimkv.ops.native import decode_kernel, native_linear, supports_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in_features) -> (..., out_features), as ``F.linear``; one row through the native kernel where it takes the call."""
    if x.numel() == x.shape[-1] and supports_linear(x, weight, bias):
        library = decode_kernel(weight.dtype)
        if library is not None:
            return native_linear(x, weight, bias, library)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose one-row calls (decode steps) take the native kernel (``linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
