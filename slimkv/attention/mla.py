"""Multi-head latent attention (MLA, DeepSeek-V2), the latent-cache baseline.

docs/mla.md explains the design. Per token, one matmul maps x (d_model) to a latent c (``kv_rank``)
and a rotary key k_pe (``rope_dim``) shared by every head. c is RMS-normalised (``latent_norm``,
default on; off, c is linear in x, as a conversion from a pretrained GQA model needs); head h reads

    key_h   = [rotate(k_pe) | c W_UK_h]      (rope_dim + head_dim channels)
    value_h = c W_UV_h                       (v_head_dim channels)
    query_h = [rotate(q_pe,h) | q_nope,h]    (rope_dim + head_dim channels)

with W_UK_h (kv_rank x head_dim) and W_UV_h (kv_rank x v_head_dim) acting on row vectors (so
W_UK_h is head h's block of ``k_up.weight``, transposed). Queries come from x directly
(``q_rank=None``) or through a normalised latent (x -> c_q (q_rank) -> RMSNorm -> up). Softmax scale
1/sqrt(head_dim + rope_dim).

Head dims: ``head_dim`` is the per-head *content* ("nope") width of queries and keys, as
DeepSeek's qk_nope_head_dim; each head's query/key is head_dim + rope_dim wide and its value
``v_head_dim`` (default head_dim) wide. The rotary channels come first, as everywhere in slimkv.

Common options:

* ``rope``: ``rope_dim`` defaults to the channels the common rope options would rotate in an MHA
  head of ``head_dim`` (``full``: head_dim, ``partial``: rope_fraction x head_dim rounded down to
  even, ``none``: 0). An explicit ``rope_dim`` (even) overrides that (``rope_fraction`` then plays
  no part); ``rope="none"`` allows only rope_dim 0, and rope_dim 0 needs ``rope="none"``.
* ``rope_frequencies``: one inverse frequency per rotary pair (rope_dim / 2 positive values, any
  order, repeats allowed) instead of the ladder rope_theta^(-2i/rope_dim); without ``rope_dim`` it
  sets rope_dim = 2 len(rope_frequencies) (overriding ``rope_fraction``, as an explicit rope_dim
  does). Like ``rope_theta`` it plays no part when nothing rotates (``rope="none"``).
* ``qk_norm``: RMSNorm over each head's whole query and over the shared rotary key k_pe (before
  rotation). The content keys already come from the normalised latent; a per-head norm of c W_UK_h
  would be non-linear in c and so could not be absorbed into the queries.
* ``bias``: on every projection of an activation (down-projections, query projections, output).
  W_UK and W_UV have none: a key bias only shifts all logits of a query equally (softmax ignores
  it) and a value bias passes through the softmax average unchanged, i.e. it is an output bias.

Cache: the (normalised) latent and the rotated rotary key, (kv_rank + rope_dim) elements per token
per layer, in one buffer of kernel layout (batch, 1, time, rope_dim + kv_rank) whose rows are
[k_pe | c]. No per-head tensor is ever cached. With grad enabled a cached call is differentiable in
its own tokens; the cache stores detached rows (earlier calls' tokens are constants, and a cache
never keeps an autograd graph alive).

Two exact paths, picked by the option ``decode_path``:

* ``"absorbed"``: queries absorb W_UK (q~_h = q_nope,h W_UK_h^T, kv_rank wide), so the logits are
  [q_pe,h | q~_h] . [k_pe,t | c_t] against the cache rows themselves, one key/value head shared by
  all query heads; W_UV applies after the softmax: o_h = (a_h C) W_UV_h.
* ``"expanded"``: per-head keys and values are rebuilt from every cached latent and fed to SDPA.
* ``"auto"`` (default): whichever costs fewer multiply-adds for the call (``absorbed_is_cheaper``):
  absorbed for decode steps and short chunks, expanded for training and long prefill chunks.

Shapes: activations (batch, time, heads, dim); kernels and caches (batch, heads, time, dim).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from slimkv.attention.base import Attention, LayerShape, Presets, register_attention
from slimkv.attention.cache import AttentionCache
from slimkv.common.buffer import dtype_bytes
from slimkv.common.checks import Checked, check_bool, check_choice, check_int
from slimkv.ops.attention import attend
from slimkv.ops.linear import Linear, heads_matmul
from slimkv.ops.norm import RMSNorm
from slimkv.ops.quantize import FULL, KVStorage
from slimkv.ops.rope import Rotary, check_rope_frequencies, rotary_dim

DECODE_PATHS = ("auto", "absorbed", "expanded")


class LatentCache(AttentionCache):
    """Every past token's [rotated k_pe | (normalised) c] row, (batch, 1, time, rope_dim + kv_rank)."""

    def __init__(self, owner_spec: tuple, batch_size: int, width: int, *, dtype, device, storage: KVStorage = FULL) -> None:
        super().__init__(owner_spec, batch_size, dtype, device, storage)
        self.latent = self.row_buffer(1, width)

    def tensors(self):
        return iter((self.latent,))

    def extend(self, rows: torch.Tensor) -> torch.Tensor:
        """Append new rows (batch, 1, n, width); return every cached row (a view, past and new)."""
        self.seq_len += rows.shape[2]
        return self.latent.append(rows)


