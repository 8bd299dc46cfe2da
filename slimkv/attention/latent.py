"""``latent``: a cached joint key/value latent with keys rebuilt, then rotated (exact RoPE).

Per token one matmul maps x (d_model) to a latent c (``kv_rank``), the only thing cached; key/value
group g reads

    key_g   = rotate(c W_UK_g, position)     (head_dim channels, every RoPE pair exact)
    value_g = c W_UV_g                       (head_dim channels)

and query head h reads group h // (n_heads / n_kv_heads), as in GQA. Unlike ``mla`` nothing is
absorbed into the queries: RoPE turns the rebuilt key, so positions are never approximated (no
decoupled rotary key, no expected rotation), at the price of rebuilding every cached key at every
call: a decode step costs kv_rank x 2 n_kv_heads x head_dim multiply-adds per cached token (MLA's
absorbed step reads kv_rank + rope_dim per token and head). It is the quality ceiling of a latent
cache of this size (docs/conversion.md), the layout Palu-style low-rank cache compression uses.

Cache: the latent rows, (batch, 1, time, kv_rank) (``mla``'s ``LatentCache``), kv_rank elements per
token per layer. ``qk_norm`` normalises each rebuilt key head (after rebuilding, before rotation).

Two exact paths, picked by the runtime option ``decode_path``:

* ``"expanded"`` (the reference): rebuild every key and value, then attention as GQA;
* ``"absorbed"``: rebuild only the keys; the values stay latent (softmax x latent rows, one value
  head shared by every query head), and W_UV applies after the softmax, as in ``mla``. It halves
  the rebuilding when a call has few queries;
* ``"auto"`` (default): absorbed when the call's queries x heads are fewer than the rebuilt value
  width (2 G d_h / 2: decode steps and short chunks), expanded otherwise (training, prefill).
"""

from __future__ import annotations

import torch

from slimkv.attention.base import Attention, LayerShape, Presets, register_attention
from slimkv.attention.mla import LatentCache
from slimkv.common.buffer import dtype_bytes
from slimkv.common.checks import Checked, check_choice, check_int
from slimkv.ops.attention import attend
from slimkv.ops.linear import Linear

DECODE_PATHS = ("auto", "absorbed", "expanded")


