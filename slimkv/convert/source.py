"""Reading a pretrained Llama-family model (Llama, Mistral, Qwen2: GQA + RoPE + gated SiLU MLP)
for conversion, and building the exact slimkv copy of it.

Two conventions differ between transformers' Llama and slimkv and are mapped exactly:

* RoPE pairs: Llama rotates channel i with channel i + d_h/2 ("rotate half"); slimkv rotates
  adjacent pairs (2i, 2i+1) (docs/contract.md). Permuting the query and key channels of every
  head by ``ROPE_PAIRING`` (new channel 2i = old i, 2i+1 = old i + d_h/2) leaves every q . k
  unchanged and turns one convention into the other (same frequencies, same direction).
* Biases: Qwen2 has q/k/v biases but none on o; slimkv's ``bias`` option puts one on every
  projection, so o gets a zero bias.

``exact_copy`` builds a ``SlimKVForCausalLM`` with ``gqa`` layers (``mha`` when every head has its
own K/V) whose logits equal the original's to float round-off: the starting point of every
conversion and its check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slimkv.model import ModelConfig, SlimKVForCausalLM
from slimkv.pretrained import LoadedModel

CONVERTIBLE_TYPES = ("llama", "mistral", "qwen2")
CONVERTIBLE_TEXT = "Llama, Mistral and Qwen2 causal LMs (model_type llama/mistral/qwen2: GQA + RoPE + gated SiLU MLP)"


@dataclass
class Shape:
    """The facts of a source model that a conversion needs."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.n_heads // self.n_kv_heads

    @property
    def cache_elements(self) -> int:
        """K/V cache elements per token per layer of the original: 2 n_kv_heads head_dim."""
        return 2 * self.n_kv_heads * self.head_dim


def check_convertible(config: Any) -> Shape:
    """The shape of a transformers config slimkv can convert; ValueError saying what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in CONVERTIBLE_TYPES:
        raise ValueError(f"cannot convert model_type {model_type!r}: slimkv converts {CONVERTIBLE_TEXT}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"cannot convert RoPE scaling {rope.get('rope_type')!r}: slimkv converts models with plain RoPE (rope_type 'default')")
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        raise ValueError("cannot convert: slimkv converts gated SiLU MLPs without biases")
    window = getattr(config, "sliding_window", None)
    if window is not None and (model_type != "qwen2" or getattr(config, "use_sliding_window", False)):
        raise ValueError(f"cannot convert a model with sliding-window attention (sliding_window={window}): slimkv converts full-attention models")
    qkv_bias = bool(getattr(config, "attention_bias", False)) or model_type == "qwen2"
    if model_type != "qwen2" and qkv_bias:
        raise ValueError("cannot convert attention biases on o_proj: slimkv converts biases on q/k/v only (as Qwen2)")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 2:
        raise ValueError(f"cannot convert head_dim={head_dim}: RoPE needs an even head dimension")
    return Shape(
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
        n_heads=heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        d_ff=config.intermediate_size,
        vocab_size=config.vocab_size,
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        norm_eps=float(config.rms_norm_eps),
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
    )


def rope_pairing(head_dim: int) -> torch.Tensor:
    """Channel order turning rotate-half pairs (i, i + d/2) into adjacent pairs (2i, 2i + 1)."""
    half = torch.arange(head_dim // 2)
    return torch.stack((half, half + head_dim // 2), dim=1).flatten()


@dataclass
class LayerWeights:
    """One attention layer of the source in slimkv's conventions, float64 (weights (out, in)).

    q: (H, d_h, d), k and v: (G, d_h, d), o: (d, H d_h); q/k channels already in adjacent-pair
    RoPE order; biases (H, d_h) / (G, d_h) or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None


