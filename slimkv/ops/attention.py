"""Softmax attention kernels: a fused fast path and a plain reference kept for the tests.

Kernel layout: q is (batch, q_heads, q_len, dim), k is (batch, kv_heads, k_len, dim), v is
(batch, kv_heads, k_len, v_dim). q_heads must be a multiple of kv_heads (grouped queries share a
key/value head: query head h reads kv head h // (q_heads // kv_heads)). Queries are aligned to the
END of the keys: query i sits at key position i + k_len - q_len, which is how a cache that already
holds the past presents itself. ``window`` (tokens a query sees, itself included) limits how far
back a query looks; None means unlimited.

Memory: no path forms a (q_len, k_len) tensor for a long call. Causal self-attention goes to the
fused kernel (``is_causal``, no mask), with query/key and value widths made equal by zero channels
when they differ (MLA): the CPU fused kernel needs equal widths and otherwise falls back to a math
kernel that materialises every score. A call that needs a mask (a window, or fewer queries than
keys) and whose scores would exceed ``SCORE_BLOCK_ELEMENTS`` runs in query blocks, each against
only the keys it can see, so its extra memory is O(block x k_len), never O(q_len x k_len).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slimkv.common.buffer import GrowableBuffer
from slimkv.ops.codes import QuantizedRows
from slimkv.ops.native import (
    StoredRows,
    decode_kernel,
    kernel_for,
    native_decode_attention,
    native_stored_attention,
    supports_stored,
)
from slimkv.ops.norm import compute_dtype
from slimkv.ops.quantize import QuantizedBuffer

BACKENDS = ("sdpa", "reference")
SCORE_BLOCK_ELEMENTS = 1 << 22  # masked calls with more scores (batch x q_heads x q_len x k_len) run in query blocks
MIN_QUERY_BLOCK = 64  # the smallest such block, so that many heads or a large batch cannot force one-query blocks


def visibility_mask(q_len: int, k_len: int, window: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (q_len, k_len) mask, True where a query may read a key (causal, lower-right aligned)."""
    q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    k_pos = torch.arange(k_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Explicit softmax(q k^T * scale + mask) v, computed in float32 (float64 for float64 input)."""
    groups = q.shape[1] // k.shape[1]
    work = compute_dtype(q.dtype)
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    if groups > 1:
        kf = kf.repeat_interleave(groups, dim=1)
        vf = vf.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (qf @ kf.transpose(-1, -2)) * scale
    mask = visibility_mask(q.shape[2], k.shape[2], window, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ vf).to(q.dtype)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Causal (optionally windowed) attention; ``backend`` picks the fused kernel or the reference."""
    if backend == "reference":
        return reference_attention(q, k, v, window=window, scale=scale)
    q_len, k_len = q.shape[2], k.shape[2]
    unlimited = window is None or window >= k_len
    if unlimited and q_len == k_len:
        return causal_attention(q, k, v, scale=scale)
    if unlimited and q_len == 1:
        return decode_attention(q, k, v, scale=scale)
    return blocked_attention(q, k, v, window=window, scale=scale, block=query_block(q, k_len))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Causal self-attention (q_len == k_len) through the fused kernel, which never forms the
    (q_len, k_len) scores. When the value width differs from the query/key width (MLA: rope_dim +
    head_dim vs v_head_dim, or its shared latent), the narrower side gets zero channels first: zero
    query/key channels add nothing to a logit and zero value channels are cut from the output, so
    the result is unchanged, while the CPU kernel would otherwise fall back to a math kernel that
    holds every score (O(T^2) memory: 10 GB for 4 heads at 16K tokens)."""
    gqa = q.shape[1] != k.shape[1]
    width, v_width = k.shape[-1], v.shape[-1]
    if width == v_width:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    scale = 1.0 / math.sqrt(width) if scale is None else scale
    if v_width < width:
        v = F.pad(v, (0, width - v_width))
    else:
        q, k = F.pad(q, (0, v_width - width)), F.pad(k, (0, v_width - width))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)[..., :v_width]


def query_block(q: torch.Tensor, k_len: int) -> int:
    """Queries per block for a masked call: as many as keep batch x q_heads x block x k_len within
    ``SCORE_BLOCK_ELEMENTS``, at least ``MIN_QUERY_BLOCK`` (q_len or more: the whole call fits)."""
    batch, heads = q.shape[:2]
    return max(MIN_QUERY_BLOCK, SCORE_BLOCK_ELEMENTS // max(1, batch * heads * k_len))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """One masked call (mask (q_len, k_len), True = visible): SDPA, or ``grouped_attention`` for
    grouped query heads over keys and values of different widths."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and v.shape[-1] != k.shape[-1]:
        return grouped_attention(q, k, v, mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
    block: int,
) -> torch.Tensor:
    """Masked attention (queries aligned to the end of the keys, causal, optional window) in blocks
    of ``block`` queries. Each block attends to the keys it can see (from its first query's window
    start to its last query) with a (block, keys) mask, so no tensor of q_len x k_len elements is
    formed; with ``block >= q_len`` it is one ``masked_attention`` call with the full mask."""
    q_len, k_len = q.shape[2], k.shape[2]
    if block >= q_len:
        return masked_attention(q, k, v, visibility_mask(q_len, k_len, window, q.device), scale=scale)
    offset = k_len - q_len  # query i sits at key position i + offset
    outs = []
    for i0 in range(0, q_len, block):
        i1 = min(q_len, i0 + block)
        hi = i1 + offset  # one past the block's last query position
        lo = 0 if window is None else max(0, i0 + offset - window + 1)
        mask = visibility_mask(i1 - i0, hi - lo, window, q.device)  # the block's queries sit at the end of keys lo..hi-1
        outs.append(masked_attention(q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi], mask, scale=scale))
    return torch.cat(outs, dim=2)


