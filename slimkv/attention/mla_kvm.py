"""``mla-kvm``: KVM over an MLA latent cache (docs/kvm.md, "KVM over a latent").

An MLA layer (``slimkv.attention.mla``) caches one row per token, [rotated k_pe | c]; with W_UK
absorbed into the queries those rows are the single key head that every query head reads, and
their c part the single value head (W_UV applies after the softmax). Keys and values are linear
in c, so a mean of latents is the latent of the mean key and value: KVM (``slimkv.ops.kvm``) can
run on the rows themselves, as a one-KV-head layer whose keys are ``rope_dim + kv_rank`` wide
(the first ``rope_dim`` rotary, dropped when a key enters the state) and whose values are c.

* **Window**: the exact rows of the last ``window_chunks`` chunks: the MLA cache, kept as keys
  [k_pe | c] and values c (so c is held twice there: ``kv_rank`` more per window token).
* **State**: rows of summed prepared latents and summed c, read as LN_s(s_k) and the value readout;
  one set of rows shared by every head (routing is on the latent, not per head). A query head
  reads a state row as the content key LN_s(s_k) W_UK_h and the value (readout) W_UV_h.
* **Parameters**: MLA's projections, then KVM's own: LN_s over the whole key row (width
  rope_dim + kv_rank), one merge gate per token, two temperatures per query head.
* Softmax scale 1/sqrt(rope_dim + head_dim), as MLA's.

Per token, the state stops growing (``schedule="fixed"``) and the window holds W x C rows, so
the cache is flat in the context length. Options: MLA's (``kv_rank``, ``q_rank``, ``rope_dim``,
``v_head_dim``, ``latent_norm``, ``rope_frequencies``) and KVM's (``chunk_size``,
``window_chunks``, ``schedule``, ``min_rows``, ``sqrt_coef``, ``saturating_rows``, ``max_rows``,
``sink_len``, ``value_norm``, ``merge_gate``, ``use_temperatures``, ``routing_dtype``,
``gate_appends``). There is one exact path (the absorbed one), so no ``decode_path``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from slimkv.attention.base import Attention, LayerShape, Presets, register_attention
from slimkv.attention.kvm import KVMCache, KVMRegions, kvm_settings
from slimkv.attention.mla import MultiHeadLatentAttention, _mla_at


class MLAKVMAttention(KVMRegions, MultiHeadLatentAttention):
    """MLA projections, KVM over the latent rows (module docstring)."""

    kind = "mla-kvm"
    RUNTIME_OPTIONS = Attention.RUNTIME_OPTIONS

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
        chunk_size: int = 256,
        window_chunks: int = 2,
        schedule: str | Callable[[int], int] = "fixed",
        min_rows: int | None = None,
        sqrt_coef: float | None = None,
        saturating_rows: int | None = None,
        max_rows: int | None = None,
        sink_len: int = 1,
        use_temperatures: bool = True,
        value_norm: str = "radius",
        merge_gate: bool = True,
        routing_dtype: str = "float32",
        gate_appends: bool = False,
        **common,
    ) -> None:
        settings = kvm_settings(chunk_size=chunk_size, window_chunks=window_chunks, schedule=schedule, min_rows=min_rows, sqrt_coef=sqrt_coef,
                                saturating_rows=saturating_rows, max_rows=max_rows, sink_len=sink_len, value_norm=value_norm,
                                routing_dtype=routing_dtype, gate_appends=gate_appends, merge_gate=merge_gate, use_temperatures=use_temperatures)
        super().__init__(d_model, n_heads, head_dim, kv_rank=kv_rank, q_rank=q_rank, rope_dim=rope_dim, v_head_dim=v_head_dim,
                         latent_norm=latent_norm, decode_path="absorbed", **common)
        self.settings = replace(settings, rot_dim=self.rope_dim)
        self._add_kvm_parameters(self.rope_dim + self.kv_rank, d_model, n_heads, 1, merge_gate=merge_gate, use_temperatures=use_temperatures)

    def state_shape(self) -> tuple[int, int, int]:
        """One key head: rows [k_pe | c] as keys, c as values."""
        return 1, self.rope_dim + self.kv_rank, self.kv_rank

    def _forward(self, x: torch.Tensor, cache: KVMCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        start = cache.seq_len if cache is not None else 0
        q = self.absorb_queries(self.queries(x, start))  # (batch, heads, time, rope_dim + kv_rank)
        rows = self.latent_rows(x, start)  # (batch, 1, time, rope_dim + kv_rank): keys; their c part: values
        context = self._kvm_attend(x, q, rows, rows[..., self.rope_dim:], cache, scale=self.scale)
        out = self.expand_context(context)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.v_head_dim))

    def extra_repr(self) -> str:
        return super().extra_repr() + self._kvm_repr()


def _mla_kvm_comparable(shape: LayerShape, explicit: dict) -> tuple[dict, str]:
    """MLA's latent at half of MHA's per-token cache, KVM's window and rows at the recipe's scale
    (chunks of seq_len/8 and one chunk's worth of fixed rows, as ``kvm``'s comparable preset)."""
    chunk = max(2, shape.seq_len // 8)
    options = {**_mla_at(shape, 0.5), "chunk_size": chunk, "schedule": "fixed", "min_rows": chunk}
    return options, f"latent rows as mla at 0.5; chunk_size = seq_len/8 = {chunk}; {chunk} state rows"


register_attention(
    "mla-kvm",
    MLAKVMAttention,
    example_options=[
        # chunk 4, window 2 chunks: the state appears at token 8 and folds run at 12, 16, ...
        {"kv_rank": 6, "chunk_size": 4, "min_rows": 6},
        {"kv_rank": 5, "chunk_size": 3, "window_chunks": 3, "schedule": "sqrt", "sqrt_coef": 2.0, "min_rows": 1,
         "q_rank": 10, "v_head_dim": 6},
        # a converted layer's shape (convert --to mla-kvm)
        {"kv_rank": 5, "latent_norm": False, "rope_frequencies": [0.9, 0.05], "chunk_size": 4, "min_rows": 5, "sink_len": 2},
    ],
    description="KVM over an MLA latent cache: exact latent window + bounded state of latent means",
    presets=Presets(
        comparable=_mla_kvm_comparable,
        decode=lambda shape: [("mla-kvm", {"kv_rank": 4 * shape.head_dim, "rope_dim": shape.head_dim // 2, "chunk_size": 256, "schedule": "fixed"})],
    ),
)
