"""Multi-head attention and its key/value-sharing variants (GQA, MQA).

One class serves the three kinds: ``mha`` (one K/V head per query head), ``gqa`` (``n_kv_heads``
groups) and ``mqa`` (a single K/V head). The cache stores rotated keys and values, in kernel
layout (batch, kv_heads, time, head_dim), in growable buffers.
"""

from __future__ import annotations

import torch

from slimkv.attention.base import Attention, LayerShape, Presets, register_attention
from slimkv.attention.cache import AttentionCache
from slimkv.common.buffer import dtype_bytes
from slimkv.common.checks import check_int
from slimkv.ops.attention import attend, buffer_segments, stored_decode_attention
from slimkv.ops.linear import Linear, project
from slimkv.ops.quantize import FULL, KVStorage


class KVCache(AttentionCache):
    """Keys and values of every past token, or of the newest ``keep`` tokens when ``keep`` is set."""

    def __init__(self, owner_spec: tuple, batch_size: int, kv_heads: int, head_dim: int, *, dtype, device, keep: int | None = None,
                 storage: KVStorage = FULL) -> None:
        super().__init__(owner_spec, batch_size, dtype, device, storage)
        self.keep = keep
        self.k, self.v = self.row_buffer(kv_heads, head_dim), self.row_buffer(kv_heads, head_dim)

    def tensors(self):
        return iter((self.k, self.v))

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new (batch, kv_heads, n, head_dim) keys/values; return every key/value the new
        queries may need (the retained past plus the new ones). With autograd recording, the
        returned tensors are a fresh copy (differentiable in the new tokens) and the buffers store
        the new tokens detached."""
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            keys, values = torch.cat((self.k.view(), k), dim=2), torch.cat((self.v.view(), v), dim=2)
            self.k.append(k.detach())
            self.v.append(v.detach())
        else:
            keys, values = self.k.append(k), self.v.append(v)
        self.seq_len += k.shape[2]
        return keys, values

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append new keys/values without returning the history (a decode step that reads the
        buffers as stored: ``stored_decode_attention``)."""
        self.k.store(k.detach())
        self.v.store(v.detach())
        self.seq_len += k.shape[2]

    def trim(self) -> None:
        """Forget what no future query can see (sliding windows)."""
        if self.keep is not None:
            self.k.keep_last(self.keep)
            self.v.keep_last(self.keep)


