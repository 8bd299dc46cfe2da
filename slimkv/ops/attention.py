"""Softmax attention kernels: a fused fast path and a plain reference kept for the tests.

Kernel layout: q is (batch, q_heads, q_len, dim), k is (batch, kv_heads, k_len, dim), v is
(batch, kv_heads, k_len, v_dim). q_heads must be a multiple of kv_heads (grouped queries share a
key/value head: query head h reads kv head h // (q_heads // kv_heads)). Queries are aligned to the
END of the keys: query i sits at key position i + k_len - q_len, which is how a cache that already
holds the past presents itself. ``window`` (tokens a query sees, itself included) limits how far
back a query looks; None means unlimited.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slimkv.ops.norm import compute_dtype

BACKENDS = ("sdpa", "reference")


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
    gqa = q.shape[1] != k.shape[1]
    if unlimited and q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if unlimited and q_len == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    mask = visibility_mask(q_len, k_len, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
