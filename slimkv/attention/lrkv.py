"""Low-rank key-value attention (LRKV): one shared K/V projection plus per-head low-rank residuals
(docs/lrkv.md has the design, the cache layout, the RoPE placements and the decode paths).

Head (or residual group) h uses W^K_h = W^K_shared + U^K_h (B^K_h)^T and likewise for values;
queries are full. The cache holds, per token, the shared key and value (d_h each) and every
group's latents z^K_h = x U^K_h (r_k) and z^V_h = x U^V_h (r_v), as one row (``LRKVCache``), plus
one key scale per group with ``qk_norm``: 2 d_h + G (r_k + r_v) [+ G] elements per token per layer
(MHA: 2 H d_h).

Positions (``rope_placement``): ``decoupled`` (default; the rotary channels come from the shared key,
rotated once when cached; exact factored decode), ``full`` (RoPE on the rebuilt per-head key;
decode rebuilds keys in bounded blocks) or ``none``; ``layer.rope_placement`` is the placement in
effect (``none`` when nothing rotates, e.g. with the common ``rope="none"``). Calls without cached
context materialise the call's per-head K/V for SDPA; calls with cached context take ``decode_path``: ``factored``
(never forming a past token's per-head key or value; a decode step runs it as one attention over
the cache rows, on the native kernel where it can) or ``expanded`` (the reference: rebuild every
cached K/V and use SDPA); the factored and rebuilt paths live in ``slimkv.attention.lrkv_decode``.
Shapes: activations (batch, time, heads, dim); kernels and caches (batch, heads, time, dim), the
shared key/value with one head, the latents time-last.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from slimkv.attention.base import Attention, LayerShape, Presets, register_attention
from slimkv.attention.cache import LRKVCache, LRKVEntries
from slimkv.attention.lrkv_decode import LRKVCachedPaths
from slimkv.common.buffer import dtype_bytes
from slimkv.common.checks import Checked, check_choice, check_float, check_int
from slimkv.ops.attention import attend
from slimkv.ops.linear import Linear
from slimkv.ops.norm import compute_dtype
from slimkv.ops.rope import Rotary

LRKV_ROPE_PLACEMENTS = ("decoupled", "full", "none")
DECODE_PATHS = ("factored", "expanded")


def resolve_ranks(rank: int | None, rank_k: int | None, rank_v: int | None) -> tuple[int, int]:
    """(rank_k, rank_v) from ``rank`` or the pair; ValueError naming the option otherwise."""
    if rank is not None and (rank_k is not None or rank_v is not None):
        raise ValueError("pass either rank or rank_k and rank_v, not both")
    if rank is not None:
        check_int("rank", rank, 0)
        return rank, rank
    if rank_k is None or rank_v is None:
        raise ValueError("lrkv needs rank (or both rank_k and rank_v): the residual rank per head, an integer >= 0")
    check_int("rank_k", rank_k, 0)
    check_int("rank_v", rank_v, 0)
    return rank_k, rank_v


def resolve_positions(head_dim: int, rope_placement: str, rope: str, rope_fraction: float, rope_theta: float,
                      rope_frequencies: list[float] | None = None) -> tuple[Rotary, str]:
    """The rotary map of an lrkv layer and its effective placement ("decoupled", "full" or "none"),
    from its ``rope_placement`` option and the common ``rope`` options (see the module docstring; explicit
    ``rope_frequencies``, one per rotated pair, are a converted layer's)."""
    if rope_placement == "none" or rope == "none":
        return Rotary(head_dim, "none"), "none"
    if rope_placement == "decoupled":
        rotary = Rotary(head_dim, "partial", rope_fraction, rope_theta, rope_frequencies)
        if rotary.rot_dim >= head_dim:
            raise ValueError(
                f"rope_placement='decoupled' needs key channels the residual can write, but rope_fraction={rope_fraction} "
                f"rotates all {head_dim}; lower rope_fraction or use rope_placement='full'"
            )
    else:
        rotary = Rotary(head_dim, rope, rope_fraction, rope_theta, rope_frequencies)
    return rotary, (rope_placement if rotary.rot_dim else "none")


class LowRankKVAttention(LRKVCachedPaths, Attention):
    """``lrkv``: shared K/V plus per-head rank-r residuals (see the module docstring); the paths
    over cached context are ``LRKVCachedPaths``'s (``slimkv.attention.lrkv_decode``)."""

    kind = "lrkv"
    RUNTIME_OPTIONS = (*Attention.RUNTIME_OPTIONS, "decode_path", "rebuild_block_tokens")
    decode_path = Checked(check_choice, DECODE_PATHS)  # "factored" (the compact cache read directly) or "expanded" (the reference)
    rebuild_block_tokens = Checked(check_int, 1)  # keys rebuilt per block by the ``full`` rope decode (bounds its memory)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        *,
        rank: int | None = None,
        rank_k: int | None = None,
        rank_v: int | None = None,
        rope_placement: str = "decoupled",
        residual_init: float = 0.1,
        n_kv_heads: int | None = None,
        decode_path: str = "factored",
        rebuild_block_tokens: int = 512,
        **common,
    ) -> None:
        rank_k, rank_v = resolve_ranks(rank, rank_k, rank_v)
        check_choice("rope_placement", rope_placement, LRKV_ROPE_PLACEMENTS)
        check_float("residual_init", residual_init, 0.0)
        super().__init__(d_model, n_heads, head_dim, **common)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_int("n_kv_heads", n_kv_heads, 1)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.n_kv_heads, groups = n_kv_heads, n_kv_heads
        hd, bias = self.head_dim, self.use_bias
        self.rank_k, self.rank_v, self.residual_init = rank_k, rank_v, float(residual_init)
        self.rotary, self.rope_placement = resolve_positions(self.head_dim, rope_placement, self.rope, self.rope_fraction, self.rope_theta,
                                                               self.rope_frequencies)
        # First key channel the residual writes: decoupled keeps the rotary channels shared.
        self.key_residual_start = self.rotary.rot_dim if self.rope_placement == "decoupled" else 0
        self._warn_if_larger_than_mha()

        self.q_proj = Linear(d_model, n_heads * hd, bias=bias)
        self.k_shared = Linear(d_model, hd, bias=bias)
        self.v_shared = Linear(d_model, hd, bias=bias)
        # U^K_g for all groups as one (d -> G r_k) map, and B^K_g stacked as (G, channels written, r_k).
        self.k_latent = Linear(d_model, groups * rank_k, bias=bias) if rank_k else None
        self.k_up = nn.Parameter(torch.empty(groups, hd - self.key_residual_start, rank_k)) if rank_k else None
        self.v_latent = Linear(d_model, groups * rank_v, bias=bias) if rank_v else None
        self.v_up = nn.Parameter(torch.empty(groups, hd, rank_v)) if rank_v else None
        self.o_proj = Linear(n_heads * hd, d_model, bias=bias)
        self._make_qk_norms(hd, hd)
        self._init_residual_factors()
        self.decode_path = decode_path
        self.rebuild_block_tokens = rebuild_block_tokens

    # -- construction helpers -------------------------------------------------------------

    def cache_elements_per_token(self) -> int:
        """Cache elements per token per layer per sequence: 2 d_h + G (r_k + r_v) [+ G with qk_norm]."""
        per_group = self.rank_k + self.rank_v + (1 if self.use_qk_norm else 0)
        return 2 * self.head_dim + self.n_kv_heads * per_group

    def _warn_if_larger_than_mha(self) -> None:
        """Warn when the cache is larger than that of plain attention with as many K/V heads as
        residual groups (MHA for G = H): such ranks save nothing."""
        plain = 2 * self.n_kv_heads * self.head_dim
        if self.cache_elements_per_token() > plain:
            reference = "MHA" if self.n_kv_heads == self.n_heads else f"GQA with {self.n_kv_heads} K/V heads"
            limit = self.head_dim * (1 - 1 / self.n_kv_heads)
            warnings.warn(
                f"lrkv with rank_k={self.rank_k}, rank_v={self.rank_v} caches {self.cache_elements_per_token()} elements per "
                f"token per layer, more than {reference}'s {plain} (a rank above head_dim * (1 - 1/n_kv_heads) = {limit:g} saves nothing)",
                UserWarning,
                stacklevel=3,
            )

    @torch.no_grad()
    def _init_residual_factors(self) -> None:
        """Random U_h, B_h scaled so ||U_h B_h^T||_F = residual_init * ||W_shared||_F for every head,
        with ||U_h||_F = ||B_h||_F. With residual_init = 0, B_h = 0 (U_h keeps its init, so B_h
        still receives gradients)."""
        for shared, latent, up in ((self.k_shared, self.k_latent, self.k_up), (self.v_shared, self.v_latent, self.v_up)):
            if latent is None:
                continue
            if self.residual_init == 0:
                up.zero_()
                continue
            target = self.residual_init * shared.weight.norm()
            u = torch.randn_like(latent.weight).view(self.n_kv_heads, -1, self.d_model)  # (G, r, d): rows of U_g^T
            b = torch.randn_like(up)  # (G, channels, r)
            # ||U B^T||_F^2 = tr((U^T U)(B^T B)), from r x r products only.
            product = torch.einsum("hij,hji->h", u @ u.transpose(1, 2), b.transpose(1, 2) @ b).sqrt()
            scale = target / product
            u_norm, b_norm = u.flatten(1).norm(dim=1), b.flatten(1).norm(dim=1)
            u *= (scale * b_norm / u_norm).sqrt()[:, None, None]
            b *= (scale * u_norm / b_norm).sqrt()[:, None, None]
            latent.weight.copy_(u.reshape_as(latent.weight))
            up.copy_(b)

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        """Shared maps, queries and output as every projection (see the base); residual factors at
        ``residual_init`` of the shared map's norm."""
        super().reset_parameters(std, out_std)
        self._init_residual_factors()

    # -- the contract ------------------------------------------------------------------------

    def cache_spec(self) -> tuple:
        return super().cache_spec() + (self.rank_k, self.rank_v, self.rope_placement, self.rotary.rot_dim, self.use_qk_norm, self.n_kv_heads)

    def new_cache(self, batch_size: int, dtype=None, device=None, storage=None) -> LRKVCache:
        b, dtype, device, storage = self._cache_args(batch_size, dtype, device, storage)
        return LRKVCache(self.cache_spec(), b, self.n_kv_heads, self.head_dim, self.rank_k, self.rank_v, self.use_qk_norm, dtype=dtype, device=device,
                         storage=storage)

    def _cache_bytes(self, seq_len: int, dtype: torch.dtype, batch_size: int) -> int:
        return batch_size * seq_len * self.cache_elements_per_token() * dtype_bytes(dtype)

    def head_qk_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Effective (W^Q_h, W^K_h), each (H, d_model, head_dim): W^K_h = W_shared + U_g B_g^T for
        head h's group g (the residual writes only the non-rotary channels in decoupled mode;
        the shared rotary channels keep W_shared), qk-norm gains folded in."""
        hd, groups = self.head_dim, self.n_kv_heads
        wq = self.q_proj.weight.view(self.n_heads, hd, self.d_model).transpose(1, 2)
        wk = self.k_shared.weight.t().expand(groups, -1, -1)
        if self.rank_k:
            u = self.k_latent.weight.view(groups, self.rank_k, self.d_model)
            residual = torch.einsum("grd,gcr->gdc", u, self.k_up)  # (G, d, channels written)
            wk = torch.cat((wk[..., : self.key_residual_start], wk[..., self.key_residual_start :] + residual), dim=-1)
        return self._with_qk_gains(wq, wk.repeat_interleave(self.n_heads // groups, dim=0))

    def _forward(self, x: torch.Tensor, cache: LRKVCache | None) -> torch.Tensor:
        start = cache.seq_len if cache is not None else 0
        q, new = self._project(x, start)
        if cache is None:
            out = self._attend_expanded(q, new)
        else:
            entries, rows = cache.extend(new)
            if start == 0 or self.decode_path == "expanded":  # a prompt into an empty cache: like training
                out = self._attend_expanded(q, entries)
            elif self.rope_placement == "full":
                out = self._attend_rebuilt(q, entries)
            elif x.shape[1] == 1 and entries.key_scale is None:
                out = self._decode_rows(q, rows, cache.key_width)
            else:
                out = self._attend_factored(q, entries)
        b, t = x.shape[:2]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    # -- projections -------------------------------------------------------------------------

    def _project(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, LRKVEntries]:
        """Queries (batch, heads, time, head_dim), normed and rotated, and the new tokens' cache entries."""
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.rotary(self.q_norm(self.q_proj(x).view(b, t, self.n_heads, hd)), start).transpose(1, 2)
        k_s = self.k_shared(x).view(b, t, 1, hd)
        v_s = self.v_shared(x).view(b, t, 1, hd).transpose(1, 2)
        z_k = self._latents(self.k_latent, x, self.rank_k)
        z_v = self._latents(self.v_latent, x, self.rank_v)
        key_scale = None
        if self.use_qk_norm:
            raw = self._raw_keys(k_s.transpose(1, 2), z_k)
            work = compute_dtype(x.dtype)
            key_scale = torch.rsqrt(raw.to(work).square().mean(-1, keepdim=True) + self.k_norm.eps).to(x.dtype)
        if self.rope_placement == "decoupled":
            rot = self.rotary.rot_dim
            if self.use_qk_norm:
                k_s = torch.cat((k_s[..., :rot] * self.k_norm.weight[:rot], k_s[..., rot:]), dim=-1)
            k_s = self.rotary(k_s, start)
        return q, LRKVEntries(k_s.transpose(1, 2), v_s, z_k, z_v, key_scale)

    def _latents(self, latent: nn.Linear | None, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Per-group latents, time last (batch, G, rank, time), of x (batch, time, d_model)."""
        b, t, _ = x.shape
        if latent is None:
            return x.new_empty(b, self.n_kv_heads, 0, t)
        return latent(x).view(b, t, self.n_kv_heads, rank).permute(0, 2, 3, 1)

    def _key_up_all_channels(self) -> torch.Tensor:
        """B^K as (G, head_dim, r_k): zero rows for the shared rotary channels in decoupled mode."""
        c = self.key_residual_start
        if c == 0:
            return self.k_up
        return torch.cat((self.k_up.new_zeros(self.n_kv_heads, c, self.rank_k), self.k_up), dim=1)

    def _raw_keys(self, shared_k: torch.Tensor, latent_k: torch.Tensor) -> torch.Tensor:
        """k_s + z_g B_g^T for every group: (batch, 1, L, hd), (batch, G, r_k, L) -> (batch, G, L, hd).
        The residual writes channels key_residual_start.. only. One batched matmul writes the
        result, the shared key is added in place (no further full-size temporaries)."""
        b, _, length, hd = shared_k.shape
        if not self.rank_k:
            return shared_k.expand(b, self.n_kv_heads, length, hd)
        return (latent_k.transpose(-1, -2) @ self._key_up_all_channels().transpose(-1, -2)).add_(shared_k)

    def _expand_keys(self, entries: LRKVEntries, start: int) -> torch.Tensor:
        """Per-group keys (batch, G, L, hd) of tokens start.. as the queries see them: qk-norm gain
        and scale applied, rotated (``full``; ``decoupled`` entries arrive rotated)."""
        keys = self._raw_keys(entries.shared_k, entries.latent_k)
        if self.use_qk_norm:
            keys = keys * self._key_gain_on_residual_channels() * entries.key_scale
        if self.rope_placement == "full":
            keys = self.rotary(keys.transpose(1, 2), start).transpose(1, 2)
        return keys

    def _key_gain_on_residual_channels(self) -> torch.Tensor:
        """The qk-norm key gain (head_dim,) on the channels the cache stores without it (all but
        decoupled's rotary channels, which are cached with the gain applied), 1 elsewhere."""
        c, gain = self.key_residual_start, self.k_norm.weight
        return torch.cat((gain.new_ones(c), gain[c:])) if c else gain

    def _expand_values(self, entries: LRKVEntries) -> torch.Tensor:
        """Per-group values (batch, G, L, hd) = v_s + z^V_g (B^V_g)^T."""
        b, _, length, hd = entries.shared_v.shape
        if not self.rank_v:
            return entries.shared_v.expand(b, self.n_kv_heads, length, hd)
        return (entries.latent_v.transpose(-1, -2) @ self.v_up.transpose(-1, -2)).add_(entries.shared_v)

    # -- attention paths ---------------------------------------------------------------------

    def _attend_expanded(self, q: torch.Tensor, entries: LRKVEntries) -> torch.Tensor:
        """Materialise every group's key/value and use the fused kernel (training, prefill, reference);
        query heads share their group's key/value as in GQA."""
        return attend(q, self._expand_keys(entries, 0), self._expand_values(entries), backend=self.backend)

    def extra_repr(self) -> str:
        groups = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        return super().extra_repr() + f", rank_k={self.rank_k}, rank_v={self.rank_v}{groups}, rope_placement={self.rope_placement}, rot_dim={self.rotary.rot_dim}"


def _rank_for(shape: LayerShape, fraction: float) -> int:
    """The rank whose cache 1/H + r/d_h is closest to ``fraction`` of MHA's (at least 0)."""
    return max(0, round(shape.head_dim * (fraction - 1 / shape.n_heads)))


def _lrkv_comparable(shape: LayerShape, explicit: dict) -> tuple[dict, str]:
    if "rank_k" in explicit or "rank_v" in explicit:
        return {}, "ranks set by the entry"
    rank = _rank_for(shape, 0.5)
    return {"rank": rank}, f"rank = round(d_h (1/2 - 1/H)) = {rank}: cache 1/H + r/d_h = {1 / shape.n_heads + rank / shape.head_dim:.3f} of MHA"


def _lrkv_sizes(shape: LayerShape) -> list[tuple[str, dict]]:
    """Caches between MQA's (1/H of MHA's) and half of MHA's: where LRKV competes with GQA and MQA."""
    ranks = dict.fromkeys(max(1, _rank_for(shape, f)) for f in (0.3, 0.4, 0.5))
    return [(f"lrkv:rank={r}", {"rank": r}) for r in ranks]


register_attention(
    "lrkv",
    LowRankKVAttention,
    example_options=[
        {"rank": 2},
        {"rank_k": 3, "rank_v": 1, "rope_placement": "full"},
        {"rank_k": 1, "rank_v": 3, "rope_placement": "none"},
        {"rank": 0},
        {"rank": 2, "n_kv_heads": 2},
        {"rank_k": 3, "rank_v": 2, "rope_placement": "full", "n_kv_heads": 2},
    ],
    description="low-rank key-value attention",
    presets=Presets(
        comparable=_lrkv_comparable,
        decode=lambda shape: [("lrkv", {"rank": max(1, shape.head_dim // 4)}), ("lrkv-expanded", {"rank": max(1, shape.head_dim // 4), "decode_path": "expanded"})],
        sizes=_lrkv_sizes,
        demo=("lrkv",),
    ),
)
