"""A decode step's one-row work through the native kernel (csrc/decode_linear.h): the projections
(``native_project``: one row through the linear layers that share it), the RMS norm, RoPE on one
token's heads and a pre-norm SwiGLU block's second half, each in the row's dtype (float32 or
bfloat16: a bfloat16 row is widened and its results rounded in C, where torch's path rounds).

Each ``native_*`` has a ``supports_*`` that says whether it takes a call (one row on the CPU, no
autograd, no torch dispatch mode: a FLOP counter must see torch's ops); the callers in
``slimkv.ops.linear``, ``slimkv.ops.norm`` and ``slimkv.ops.rope`` take torch's path otherwise, and
that path is the plain reference tests/ops/test_native_linear.py compares every entry with.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from slimkv.ops.native_build import HEADS_ENTRIES, NORM_ENTRIES, PROJECT_ENTRIES, ROTATE_ENTRIES, SWIGLU_ENTRIES

# Measured by benchmarks/decode_threads.py (results/decode/decode_threads_2thread.md): with threads that need no start
# per call, two gained from SmolLM2's float32 projections (1.1 MB and up). From 1 MiB down to 256 KiB (2026-12-06,
# Intel Xeon, two threads, SmolLM2 at 16K in bfloat16, the two values alternating in one process, 8 rounds of 3 steps)
# the bfloat16 output projection (663 KB) and gqa 0.5's one-head q/k/v (811 KB) split too: 1.4-3.0% less per step for
# the exact copy, gqa 0.5, mla 0.5 and the int8 plan alike.
PARALLEL_MIN_BYTES = 1 << 18  # a linear layer's weights (a one-row product reads them once: bytes are its work)


def linear_threads(weight_bytes: int) -> int:
    """Threads for one row through linear layers of ``weight_bytes`` in all (the bytes are the work of
    a one-row product): torch's thread count from ``PARALLEL_MIN_BYTES`` up, else 1."""
    return torch.get_num_threads() if weight_bytes >= PARALLEL_MIN_BYTES else 1


def supports_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``native_linear`` takes this call: one row (x's elements are one input row), float32
    or bfloat16 weights (and bias) with x of the same dtype on the CPU, weight rows contiguous, no
    autograd, and no torch dispatch mode (a FLOP counter must see the call). Whatever torch's
    thread count: on two threads the kernel's loop beat torch's one-row matmul at every SmolLM2
    shape (``benchmarks/decode_threads.py``)."""
    if weight.dtype not in PROJECT_ENTRIES or x.dtype != weight.dtype or x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if weight.dim() != 2 or x.numel() != weight.shape[1] or x.shape[-1] != weight.shape[1] or not weight.is_contiguous():
        return False
    if bias is not None and (bias.dtype != weight.dtype or bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    return torch._C._len_torch_dispatch_stack() == 0


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, library: ctypes.CDLL) -> torch.Tensor:
    """x (..., in_features) holding one row -> (..., out_features) = x W^T + bias, in x's dtype (float32
    sums, rounded once). Call ``supports_linear`` first, and pass the library ``decode_kernel`` gave
    for the weights' dtype."""
    return native_project(x, (weight,), (bias,), library)[0]


def native_project(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], library: ctypes.CDLL,
                   gate: torch.Tensor | None = None) -> list[torch.Tensor]:
    """x (..., in_features) holding one row through several linear layers in one call: ``[x W_c^T
    + b_c]``, each in x's dtype (float32 sums, rounded once). With ``gate`` (x's shape and dtype),
    the input is silu(gate) * x, each of silu and the product rounded to x's dtype as torch rounds
    them. The row, the gate and the outputs stay in x's dtype (a bfloat16 row is widened in C, not
    by a torch conversion per call). Call ``supports_linear`` for each weight first; the weights
    share a dtype, the library is ``decode_kernel``'s for it. The outputs are views of one buffer."""
    calls = _projections(tuple(w.data_ptr() for w in weights), tuple(0 if b is None else b.data_ptr() for b in biases),
                         tuple(w.shape[0] for w in weights), weights[0].shape[1] * weights[0].element_size())
    row = x if x.is_contiguous() else x.contiguous()
    gate_row = None if gate is None else gate if gate.is_contiguous() else gate.contiguous()
    out = torch.empty(*x.shape[:-1], calls.total, dtype=x.dtype)  # sizes unpacked: a torch.Size argument costs 3 us here
    status = getattr(library, PROJECT_ENTRIES[weights[0].dtype])(row.data_ptr(), 0 if gate_row is None else gate_row.data_ptr(), x.shape[-1],
                                                                len(weights), calls.weights, calls.biases, calls.sizes, out.data_ptr(),
                                                                linear_threads(calls.weight_bytes))
    if status != 0:
        raise RuntimeError(f"native projections failed (status {status}: {'out of memory' if status == 1 else 'bad arguments'})")
    return list(out.split_with_sizes(calls.split, -1)) if len(weights) > 1 else [out]  # split_with_sizes: half of Tensor.split's cost


