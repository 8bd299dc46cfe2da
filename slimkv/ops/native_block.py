"""A pre-norm block's decode step in one native call, or in two around the attention (csrc/decode_block.h).

``BlockWeights`` names what the calls read of a block (its norms, projections and MLP). One
``native_block_step`` call does, for one token, the attention's norm, q/k/v, RoPE, the new key
and value rows written into the cache's storage, the attention over each KV head's cached rows
(``CacheRole``: a GQA cache's heads alike, or per-head roles' exact rows and sinks + window; rows
or int8 / int4 codes, named by spans of the cache's storage), the output projection and residual, and the SwiGLU half, each by the entry
the module path would call and rounded where it rounds. For a block whose attention's cache is not
described that way (a sliding window; codes with no full-precision window),
``native_block_input`` does everything before the attention and ``native_block_output``
everything after it; an MLA block (``LatentWeights``) takes ``native_latent_input``, its absorbed
attention in Python, then ``native_block_output``. ``slimkv.model.block_step`` decides when a block may
take them; the module path is their reference (tests/model/test_block_step.py).
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from slimkv.common.buffer import RowSpan
from slimkv.ops.codes import CodeSpans
from slimkv.ops.native import attention_threads, segment_fields, stored_segment_fields
from slimkv.ops.native_build import BLOCK_ENTRIES, BLOCK_INPUT_ENTRIES, BLOCK_OUTPUT_ENTRIES, LATENT_INPUT_ENTRIES
from slimkv.ops.native_rows import linear_threads


class BlockWeights(NamedTuple):
    """The tensors a block's step reads, each contiguous in the block's dtype: the attention's norm
    gain, wq (n_heads * head_dim, d_model), wk and wv (kv_heads * head_dim, d_model), wo (d_model,
    n_heads * head_dim), the MLP's norm gain, gate and up (d_ff, d_model) and down (d_model, d_ff)."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class BlockShape(NamedTuple):
    """A block's sizes and constants: widths, heads, rotary channels, the norms' eps and the attention's scale."""

    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    rot_dim: int
    d_ff: int
    attn_eps: float
    mlp_eps: float
    scale: float