class MultiHeadAttention(Attention):
    """Softmax attention with ``n_kv_heads`` key/value heads shared by groups of query heads, and
    an optional sliding ``window`` (tokens a query sees, itself included)."""

    kind = "mha"

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, n_kv_heads: int | None = None, window: int | None = None, **common) -> None:
        check_int("n_heads", n_heads, 1)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_int("n_kv_heads", n_kv_heads, 1)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        if window is not None:
            check_int("window", window, 1)
        super().__init__(d_model, n_heads, head_dim, **common)
        self.n_kv_heads, self.window = n_kv_heads, window
        hd, bias = self.head_dim, self.use_bias
        self.q_proj = Linear(d_model, n_heads * hd, bias=bias)
        self.k_proj = Linear(d_model, n_kv_heads * hd, bias=bias)
        self.v_proj = Linear(d_model, n_kv_heads * hd, bias=bias)
        self.o_proj = Linear(n_heads * hd, d_model, bias=bias)
        self._make_qk_norms(hd, hd)

    def cache_spec(self) -> tuple:
        return super().cache_spec() + (self.n_kv_heads, self.window)

    def head_qk_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W^Q_h, W^K_h), each (n_heads, d_model, head_dim); a query head gets its group's key map."""
        hd, groups = self.head_dim, self.n_heads // self.n_kv_heads
        wq = self.q_proj.weight.view(self.n_heads, hd, self.d_model).transpose(1, 2)
        wk = self.k_proj.weight.view(self.n_kv_heads, hd, self.d_model).transpose(1, 2).repeat_interleave(groups, dim=0)
        return self._with_qk_gains(wq, wk)

    def new_cache(self, batch_size: int, dtype=None, device=None, storage=None) -> KVCache:
        b, dtype, device, storage = self._cache_args(batch_size, dtype, device, storage)
        keep = None if self.window is None else self.window - 1
        return KVCache(self.cache_spec(), b, self.n_kv_heads, self.head_dim, dtype=dtype, device=device, keep=keep, storage=storage)

    def _cache_bytes(self, seq_len: int, dtype: torch.dtype, batch_size: int) -> int:
        kept = seq_len if self.window is None else min(seq_len, self.window - 1)
        return batch_size * kept * 2 * self.n_kv_heads * self.head_dim * dtype_bytes(dtype)

    def project_qkv(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys, values in kernel layout (batch, heads, time, head_dim), normed and rotated."""
        b, t, _ = x.shape
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))  # one native call for a decode step's row
        q = self.q_norm(q.view(b, t, self.n_heads, self.head_dim))
        k = self.k_norm(k.view(b, t, self.n_kv_heads, self.head_dim))
        v = v.view(b, t, self.n_kv_heads, self.head_dim)
        q, k = self.rotary(q, start), self.rotary(k, start)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _forward(self, x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cache.seq_len if cache is not None else 0)
        out = self.attend_rows(q, k, v, cache)
        b, t = x.shape[:2]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """The attention between ``project_qkv``'s rows and the cache, which takes the new keys and
        values: (batch, n_heads, time, head_dim), before the output projection. A decode step whose
        block computes the projections in one native call (``slimkv.model.block_step``) calls this."""
        if cache is not None and self.window is None and cache.reads_codes(q.shape[2], self.backend):
            cache.store(k, v)
            out = stored_decode_attention(q, buffer_segments(cache.k, cache.v))
        else:
            if cache is not None:
                k, v = cache.extend(k, v)
            out = attend(q, k, v, window=self.window, backend=self.backend)
        if cache is not None:
            cache.trim()
        return out

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return super().extra_repr() + f", n_kv_heads={self.n_kv_heads}{window}"


class MHA(MultiHeadAttention):
    """``mha``: one key/value head per query head."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, **common) -> None:
        super().__init__(d_model, n_heads, head_dim, **common)


class GQA(MultiHeadAttention):
    """``gqa``: ``n_kv_heads`` key/value heads, each shared by n_heads / n_kv_heads query heads."""

    kind = "gqa"

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, n_kv_heads: int, **common) -> None:
        super().__init__(d_model, n_heads, head_dim, n_kv_heads=n_kv_heads, **common)


class MQA(MultiHeadAttention):
    """``mqa``: a single key/value head shared by every query head."""

    kind = "mqa"

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, **common) -> None:
        super().__init__(d_model, n_heads, head_dim, n_kv_heads=1, **common)


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap`` (at least 1)."""
    return max(d for d in range(1, max(cap, 1) + 1) if n % d == 0)


def _gqa_comparable(shape: LayerShape, explicit: dict) -> tuple[dict, str]:
    kv = largest_divisor_at_most(shape.n_heads, shape.n_heads // 2)
    return {"n_kv_heads": kv}, f"n_kv_heads = H/2 ({kv} of {shape.n_heads}): half of MHA's cache"


def _gqa_sizes(shape: LayerShape) -> list[tuple[str, dict]]:
    counts = [d for d in range(2, shape.n_heads) if shape.n_heads % d == 0] or [largest_divisor_at_most(shape.n_heads, shape.n_heads // 2)]
    return [(f"gqa:n_kv_heads={d}", {"n_kv_heads": d}) for d in counts]


register_attention(
    "mha",
    MHA,
    description="multi-head attention",
    presets=Presets(comparable=lambda shape, explicit: ({}, "no options"), demo=("mha",)),
)
register_attention(
    "gqa",
    GQA,
    example_options=[{"n_kv_heads": 2}],
    description="grouped-query attention",
    presets=Presets(
        comparable=_gqa_comparable,
        decode=lambda shape: [("gqa", {"n_kv_heads": largest_divisor_at_most(shape.n_heads, shape.n_heads // 4)})],
        sizes=_gqa_sizes,
        demo=("gqa",),
    ),
)
register_attention(
    "mqa",
    MQA,
    description="multi-query attention",
    presets=Presets(comparable=lambda shape, explicit: ({}, "no options"), demo=("mqa",)),
)
