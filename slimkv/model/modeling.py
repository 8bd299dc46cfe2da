"""``SlimKVForCausalLM``: a pre-norm decoder LM that takes any registered attention kind.

A ``transformers`` model: ``generate()``, ``save_pretrained``/``from_pretrained`` (safetensors)
and the Auto classes work once ``slimkv`` is imported. Each layer's attention keeps its own cache;
``SlimKVCache`` bundles them for the model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from slimkv.attention import Attention, AttentionCache, build_attention
from slimkv.common.quiet import quiet_transformers
from slimkv.model.block_step import block_step
from slimkv.model.config import ModelConfig
from slimkv.ops.linear import Linear, glu_linear, project, swiglu_residual
from slimkv.ops.norm import RMSNorm
from slimkv.ops.quantize import DEFAULT_GROUP, DEFAULT_RESIDUAL, KVStorage, parse_storage

# Keywords transformers' generate() and Trainer pass to forward() that change nothing here.
IGNORED_KWARGS = frozenset({"cache_position", "num_items_in_batch", "next_sequence_length"})


class SlimKVCache:
    """The per-layer attention caches of one model, advanced together."""

    is_compileable = False  # generation must not try to torch.compile around it

    @property
    def is_linear(self) -> list[bool]:
        """Asked by ``transformers`` generation; slicing of new tokens is done by the model itself."""
        return [False] * len(self.layers)

    def __init__(self, layers: list[AttentionCache]) -> None:
        self.layers = layers

    @property
    def seq_len(self) -> int:
        return self.layers[0].seq_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (the name ``transformers`` generation asks for)."""
        return self.layers[layer_idx].seq_len

    def nbytes(self, float_size: int | None = None) -> int:
        """Bytes of live state summed over layers (``float_size``: ``slimkv.common.buffer.element_bytes``)."""
        return sum(c.nbytes(float_size) for c in self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"SlimKVCache(layers={len(self.layers)}, seq_len={self.seq_len}, nbytes={self.nbytes()})"


class MLP(nn.Module):
    """SwiGLU (down(silu(gate x) * up x)) or ReLU^2 (down(relu(up x)^2)) feed-forward."""

    def __init__(self, d_model: int, d_ff: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.up_proj = Linear(d_model, d_ff, bias=False)
        self.gate_proj = Linear(d_model, d_ff, bias=False) if kind == "swiglu" else None
        self.down_proj = Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:
            gate, up = project(x, (self.gate_proj, self.up_proj))  # a decode step's row: one native call for both, one for the down projection
            return glu_linear(gate, up, self.down_proj)
        return self.down_proj(F.relu(self.up_proj(x)).square())

    def residual(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x + self(norm(x)) (the block's second half); a decode step's row of a SwiGLU MLP in one
        native call (``swiglu_residual``: the norm, gate and up, SwiGLU, down and the sum)."""
        if self.gate_proj is not None:
            fused = swiglu_residual(x, norm.weight, norm.eps, self.gate_proj, self.up_proj, self.down_proj)
            if fused is not None:
                return fused
        return x + self(norm(x))


class Block(GradientCheckpointingLayer):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). With
    ``model.activation_checkpointing_enable()`` (transformers' ``GradientCheckpointingLayer``) a
    training forward keeps only each block's input and recomputes the rest in the backward pass."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        kind = config.layer_kinds()[layer]
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = build_attention(kind, config.d_model, config.n_heads, config.head_dim, **config.layer_options(layer))
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config.d_model, config.d_ff, config.mlp)
        self.native_step = True  # a decode step in one or two native calls where the block allows (block_step); False: the module path

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        if cache is not None:
            out = block_step(self, x, cache)
            if out is not None:
                return out
        x = x + self.attn(self.attn_norm(x), cache=cache)
        return self.mlp.residual(x, self.mlp_norm)


class SlimKVPreTrainedModel(PreTrainedModel):
    config_class = ModelConfig
    config: ModelConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True  # model.activation_checkpointing_enable(): each Block's activations recomputed in the backward pass

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *args: Any, **kwargs: Any):
        """transformers' ``from_pretrained``, refusing a local folder without config.json up front
        (transformers would build a default-shaped model and report every weight as mismatched)."""
        path = Path(str(pretrained_model_name_or_path)).expanduser()
        if path.is_dir() and kwargs.get("config") is None and not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: it is not a saved slimkv model (save one with model.save_pretrained(folder))")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Normal(init_std) weights; residual output projections scaled by 1/sqrt(2 n_layers).
        Applied children first, so an attention module's own ``reset_parameters`` has the last word."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, MLP):
            module.down_proj.weight.normal_(0.0, out_std)
        elif isinstance(module, Attention):
            module.reset_parameters(std, out_std)


class SlimKVModel(SlimKVPreTrainedModel):
    """Embeddings, blocks and the final norm; returns hidden states."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None, cache: SlimKVCache | None = None,
                hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Final normed hidden states (batch, time, d_model); appends every layer's input (and
        the final output) to ``hidden_states`` when a list is given."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            _check_ids(input_ids, self.config.vocab_size)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if h.dim() != 3 or h.shape[1] == 0:
            raise ValueError(f"expected at least one token per sequence, (batch, time >= 1) ids or (batch, time >= 1, d_model) embeddings; got shape "
                             f"{tuple((input_ids if inputs_embeds is None else inputs_embeds).shape)}")
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, the model has {len(self.layers)}")
        for i, block in enumerate(self.layers):
            if hidden_states is not None:
                hidden_states.append(h)
            h = block(h, cache=None if cache is None else cache.layers[i])  # a keyword: activation checkpointing drops a cache it would write twice
        h = self.norm(h)
        if hidden_states is not None:
            hidden_states.append(h)
        return h


class SlimKVForCausalLM(SlimKVPreTrainedModel, GenerationMixin):
    """Decoder LM with an LM head (tied to the embeddings unless ``tie_word_embeddings=False``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = SlimKVModel(config)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @property
    def attention_layers(self) -> list[Attention]:
        return [block.attn for block in self.model.layers]

    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                  storage: KVStorage | str | None = None) -> SlimKVCache:
        """An empty cache for every layer (dtype/device follow the model unless given). ``storage``
        holds every layer's per-token rows as int8 / int4 codes (``"int4"``, ``"int8:group=64,residual=32,block=8"``;
        ``slimkv.ops.quantize``) instead of the cache dtype; by default the config's ``cache_storage``."""
        storage = parse_storage(self.config.cache_storage if storage is None else storage)
        return SlimKVCache([attn.new_cache(batch_size, dtype=dtype, device=device, storage=storage) for attn in self.attention_layers])

    @torch.no_grad()
    def cache_elements_per_token(self, tokens: int = 64) -> list[float]:
        """Cache elements per token of each layer, measured from a live cache after ``tokens`` tokens
        (held in full storage: elements, not the bytes a quantized storage packs them in)."""
        weight = next(self.parameters())
        cache = self.new_cache(1, storage="full")
        self(torch.zeros(1, tokens, dtype=torch.long, device=weight.device), cache=cache)
        size = torch.empty((), dtype=weight.dtype).element_size()
        return [layer.nbytes() / tokens / size for layer in cache.layers]

    def cache_is_per_token(self) -> bool:
        """Whether every layer's cache holds the same number of elements for each token (so elements
        per token and a cache ratio describe it); a bounded state (kvm, mla-kvm, streaming) does not."""
        return all(attn.cache_bytes(2048) == 2 * attn.cache_bytes(1024) for attn in self.attention_layers)

    def cache_bytes(self, seq_len: int, dtype: torch.dtype = torch.float32, batch_size: int = 1) -> int:
        """Analytic cache bytes of the whole model after ``seq_len`` tokens (each layer checks the arguments)."""
        return sum(attn.cache_bytes(seq_len, dtype, batch_size) for attn in self.attention_layers)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: SlimKVCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits for every position (or the last ``logits_to_keep``). ``labels`` (same shape as
        input_ids, -100 = ignore) give the mean next-token cross-entropy as ``loss``. With
        ``use_cache`` and no cache, a new one is made and returned. ``past_key_values`` is the
        deprecated name of ``cache`` (as in transformers); unknown keywords raise TypeError."""
        unknown = sorted(set(kwargs) - IGNORED_KWARGS)
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward() got unexpected keyword argument(s): {', '.join(unknown)}")
        if cache is not None and not isinstance(cache, SlimKVCache):
            raise TypeError(f"cache must be a SlimKVCache (from model.new_cache(batch_size)), got {type(cache).__name__}")
        if output_attentions:
            raise ValueError("output_attentions is not supported: several slimkv kinds never form an attention matrix")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask with padding is not supported: slimkv caches hold unpadded sequences; batch prompts of equal length")
        ref = input_ids if input_ids is not None else inputs_embeds
        if position_ids is not None:
            _check_positions(position_ids, 0 if cache is None else cache.seq_len, ref.shape[1])
        if cache is None and use_cache:
            cache = self.new_cache(ref.shape[0], device=ref.device)
        hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        h = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache, hidden_states=hidden)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache, hidden_states=tuple(hidden) if hidden is not None else None)

    # -- generation plumbing: every layer is driven through its own cache ------------------

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int) -> None:
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return
        if generation_config.num_beams > 1:
            raise ValueError("beam search is not supported by slimkv models; use greedy decoding or sampling")
        storage = generation_storage(generation_config)
        model_kwargs["cache"] = self.new_cache(batch_size * max(1, generation_config.num_return_sequences or 1), storage=storage)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, cache: SlimKVCache | None = None, **kwargs: Any) -> dict:
        """The tokens the cache has not seen yet: ``generate()`` passes the whole sequence, whose
        first ``cache.seq_len`` tokens must be the ones the cache holds."""
        if cache is not None and cache.seq_len > 0:
            if cache.seq_len >= input_ids.shape[1]:
                raise ValueError(f"the cache passed to generate() (past_key_values/cache) already holds {cache.seq_len} tokens, and input_ids has "
                                 f"{input_ids.shape[1]}: input_ids must be the cached sequence followed by at least one new token. "
                                 "A cache holds one sequence; for another one pass a new cache (model.new_cache(batch_size)) or none")
            input_ids = input_ids[:, cache.seq_len :]
        kwargs.pop("position_ids", None)
        return super().prepare_inputs_for_generation(input_ids, cache=cache, **kwargs)


def generation_storage(generation_config: Any) -> KVStorage | None:
    """The storage ``generate()`` asks for in transformers' words: ``cache_implementation="quantized"``
    with ``cache_config={"nbits": 4 or 8, "q_group_size": G, "residual_length": R}`` is slimkv's own
    int4 / int8 storage (whatever ``backend`` names); ``None``/``"dynamic"`` the config's default."""
    implementation = getattr(generation_config, "cache_implementation", None)
    if implementation in (None, "dynamic"):
        return None
    if implementation != "quantized":
        raise ValueError(f"cache_implementation={implementation!r} is not supported by slimkv models; use 'quantized' "
                         "(cache_config nbits 4 or 8) or leave it unset")
    config = dict(getattr(generation_config, "cache_config", None) or {})
    bits = config.get("nbits", 4)
    if bits not in (4, 8):
        raise ValueError(f"cache_config nbits={bits!r}: slimkv's quantized storage has 4 or 8 bits")
    return KVStorage(bits=bits, group=config.get("q_group_size", DEFAULT_GROUP),
                     residual=config.get("residual_length", DEFAULT_RESIDUAL))


def _check_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Token ids must lie in [0, vocab_size): a clear error instead of an index error deep inside."""
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(f"input_ids hold ids outside [0, {vocab_size}) (min {int(input_ids.min())}, max {int(input_ids.max())}); "
                         "the tokenizer does not match this model's vocabulary")


def _check_positions(position_ids: torch.Tensor, start: int, length: int) -> None:
    """slimkv positions are the cache's token count: refuse any other (padded or packed) positions."""
    expected = torch.arange(start, start + length, device=position_ids.device)
    if position_ids.shape[-1] != length or not bool((position_ids == expected).all()):
        raise ValueError(f"position_ids must be {start}..{start + length - 1} (slimkv places tokens after the cache's {start}); "
                         "padded or packed positions are not supported")


def load_model_folder(folder: str | Path, **kwargs: Any) -> SlimKVForCausalLM:
    """``SlimKVForCausalLM.from_pretrained(folder)`` in eval mode, refusing weights that do not fit
    (missing, unexpected or mis-shaped keys: ValueError naming the folder) instead of initialising
    them at random, and damaged files (ValueError naming the file)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: it is not a saved slimkv model")
    try:
        with quiet_transformers():
            model, info = SlimKVForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
    except (OSError, SafetensorError) as err:
        raise ValueError(f"the weights in {folder} cannot be read ({err}); a file is truncated or damaged") from None
    problems = {k.replace("_keys", ""): sorted(map(str, v)) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(f"{folder}: the weights do not fit config.json ({'; '.join(f'{k}: {v}' for k, v in problems.items())}); was config.json edited?")
    return model.eval()
