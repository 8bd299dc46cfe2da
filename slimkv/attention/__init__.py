"""Attention mechanisms behind one contract (see ``slimkv.attention.base``).

``build_attention(kind, d_model, n_heads, head_dim=None, **options)`` builds any registered kind;
``ATTENTION_KINDS`` lists them. Importing this package registers every built-in kind.
"""

from slimkv.attention import kvm, lrkv, mha, mla, swa  # noqa: F401  (registers the built-in kinds)
from slimkv.attention.base import (
    ATTENTION_KINDS,
    COMMON_OPTIONS,
    Attention,
    attention_options,
    build_attention,
    kind_spec,
    register_attention,
)
from slimkv.attention.cache import AttentionCache, GrowableBuffer

__all__ = [
    "ATTENTION_KINDS",
    "COMMON_OPTIONS",
    "Attention",
    "AttentionCache",
    "GrowableBuffer",
    "attention_options",
    "build_attention",
    "kind_spec",
    "register_attention",
]
