"""Pretrained GQA -> ``hybrid`` (per-head cache roles): the KV heads that retrieve keep every token,
the others keep attention sinks and a window; the weights are the original's, unchanged.

1. **Roles, measured** (``convert.roles``): every (layer, KV head) of the original gets a
   retrieval score on copy contexts built from the calibration prose (no evaluation template).
2. **The budget.** ``--cache-ratio R`` is the kept fraction of the original cache at ``at``
   tokens (default: the model's positions, at most 8192). With T KV heads in all, N = ``at`` and
   K the tokens a streaming head keeps at N (sinks + window - 1), k exact heads cost
   (k N + (T - k) K) / (T N) of the original: the largest k within R are exact.
3. **Which heads.** The k highest-scoring heads over all layers (``score``: ``copy_mass``, the
   attention on the first copy, ``window_loss``, the output change a window alone causes, or
   ``combined``, the next head of each ranking in turn) are exact; the rest stream.
"""

from __future__ import annotations

import math
from typing import Any

from slimkv.attention.streaming import kept_tokens
from slimkv.common.checks import check_choice, check_int
from slimkv.convert.context import LayerContext, LayerFit
from slimkv.convert.roles import SCORES, CopyContext, copy_contexts, measure_head_roles
from slimkv.convert.source import Shape, Source, gqa_state
from slimkv.data.texts import calibration_sources

# score "combined" by default: on held-out copy contexts (Austen, word lists and JSON records, 30 of SmolLM2's 90 KV heads exact)
# its heads copied best on average over 2K and 8K, clearly above copy_mass's at 8K and even with window_loss's there
# (benchmarks/results/convert/convert_hybrid_heads_smollm2.md; docs/conversion.md, hybrid)
METHOD_OPTIONS = {"window": 256, "sink_len": 4, "at": None, "score": "combined", "roles_seq_len": None, "roles_contexts": 2}
MAX_AT = 8192
COMBINED = "combined"  # the two role scores' rankings taken in turn (ranked_heads)
ROLES_SEQ_LEN = 2048


def budget_length(shape: Shape, options: dict[str, Any]) -> int:
    """N, the context the budget is measured at."""
    return options["at"] if options["at"] is not None else min(MAX_AT, shape.max_position_embeddings)


def streaming_tokens(length: int, options: dict[str, Any]) -> int:
    """Tokens a streaming head keeps after ``length`` tokens (as ``HybridAttention``'s cache)."""
    return kept_tokens(length, options["sink_len"], options["window"])


def ratio_floor(shape: Shape, options: dict[str, Any]) -> float:
    """The smallest ratio: every head streaming."""
    length = budget_length(shape, options)
    return streaming_tokens(length, options) / length


def check_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None = None) -> None:
    """Every ``--to hybrid`` option, before any work: ValueError naming the option."""
    positions = shape.max_position_embeddings
    check_int("--to hybrid: window", options["window"], 1, positions - 1)
    check_int("--to hybrid: sink_len", options["sink_len"], 0, positions - 1)
    check_choice("--to hybrid: score", options["score"], (*SCORES, COMBINED))
    check_int("--to hybrid: roles_contexts", options["roles_contexts"], 1)
    if options["at"] is not None:
        check_int("--to hybrid: at", options["at"], options["window"] + options["sink_len"] + 1, positions)
    elif options["window"] + options["sink_len"] >= budget_length(shape, options):
        raise ValueError(f"--to hybrid: window={options['window']} and sink_len={options['sink_len']} keep every one of the "
                         f"{budget_length(shape, options)} tokens the budget is measured at: nothing would be forgotten; give a shorter window")
    if options["roles_seq_len"] is not None:
        check_int("--to hybrid: roles_seq_len", options["roles_seq_len"], 4 * options["window"], positions)
    elif min(ROLES_SEQ_LEN, positions) < 4 * options["window"]:
        raise ValueError(f"--to hybrid: window={options['window']} is too long to measure roles in this model's {positions} positions "
                         f"(copy contexts of {min(ROLES_SEQ_LEN, positions)} tokens need a window of at most a quarter of them)")