class RebuiltLatentAttention(Attention):
    """``latent``: a ``kv_rank``-wide cached latent shared by ``n_kv_heads`` rebuilt K/V heads."""

    kind = "latent"
    RUNTIME_OPTIONS = (*Attention.RUNTIME_OPTIONS, "decode_path")
    decode_path = Checked(check_choice, DECODE_PATHS)  # "auto", "absorbed" or "expanded" (module docstring)

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, kv_rank: int, n_kv_heads: int | None = None,
                 decode_path: str = "auto", **common) -> None:
        check_int("kv_rank", kv_rank, 1)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_int("n_kv_heads", n_kv_heads, 1)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        super().__init__(d_model, n_heads, head_dim, **common)
        self.kv_rank, self.n_kv_heads = kv_rank, n_kv_heads
        self.decode_path = decode_path
        hd, bias = self.head_dim, self.use_bias
        self.q_proj = Linear(d_model, n_heads * hd, bias=bias)
        self.kv_down = Linear(d_model, kv_rank, bias=bias)
        self.k_up = Linear(kv_rank, n_kv_heads * hd, bias=False)  # a constant key shift is kv_down's bias times k_up
        self.v_up = Linear(kv_rank, n_kv_heads * hd, bias=False)
        self.o_proj = Linear(n_heads * hd, d_model, bias=bias)
        self._make_qk_norms(hd, hd)

    def cache_spec(self) -> tuple:
        return super().cache_spec() + (self.kv_rank,)

    def new_cache(self, batch_size: int, dtype=None, device=None, storage=None) -> LatentCache:
        b, dtype, device, storage = self._cache_args(batch_size, dtype, device, storage)
        return LatentCache(self.cache_spec(), b, self.kv_rank, dtype=dtype, device=device, storage=storage)

    def _cache_bytes(self, seq_len: int, dtype: torch.dtype, batch_size: int) -> int:
        return batch_size * seq_len * self.kv_rank * dtype_bytes(dtype)

    def head_qk_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W^Q_h, W^K_h), each (n_heads, d_model, head_dim): W^K_g = W_down^T W_UK_g^T, per query head."""
        hd, groups = self.head_dim, self.n_heads // self.n_kv_heads
        wq = self.q_proj.weight.view(self.n_heads, hd, self.d_model).transpose(1, 2)
        wk = (self.k_up.weight @ self.kv_down.weight).view(self.n_kv_heads, hd, self.d_model).transpose(1, 2)
        return self._with_qk_gains(wq, wk.repeat_interleave(groups, dim=0))

    def keys(self, latent: torch.Tensor) -> torch.Tensor:
        """Rotated keys of every row of ``latent`` (batch, time, kv_rank), the first row at
        position 0: (batch, n_kv_heads, time, head_dim)."""
        b, t, _ = latent.shape
        k = self.k_norm(self.k_up(latent).view(b, t, self.n_kv_heads, self.head_dim))
        return self.rotary(k, 0).transpose(1, 2)

    def uses_absorbed(self, new_tokens: int) -> bool:
        """Whether a call of ``new_tokens`` queries takes the absorbed path (module docstring)."""
        if self.decode_path != "auto":
            return self.decode_path == "absorbed"
        return new_tokens * self.n_heads < self.n_kv_heads * self.head_dim

    def _attend(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """q (batch, heads, t, head_dim) over every row of ``latent`` (batch, time, kv_rank) -> (batch, heads, t, head_dim)."""
        b, t = latent.shape[0], latent.shape[1]
        k = self.keys(latent)
        if not self.uses_absorbed(q.shape[2]):
            v = self.v_up(latent).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            return attend(q, k, v, backend=self.backend)
        rows = latent.unsqueeze(1).expand(b, self.n_kv_heads, t, self.kv_rank)  # one latent value head per K/V group (a view)
        context = attend(q, k, rows, scale=self.head_dim**-0.5, backend=self.backend)  # (batch, heads, q, kv_rank)
        groups = self.n_heads // self.n_kv_heads
        v_up = self.v_up.weight.view(self.n_kv_heads, 1, self.head_dim, self.kv_rank)
        out = context.view(b, self.n_kv_heads, groups, -1, self.kv_rank) @ v_up.transpose(-1, -2)
        return out.view(b, self.n_heads, -1, self.head_dim)

    def _forward(self, x: torch.Tensor, cache: LatentCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        start = cache.seq_len if cache is not None else 0
        q = self.rotary(self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)), start).transpose(1, 2)
        rows = self.kv_down(x).unsqueeze(1)  # (batch, 1, time, kv_rank)
        if cache is None:
            latent = rows
        elif rows.requires_grad:  # differentiable in this call's tokens: a fresh copy of past + new, the new rows cached detached
            latent = torch.cat((cache.latent.view(), rows), dim=2)
            cache.extend(rows.detach())
        else:
            latent = cache.extend(rows)
        out = self._attend(q, latent[:, 0])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kv_rank={self.kv_rank}, n_kv_heads={self.n_kv_heads}, decode_path={self.decode_path}"


def _latent_at(shape: LayerShape, fraction: float) -> dict:
    return {"kv_rank": max(1, round(fraction * 2 * shape.n_heads * shape.head_dim))}


register_attention(
    "latent",
    RebuiltLatentAttention,
    example_options=[{"kv_rank": 8}, {"kv_rank": 5, "n_kv_heads": 2}, {"kv_rank": 6, "n_kv_heads": 2, "decode_path": "absorbed"}],
    description="cached joint K/V latent, keys rebuilt then rotated (exact RoPE, no absorption): the latent cache's quality ceiling",
    presets=Presets(
        comparable=lambda shape, explicit: (_latent_at(shape, 0.5), "kv_rank = half of MHA's cache"),
        decode=lambda shape: [("latent", _latent_at(shape, 0.5))],
        sizes=lambda shape: [(f"latent:kv_rank={_latent_at(shape, f)['kv_rank']}", _latent_at(shape, f)) for f in (0.125, 0.25, 0.5)],
    ),
)
