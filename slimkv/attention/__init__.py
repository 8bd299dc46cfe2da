"""Attention mechanisms behind one contract (see ``slimkv.attention.base`` and docs/contract.md).

``build_attention(kind, d_model, n_heads, head_dim=None, **options)`` builds any registered kind;
``ATTENTION_KINDS`` lists them. Importing this package registers every built-in kind, in this
order: mha, gqa, mqa, swa, streaming, hybrid, mla, latent, lrkv, kvm, mla-kvm.
"""

from slimkv.attention import mha, swa, streaming, hybrid, mla, latent, lrkv, kvm, mla_kvm  # noqa: F401, I001  (registers the built-in kinds, in this order)
from slimkv.attention.base import (
    ATTENTION_KINDS,
    COMMON_OPTIONS,
    Attention,
    LayerShape,
    Presets,
    attention_options,
    build_attention,
    kind_spec,
    register_attention,
    unregister_attention,
)
from slimkv.attention.cache import AttentionCache
from slimkv.common.buffer import GrowableBuffer

__all__ = [
    "ATTENTION_KINDS",
    "COMMON_OPTIONS",
    "Attention",
    "AttentionCache",
    "GrowableBuffer",
    "LayerShape",
    "Presets",
    "attention_options",
    "build_attention",
    "kind_spec",
    "register_attention",
    "unregister_attention",
]