class _Projections(NamedTuple):
    """One set of projections as the C entry takes them: weight and bias addresses and output sizes
    as C arrays, the sizes as a list (the outputs' split), their sum, and the weights' bytes."""

    weights: ctypes.Array
    biases: ctypes.Array
    sizes: ctypes.Array
    split: list[int]
    total: int
    weight_bytes: int


@functools.lru_cache(maxsize=1024)
def _projections(weights: tuple[int, ...], biases: tuple[int, ...], sizes: tuple[int, ...], row_bytes: int) -> _Projections:
    """A set of projections' ``_Projections``, built once per set, since a decode step calls the
    same layers every step. Keyed by the addresses, output sizes and bytes per weight row
    themselves, so what is found always describes what it is looked up by."""
    count = len(weights)
    return _Projections((ctypes.c_void_p * count)(*weights), (ctypes.c_void_p * count)(*biases), (ctypes.c_int64 * count)(*sizes), list(sizes),
                        sum(sizes), sum(sizes) * row_bytes)


HEADS_ROWS_MAX = 256
"""Most rows ``native_heads_matmul`` takes: it reads a head's matrix once per row (a decode step's
handful of rows), where torch's batched product serves a prefill's many rows better."""


def heads_layout(x: torch.Tensor, w: torch.Tensor) -> int | None:
    """Whether ``native_heads_matmul`` takes ``torch.matmul(x, w)``, and how it reads w: 1 for w
    (matrices, in, out) contiguous, 0 for its transpose's layout (w a ``transpose(-1, -2)`` view of
    contiguous (matrices, out, in) weights), None where it does not take the call. x (...,
    matrices, rows_per_matrix, in) holds at most ``HEADS_ROWS_MAX`` rows, float32 or bfloat16 like w,
    on the CPU; no autograd, no torch dispatch mode (a FLOP counter must see torch's product)."""
    if x.dtype != w.dtype or w.dtype not in HEADS_ENTRIES or not (x.is_cpu and w.is_cpu) or w.dim() != 3 or x.dim() < 3:
        return None
    x_shape, w_shape = x.shape, w.shape
    if x_shape[-3] != w_shape[0] or x_shape[-1] != w_shape[1] or not 0 < x.numel() <= HEADS_ROWS_MAX * x_shape[-1]:
        return None
    if (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) or torch._C._len_torch_dispatch_stack() > 0:
        return None
    strides = w.stride()
    if strides[0] != w_shape[1] * w_shape[2]:
        return None
    return 1 if strides[1:] == (w_shape[2], 1) else 0 if strides[1:] == (1, w_shape[1]) else None


def native_heads_matmul(x: torch.Tensor, w: torch.Tensor, layout: int, library: ctypes.CDLL) -> torch.Tensor:
    """``torch.matmul(x, w)`` for a decode step's per-head products: x (..., matrices, rows_per_matrix,
    in), w (matrices, in, out), each row through its own head's matrix in one native call (float32
    sums, rounded once to x's dtype). ``layout``: ``heads_layout(x, w)``; the library is
    ``decode_kernel``'s for w's dtype. -> (..., matrices, rows_per_matrix, out), contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    matrices, in_f, out_f = w.shape
    out = torch.empty(*x.shape[:-1], out_f, dtype=x.dtype)
    status = getattr(library, HEADS_ENTRIES[w.dtype])(rows.data_ptr(), rows.stride(0), rows.shape[0], w.data_ptr(), matrices, x.shape[-2], in_f,
                                                     out_f, layout, out.data_ptr(), out_f)
    if status != 0:
        raise RuntimeError(f"native per-head products failed (status {status}: {'out of memory' if status == 1 else 'bad arguments'})")
    return out


def supports_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``native_rms_norm`` takes this call: one row on the CPU, float32 or bfloat16 gain of
    the row's width and dtype, no autograd, no torch dispatch mode."""
    if weight.dtype not in NORM_ENTRIES or x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype != weight.dtype:
        return False
    if x.numel() != x.shape[-1] or weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return torch._C._len_torch_dispatch_stack() == 0


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, library: ctypes.CDLL) -> torch.Tensor:
    """One row's RMS norm with gain ``weight``, computed in float32 and rounded once to x's dtype (as
    ``torch.nn.functional.rms_norm`` on the float32 row, cast back). Call ``supports_norm`` first; the
    library is ``decode_kernel``'s for the gain's dtype."""
    row = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(row)
    status = getattr(library, NORM_ENTRIES[weight.dtype])(row.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[-1], eps)
    if status != 0:
        raise RuntimeError(f"native RMS norm failed (status {status}: bad arguments)")
    return out


