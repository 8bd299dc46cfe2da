"""``hybrid``: per-head cache roles. The KV heads listed in ``full_heads`` keep every token (the
heads that copy from far back: retrieval heads); the others keep attention sinks and a sliding
window (StreamingLLM), so their cache stops growing. The weights are GQA's; only what each KV head
remembers differs (DuoAttention's split of retrieval and streaming heads, Xiao et al. 2024).

Query head h reads KV head h // (n_heads / n_kv_heads), as in GQA, so a KV head's role is its
query heads' too. ``convert --to hybrid`` chooses the roles from measured retrieval scores
(``slimkv.convert.roles``). Positions are the tokens' own in both roles.
"""

from __future__ import annotations

import torch

from slimkv.attention.base import Presets, register_attention
from slimkv.attention.mha import MultiHeadAttention
from slimkv.attention.streaming import StreamingCache, kept_tokens, streaming_attention, streaming_attention_reference
from slimkv.common.buffer import dtype_bytes
from slimkv.common.checks import check_int
from slimkv.ops.attention import attend, buffer_segments, stored_decode_attention
from slimkv.ops.quantize import FULL, KVStorage


class HybridCache(StreamingCache):
    """The full heads' keys/values for every token, and the streaming heads' sinks and window
    (``StreamingCache``'s buffers, over the streaming heads only)."""

    def __init__(self, owner_spec: tuple, batch_size: int, full_heads: int, streaming_heads: int, head_dim: int, sink_len: int, window: int, *,
                 dtype, device, storage: KVStorage = FULL) -> None:
        super().__init__(owner_spec, batch_size, streaming_heads, head_dim, sink_len, window, dtype=dtype, device=device, storage=storage)
        self.full_k, self.full_v = self.row_buffer(full_heads, head_dim), self.row_buffer(full_heads, head_dim)

    def tensors(self):
        return iter((self.full_k, self.full_v, *super().tensors()))