class LatentWeights(NamedTuple):
    """The tensors an MLA block's two-call step reads (``native_latent_input``, then
    ``native_block_output``), each contiguous in the block's dtype: the attention's norm gain, wq
    (n_heads * qk_dim, d_model), w_kv (the latent row's width, d_model: ``kv_down``), wo (d_model,
    n_heads * v_head_dim), the MLP's norm gain, gate and up (d_ff, d_model) and down (d_model, d_ff)."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    w_kv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class LatentShape(NamedTuple):
    """An MLA block's sizes and constants: widths, heads, the query heads' and the cache row's widths, rotary channels, the norms' eps."""

    d_model: int
    n_heads: int
    qk_dim: int
    row_width: int
    rot_dim: int
    d_ff: int
    attn_eps: float
    mlp_eps: float


def block_fields(weights: BlockWeights, shape: BlockShape) -> tuple[int, ...]:
    """What the entry keeps from step to step (the first 15 of its fields), built once per block."""
    return (*(w.data_ptr() for w in weights), shape.d_model, shape.n_heads, shape.kv_heads, shape.head_dim, shape.rot_dim, shape.d_ff)


class CacheRole(NamedTuple):
    """KV heads of a block whose cache has the same segments for a decode step: ``heads`` (KV head
    indices, in the order of the storage's head dimension), where their new key and value rows go
    (``new_keys`` / ``new_values``: one-row spans of the cache's storage) and the (keys, values)
    segments the attention reads, in order, under one softmax (spans of (1, len(heads), capacity,
    head_dim) storage, rows contiguous, or of int8 / int4 codes: ``CodeSpans``, read by the
    quantized entry as ``native_stored_attention`` reads ``QuantizedRows``; a segment may hold the
    new rows, which are written first). Spans, not views: a view costs microseconds to make, and a
    step of a model names a few hundred segments."""

    heads: Sequence[int]
    new_keys: RowSpan
    new_values: RowSpan
    segments: Sequence[tuple[RowSpan | CodeSpans, RowSpan | CodeSpans]]


def native_block_step(x: torch.Tensor, fields: tuple[int, ...], weights: BlockWeights, shape: BlockShape, rotation: torch.Tensor,
                      roles: Sequence[CacheRole], library: ctypes.CDLL) -> torch.Tensor:
    """One token's step through the block: x (1, 1, d_model) -> (1, 1, d_model) in x's dtype. Each
    role's new key and value rows are written where it says, then its query heads attend over its
    segments (a GQA cache: one role, every head, its live rows with the new one; per-head roles:
    one role per kind of cache); the caller then counts the rows as stored. ``fields``:
    ``block_fields(weights, shape)``; ``rotation``: the token's cos + i sin, rot_dim // 2
    contiguous complex64 values; the library is ``decode_kernel``'s for x's dtype. RuntimeError if
    the kernel fails (the rows may have been written, but none is counted)."""
    out = torch.empty_like(x)
    size = x.element_size()
    group = shape.n_heads // shape.kv_heads
    packed = array.array("q", (*fields, x.data_ptr(), out.data_ptr(), linear_threads((weights.wq.numel() + 2 * weights.wk.numel()) * size),
                               linear_threads(weights.wo.numel() * size), linear_threads(2 * weights.gate.numel() * size),
                               linear_threads(weights.down.numel() * size)))
    role_fields = array.array("q")
    for role in roles:
        codes = any(isinstance(k, CodeSpans) for k, _ in role.segments)
        keys = sum(len(k) if isinstance(k, CodeSpans) else k.count for k, _ in role.segments)
        role_fields.extend((len(role.heads), len(role.segments), attention_threads(4 * len(role.heads) * group * keys * shape.head_dim),
                            role.new_keys.address, role.new_keys.strides[1], role.new_values.address, role.new_values.strides[1],
                            int(codes), *role.heads))
        for k, v in role.segments:  # in the entry's own segment layout, the query's address left for the C side to fill
            role_fields.extend(stored_segment_fields(0, k, v) if codes else segment_fields(0, k, v))
    status = getattr(library, BLOCK_ENTRIES[x.dtype])(packed.buffer_info()[0], role_fields.buffer_info()[0], len(roles), rotation.data_ptr(),
                                                      shape.attn_eps, shape.mlp_eps, shape.scale)
    if status != 0:
        raise RuntimeError(f"native block step failed (status {status}: {'out of memory or threads' if status == 1 else 'bad arguments'})")
    return out


def native_block_input(x: torch.Tensor, weights: BlockWeights, shape: BlockShape, rotation: torch.Tensor, library: ctypes.CDLL) -> torch.Tensor:
    """The block's first half for one token: x (1, 1, d_model) -> (1, 1, (n_heads + 2 * kv_heads) *
    head_dim) in x's dtype, the rotated queries, the rotated keys and the values, one after the
    other (the module path's ``project_qkv`` before its views)."""
    qkv = torch.empty(1, 1, (shape.n_heads + 2 * shape.kv_heads) * shape.head_dim, dtype=x.dtype)
    status = getattr(library, BLOCK_INPUT_ENTRIES[x.dtype])(x.data_ptr(), weights.attn_norm.data_ptr(), shape.attn_eps, weights.wq.data_ptr(),
                                                            weights.wk.data_ptr(), weights.wv.data_ptr(), shape.d_model, shape.n_heads,
                                                            shape.kv_heads, shape.head_dim, shape.rot_dim, rotation.data_ptr(), qkv.data_ptr(),
                                                            linear_threads((weights.wq.numel() + 2 * weights.wk.numel()) * x.element_size()))
    if status != 0:
        raise RuntimeError(f"native block input failed (status {status}: {'out of memory' if status == 1 else 'bad arguments'})")
    return qkv


def native_latent_input(x: torch.Tensor, weights: LatentWeights, shape: LatentShape, rotation: torch.Tensor, library: ctypes.CDLL) -> torch.Tensor:
    """An MLA block's first half for one token: x (1, 1, d_model) -> (1, 1, n_heads * qk_dim +
    row_width) in x's dtype, the rotated queries then the cache row [rotated k_pe | c] (the module
    path's ``queries`` and ``latent_rows`` before their views)."""
    out = torch.empty(1, 1, shape.n_heads * shape.qk_dim + shape.row_width, dtype=x.dtype)
    status = getattr(library, LATENT_INPUT_ENTRIES[x.dtype])(x.data_ptr(), weights.attn_norm.data_ptr(), shape.attn_eps, weights.wq.data_ptr(),
                                                             weights.w_kv.data_ptr(), shape.d_model, shape.n_heads, shape.qk_dim, shape.row_width,
                                                             shape.rot_dim, rotation.data_ptr(), out.data_ptr(),
                                                             linear_threads((weights.wq.numel() + weights.w_kv.numel()) * x.element_size()))
    if status != 0:
        raise RuntimeError(f"native latent input failed (status {status}: {'out of memory' if status == 1 else 'bad arguments'})")
    return out


def native_block_output(x: torch.Tensor, attended: torch.Tensor, weights: BlockWeights | LatentWeights, shape: BlockShape | LatentShape,
                        library: ctypes.CDLL) -> torch.Tensor:
    """The block's second half for one token: x (1, 1, d_model) and the attention's output
    ``attended`` (Wo's input width, contiguous, x's dtype) -> h + mlp(norm(h)) with
    h = x + Wo attended, (1, 1, d_model) in x's dtype."""
    out = torch.empty_like(x)
    size = x.element_size()
    status = getattr(library, BLOCK_OUTPUT_ENTRIES[x.dtype])(x.data_ptr(), attended.data_ptr(), weights.wo.data_ptr(), weights.mlp_norm.data_ptr(),
                                                             shape.mlp_eps, weights.gate.data_ptr(), weights.up.data_ptr(), weights.down.data_ptr(),
                                                             shape.d_model, attended.numel(), shape.d_ff, out.data_ptr(),
                                                             linear_threads(weights.wo.numel() * size), linear_threads(2 * weights.gate.numel() * size),
                                                             linear_threads(weights.down.numel() * size))
    if status != 0:
        raise RuntimeError(f"native block output failed (status {status}: {'out of memory' if status == 1 else 'bad arguments'})")
    return out
