"""LRKV's exact attention over cached context, from the compact cache (docs/lrkv.md, "Exact
factored decode" and "Positions"): ``_attend_factored`` (``decoupled``/``none``: no past token's
per-head key or value is formed), ``_decode_rows`` (the same for one query per head, as one
attention over the cache rows on the native kernel where it can) and ``_attend_rebuilt``
(``full``: keys rebuilt and rotated in bounded blocks under an online softmax).

``LRKVCachedPaths`` is mixed into ``LowRankKVAttention`` (``slimkv.attention.lrkv``), which owns
the factors and the projections; the attributes below are what these paths read of it.
Shapes: queries (batch, heads, time, head_dim), ``LRKVEntries`` as ``LRKVCache`` holds them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from slimkv.attention.cache import LRKVEntries
from slimkv.ops.attention import decode_attention, fold_groups, visibility_mask
from slimkv.ops.linear import heads_matmul
from slimkv.ops.norm import compute_dtype

# Largest logits tile (batch x heads x queries x keys elements) a cached call materialises at once
# (8 MiB in float32: small enough to stay in cache, large enough for efficient GEMMs).
LOGITS_BLOCK_ELEMENTS = 2**21


class LRKVCachedPaths:
    """The cached-context attention paths of ``lrkv`` (module docstring)."""

    head_dim: int
    n_kv_heads: int
    rank_k: int
    rank_v: int
    k_up: torch.nn.Parameter | None
    v_up: torch.nn.Parameter | None
    key_residual_start: int
    rope_placement: str
    use_qk_norm: bool
    rebuild_block_tokens: int

    def _key_gain_on_residual_channels(self) -> torch.Tensor:
        """The layer's qk-norm key gain on the channels cached without it; the layer says."""
        raise NotImplementedError

    def _expand_keys(self, entries: LRKVEntries, start: int) -> torch.Tensor:
        """Per-group keys of cached tokens start.., as the queries see them; the layer says."""
        raise NotImplementedError

    def _query_blocks(self, q: torch.Tensor, keys: int, block_keys: int | None = None) -> Iterator[tuple[int, int, int]]:
        """Yield (i0, i1, visible): query blocks small enough that a (batch, H, block, block_keys)
        logits tile stays under LOGITS_BLOCK_ELEMENTS, and how many keys block i0..i1 can see."""
        b, heads, t, _ = q.shape
        size = max(1, LOGITS_BLOCK_ELEMENTS // (b * heads * (block_keys or keys)))
        for i0 in range(0, t, size):
            i1 = min(t, i0 + size)
            yield i0, i1, keys - t + i1

    def _prepared_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q * softmax scale, times the key qk-norm gain on the channels the cache stores without it."""
        q = q * (1.0 / math.sqrt(self.head_dim))
        if self.use_qk_norm and self.rope_placement != "full":
            q = q * self._key_gain_on_residual_channels()
        return q

    def _attend_factored(self, q: torch.Tensor, entries: LRKVEntries) -> torch.Tensor:
        """Exact attention from the compact cache (``decoupled``/``none``): for query head h of group g
        logits = s * (q K_s^T + (q B^K_g) Z^K_g^T), output = a V_s + (a Z^V_g) (B^V_g)^T.
        No per-head key or value of a past token is ever formed. The query heads of a group are
        folded into rows of one block (``fold_groups`` order: head-major), so each group's latents
        are read once."""
        b, heads, t, hd = q.shape
        groups = self.n_kv_heads
        group = heads // groups
        q = self._prepared_queries(q)
        q_latent = None
        if self.rank_k:  # (b, H, t, r_k): each head's query times its group's B^K
            q_latent = (q[..., self.key_residual_start :].reshape(b, groups, group, t, -1) @ self.k_up[:, None]).reshape(b, heads, t, self.rank_k)
        outs = []
        for i0, i1, visible in self._query_blocks(q, entries.shared_k.shape[2]):
            n = i1 - i0
            seen = entries.tokens(0, visible)
            logits = (q[:, :, i0:i1].reshape(b, 1, heads * n, hd) @ seen.shared_k.transpose(-1, -2)).view(b * groups, group * n, visible)
            if self.rank_k:
                z_k = seen.latent_k.reshape(b * groups, self.rank_k, visible)
                logits = torch.baddbmm(logits, q_latent[:, :, i0:i1].reshape(b * groups, group * n, self.rank_k), z_k)
            logits = logits.view(b, groups, group * n, visible)
            if seen.key_scale is not None:
                logits = logits * seen.key_scale.transpose(-1, -2)
            logits = logits.view(b, heads, n, visible)
            if n > 1:
                logits = logits.masked_fill(~visibility_mask(n, visible, device=q.device), float("-inf"))
            weights = logits.softmax(dim=-1, dtype=compute_dtype(q.dtype)).to(q.dtype)
            out = (weights.reshape(b, 1, heads * n, visible) @ seen.shared_v).view(b, heads, n, hd)
            if self.rank_v:
                mixed = weights.reshape(b, groups, group * n, visible) @ seen.latent_v.transpose(-1, -2)  # (b, G, g n, r_v)
                out = out + (mixed @ self.v_up.transpose(-1, -2)).view(b, heads, n, hd)
            outs.append(out)
        return torch.cat(outs, dim=2)

    def _decode_rows(self, q: torch.Tensor, rows: torch.Tensor, key_width: int) -> torch.Tensor:
        """``_attend_factored`` for one query per head (a decode step) as plain attention over the
        cache rows (``LRKVCache``): one key/value head shared by every query head, whose key is
        [k_s | z^K_1 .. z^K_G] and value [v_s | z^V_1 .. z^V_G]. Query head h of group g becomes
        [q_h | 0 .. q_h B^K_g .. 0] (its latent query in group g's slot), so its logit is
        q_h k_s + (q_h B^K_g) z^K_g exactly, and it reads [a V_s | a Z^V_1 .. a Z^V_G], of which it
        keeps a V_s + (a Z^V_g) (B^V_g)^T. ``decode_attention`` takes the native kernel where it
        can (every cached row read once per step for all heads), else the torch path. The zeros
        cost multiply-adds, yet on the native kernel this ran faster than the factored form in
        torch products with 3 and with 8 groups, in float32 and bfloat16.
        q (b, H, 1, hd), rows (b, 1, L, row width) -> (b, H, 1, hd)."""
        b, heads, _, hd = q.shape
        groups = self.n_kv_heads
        group = heads // groups
        q = self._prepared_queries(q)
        wide = q.new_zeros(b, groups, group, groups, self.rank_k)  # the latent queries, group g's in slot g
        if self.rank_k:
            q_latent = heads_matmul(q[:, :, 0, self.key_residual_start :].reshape(b, groups, group, -1), self.k_up)  # (b, G, g, r_k)
            torch.diagonal(wide, dim1=1, dim2=3).copy_(q_latent.permute(0, 2, 3, 1))
        wide = torch.cat((q.view(b, groups, group, hd), wide.flatten(-2)), dim=-1).view(b, heads, 1, key_width)
        read = decode_attention(wide, rows[..., :key_width], rows[..., key_width:], scale=1.0).view(b, groups, group, -1)
        out = read[..., :hd]
        if self.rank_v:
            mixed = torch.diagonal(read[..., hd:].unflatten(-1, (groups, self.rank_v)), dim1=1, dim2=3).permute(0, 3, 1, 2)  # (b, G, g, r_v)
            out = out + heads_matmul(mixed, self.v_up.transpose(-1, -2))
        return out.reshape(b, heads, 1, hd)

    def _attend_rebuilt(self, q: torch.Tensor, entries: LRKVEntries) -> torch.Tensor:
        """Exact attention for ``full`` rope from the compact cache: each group's keys are rebuilt,
        normed and rotated ``rebuild_block_tokens`` at a time and merged with an online softmax
        (running max and sum), so memory stays bounded; values use the factored path. The query
        heads of a group are folded into rows of one block, as in ``_attend_factored``."""
        b, heads, t, hd = q.shape
        groups = self.n_kv_heads
        group = heads // groups
        work = compute_dtype(q.dtype)
        q = self._prepared_queries(q)
        block = self.rebuild_block_tokens
        outs = []
        for i0, i1, visible in self._query_blocks(q, entries.shared_k.shape[2], block):
            n = i1 - i0
            rows = fold_groups(q[:, :, i0:i1], groups)  # (b, G, g n, hd)
            q_pos = torch.arange(visible - n, visible, device=q.device).repeat(group)[:, None]  # position of each row's query
            best = torch.full((b, groups, group * n, 1), float("-inf"), dtype=work, device=q.device)
            total = torch.zeros(b, groups, group * n, 1, dtype=work, device=q.device)
            acc_v = torch.zeros(b, groups, group * n, hd, dtype=work, device=q.device)
            acc_z = torch.zeros(b, groups, group * n, self.rank_v, dtype=work, device=q.device)
            for j0 in range(0, visible, block):
                j1 = min(visible, j0 + block)
                part = entries.tokens(j0, j1)
                logits = (rows @ self._expand_keys(part, j0).transpose(-1, -2)).to(work)
                if j1 - 1 > visible - n:  # the block reaches past the earliest query's position
                    hidden = torch.arange(j0, j1, device=q.device)[None, :] > q_pos
                    logits = logits.masked_fill(hidden, float("-inf"))
                new_best = torch.maximum(best, logits.amax(dim=-1, keepdim=True))  # finite: key 0 is visible to all
                decay = (best - new_best).exp()
                p = (logits - new_best).exp()
                total = total * decay + p.sum(dim=-1, keepdim=True)
                p = p.to(q.dtype)
                acc_v = acc_v * decay + (p.reshape(b, 1, heads * n, j1 - j0) @ part.shared_v).view(b, groups, group * n, hd).to(work)
                if self.rank_v:
                    acc_z = acc_z * decay + (p @ part.latent_v.transpose(-1, -2)).to(work)
                best = new_best
            if self.rank_v:
                acc_v = acc_v + acc_z @ self.v_up.to(work).transpose(-1, -2)
            outs.append((acc_v / total).to(q.dtype).view(b, heads, n, hd))
        return torch.cat(outs, dim=2)
