"""The live KV cache of a real ``generate()``: bytes per token, per layer and in total, measured
from the tensors the cache holds (never a formula), for a slimkv model (``SlimKVCache``) and for a
transformers model (its default ``DynamicCache``), so a converted model can be set beside its
original at the same context (``slimkv eval cache``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from slimkv.common.checks import check_int
from slimkv.data.texts import evaluation_text, tokenize
from slimkv.eval.models import check_positions, load_language_model, load_original, original_of
from slimkv.model import SlimKVCache
from slimkv.model.block_step import block_step_counts
from slimkv.ops.native import kernel_isa, kernel_linear_prefetch, kernel_row_prefetch, kernel_threading, kernel_tile_logits
from slimkv.pretrained import LoadedModel


def layer_bytes(cache: Any) -> list[int]:
    """Live bytes of each layer of a ``SlimKVCache`` or a transformers cache (its layers' key and value tensors)."""
    if isinstance(cache, SlimKVCache):
        return [layer.nbytes() for layer in cache.layers]
    out = []
    for layer in cache.layers:
        tensors = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]
        out.append(sum(t.numel() * t.element_size() for t in tensors))
    return out


@torch.no_grad()
def live_cache(loaded: LoadedModel, prompt: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Greedy ``generate()`` of ``new_tokens`` after ``prompt`` (1, P); the cache it leaves, measured."""
    model = loaded.model
    started = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                         pad_token_id=getattr(loaded.tokenizer, "pad_token_id", None) or 0)
    cache = out["cache"]
    per_layer = layer_bytes(cache)
    tokens = cache.get_seq_length()
    dtype = next(model.parameters()).dtype
    return {
        "cache_type": type(cache).__name__,
        "tokens_cached": tokens,
        "context": int(out["sequences"].shape[1]),
        "dtype": str(dtype).replace("torch.", ""),
        "bytes_total": sum(per_layer),
        "bytes_per_layer": per_layer,
        "bytes_per_token": sum(per_layer) / tokens,
        "bytes_per_token_per_layer": [b / tokens for b in per_layer],
        "elements_per_token_per_layer": [b / tokens / torch.empty((), dtype=dtype).element_size() for b in per_layer],
        "seconds": time.perf_counter() - started,
    }


def cache_report(model: str, context: int, *, new_tokens: int = 16, text: str = "shakespeare-val") -> dict[str, Any]:
    """The live cache of ``model`` after ``generate()`` to ``context`` tokens (a prompt of
    ``context - new_tokens`` tokens of ``text``, then ``new_tokens`` greedy ones), and of its
    original (for a converted or compressed model) at the same context."""
    check_int("--context", context, 2)
    check_int("--new-tokens", new_tokens, 1)
    if new_tokens >= context:
        raise ValueError(f"--context {context} leaves no room for a prompt before --new-tokens {new_tokens} generated tokens "
                         f"(default 16): give a --context above {new_tokens} or fewer --new-tokens")
    original_of(model)  # a moved or changed original is refused before any model loads, not after the model's cache is measured
    loaded = load_language_model(model)
    check_positions(loaded.model, context, "--context")
    ids = tokenize(loaded.tokenizer, evaluation_text(text))
    if not ids:
        raise ValueError(f"text {text!r} has no tokens")
    ids = (ids * (context // len(ids) + 1))[: context - new_tokens]  # a short text is repeated to fill the context
    prompt = torch.tensor([ids], dtype=torch.long, device=next(loaded.model.parameters()).device)
    rows = {"model": {"name": model, **live_cache(loaded, prompt, new_tokens)}}
    if loaded.identity.get("base"):
        base = load_original(loaded)
        check_positions(base.model, context, "--context")
        rows["original"] = {"name": loaded.identity["base"], **live_cache(base, prompt, new_tokens)}
        rows["ratio_to_original"] = rows["model"]["bytes_per_token"] / rows["original"]["bytes_per_token"]
    dtype = next(loaded.model.parameters()).dtype
    rows["kernel_isa"] = kernel_isa(dtype)  # the decode kernel's path for this model's dtype, and how it gets its threads
    rows["kernel_threading"] = kernel_threading(dtype)
    rows["kernel_row_prefetch"] = kernel_row_prefetch(dtype)
    rows["kernel_tile_logits"] = kernel_tile_logits(dtype)
    rows["kernel_linear_prefetch"] = kernel_linear_prefetch(dtype)
    rows["block_steps"] = block_step_counts(loaded.model)  # how its blocks take a decode step: one native call, two, or the module path
    return {"context": context, "new_tokens": new_tokens, "text": text, **rows}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"live KV cache after generate() to {report['context']} tokens ({report['new_tokens']} generated after a prompt of {report['text']!r})",
             "| model | cache | tokens | bytes total | bytes/token | bytes/token/layer (min-max) |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for key in ("original", "model"):
        if key in report:
            r = report[key]
            per = r["bytes_per_token_per_layer"]
            lines.append(f"| {r['name']} | {r['cache_type']} ({r['dtype']}) | {r['tokens_cached']} | {r['bytes_total']:,} | {r['bytes_per_token']:,.1f} | {min(per):,.1f}-{max(per):,.1f} |")
    if "ratio_to_original" in report:
        lines.append(f"live cache ratio to the original: {report['ratio_to_original']:.4f}")
    if "kernel_isa" in report:
        threading = f"; threads: {report['kernel_threading']}" if report.get("kernel_threading") else ""
        prefetch = f"; row-tile prefetch: {report['kernel_row_prefetch']}" if report.get("kernel_row_prefetch") else ""
        logits = f"; tile logits: {report['kernel_tile_logits']}" if report.get("kernel_tile_logits") else ""
        linear = f"; linear-row prefetch: {report['kernel_linear_prefetch']}" if report.get("kernel_linear_prefetch") else ""
        lines.append(f"native decode kernel path: {report['kernel_isa']}{threading}{prefetch}{logits}{linear}")
    if report.get("block_steps"):
        steps = report["block_steps"]
        lines.append(f"decode steps of the model's blocks: {steps['one_call']} in one native call, {steps['two_calls']} in two around the "
                     f"attention, {steps['module_path']} on the module path (slimkv.model.block_step)")
    return "\n".join(lines)
