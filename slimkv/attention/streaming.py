"""``streaming``: attention sinks + a sliding window (StreamingLLM, Xiao et al. 2023).

Each query sees the first ``sink_len`` tokens of the sequence (the "sinks" a pretrained model
parks attention on) and the newest ``window`` tokens, itself included; everything between is
forgotten. The cache holds at most ``sink_len + window - 1`` tokens, so it stops growing: the
bounded-memory baseline that KVM's compressed state is measured against (KVM with no state).
Positions are the tokens' own (no re-indexing inside the cache).
"""

from __future__ import annotations

import math

import torch

from slimkv.attention.base import LayerShape, Presets, register_attention
from slimkv.attention.cache import AttentionCache
from slimkv.attention.mha import MultiHeadAttention
from slimkv.common.buffer import GrowableBuffer, RowSpan, dtype_bytes
from slimkv.common.checks import check_int
from slimkv.ops.attention import attend, buffer_segments, masked_attention, query_block, stored_decode_attention
from slimkv.ops.codes import CodeSpans
from slimkv.ops.native import StoredRows
from slimkv.ops.norm import compute_dtype
from slimkv.ops.quantize import FULL, KVStorage


def kept_tokens(seq_len: int, sink_len: int, window: int) -> int:
    """Tokens a streaming cache holds after ``seq_len`` tokens: the sinks and the newest ``window - 1`` others."""
    return min(seq_len, sink_len) + min(max(seq_len - sink_len, 0), window - 1)


def streaming_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sink_len: int, window: int) -> torch.Tensor:
    """(q, k) boolean, True where a query at ``q_pos`` reads a key at ``k_pos``: causal, and the key is a sink or in the window."""
    q_pos, k_pos = q_pos[:, None], k_pos[None, :]
    return (k_pos <= q_pos) & ((k_pos < sink_len) | (k_pos > q_pos - window))


def streaming_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                                  sink_len: int, window: int) -> torch.Tensor:
    """Explicit softmax(q k^T / sqrt(d) + mask) v in float32: q (b, H, t, d), k/v (b, G, n, d)."""
    groups = q.shape[1] // k.shape[1]
    work = compute_dtype(q.dtype)
    kf, vf = k.to(work).repeat_interleave(groups, dim=1), v.to(work).repeat_interleave(groups, dim=1)
    scores = (q.to(work) @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~streaming_mask(q_pos, k_pos, sink_len, window), float("-inf"))
    return (scores.softmax(-1) @ vf).to(q.dtype)


def streaming_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                        sink_len: int, window: int) -> torch.Tensor:
    """The same through fused kernels: one query that sees every key (decode) takes the decode
    path, anything else masked SDPA in blocks of queries. With the keys in position order (as a
    prefill and ``StreamingCache.extend`` give them), a block reads only the sinks and the keys its
    window reaches, so a long prefill costs O(T x (block + window)), not O(T^2); keys out of order
    are read whole (never more than ``query_block`` scores a block)."""
    if q.shape[2] == 1 and bool(streaming_mask(q_pos, k_pos, sink_len, window).all()):
        return attend(q, k, v)
    ordered = k_pos.numel() < 2 or bool((k_pos[1:] > k_pos[:-1]).all())
    sinks = int((k_pos < sink_len).sum()) if ordered else 0
    block = query_block(q, sinks + 2 * window if ordered else k.shape[2])
    outs = []
    for i in range(0, q.shape[2], block):
        q_block = q_pos[i:i + block]
        if ordered:  # the sinks, then every key some query of the block may read
            lo = max(sinks, int(torch.searchsorted(k_pos, q_block[0] - window + 1)))
            hi = int(torch.searchsorted(k_pos, q_block[-1], right=True))
            keys, values = (torch.cat((x[:, :, :sinks], x[:, :, lo:hi]), dim=2) for x in (k, v))
            positions = torch.cat((k_pos[:sinks], k_pos[lo:hi]))
        else:
            keys, values, positions = k, v, k_pos
        outs.append(masked_attention(q[:, :, i:i + block], keys, values, streaming_mask(q_block, positions, sink_len, window)))
    return torch.cat(outs, dim=2)