def absorbed_is_cheaper(new_tokens: int, total_tokens: int, head_dim: int, rope_dim: int, kv_rank: int, v_head_dim: int) -> bool:
    """Whether the absorbed path needs no more multiply-adds per head than the expanded one for a
    call of ``new_tokens`` queries over ``total_tokens`` keys.

    absorbed: absorb W_UK into each query, logits over kv_rank + rope_dim, context over kv_rank,
    W_UV after the softmax. expanded: rebuild K/V of every key, then logits over head_dim +
    rope_dim and context over v_head_dim.
    """
    absorbed = new_tokens * (head_dim * kv_rank + total_tokens * (2 * kv_rank + rope_dim) + kv_rank * v_head_dim)
    expanded = total_tokens * kv_rank * (head_dim + v_head_dim) + new_tokens * total_tokens * (head_dim + rope_dim + v_head_dim)
    return absorbed <= expanded


def resolve_rope_dim(rope_dim: int | None, head_dim: int, rope: str, rope_fraction: float, rope_frequencies: list[float] | None = None) -> int:
    """The rotary width from ``rope_dim``, ``rope_frequencies`` and the common rope options (see the
    module docstring); ValueError naming the option that contradicts another."""
    check_rope_frequencies(rope_frequencies)
    if rope_dim is not None:
        check_int("rope_dim", rope_dim, 0)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be an even integer >= 0 (RoPE rotates channel pairs), got {rope_dim}")
    if rope_frequencies is not None and rope != "none":
        pairs = len(rope_frequencies)
        if rope_dim is not None and rope_dim != 2 * pairs:
            raise ValueError(f"rope_frequencies has {pairs} values but rope_dim={rope_dim} rotates {rope_dim // 2} pairs: "
                             "give one inverse frequency per rotary pair")
        rope_dim = 2 * pairs
    if rope_dim is None:
        return rotary_dim(head_dim, rope, rope_fraction)
    if rope == "none" and rope_dim:
        raise ValueError(f"rope_dim={rope_dim} needs rope='full' or rope='partial'; with rope='none' rope_dim must be 0")
    if rope != "none" and not rope_dim:
        raise ValueError(f"rope_dim=0 rotates nothing but rope={rope!r}; pass rope='none' for attention without positions")
    return rope_dim