def supports_rotation(x: torch.Tensor) -> bool:
    """Whether ``native_rotate`` takes this call: one token's heads, x (..., heads, head_dim) float32
    or bfloat16, contiguous, on the CPU, no autograd, no torch dispatch mode."""
    if x.dtype not in ROTATE_ENTRIES or x.device.type != "cpu" or x.dim() < 2 or x.numel() != x.shape[-2] * x.shape[-1] or not x.is_contiguous():
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return torch._C._len_torch_dispatch_stack() == 0


def native_rotate(x: torch.Tensor, rotation: torch.Tensor, rot_dim: int, library: ctypes.CDLL) -> torch.Tensor:
    """RoPE on one token's heads, x (..., heads, head_dim): the first ``rot_dim`` channels as
    adjacent pairs times ``rotation`` (complex64, rot_dim // 2 values, contiguous: cos + i sin of
    the token's position), in float32, rounded once to x's dtype. Call ``supports_rotation``
    first; the library is ``decode_kernel``'s for x's dtype."""
    if rotation.dtype != torch.complex64 or rotation.numel() != rot_dim // 2 or not rotation.is_contiguous():
        raise ValueError(f"rotation must be {rot_dim // 2} contiguous complex64 values, got {rotation.numel()} of {rotation.dtype}")
    out = torch.empty_like(x)
    status = getattr(library, ROTATE_ENTRIES[x.dtype])(x.data_ptr(), x.shape[-2], x.shape[-1], rot_dim, rotation.data_ptr(), out.data_ptr())
    if status != 0:
        raise RuntimeError(f"native rotation failed (status {status}: bad arguments)")
    return out


def native_swiglu_residual(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                           library: ctypes.CDLL) -> torch.Tensor:
    """x + down(silu(gate n) * up n), n = rms_norm(x) * norm_weight, for one row (..., d_model) in one
    call (a pre-norm SwiGLU block's second half), each step rounded to x's dtype where torch's path
    rounds. Call ``supports_swiglu_residual`` first; the library is ``decode_kernel``'s for x's dtype."""
    row = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(row)
    d_ff = gate.shape[0]
    status = getattr(library, SWIGLU_ENTRIES[x.dtype])(row.data_ptr(), norm_weight.data_ptr(), eps, gate.data_ptr(), up.data_ptr(), down.data_ptr(),
                                                       x.shape[-1], d_ff, out.data_ptr(), linear_threads(2 * gate.numel() * gate.element_size()),
                                                       linear_threads(down.numel() * down.element_size()))
    if status != 0:
        raise RuntimeError(f"native SwiGLU block failed (status {status}: {'out of memory' if status == 1 else 'bad arguments'})")
    return out


def supports_swiglu_residual(x: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``native_swiglu_residual`` takes this call: ``supports_norm`` for the row and gain,
    gate and up (d_ff, d_model) and down (d_model, d_ff) contiguous in x's dtype, none needing grad."""
    if not supports_norm(x, norm_weight):
        return False
    d_model, d_ff = x.shape[-1], gate.shape[0]
    if gate.shape != (d_ff, d_model) or up.shape != (d_ff, d_model) or down.shape != (d_model, d_ff):
        return False
    if any(w.dtype != x.dtype or w.device.type != "cpu" or not w.is_contiguous() for w in (gate, up, down)):
        return False
    return not (torch.is_grad_enabled() and any(w.requires_grad for w in (gate, up, down)))
