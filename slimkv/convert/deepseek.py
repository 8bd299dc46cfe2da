"""Export of an ``mla-prefix`` conversion as a transformers ``DeepseekV3ForCausalLM`` (docs/conversion.md).

What transformers' DeepSeek-V3 attention cannot express directly, and how the export makes it exact:

* ``kv_a_layernorm`` always RMS-normalises the latent (eps 1e-6, a learnable gain), and the
  converted latent has no norm. With ``attention_bias=True`` the latent gets one extra channel with
  weight 0 and bias K, far larger than any ||c||: then rms([c; K]) = K / sqrt(r + 1) to float
  precision, the norm is linear, its gain K / sqrt(r + 1) (0 on the extra channel) undoes the scale
  and ``kv_b_proj`` reads the extra channel with zero weights. K = 1e4 x a bound on ||c|| from the
  weights alone: x is an RMS-normalised hidden state times the layer's norm gain g, so
  ||x|| <= sqrt(d) max|g| and ||c|| <= ||W_c||_2 sqrt(d) max|g| + ||b_c||. Cost: one cache element
  per token and layer.
* One RoPE ladder for the whole model, theta'^(-2p / rope_dim) with ``rope_interleave`` (adjacent
  pairs, as slimkv): the P fastest frequencies of the source's ladder theta^(-2i / d_h) are that
  ladder with theta' = theta^(2P / d_h). Any other selection (``mla``'s per-layer choice) is not
  expressible, nor are per-layer sizes.
* ``q_proj`` has no bias (with ``q_lora_rank=None``): a source with query biases (Qwen2) cannot
  be exported. ``attention_bias=True`` gives ``o_proj`` a bias (zero).
* Layouts: a query head is [nope | rope] there, [rope | nope] in slimkv; ``kv_a_proj_with_mqa``
  writes [latent | rope key]; ``kv_b_proj`` holds each head's [W_UK_h; W_UV_h]. The softmax scales
  agree (1 / sqrt(rope_dim + nope width)); every layer gets the dense MLP
  (``first_k_dense_replace`` = the number of layers), which is Llama's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from slimkv.convert.source import shared_parameter_pairs
from slimkv.model import SlimKVForCausalLM

EXPORT_FOLDER = "deepseek_v3"  # inside the conversion folder
CONSTANT_MARGIN = 1e4  # K / (bound on ||c||)


def check_exportable(model: SlimKVForCausalLM) -> tuple[float, int, int]:
    """(theta', rope_dim, kv_rank) of a model DeepSeek-V3 can express; ValueError saying why not."""
    config = model.config
    layers = [block.attn for block in model.model.layers]
    kinds = {layer.kind for layer in layers}
    if kinds != {"mla"}:
        raise ValueError(f"--export deepseek needs mla layers, this model has {', '.join(sorted(kinds))}")
    first = layers[0]
    for index, layer in enumerate(layers):
        if layer.latent_norm or layer.q_rank is not None or layer.use_qk_norm:
            raise ValueError(f"--export deepseek: layer {index} has a latent norm, low-rank queries or qk_norm; a conversion has none")
        if (layer.kv_rank, layer.rope_dim, layer.rope_frequencies) != (first.kv_rank, first.rope_dim, first.rope_frequencies):
            raise ValueError("--export deepseek needs the same latent width and RoPE frequencies in every layer (convert with --to mla-prefix)")
    if first.use_bias and bool(first.q_proj.bias.detach().abs().max() > 0):
        raise ValueError("--export deepseek: DeepSeek-V3's q_proj has no bias, and this model's queries have one (e.g. Qwen2)")
    pairs = first.rope_dim // 2
    frequencies = torch.tensor(first.rope_frequencies if first.rope_frequencies is not None else first.rotary.inverse_frequencies("cpu").tolist(), dtype=torch.float64)
    theta = float(config.attention_options.get("rope_theta", first.rope_theta)) ** (2 * pairs / config.head_dim)
    ladder = 1.0 / theta ** (torch.arange(pairs, dtype=torch.float64) * 2 / (2 * pairs))
    if not torch.allclose(frequencies, ladder, rtol=1e-9, atol=0):
        raise ValueError("--export deepseek needs the RoPE frequencies to be the fastest of the source's ladder (convert with --to mla-prefix)")
    return theta, first.rope_dim, first.kv_rank


def deepseek_config(model: SlimKVForCausalLM) -> DeepseekV3Config:
    """The DeepSeek-V3 configuration of an exportable slimkv mla model (one extra latent channel)."""
    theta, rope_dim, kv_rank = check_exportable(model)
    c, first = model.config, model.model.layers[0].attn
    tokens = {name: getattr(model.generation_config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_heads, q_lora_rank=None, kv_lora_rank=kv_rank + 1,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=first.head_dim, v_head_dim=first.v_head_dim, first_k_dense_replace=c.n_layers,
        rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_word_embeddings, attention_bias=True, rope_interleave=True, hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings or 4096, rope_parameters={"rope_type": "default", "rope_theta": theta},
        **{k: v for k, v in tokens.items() if v is not None},
    )


@torch.no_grad()
def latent_bound(block: Any) -> float:
    """An upper bound on ||c|| for every input of ``block``'s attention (module docstring)."""
    attn = block.attn
    w_c = attn.kv_down.weight[attn.rope_dim:].double()
    bound = float(torch.linalg.matrix_norm(w_c, 2)) * math.sqrt(attn.d_model) * float(block.attn_norm.weight.double().abs().max())
    if attn.kv_down.bias is not None:
        bound += float(attn.kv_down.bias[attn.rope_dim:].double().norm())
    return max(bound, 1e-6)


@torch.no_grad()
def to_deepseek(model: SlimKVForCausalLM) -> DeepseekV3ForCausalLM:
    """A DeepseekV3ForCausalLM computing what the slimkv mla ``model`` computes (module docstring)."""
    config = deepseek_config(model)
    out = DeepseekV3ForCausalLM(config).to(next(model.parameters()).dtype).eval()
    for theirs, ours in shared_parameter_pairs(out, model, config.tie_word_embeddings):
        theirs.copy_(ours)
    for target, block in zip(out.model.layers, model.model.layers):
        _copy_attention(target.self_attn, block)
    return out


def _copy_attention(target: Any, block: Any) -> None:
    attn = block.attn
    heads, p, n, v, r = attn.n_heads, attn.rope_dim, attn.head_dim, attn.v_head_dim, attn.kv_rank
    q = attn.q_proj.weight.double().view(heads, p + n, -1)
    target.q_proj.weight.copy_(torch.cat((q[:, p:], q[:, :p]), dim=1).flatten(0, 1))
    down = attn.kv_down.weight.double()
    down_bias = attn.kv_down.bias.double() if attn.kv_down.bias is not None else down.new_zeros(p + r)
    constant = CONSTANT_MARGIN * latent_bound(block)
    target.kv_a_proj_with_mqa.weight.copy_(torch.cat((down[p:], down.new_zeros(1, down.shape[1]), down[:p])))
    target.kv_a_proj_with_mqa.bias.copy_(torch.cat((down_bias[p:], down_bias.new_full((1,), constant), down_bias[:p])))
    gain = torch.full((r + 1,), constant / math.sqrt(r + 1), dtype=torch.float64)
    gain[r] = 0
    target.kv_a_layernorm.weight.copy_(gain)
    up = torch.cat((attn.k_up.weight.double().view(heads, n, r), attn.v_up.weight.double().view(heads, v, r)), dim=1).flatten(0, 1)
    target.kv_b_proj.weight.copy_(torch.cat((up, up.new_zeros(up.shape[0], 1)), dim=1))
    target.o_proj.weight.copy_(attn.o_proj.weight)
    target.o_proj.bias.copy_(attn.o_proj.bias if attn.o_proj.bias is not None else torch.zeros_like(target.o_proj.bias))


@torch.no_grad()
def max_logit_difference(model: SlimKVForCausalLM, exported: DeepseekV3ForCausalLM, length: int = 64) -> float:
    """max |logits| difference of the two models on one fixed sequence of token ids."""
    length = min(length, model.config.max_position_embeddings or length)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    device = next(model.parameters()).device
    return float((exported(ids.to(device), use_cache=False).logits - model(ids.to(device)).logits).abs().max())


def export_deepseek(model: SlimKVForCausalLM, tokenizer: Any, folder: Path) -> dict[str, Any]:
    """Write the DeepSeek-V3 form of ``model`` into ``folder`` (config, safetensors, tokenizer);
    returns what the manifest records about it."""
    exported = to_deepseek(model)
    difference = max_logit_difference(model, exported)
    exported.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return {"format": "transformers DeepseekV3ForCausalLM", "folder": folder.name, "kv_lora_rank": exported.config.kv_lora_rank,
            "rope_theta": exported.config.rope_parameters["rope_theta"], "max_abs_logit_difference": difference}