def roles_length(shape: Shape, options: dict[str, Any]) -> int:
    """The length of the copy contexts the roles are measured on."""
    return options["roles_seq_len"] or min(ROLES_SEQ_LEN, shape.max_position_embeddings)


def text_demand(options: dict[str, Any], shape: Shape) -> tuple[int, int]:
    """(tokens, window) of calibration prose the copy contexts need, checked before any work: 2 x
    their length in all, taken as ``check_calibration_size`` counts it (in windows of a quarter of
    it, so every source of a mix can give its share)."""
    length = roles_length(shape, options)
    return 2 * length, max(2, length // 4)


def calibration_copy_contexts(source: Source, options: dict[str, Any], *, calib: str, seed: int) -> list[CopyContext]:
    """``roles_contexts`` copy contexts per format of the roles' length, built from the calibration text with ``seed``."""
    documents = [doc for _name, docs in calibration_sources(calib) for doc in docs]
    return copy_contexts(source.loaded.tokenizer, documents, roles_length(source.shape, options), options["roles_contexts"], seed)


def measure_roles(source: Source, options: dict[str, Any], *, calib: str, seed: int, progress: bool = True) -> dict[str, Any]:
    """Step 1: both role scores of every (layer, KV head) on copy contexts from the calibration text."""
    contexts = calibration_copy_contexts(source, options, calib=calib, seed=seed + 2)
    return measure_head_roles(source.model, contexts, sink_len=options["sink_len"], window=options["window"], progress=progress)


def weighing_contexts(source: Source, options: dict[str, Any], *, calib: str, seed: int) -> list[CopyContext]:
    """The contexts ``convert --cache-budget`` weighs its candidate storages on (``convert.budget``): like the
    roles' contexts, other draws (the heads were chosen on those)."""
    return calibration_copy_contexts(source, options, calib=calib, seed=seed + 3)


def ranked_heads(layers: list[LayerContext], score: str) -> list[tuple[int, int]]:
    """Every (layer, KV head), the most retrieving first by ``score``: one of the measured role scores,
    or ``combined`` (``COMBINED``), which takes the next head of each score's ranking in turn."""
    def by(name: str) -> list[tuple[int, int]]:
        scored = sorted(((layer.roles[name][g], layer.index, g) for layer in layers for g in range(layer.shape.n_kv_heads)), reverse=True)
        return [(i, g) for _score, i, g in scored]
    if score != COMBINED:
        return by(score)
    merged: dict[tuple[int, int], None] = {}
    for pair in zip(*(by(name) for name in SCORES)):
        merged.update(dict.fromkeys(pair))
    return list(merged)


def plan(layers: list[LayerContext], ratio: float, **options: Any) -> tuple[list[dict[str, Any]], str]:
    """Steps 2-3 of the module docstring: per layer, the KV heads that keep every token."""
    shape = layers[0].shape
    length = budget_length(shape, options)
    kept = streaming_tokens(length, options)
    total = shape.n_layers * shape.n_kv_heads
    exact = max(0, min(total, math.floor((ratio * total * length - total * kept) / (length - kept) + 1e-9)))
    chosen = set(ranked_heads(layers, options["score"])[:exact])
    plans = [{"full_heads": [g for g in range(shape.n_kv_heads) if (layer.index, g) in chosen], "window": options["window"],
              "sink_len": options["sink_len"]} for layer in layers]
    achieved = (exact * length + (total - exact) * kept) / (total * length)
    return plans, (f"{exact} of {total} KV heads keep every token (the highest {options['score']}), the others {options['sink_len']} sinks and a "
                   f"window of {options['window']}: {achieved:.4f} of the original cache at {length} tokens (asked {ratio})")


def fit_layer(layer: LayerContext, options: dict[str, Any]) -> LayerFit:
    """The original layer's weights; the roles decide only what each KV head caches."""
    layer_opts = {"n_kv_heads": layer.shape.n_kv_heads, "full_heads": list(options["full_heads"]), "window": options["window"],
                  "sink_len": options["sink_len"]}
    return LayerFit(gqa_state(layer.weights, layer.shape.qkv_bias), [], {"full_heads": list(options["full_heads"])}, layer_opts)