class HybridAttention(MultiHeadAttention):
    """``hybrid``: KV heads ``full_heads`` exact, the rest ``sink_len`` sinks + a ``window``."""

    kind = "hybrid"

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, full_heads: list[int], window: int, sink_len: int = 4,
                 n_kv_heads: int | None = None, **common) -> None:
        check_int("window", window, 1)
        check_int("sink_len", sink_len, 0)
        super().__init__(d_model, n_heads, head_dim, n_kv_heads=n_kv_heads, **common)
        heads = list(full_heads) if isinstance(full_heads, (list, tuple)) else None
        if heads is None or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < self.n_kv_heads for h in heads) \
                or len(set(heads)) != len(heads):
            raise ValueError(f"full_heads={full_heads!r} must be a list of distinct KV head indices from 0 to {self.n_kv_heads - 1}")
        self.window, self.sink_len, self.full_heads = window, sink_len, sorted(heads)
        self.streaming_heads = [g for g in range(self.n_kv_heads) if g not in self.full_heads]
        group = self.n_heads // self.n_kv_heads
        # plain lists, and index tensors made from them on first use per device (``_select``): buffers would not survive
        # transformers' meta-device loading (non-persistent buffers are not restored)
        self._full_queries = [g * group + j for g in self.full_heads for j in range(group)]
        self._streaming_queries = [g * group + j for g in self.streaming_heads for j in range(group)]
        order = self._full_queries + self._streaming_queries
        self._query_order = [order.index(h) for h in range(self.n_heads)]  # head h of the output is row _query_order[h] of [full | streaming]
        self._indices: dict[tuple[torch.device, str], torch.Tensor | slice] = {}

    def _select(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """Heads (dim 1) of x: ``full`` / ``streaming`` KV heads, ``full_queries`` / ``streaming_queries``, or ``order``
        (the output's heads from [full | streaming] rows); a slice where they are consecutive, else an index tensor made once
        per device (a decode step runs this for every layer: a Python list as an index costs a tensor per call)."""
        key = (x.device, which)
        index = self._indices.get(key)
        if index is None:
            heads = {"full": self.full_heads, "streaming": self.streaming_heads, "full_queries": self._full_queries,
                     "streaming_queries": self._streaming_queries, "order": self._query_order}[which]
            consecutive = heads == list(range(heads[0], heads[0] + len(heads)))
            index = self._indices[key] = slice(heads[0], heads[0] + len(heads)) if consecutive else torch.tensor(heads, device=x.device)
        return x[:, index] if isinstance(index, slice) else x.index_select(1, index)

    def cache_spec(self) -> tuple:
        return super().cache_spec() + (self.sink_len, tuple(self.full_heads))

    def new_cache(self, batch_size: int, dtype=None, device=None, storage=None) -> HybridCache:
        b, dtype, device, storage = self._cache_args(batch_size, dtype, device, storage)
        return HybridCache(self.cache_spec(), b, len(self.full_heads), len(self.streaming_heads), self.head_dim, self.sink_len, self.window,
                           dtype=dtype, device=device, storage=storage)

    def _cache_bytes(self, seq_len: int, dtype: torch.dtype, batch_size: int) -> int:
        rows = seq_len * len(self.full_heads) + kept_tokens(seq_len, self.sink_len, self.window) * len(self.streaming_heads)
        return batch_size * rows * 2 * self.head_dim * dtype_bytes(dtype)

    def _forward(self, x: torch.Tensor, cache: HybridCache | None) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cache.seq_len if cache is not None else 0)  # (b, H, t, d), (b, G, t, d)
        out = self.attend_rows(q, k, v, cache)
        b, t = x.shape[:2]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: HybridCache | None) -> torch.Tensor:
        """``MultiHeadAttention.attend_rows`` with each KV head's role: (b, H, t, d) before the output projection."""
        start = cache.seq_len if cache is not None else 0
        t = q.shape[2]
        codes = cache is not None and cache.reads_codes(t, self.backend)
        parts = []
        if self.full_heads:
            qf, kf, vf = self._select(q, "full_queries"), self._select(k, "full"), self._select(v, "full")
            if codes:
                cache.full_k.store(kf)
                cache.full_v.store(vf)
                parts.append(stored_decode_attention(qf, buffer_segments(cache.full_k, cache.full_v)))
            else:
                if cache is not None:
                    kf, vf = cache.full_k.append(kf.detach()), cache.full_v.append(vf.detach())
                parts.append(attend(qf, kf, vf, backend=self.backend))
        if self.streaming_heads:
            qs, ks, vs = self._select(q, "streaming_queries"), self._select(k, "streaming"), self._select(v, "streaming")
            if cache is not None and cache.reads_stored(t, self.backend):
                parts.append(stored_decode_attention(qs, [*cache.stored_segments(), (ks, vs)]))
                cache.add(ks, vs)
            else:
                q_pos = torch.arange(start, start + t, device=q.device)
                keys, values, k_pos = (ks, vs, q_pos) if cache is None else cache.extend(ks, vs, q_pos)
                run = streaming_attention_reference if self.backend == "reference" else streaming_attention
                parts.append(run(qs, keys, values, q_pos, k_pos, self.sink_len, self.window))
        elif cache is not None:
            cache.seq_len += t  # no streaming head: only the full heads' buffers hold tokens
        return self._select(torch.cat(parts, dim=1), "order") if len(parts) > 1 else parts[0]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sink_len={self.sink_len}, full_heads={self.full_heads}"


register_attention(
    "hybrid",
    HybridAttention,
    example_options=[{"n_kv_heads": 2, "full_heads": [1], "window": 4, "sink_len": 2}, {"full_heads": [0, 2], "window": 1, "sink_len": 1},
                     {"n_kv_heads": 2, "full_heads": [], "window": 5, "sink_len": 0}, {"n_kv_heads": 2, "full_heads": [0, 1], "window": 3}],
    description="per-head cache roles: listed KV heads keep every token, the others sinks + a window (DuoAttention-style)",
    presets=Presets(comparable=lambda shape, explicit: ({"full_heads": [0], "window": max(1, shape.seq_len // 2), "sink_len": 4},
                                                        "KV head 0 exact, the rest a window of seq_len / 2 and 4 sinks")),
)
