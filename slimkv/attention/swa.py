"""Sliding-window attention: each query sees the newest ``window`` tokens (itself included).

The cache keeps only the newest ``window - 1`` keys/values, so its size stops growing at the
window; dropping old tokens is a pointer move in the growable buffer (see ``GrowableBuffer``).
"""

from __future__ import annotations

from slimkv.attention.base import LayerShape, Presets, register_attention
from slimkv.attention.mha import MultiHeadAttention


class SlidingWindowAttention(MultiHeadAttention):
    """``swa``: windowed causal attention; ``n_kv_heads`` optionally shares K/V heads as in GQA."""

    kind = "swa"

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, window: int, n_kv_heads: int | None = None, **common) -> None:
        super().__init__(d_model, n_heads, head_dim, n_kv_heads=n_kv_heads, window=window, **common)


def _swa_comparable(shape: LayerShape, explicit: dict) -> tuple[dict, str]:
    return {"window": max(1, shape.seq_len // 2)}, "window = seq_len / 2"


def _swa_sizes(shape: LayerShape) -> list[tuple[str, dict]]:
    windows = dict.fromkeys(max(1, shape.seq_len // d) for d in (8, 4, 2))
    return [(f"swa:window={w}", {"window": w}) for w in windows]


register_attention(
    "swa",
    SlidingWindowAttention,
    example_options=[{"window": 1}, {"window": 4}, {"window": 7, "n_kv_heads": 2}],
    description="sliding-window attention",
    presets=Presets(comparable=_swa_comparable, decode=lambda shape: [("swa", {"window": 4096})], sizes=_swa_sizes, demo=("swa",)),
)