class Source:
    """A loaded Llama-family model read in slimkv's conventions."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.shape = check_convertible(loaded.model.config)
        self.pairing = rope_pairing(self.shape.head_dim)

    def attention(self, layer: int) -> LayerWeights:
        s, attn = self.shape, self.model.model.layers[layer].self_attn
        hd, d = s.head_dim, s.d_model

        def heads(proj: nn.Linear, count: int, rotary: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = proj.weight.detach().double().view(count, hd, d)
            b = proj.bias.detach().double().view(count, hd) if proj.bias is not None else None
            if rotary:
                w, b = w[:, self.pairing], (b[:, self.pairing] if b is not None else None)
            return w, b

        q, qb = heads(attn.q_proj, s.n_heads, True)
        k, kb = heads(attn.k_proj, s.n_kv_heads, True)
        v, vb = heads(attn.v_proj, s.n_kv_heads, False)
        return LayerWeights(q, k, v, attn.o_proj.weight.detach().double(), qb, kb, vb)

    def rotary_inv_freq(self) -> torch.Tensor:
        """theta^(-2i/d_h), float64 (d_h/2,): the frequency of adjacent pair i after ``rope_pairing``."""
        pairs = torch.arange(self.shape.head_dim // 2, dtype=torch.float64)
        return 1.0 / (self.shape.rope_theta ** (pairs * 2 / self.shape.head_dim))


def slimkv_config(shape: Shape, fields: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a converted model: the source's shape with the attention ``fields``
    (``attention``, ``attention_options``, ``kind_options``, ``per_layer_options``). RoPE, its theta
    and the q/k/v biases become common attention options; the original's position limit is kept."""
    common = {"rope": "full", "rope_theta": shape.rope_theta, "bias": shape.qkv_bias}
    return ModelConfig(
        vocab_size=shape.vocab_size,
        d_model=shape.d_model,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        head_dim=shape.head_dim,
        attention=fields["attention"],
        attention_options={**common, **fields.get("attention_options", {})},
        kind_options=fields.get("kind_options"),
        per_layer_options=fields.get("per_layer_options"),
        mlp="swiglu",
        d_ff=shape.d_ff,
        norm_eps=shape.norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
        cache_storage=fields.get("cache_storage", "full"),
    )


def shared_parameter_pairs(llama_like: nn.Module, slim: SlimKVForCausalLM, tied: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(transformers parameter, slimkv parameter) for everything but attention: embeddings, final
    norm, LM head (unless ``tied``), and per layer both norms and the gated MLP. Llama's layout,
    which DeepSeek-V3's dense layers share; used to copy in either direction."""
    pairs = [(llama_like.model.embed_tokens.weight, slim.model.embed_tokens.weight), (llama_like.model.norm.weight, slim.model.norm.weight)]
    if not tied:
        pairs.append((llama_like.lm_head.weight, slim.lm_head.weight))
    for layer, block in zip(llama_like.model.layers, slim.model.layers):
        pairs += [(layer.input_layernorm.weight, block.attn_norm.weight), (layer.post_attention_layernorm.weight, block.mlp_norm.weight)]
        pairs += [(getattr(layer.mlp, name).weight, getattr(block.mlp, name).weight) for name in ("gate_proj", "up_proj", "down_proj")]
    return pairs


@torch.no_grad()
def copy_shared_weights(source: Source, target: SlimKVForCausalLM) -> None:
    """Embeddings, norms, MLPs and the LM head (everything but attention) from the source."""
    for theirs, ours in shared_parameter_pairs(source.model, target, source.shape.tie_word_embeddings):
        ours.copy_(theirs)


def gqa_state(weights: LayerWeights, bias: bool) -> dict[str, torch.Tensor]:
    """The state dict of a gqa/mha layer computing exactly the source attention layer."""
    state = {
        "q_proj.weight": weights.q.flatten(0, 1),
        "k_proj.weight": weights.k.flatten(0, 1),
        "v_proj.weight": weights.v.flatten(0, 1),
        "o_proj.weight": weights.o,
    }
    if bias:
        zeros = lambda w: torch.zeros(w.shape[0] * w.shape[1], dtype=w.dtype)  # noqa: E731
        state["q_proj.bias"] = weights.q_bias.flatten() if weights.q_bias is not None else zeros(weights.q)
        state["k_proj.bias"] = weights.k_bias.flatten() if weights.k_bias is not None else zeros(weights.k)
        state["v_proj.bias"] = weights.v_bias.flatten() if weights.v_bias is not None else zeros(weights.v)
        state["o_proj.bias"] = torch.zeros(weights.o.shape[0], dtype=weights.o.dtype)
    return state


def plain_attention_fields(shape: Shape) -> dict[str, Any]:
    """Attention fields of the exact copy: gqa with the source's K/V heads (mha when H = G)."""
    if shape.n_kv_heads == shape.n_heads:
        return {"attention": "mha"}
    return {"attention": "gqa", "attention_options": {"n_kv_heads": shape.n_kv_heads}}


@torch.no_grad()
def exact_copy(source: Source, dtype: torch.dtype = torch.float32) -> SlimKVForCausalLM:
    """A slimkv model computing exactly what the source computes (gqa/mha layers)."""
    model = SlimKVForCausalLM(slimkv_config(source.shape, plain_attention_fields(source.shape))).to(dtype).eval()
    copy_shared_weights(source, model)
    for index, block in enumerate(model.model.layers):
        state = gqa_state(source.attention(index), source.shape.qkv_bias)
        block.attn.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model
