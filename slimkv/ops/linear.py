"""Linear layers whose decode steps take the native kernel.

A decode step multiplies one token's row by every projection's weights: a matrix-vector product
whose time is reading the weights. ``linear`` sends such a call (one row, no autograd, float32 or
bfloat16) to the native kernel's loop (``slimkv.ops.native_rows.native_linear``, csrc/decode_linear.h),
which reads the weights at about twice the rate torch's one-row matmul was measured at on the
development machine; every other call (prefill, training, batches, other dtypes, no kernel) is
``torch.nn.functional.linear``, the plain reference the tests compare it with. ``Linear`` is
``nn.Linear`` with that forward: the same parameters, state dict and ``isinstance``.

``heads_matmul`` takes a decode step's per-head products (a few rows, each through its own
head's small matrix) to the kernel the same way. ``project`` sends one row through several layers that share it (an attention layer's q, k and v,
an MLP's gate and up) in one native call, and ``glu_linear`` SwiGLU's down projection of
silu(gate) * up: a decode step pays Python's and the dispatcher's cost per call, which on SmolLM2
was as large as reading the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from slimkv.ops.native import decode_kernel
from slimkv.ops.native_rows import (
    heads_layout,
    native_heads_matmul,
    native_linear,
    native_project,
    native_swiglu_residual,
    supports_linear,
    supports_swiglu_residual,
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in_features) -> (..., out_features), as ``F.linear``; one row through the native kernel where it takes the call."""
    if x.numel() == x.shape[-1] and supports_linear(x, weight, bias):
        library = decode_kernel(weight.dtype)
        if library is not None:
            return native_linear(x, weight, bias, library)
    return F.linear(x, weight, bias)


def _native_rows(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]):
    """The kernel library when one native call takes x through every layer (one row, one weight dtype), else None."""
    if x.numel() != x.shape[-1]:
        return None
    dtype = weights[0].dtype
    for weight, bias in zip(weights, biases, strict=True):
        if weight.dtype != dtype or not supports_linear(x, weight, bias):
            return None
    return decode_kernel(dtype)


def project(x: torch.Tensor, layers: Sequence[nn.Linear]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]``: one row through every layer in one native call where the
    kernel takes it, else each layer's own forward."""
    weights, biases = [layer.weight for layer in layers], [layer.bias for layer in layers]
    library = _native_rows(x, weights, biases)
    if library is None:
        return [layer(x) for layer in layers]
    return native_project(x, weights, biases, library)


def glu_linear(gate: torch.Tensor, up: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(F.silu(gate) * up)`` (SwiGLU's down projection); one row in one native call (silu and
    the product rounded to the row's dtype, as torch rounds them), else through torch."""
    if gate.dtype == up.dtype and gate.shape == up.shape and _native_rows(up, [layer.weight], [layer.bias]) is not None:
        return native_project(up, [layer.weight], [layer.bias], decode_kernel(layer.weight.dtype), gate=gate)[0]
    return layer(F.silu(gate) * up)


def swiglu_residual(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> torch.Tensor | None:
    """x + down(silu(gate n) * up n) with n = rms_norm(x) * norm_weight (a pre-norm SwiGLU block's
    second half) for one row in one native call, or None where the kernel does not take it (the
    caller then composes its own modules, the plain path this is tested against)."""
    if any(layer.bias is not None for layer in (gate, up, down)):
        return None
    if not supports_swiglu_residual(x, norm_weight, gate.weight, up.weight, down.weight):  # one row, dtypes, shapes, no autograd
        return None
    library = decode_kernel(x.dtype)
    return None if library is None else native_swiglu_residual(x, norm_weight, eps, gate.weight, up.weight, down.weight, library)


def heads_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(x, w)`` for per-head weights: x (..., matrices, rows_per_matrix, in), w
    (matrices, in, out) (contiguous, or a ``transpose(-1, -2)`` view of contiguous (matrices, out,
    in) weights). A decode step's few rows (MLA absorbing W_UK into its queries and applying W_UV
    to its context; LRKV's latent queries and values) in bfloat16 take one native call
    (``native_heads_matmul``): torch's batched bfloat16 product of SmolLM2's MLA shapes (9 heads of
    64 x 160) took 34-38 us where it took 16-18, and a decode step of its MLA 0.5 conversion was
    1.06x faster with it (2026-12-07, a 2-core Intel Xeon with AVX-512, one thread, load under 1). In float32 torch's product was the
    faster (8-15 us against 15-22), so float32 calls, like every other call, take torch's product,
    the plain reference."""
    layout = heads_layout(x, w) if w.dtype == torch.bfloat16 else None
    if layout is not None:
        library = decode_kernel(w.dtype)
        if library is not None:
            return native_heads_matmul(x, w, layout, library)
    return torch.matmul(x, w)


class Linear(nn.Linear):
    """``nn.Linear`` whose one-row calls (decode steps) take the native kernel (``linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