def fold_groups(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, q_heads, q_len, dim) -> (batch, kv_heads, groups * q_len, dim): the query heads that
    share a key/value head become rows of one query block against it (row g * q_len + i is query i
    of the group's head g), so a kernel reads each shared key/value once, not once per query head."""
    b, q_heads, q_len, dim = q.shape
    return q.reshape(b, kv_heads, (q_heads // kv_heads) * q_len, dim)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Masked attention of grouped query heads, folded onto their shared key/value heads (the
    mask, (q_len, k_len), is repeated for every head of a group); same result as SDPA with
    ``enable_gqa``. ``attend`` uses it when values and keys differ in width (MLA's shared latent):
    the fused CPU kernel then takes a fallback that was measured 2x-10x slower (8 query heads over
    one 288-wide key head, 8K keys, 16-64 queries). With equal widths SDPA is as fast or faster."""
    b, q_heads, q_len, _ = q.shape
    groups = q_heads // k.shape[1]
    out = F.scaled_dot_product_attention(fold_groups(q, k.shape[1]), k, v, attn_mask=mask.repeat(groups, 1), scale=scale)
    return out.reshape(b, q_heads, q_len, v.shape[-1])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """One query per head attending to every key (a decode step; no mask is needed).

    float32 and bfloat16 on the CPU run slimkv's native single-pass kernel (``slimkv.ops.native``:
    keys and values streamed once in blocks with an online softmax, grouped query heads served from
    the same block, float32 arithmetic) when it could be built; everything else, and every call
    when it could not, runs
    ``matmul_decode_attention``. q (batch, q_heads, 1, dim), k/v (batch, kv_heads, k_len, dim / v_dim)
    -> (batch, q_heads, 1, v_dim)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    library = kernel_for([q], [(k, v)])
    if library is not None:
        return native_decode_attention([q], [(k, v)], scale, library)
    return matmul_decode_attention(q, k, v, scale=scale)


def buffer_segments(keys: GrowableBuffer | QuantizedBuffer, values: GrowableBuffer | QuantizedBuffer) -> list[tuple[StoredRows, StoredRows]]:
    """The (keys, values) segments of two buffers appended in step, as a cache appends them."""
    return list(zip(keys.segments(), values.segments()))


def stored_decode_attention(q: torch.Tensor, segments: list[tuple[StoredRows, StoredRows]], *, scale: float | None = None) -> torch.Tensor:
    """A decode step over a cache's (keys, values) segments as stored, read one after the other
    under one softmax: plain rows, or int8 / int4 codes (``QuantizedRows``) that the native
    kernel's quantized entry reads in place (``slimkv.ops.native.native_stored_attention``) when it
    takes the call, plain rows only through its plain entry (``native_decode_attention``, segment by
    segment: a bounded cache's sinks, window and new token need no concatenation); otherwise (no
    kernel, autograd) ``decode_attention`` over the segments' rows, codes dequantized in the query's
    dtype. q (batch, q_heads, 1, dim) -> (batch, q_heads, 1, v_dim)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if any(isinstance(k, QuantizedRows) for k, _ in segments):
        if supports_stored(q, segments):
            library = decode_kernel(q.dtype)
            if library is not None:
                return native_stored_attention(q, segments, scale, library)
    else:
        queries = [q] * len(segments)
        library = kernel_for(queries, segments)
        if library is not None:
            return native_decode_attention(queries, segments, scale, library)
    rows = [[part.dequantize(q.dtype) if isinstance(part, QuantizedRows) else part for part in pair] for pair in segments]
    keys, values = (torch.cat(side, dim=2) if len(side) > 1 else side[0] for side in zip(*rows))
    return decode_attention(q, keys, values, scale=scale)


def matmul_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """``decode_attention`` through torch: the query heads that share a key/value head are folded
    onto it (``fold_groups``; one row per head for MHA) and, in float32/float64, run as two matmuls
    around a softmax, so each cached key and value is read once per step whatever the number of
    query heads: the logits as keys x queries^T, (k_len, dim) x (dim, groups), with the cache as the
    large row-major operand (the form BLAS streams fastest for a few query rows), made contiguous
    before the softmax (a strided softmax output sends the next matmul to a slow path), then
    probabilities x values. Other dtypes run SDPA (torch's fused kernel) on the folded rows. ``decode_attention``
    comes here for every call the native kernel does not take; benchmarks/decode_native.py times
    this path against the kernel (benchmarks/results/decode_native_*thread.json). Shapes as
    ``decode_attention``."""
    b, q_heads, _, dim = q.shape
    rows = fold_groups(q, k.shape[1])
    if q.dtype in (torch.float32, torch.float64):
        scale = 1.0 / math.sqrt(dim) if scale is None else scale
        scores = torch.matmul(k, (rows * scale).transpose(-1, -2)).transpose(-1, -2).contiguous()  # (batch, kv_heads, groups, k_len)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
    else:
        out = F.scaled_dot_product_attention(rows, k, v, scale=scale)
    return out.reshape(b, q_heads, 1, v.shape[-1])