class MultiHeadLatentAttention(Attention):
    """``mla``: keys and values rebuilt per head from a cached low-rank latent (module docstring)."""

    kind = "mla"
    RUNTIME_OPTIONS = (*Attention.RUNTIME_OPTIONS, "decode_path")
    decode_path = Checked(check_choice, DECODE_PATHS)  # "auto", "absorbed" or "expanded" (module docstring)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        *,
        kv_rank: int | None = None,
        q_rank: int | None = None,
        rope_dim: int | None = None,
        v_head_dim: int | None = None,
        latent_norm: bool = True,
        rope_frequencies: list[float] | None = None,
        decode_path: str = "auto",
        **common,
    ) -> None:
        if kv_rank is None:
            raise ValueError("mla needs kv_rank: the width of the cached latent, an integer >= 1")
        check_int("kv_rank", kv_rank, 1)
        if q_rank is not None:
            check_int("q_rank", q_rank, 1)
        if v_head_dim is not None:
            check_int("v_head_dim", v_head_dim, 1)
        check_bool("latent_norm", latent_norm)
        super().__init__(d_model, n_heads, head_dim, **common)
        rope_dim = resolve_rope_dim(rope_dim, self.head_dim, self.rope, self.rope_fraction, rope_frequencies)
        self.kv_rank, self.q_rank, self.rope_dim = kv_rank, q_rank, rope_dim
        self.latent_norm = latent_norm
        self.rope_frequencies = list(rope_frequencies) if rope_frequencies is not None and rope_dim else None
        self.v_head_dim = self.head_dim if v_head_dim is None else v_head_dim
        self.qk_dim = rope_dim + self.head_dim
        self.scale = 1.0 / math.sqrt(self.qk_dim)
        # replaces the base class's per-head rotary: only the rope_dim leading channels of queries and k_pe turn
        self.rotary = Rotary(rope_dim, "full" if rope_dim else "none", theta=self.rope_theta, frequencies=self.rope_frequencies)
        self.decode_path = decode_path

        h, bias = n_heads, self.use_bias
        if q_rank is None:
            self.q_proj = Linear(d_model, h * self.qk_dim, bias=bias)
        else:
            self.q_down = Linear(d_model, q_rank, bias=bias)
            self.q_latent_norm = RMSNorm(q_rank)
            self.q_up = Linear(q_rank, h * self.qk_dim, bias=bias)
        self.kv_down = Linear(d_model, rope_dim + kv_rank, bias=bias)
        self.kv_norm = RMSNorm(kv_rank) if latent_norm else nn.Identity()
        self.k_up = Linear(kv_rank, h * self.head_dim, bias=False)
        self.v_up = Linear(kv_rank, h * self.v_head_dim, bias=False)
        self.o_proj = Linear(h * self.v_head_dim, d_model, bias=bias)
        self.q_norm = RMSNorm(self.qk_dim) if self.use_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(rope_dim) if self.use_qk_norm and rope_dim else nn.Identity()

    # -- the contract ------------------------------------------------------------------------

    def cache_spec(self) -> tuple:
        return super().cache_spec() + (self.kv_rank, self.rope_dim)

    def new_cache(self, batch_size: int, dtype=None, device=None, storage=None) -> LatentCache:
        b, dtype, device, storage = self._cache_args(batch_size, dtype, device, storage)
        return LatentCache(self.cache_spec(), b, self.rope_dim + self.kv_rank, dtype=dtype, device=device, storage=storage)

    def _cache_bytes(self, seq_len: int, dtype: torch.dtype, batch_size: int) -> int:
        return batch_size * seq_len * (self.kv_rank + self.rope_dim) * dtype_bytes(dtype)

    def head_qk_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Effective (W^Q_h, W^K_h), each (H, d_model, rope_dim + head_dim), channels ordered as the
        logits use them: [rotary | content]. The RMSNorms on c, c_q and (with qk_norm) the query and
        k_pe count as their gains (their per-token rms scale depends on the input; g_c = 1 without
        ``latent_norm``), so W^K_h = [W_pe^T diag(g_k) | W_c^T diag(g_c) W_UK_h] (W_pe, W_c: the rotary and latent rows of
        ``kv_down.weight``) and, with q_rank, W^Q_h = W_qd^T diag(g_cq) W_qu,h (head h's rows of
        ``q_up.weight``, transposed); g_q (qk_norm) scales W^Q_h's columns."""
        h, p = self.n_heads, self.rope_dim
        if self.q_rank is None:
            wq = self.q_proj.weight.view(h, self.qk_dim, self.d_model).transpose(1, 2)
        else:
            up = self.q_up.weight.view(h, self.qk_dim, self.q_rank)
            wq = torch.einsum("rd,r,hcr->hdc", self.q_down.weight, self.q_latent_norm.weight, up)
        w_pe, w_c = self.kv_down.weight[:p], self.kv_down.weight[p:]
        k_up = self.k_up.weight.view(h, self.head_dim, self.kv_rank)
        latent_gain = self.kv_norm.weight if self.latent_norm else w_c.new_ones(self.kv_rank)
        wk_nope = torch.einsum("rd,r,hcr->hdc", w_c, latent_gain, k_up)
        wk_pe = w_pe.t()
        if self.use_qk_norm:
            wq = wq * self.q_norm.weight
            if p:
                wk_pe = wk_pe * self.k_norm.weight
        wk = torch.cat((wk_pe.expand(h, -1, -1), wk_nope), dim=-1)
        return wq, wk

    def _forward(self, x: torch.Tensor, cache: LatentCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        start = cache.seq_len if cache is not None else 0
        q = self.queries(x, start)
        rows = self.latent_rows(x, start)
        if cache is None:
            out = self._attend(q, rows)
        elif q.requires_grad or rows.requires_grad:
            # differentiable in this call's tokens only: attend over a fresh copy of past + new rows
            # (the buffer is written in place by later calls) and cache the new rows detached
            out = self._attend(q, torch.cat((cache.latent.view(), rows), dim=2))
            cache.extend(rows.detach())
        else:
            out = self._attend(q, cache.extend(rows))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.v_head_dim))

    def _attend(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The path ``uses_absorbed`` picks for these queries over these rows."""
        if self.uses_absorbed(q.shape[2], rows.shape[2]):
            return self._attend_absorbed(q, rows)
        return self._attend_expanded(q, rows)

    # -- projections -------------------------------------------------------------------------

    def queries(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotated queries [q_pe | q_nope], (batch, heads, time, rope_dim + head_dim)."""
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_rank is None else self.q_up(self.q_latent_norm(self.q_down(x)))
        q = self.rotary(self.q_norm(q.view(b, t, self.n_heads, self.qk_dim)), start)
        return q.transpose(1, 2)

    def latent_rows(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """What the cache stores for x: rows [rotated k_pe | (normalised) c], (batch, 1, time, rope_dim + kv_rank)."""
        p = self.rope_dim
        down = self.kv_down(x).unsqueeze(2)  # (batch, time, 1, rope_dim + kv_rank)
        k_pe = self.rotary(self.k_norm(down[..., :p]), start)
        rows = torch.cat((k_pe, self.kv_norm(down[..., p:])), dim=-1)
        return rows.transpose(1, 2)

    # -- attention paths -----------------------------------------------------------------------

    def uses_absorbed(self, new_tokens: int, total_tokens: int) -> bool:
        """Which path a call of ``new_tokens`` queries over ``total_tokens`` keys takes."""
        if self.decode_path != "auto":
            return self.decode_path == "absorbed"
        return absorbed_is_cheaper(new_tokens, total_tokens, self.head_dim, self.rope_dim, self.kv_rank, self.v_head_dim)

    def _attend_absorbed(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Attention with W_UK absorbed into the queries and W_UV applied after the softmax; the
        cached rows serve as the one key head (and their c part as the one value head) that every
        query head shares. q (batch, heads, time, qk_dim) -> (batch, heads, time, v_head_dim)."""
        context = attend(self.absorb_queries(q), rows, rows[..., self.rope_dim:], scale=self.scale, backend=self.backend)
        return self.expand_context(context)

    def absorb_queries(self, q: torch.Tensor) -> torch.Tensor:
        """[q_pe | q_nope] -> [q_pe | q_nope W_UK_h^T]: queries that read the cache rows directly,
        (batch, heads, time, rope_dim + head_dim) -> (batch, heads, time, rope_dim + kv_rank)."""
        p = self.rope_dim
        k_up = self.k_up.weight.view(self.n_heads, self.head_dim, self.kv_rank)
        return torch.cat((q[..., :p], heads_matmul(q[..., p:], k_up)), dim=-1)

    def expand_context(self, context: torch.Tensor) -> torch.Tensor:
        """Each head's attention-weighted latent through its W_UV: (batch, heads, time, kv_rank) ->
        (batch, heads, time, v_head_dim)."""
        v_up = self.v_up.weight.view(self.n_heads, self.v_head_dim, self.kv_rank)
        return heads_matmul(context, v_up.transpose(1, 2))

    def _attend_expanded(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Attention over per-head keys/values rebuilt from every row; same in/out as the absorbed path."""
        b, _, keys, _ = rows.shape
        p, h = self.rope_dim, self.n_heads
        latent = rows[:, 0, :, p:]  # (batch, keys, kv_rank)
        k_nope = self.k_up(latent).view(b, keys, h, self.head_dim).transpose(1, 2)
        k = torch.cat((rows[..., :p].expand(b, h, keys, p), k_nope), dim=-1)
        v = self.v_up(latent).view(b, keys, h, self.v_head_dim).transpose(1, 2)
        return attend(q, k, v, scale=self.scale, backend=self.backend)

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", kv_rank={self.kv_rank}, q_rank={self.q_rank}, rope_dim={self.rope_dim}, v_head_dim={self.v_head_dim}"
            + ("" if self.latent_norm else ", latent_norm=False")
            + ("" if self.rope_frequencies is None else f", rope_frequencies={self.rope_frequencies}")
        )


def _rope_dim_for(head_dim: int) -> int:
    return max(2, head_dim // 2 - head_dim // 2 % 2)


def _mla_at(shape: LayerShape, fraction: float) -> dict:
    """kv_rank and rope_dim (half of head_dim, even) for a cache of ``fraction`` of MHA's."""
    rope_dim = _rope_dim_for(shape.head_dim)
    total = max(rope_dim + 1, round(2 * shape.n_heads * shape.head_dim * fraction))
    return {"kv_rank": total - rope_dim, "rope_dim": rope_dim}


def _mla_comparable(shape: LayerShape, explicit: dict) -> tuple[dict, str]:
    options = _mla_at(shape, 0.5)
    return options, f"kv_rank + rope_dim = H d_h = {options['kv_rank'] + options['rope_dim']}: half of MHA's cache"


def _mla_decode(shape: LayerShape) -> list[tuple[str, dict]]:
    """As DeepSeek-V2: kv_rank 4 head_dim, rope_dim head_dim / 2; both exact paths."""
    options = {"kv_rank": 4 * shape.head_dim, "rope_dim": _rope_dim_for(shape.head_dim)}
    return [("mla", options), ("mla-expanded", {**options, "decode_path": "expanded"})]


def _mla_sizes(shape: LayerShape) -> list[tuple[str, dict]]:
    sizes = {}
    for fraction in (0.125, 0.25, 0.5):
        options = _mla_at(shape, fraction)
        sizes[options["kv_rank"]] = (f"mla:kv_rank={options['kv_rank']},rope_dim={options['rope_dim']}", options)
    return list(sizes.values())


register_attention(
    "mla",
    MultiHeadLatentAttention,
    example_options=[
        {"kv_rank": 6},
        {"kv_rank": 12, "q_rank": 10, "v_head_dim": 6},
        {"kv_rank": 5, "latent_norm": False, "rope_frequencies": [0.9, 0.05, 0.9]},  # a converted layer's shape
    ],
    description="multi-head latent attention (DeepSeek-V2)",
    presets=Presets(comparable=_mla_comparable, decode=_mla_decode, sizes=_mla_sizes, demo=("mla",)),
)
