"""``ModelConfig``: a decoder-only LM whose layers each use one registered attention kind."""

from __future__ import annotations

import json
from typing import Any

from transformers import PretrainedConfig

from slimkv.attention.base import attention_options, check_choice, check_int, close_matches, kind_spec

MLP_KINDS = ("swiglu", "relu2")


class ModelConfig(PretrainedConfig):
    """Shape of a slimkv LM.

    ``attention`` is one kind for every layer, or a list of kinds: either one per layer, or a
    pattern repeated over the layers (``["swa", "kvm"]`` alternates them). ``attention_options``
    go to every layer; ``kind_options`` maps a kind to options for that kind's layers only (e.g.
    ``{"swa": {"window": 256}}`` in a KVM/SWA hybrid).
    """

    model_type = "slimkv"

    def __init__(
        self,
        vocab_size: int = 4096,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 8,
        head_dim: int | None = None,
        attention: str | list[str] = "mha",
        attention_options: dict[str, Any] | None = None,
        kind_options: dict[str, dict[str, Any]] | None = None,
        mlp: str = "swiglu",
        d_ff: int | None = None,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        tie_word_embeddings: bool = True,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.head_dim = head_dim if head_dim is not None else (d_model // n_heads if n_heads else None)
        self.attention = attention
        self.attention_options = dict(attention_options or {})
        self.kind_options = {k: dict(v) for k, v in (kind_options or {}).items()}
        self.mlp = mlp
        self.d_ff = d_ff if d_ff is not None else self.default_d_ff(d_model, mlp)
        self.norm_eps = norm_eps
        self.init_std = init_std
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate()

    @staticmethod
    def default_d_ff(d_model: int, mlp: str) -> int:
        """SwiGLU: 8/3 d rounded up to a multiple of 64 (same parameters as a 4d MLP); ReLU^2: 4d."""
        if mlp == "swiglu":
            return -(-int(8 * d_model / 3) // 64) * 64
        return 4 * d_model

    # -- derived views ----------------------------------------------------------------

    def layer_kinds(self) -> list[str]:
        """The attention kind of every layer."""
        kinds = [self.attention] if isinstance(self.attention, str) else list(self.attention)
        return [kinds[i % len(kinds)] for i in range(self.n_layers)]

    def layer_options(self, layer: int) -> dict[str, Any]:
        """The options ``build_attention`` receives for one layer."""
        kind = self.layer_kinds()[layer]
        return {**self.attention_options, **self.kind_options.get(kind, {})}

    # -- validation ---------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError naming the option for anything that cannot build."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff"):
            check_int(name, getattr(self, name), 1)
        if self.head_dim is None or self.d_model % self.n_heads and self.head_dim == self.d_model // self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}; set head_dim")
        check_int("head_dim", self.head_dim, 1)
        check_choice("mlp", self.mlp, MLP_KINDS)
        kinds = [self.attention] if isinstance(self.attention, str) else list(self.attention)
        if not kinds:
            raise ValueError("attention must name at least one kind")
        if not isinstance(self.attention, str) and self.n_layers % len(kinds):
            raise ValueError(f"attention pattern of length {len(kinds)} does not divide n_layers={self.n_layers}")
        for kind in kinds:
            kind_spec(kind)
        for kind in self.kind_options:
            if kind not in kinds:
                raise ValueError(f"kind_options names {kind!r}, which no layer uses{close_matches(kind, kinds)}; layers use: {', '.join(sorted(set(kinds)))}")
        for layer, kind in enumerate(self.layer_kinds()):
            allowed = attention_options(kind)
            for name, value in self.layer_options(layer).items():
                if name not in allowed:
                    raise ValueError(
                        f"unknown option {name!r} for attention kind {kind!r}{close_matches(name, allowed)}; "
                        f"allowed options: {', '.join(allowed)}"
                    )
                try:
                    json.dumps(value)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"attention option {name}={value!r} cannot be saved: a ModelConfig holds JSON values only "
                        "(a callable KVM schedule works when the layer is built directly with build_attention)"
                    ) from None
