"""``ModelConfig``: a decoder-only LM whose layers each use one registered attention kind."""

from __future__ import annotations

import json
from typing import Any

import torch
from transformers import PretrainedConfig

from slimkv.attention import build_attention
from slimkv.common.checks import check_bool, check_choice, check_float, check_int
from slimkv.common.spec import AttentionSpec
from slimkv.common.vocabulary import current_attention_fields
from slimkv.ops.quantize import parse_storage

MLP_KINDS = ("swiglu", "relu2")
STATEFUL_KINDS = ("kvm", "mla-kvm")  # their memory rows are running means: no quantized storage


class ModelConfig(PretrainedConfig):
    """Shape of a slimkv LM.

    ``attention`` is one kind for every layer, or a list of kinds: either one per layer, or a
    pattern repeated over the layers (``["swa", "kvm"]`` alternates them). ``attention_options``
    go to every layer; ``kind_options`` maps a kind to options for that kind's layers only (e.g.
    ``{"swa": {"window": 256}}`` in a KVM/SWA hybrid); ``per_layer_options`` (one mapping per layer)
    overrides both for single layers (converted models whose layers have different sizes). These
    are the fields of ``slimkv.common.spec.AttentionSpec`` (``attention_spec()``). ``cache_storage``
    is how ``new_cache`` holds the per-token rows unless told otherwise: ``full`` (the cache dtype),
    ``int8`` or ``int4[:group=G,residual=R,block=B]`` (``slimkv.ops.quantize``).
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
        per_layer_options: list[dict[str, Any]] | None = None,
        mlp: str = "swiglu",
        d_ff: int | None = None,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        tie_word_embeddings: bool = True,
        cache_storage: str = "full",
        **kwargs: Any,
    ) -> None:
        spec = AttentionSpec.from_fields(attention, attention_options, kind_options, per_layer_options)
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.head_dim = head_dim if head_dim is not None else (d_model // n_heads if _positive_ints(d_model, n_heads) else None)
        self.attention = spec.to_fields()["attention"]
        self.attention_options = spec.shared
        self.kind_options = spec.per_kind
        self.per_layer_options = [dict(o) for o in spec.per_layer] or None
        self.mlp = mlp
        self.d_ff = d_ff if d_ff is not None else (self.default_d_ff(d_model, mlp) if _positive_ints(d_model) else None)
        self.norm_eps = norm_eps
        self.init_std = init_std
        self.cache_storage = parse_storage(cache_storage, "cache_storage").name
        if self.cache_storage != "full" and any(kind in STATEFUL_KINDS for kind in spec.layer_kinds(n_layers) if _positive_ints(n_layers)):
            raise ValueError(f"cache_storage={cache_storage!r}: kinds {', '.join(STATEFUL_KINDS)} update their memory in place and take full storage only")
        check_bool("tie_word_embeddings", tie_word_embeddings)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> ModelConfig:
        """transformers' ``from_dict``, the one door of a stored config.json (``from_pretrained``,
        ``AutoConfig``): layer options renamed since it was written read as today's
        (``slimkv.common.vocabulary.current_attention_fields``: lrkv's ``rope_mode`` is ``rope_placement``).
        A config made in Python with an old name is refused, naming the new one (``build_attention``)."""
        return super().from_dict(current_attention_fields(config_dict), **kwargs)

    @staticmethod
    def default_d_ff(d_model: int, mlp: str) -> int:
        """SwiGLU: 8/3 d rounded up to a multiple of 64 (same parameters as a 4d MLP); ReLU^2: 4d."""
        if mlp == "swiglu":
            return -(-int(8 * d_model / 3) // 64) * 64
        return 4 * d_model

    # -- derived views ----------------------------------------------------------------

    def attention_spec(self) -> AttentionSpec:
        """The attention of every layer as one ``AttentionSpec``."""
        return AttentionSpec.from_fields(self.attention, self.attention_options, self.kind_options, self.per_layer_options)

    def layer_kinds(self) -> list[str]:
        """The attention kind of every layer."""
        return self.attention_spec().layer_kinds(self.n_layers)

    def layer_options(self, layer: int) -> dict[str, Any]:
        """The options ``build_attention`` receives for one layer."""
        return self.attention_spec().layer_options(layer)

    # -- validation ---------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError naming the option for anything that cannot build. Every layer's
        attention is built once on the meta device: ``build_attention`` is the one validator."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff"):
            check_int(name, getattr(self, name), 1)
        if self.head_dim is None or self.d_model % self.n_heads and self.head_dim == self.d_model // self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}; set head_dim")
        check_int("head_dim", self.head_dim, 1)
        check_choice("mlp", self.mlp, MLP_KINDS)
        check_float("norm_eps", self.norm_eps, 0.0, 1.0, open_low=True)
        check_float("init_std", self.init_std, 0.0, open_low=True)
        spec = self.attention_spec()
        spec.check_layers(self.n_layers)
        built = set()
        for layer, kind in enumerate(spec.layer_kinds(self.n_layers)):
            options = spec.layer_options(layer)
            for name, value in options.items():
                try:
                    json.dumps(value)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"attention option {name}={value!r} cannot be saved: a ModelConfig holds JSON values only "
                        "(a callable KVM schedule works when the layer is built directly with build_attention)"
                    ) from None
            key = json.dumps([kind, options], sort_keys=True)
            if key not in built:
                with torch.device("meta"):
                    build_attention(kind, self.d_model, self.n_heads, self.head_dim, **options)
                built.add(key)


def _positive_ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
