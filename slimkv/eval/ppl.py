"""Perplexity of a pretrained (possibly compressed) causal LM on held-out text.

Protocol (docs/evaluation.md, "Perplexity of pretrained models"): join documents with "\\n\\n",
tokenize once, cut into non-overlapping windows of ``seq_len`` tokens, and report
ppl = exp(total NLL / tokens predicted); each window predicts its tokens 2..n from their prefix
in the window. A window whose loss is not finite is an error, never skipped. For a compressed
or converted model its original is evaluated in the same run and printed beside it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slimkv.common.checks import check_int
from slimkv.common.markdown import markdown_table
from slimkv.data.texts import evaluation_text, text_sha256, tokenize
from slimkv.eval.models import cache_label, check_positions, conversion_method, load_language_model, original_of
from slimkv.ops.quantize import parse_storage
from slimkv.scoring import perplexity_of_ids

QUANTIZED_CHUNK = 128  # calls of a quantized cache with no residual window


def perplexity(model: nn.Module, tokenizer, text: str, seq_len: int = 1024, max_tokens: int | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Perplexity of ``model`` on ``text`` (tokenized once; the first ``max_tokens`` tokens if given)."""
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    ids = torch.tensor(tokenize(tokenizer, text), dtype=torch.long)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return perplexity_of_ids(model, ids, seq_len, progress=progress, cache_chunk=cache_chunk(model))


def cache_chunk(model: nn.Module) -> int | None:
    """Calls of this many tokens score a model whose cache is quantized through that cache (its
    residual window: a call's queries read every older row as codes, never kinder than decode);
    None for a full-precision cache (one call per window is the same computation)."""
    storage = getattr(getattr(model, "config", None), "cache_storage", "full")
    if storage == "full":
        return None
    return parse_storage(storage).residual or QUANTIZED_CHUNK


def perplexity_report(model: str, text: str = "shakespeare-val", seq_len: int = 1024, max_tokens: int | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Perplexity of ``model`` (anything ``load_language_model`` reads) on ``text``; for a compressed or
    converted model its original is evaluated in the same run and listed first. Refuses the text a
    model was calibrated on."""
    check_int("--seq-len", seq_len, 2)
    if max_tokens is not None:
        check_int("--max-tokens", max_tokens, 2)
    eval_text = evaluation_text(text)
    original = original_of(model)  # moved, deleted or changed: refused before any model loads
    loaded = load_language_model(model)
    check_positions(loaded.model, seq_len, "--seq-len")
    rows = []
    calibrated_on = (loaded.identity.get("compressed") or {}).get("calibration_text_sha256") or ((loaded.identity.get("converted") or {}).get("calibration") or {}).get("text_sha256")
    if calibrated_on is not None and calibrated_on == text_sha256(eval_text):
        raise ValueError(f"text {text!r} is the text this model was calibrated on; evaluate on held-out text")
    sources = set((loaded.identity.get("compressed") or {}).get("calibration_sources") or [])
    sources |= set(str(((loaded.identity.get("converted") or {}).get("calibration") or {}).get("source") or "").split(","))
    if text in sources:
        raise ValueError(f"text {text!r} is one of the calibration sources of this model ({', '.join(sorted(s for s in sources if s))}); "
                         "evaluate on a text it was not calibrated on")
    if original is not None:
        base = load_language_model(original)
        what = "dense" if loaded.identity.get("compressed") else "original"
        rows.append({"model": f"{what} ({loaded.identity['base']})", **perplexity(base.model, base.tokenizer, eval_text, seq_len, max_tokens, progress=progress)})
        del base
    rows.append({"model": describe(loaded.identity, model), **perplexity(loaded.model, loaded.tokenizer, eval_text, seq_len, max_tokens, progress=progress)})
    return {"text": text, "text_sha256": text_sha256(eval_text), "seq_len": seq_len, "model": loaded.identity, "results": rows}


def describe(identity: dict[str, Any], spec: str) -> str:
    """A row label: the method and ratio of a compressed or converted model (for a converted one
    also the kind of its layers, from config.json, and its cache: ``cache_label``), else its name."""
    if identity.get("compressed"):
        c = identity["compressed"]
        return f"{c['method']} ratio {c['ratio']} (achieved {c['achieved_ratio']:.4f})"
    if identity.get("converted"):
        c = identity["converted"]
        healed = " healed" if c.get("healing") else ""
        return f"convert {conversion_method(c)} ({c['kind']} layers) {cache_label(c)}{healed}"
    return spec


def format_table(report: dict[str, Any]) -> str:
    """The report as a markdown table (a model scored through its quantized cache says so)."""
    rows = [[r["model"] + (f" (through its cache, calls of {r['through_cache_in_calls_of']})" if r.get("through_cache_in_calls_of") else ""),
             f"{r['ppl']:.3f}", r["tokens_predicted"], r["windows"]] for r in report["results"]]
    return f"perplexity on {report['text']!r}, {report['seq_len']}-token windows\n" + markdown_table(
        ["model", "ppl", "tokens predicted", "windows"], rows, align=["left", "right", "right", "right"])
