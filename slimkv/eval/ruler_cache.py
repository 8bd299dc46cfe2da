"""KV-cache options of ``slimkv eval ruler`` and the live cache they hold (docs/ruler.md).

An option names the cache a model generates with: ``none`` (the model's own: transformers'
``DynamicCache`` in the model's dtype, or a slimkv model's ``SlimKVCache``), ``bfloat16`` /
``float16`` (a ``DynamicCache`` whose keys and values are stored in that dtype and handed to
attention in the model's), or ``quanto-int4`` / ``quanto-int2`` / ``hqq-int4`` / ``hqq-int2``
(transformers' ``QuantizedCache``, KIVI-style: the prompt's keys and values quantized per channel
in groups, new tokens kept in full precision until the residual window fills), or a kvpress press
at a budget (``press:kvzip@0.25``: ``slimkv.eval.ruler_press``, run in kvpress's own environment).
Bytes are read off the cache object's tensors after a prefill, never computed from a formula.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, QuantizedCache

from slimkv.common.checks import check_choice
from slimkv.eval import ruler_press
from slimkv.model import SlimKVForCausalLM

CAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED = {"quanto-int4": ("quanto", 4), "quanto-int2": ("quanto", 2), "hqq-int4": ("hqq", 4), "hqq-int2": ("hqq", 2)}
CACHE_OPTIONS = ("none", *CAST_DTYPES, *QUANTIZED)
BACKEND_MODULES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
# transformers' QuantizedCache defaults, recorded beside every quantized result
QUANTIZED_SETTINGS = {"q_group_size": 64, "residual_length": 128, "axis_key": 0, "axis_value": 0}
DECODE_PROBE_TOKENS = 8  # greedy steps after the probe's prefill: the decode cost per token, and the residual window's bytes


class CastLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores keys and values in ``dtype`` (bfloat16, float16) and hands
    attention the whole history in the dtype of the states it is given (the model's)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.store_dtype = dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states.to(self.store_dtype), value_states.to(self.store_dtype), *args, **kwargs)
        return keys.to(key_states.dtype), values.to(value_states.dtype)


def parse_caches(text: str) -> list[str]:
    """``"none,quanto-int4,press:kvzip@0.25"`` -> distinct cache options, in the order given (a press
    in its one spelling, ``press:NAME@BUDGET``); ValueError naming --caches."""
    options = [part.strip() for part in str(text).split(",") if part.strip()]
    for index, option in enumerate(options):
        if ruler_press.is_press(option):
            options[index] = ruler_press.canonical(option)
        elif option.startswith("press") or option in ruler_press.PRESSES:
            raise ValueError(f"--caches {option}: a kvpress press is written press:NAME@BUDGET (e.g. press:kvzip@0.25); "
                             f"allowed presses: {', '.join(ruler_press.PRESSES)}")
        else:
            check_choice("--caches", option, CACHE_OPTIONS + ("press:NAME@BUDGET",))
    if not options or len(set(options)) != len(options):
        raise ValueError(f"--caches must list distinct cache options among {', '.join(CACHE_OPTIONS)} and press:NAME@BUDGET, got {text!r}")
    return options


def check_backends(options: list[str]) -> None:
    """Every quantized option's backend must be importable, and kvpress's environment must exist for
    a press; ImportError naming the option and the package (or ``make bench-kvpress-env``)."""
    ruler_press.check_env(options)
    for option in options:
        if option in QUANTIZED:
            module, package = BACKEND_MODULES[QUANTIZED[option][0]]
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                raise ImportError(f"--caches {option} needs {package}, which is not installed here; `make ruler-env` installs it (with optimum-quanto "
                                  "and hqq) into .venv-ruler: use .venv-ruler/bin/slimkv")


def check_model_takes(model: torch.nn.Module, options: list[str]) -> None:
    """A slimkv model (``slimkv convert``) generates through its own ``SlimKVCache`` only; a
    transformers model with sliding-window layers cannot take ``QuantizedCache``. ValueError naming
    the option, before any work."""
    for option in options:
        if option == "none":
            continue
        if isinstance(model, SlimKVForCausalLM):
            raise ValueError(f"--caches {option}: this is a slimkv model ({', '.join(sorted(set(model.config.layer_kinds())))} layers), which "
                             "generates through its own cache (SlimKVCache); transformers' cache options apply to transformers models "
                             "(the original or a `slimkv compress` output): use --caches none")
        text = model.config.get_text_config(decoder=True)
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(f"--caches {option}: this model has {', '.join(sorted(kinds))} layers; slimkv eval ruler's cache options "
                             "need full-attention layers only")
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if option in QUANTIZED and head_dim % QUANTIZED_SETTINGS["q_group_size"]:
            raise ValueError(f"--caches {option}: the quantized cache groups {QUANTIZED_SETTINGS['q_group_size']} channels, which do not divide "
                             f"this model's head_dim {head_dim}")


def cache_factory(model: torch.nn.Module, option: str) -> Callable[[], Cache] | None:
    """A maker of a fresh cache of ``option`` for each prompt, or None for the model's own."""
    if option == "none":
        return None
    if ruler_press.is_press(option):
        raise ValueError(f"--caches {option}: a press runs in kvpress's environment (slimkv.eval.ruler_press), not in this process")
    text = model.config.get_text_config(decoder=True)
    if option in CAST_DTYPES:
        dtype = CAST_DTYPES[option]
        return lambda: Cache(layers=[CastLayer(dtype) for _ in range(text.num_hidden_layers)])
    backend, nbits = QUANTIZED[option]
    return lambda: QuantizedCache(backend, model.config, nbits=nbits, **QUANTIZED_SETTINGS)


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor in ``obj`` (a tensor, or dicts, lists and tuples of them), each
    counted once; a tensor subclass (quanto's packed int2/int4 tensors) is counted as its inner
    tensors: the packed data, the scales and the zero points."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name), seen) for name in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def cache_bytes(cache: Any) -> list[int]:
    """Live bytes per layer of a slimkv ``SlimKVCache`` (its ``nbytes()``) or a transformers cache
    (every tensor a layer holds: full-precision keys and values, a quantized layer's packed data,
    scales, zero points and its full-precision residual window)."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return [layer.nbytes() for layer in cache.layers]
    return [tensor_bytes(vars(layer)) for layer in cache.layers]


@torch.no_grad()
def probe(model: torch.nn.Module, option: str, length: int, vocab: int, *, decode_tokens: int = DECODE_PROBE_TOKENS) -> dict[str, Any]:
    """Prefill ``length`` token ids (1, length) through ``model`` into a cache of ``option``, read
    the cache's bytes, then decode ``decode_tokens`` greedy tokens and read them again; the
    prefill's seconds and the seconds per decoded token give the planner's cost of a prompt."""
    device = next(model.parameters()).device
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length), device=device)
    slimkv_model = isinstance(model, SlimKVForCausalLM)
    factory = cache_factory(model, option)
    cache = model.new_cache(1, device=device) if slimkv_model else (factory() if factory else DynamicCache(config=model.config))
    started = time.perf_counter()
    logits = model(input_ids=ids, use_cache=True, cache=cache).logits
    prefill_s = time.perf_counter() - started
    after_prompt = cache_bytes(cache)
    tokens = int(cache.get_seq_length())
    started = time.perf_counter()
    for _ in range(decode_tokens):
        logits = model(input_ids=logits[:, -1:].argmax(-1), use_cache=True, cache=cache).logits
    decode_s = (time.perf_counter() - started) / max(decode_tokens, 1)
    after_decode = cache_bytes(cache)
    return {
        "option": option, "cache_type": type(cache).__name__, "tokens": tokens, "bytes_total": sum(after_prompt), "bytes_per_layer": after_prompt,
        "bytes_per_token": sum(after_prompt) / tokens, "decode_tokens": decode_tokens,
        "bytes_per_token_after_decode": sum(after_decode) / int(cache.get_seq_length()),
        "prefill_s": prefill_s, "decode_s_per_token": decode_s, "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        **option_settings(option),
    }


def option_settings(option: str) -> dict[str, Any]:
    """What a quantized option stands for (backend, bits and transformers' grouping) or a press (its
    class, options and budget), ``{}`` for the others."""
    if ruler_press.is_press(option):
        return ruler_press.settings(option)
    if option not in QUANTIZED:
        return {}
    backend, nbits = QUANTIZED[option]
    return {"quantized": {"backend": backend, "nbits": nbits, **QUANTIZED_SETTINGS}}


def bf16_reference(reference_probe: dict[str, Any]) -> float:
    """Bytes per token of the original's cache counted at 2 bytes an element (its bfloat16 release),
    from a ``probe`` of the original's own ``DynamicCache`` in the original's dtype (float32 here: half its bytes)."""
    return reference_probe["bytes_per_token"] * 2 / torch.empty((), dtype=getattr(torch, reference_probe["dtype"])).element_size()