class StreamingCache(AttentionCache):
    """The sink tokens' keys/values and those of the newest ``window - 1`` other tokens."""

    def __init__(self, owner_spec: tuple, batch_size: int, kv_heads: int, head_dim: int, sink_len: int, window: int, *, dtype, device,
                 storage: KVStorage = FULL) -> None:
        super().__init__(owner_spec, batch_size, dtype, device, storage)
        self.sink_len, self.window = sink_len, window
        # the few sink tokens stay in full precision (they take much of every query's attention)
        self.sink_k, self.sink_v = (GrowableBuffer(batch_size, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
        self.recent_k, self.recent_v = self.row_buffer(kv_heads, head_dim), self.row_buffer(kv_heads, head_dim)

    def tensors(self):
        return iter((self.sink_k, self.sink_v, self.recent_k, self.recent_v))

    def positions(self) -> torch.Tensor:
        """Positions of the cached keys, sinks first: (cached tokens,) long."""
        sinks, recent = len(self.sink_k), len(self.recent_k)
        return torch.cat((torch.arange(sinks), torch.arange(self.seq_len - recent, self.seq_len))).to(self.device)

    def stored_segments(self) -> list[tuple[StoredRows, StoredRows]]:
        """The cached (keys, values) as stored, sinks first, every one visible to the next token's
        query (a decode step reads them all: ``stored_decode_attention``; store the new token with
        ``add`` after reading, which may move what these segments point to)."""
        return [*buffer_segments(self.sink_k, self.sink_v), *buffer_segments(self.recent_k, self.recent_v)]

    def stored_spans(self) -> list[tuple[RowSpan | CodeSpans, RowSpan | CodeSpans]]:
        """``stored_segments`` named by spans of the buffers' storage (no views: a native block step's roles)."""
        return [*zip(self.sink_k.spans(), self.sink_v.spans()), *zip(self.recent_k.spans(), self.recent_v.spans())]

    def extend(self, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, positions) a call reads: the cached sinks and window, then the new tokens
        k/v (batch, kv_heads, n, d) at ``q_pos``; the new tokens are then stored (``add``)."""
        k_pos = torch.cat((self.positions(), q_pos))
        keys = torch.cat((self.sink_k.view(), self.recent_k.view(), k), dim=2)
        values = torch.cat((self.sink_v.view(), self.recent_v.view(), v), dim=2)
        self.add(k, v)
        return keys, values, k_pos

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new (batch, kv_heads, n, d) tokens (detached): sinks while there are fewer than ``sink_len``, then the window."""
        k, v = k.detach(), v.detach()
        to_sinks = max(0, min(self.sink_len - self.seq_len, k.shape[2]))
        if to_sinks:
            self.sink_k.store(k[:, :, :to_sinks])
            self.sink_v.store(v[:, :, :to_sinks])
        if to_sinks < k.shape[2]:
            self.recent_k.store(k[:, :, to_sinks:])
            self.recent_v.store(v[:, :, to_sinks:])
            self.recent_k.keep_last(self.window - 1)
            self.recent_v.keep_last(self.window - 1)
        self.seq_len += k.shape[2]


class StreamingAttention(MultiHeadAttention):
    """``streaming``: ``sink_len`` sink tokens + a sliding ``window``; ``n_kv_heads`` as in GQA."""

    kind = "streaming"

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, window: int, sink_len: int = 4,
                 n_kv_heads: int | None = None, **common) -> None:
        check_int("window", window, 1)
        check_int("sink_len", sink_len, 0)
        super().__init__(d_model, n_heads, head_dim, n_kv_heads=n_kv_heads, **common)
        self.window, self.sink_len = window, sink_len

    def cache_spec(self) -> tuple:
        return super().cache_spec() + (self.sink_len,)

    def new_cache(self, batch_size: int, dtype=None, device=None, storage=None) -> StreamingCache:
        b, dtype, device, storage = self._cache_args(batch_size, dtype, device, storage)
        return StreamingCache(self.cache_spec(), b, self.n_kv_heads, self.head_dim, self.sink_len, self.window, dtype=dtype, device=device,
                              storage=storage)

    def _cache_bytes(self, seq_len: int, dtype: torch.dtype, batch_size: int) -> int:
        return batch_size * kept_tokens(seq_len, self.sink_len, self.window) * 2 * self.n_kv_heads * self.head_dim * dtype_bytes(dtype)

    def _forward(self, x: torch.Tensor, cache: StreamingCache | None) -> torch.Tensor:
        start = cache.seq_len if cache is not None else 0
        q, k, v = self.project_qkv(x, start)
        b, t = x.shape[:2]
        if cache is not None and cache.reads_stored(t, self.backend):
            out = stored_decode_attention(q, [*cache.stored_segments(), (k, v)])
            cache.add(k, v)
        else:
            q_pos = torch.arange(start, start + t, device=x.device)
            keys, values, k_pos = (k, v, q_pos) if cache is None else cache.extend(k, v, q_pos)
            run = streaming_attention_reference if self.backend == "reference" else streaming_attention
            out = run(q, keys, values, q_pos, k_pos, self.sink_len, self.window)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sink_len={self.sink_len}"


def _streaming_comparable(shape: LayerShape, explicit: dict) -> tuple[dict, str]:
    return {"window": max(1, shape.seq_len // 2), "sink_len": 4}, "window = seq_len / 2, 4 sink tokens"


register_attention(
    "streaming",
    StreamingAttention,
    example_options=[{"window": 4, "sink_len": 2}, {"window": 1, "sink_len": 1}, {"window": 5, "sink_len": 3, "n_kv_heads": 2}],
    description="attention sinks + sliding window (StreamingLLM): bounded cache, no memory of the middle",
    presets=Presets(comparable=_streaming_comparable),
)
