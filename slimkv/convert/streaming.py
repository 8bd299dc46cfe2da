"""Pretrained GQA -> ``streaming`` (attention sinks + sliding window, StreamingLLM): the weights
are the original's, unchanged; only the cache forgets. The bounded-memory baseline of the KVM
conversion: at the same state bytes it shows what KVM's compressed memory buys."""

from __future__ import annotations

from typing import Any

from slimkv.common.checks import check_int
from slimkv.convert.context import LayerContext, LayerFit
from slimkv.convert.source import Shape, gqa_state

METHOD_OPTIONS = {"window": 1024, "sink_len": 4}


def check_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None = None) -> None:
    """``window`` from 1 to below the model's positions (else nothing is ever forgotten), ``sink_len`` >= 0."""
    check_int("--to streaming: window", options["window"], 1, shape.max_position_embeddings - 1)
    check_int("--to streaming: sink_len", options["sink_len"], 0)


def plan(layers: list[LayerContext], ratio: float | None, **options: Any) -> tuple[list[dict[str, Any]], str]:
    """The same window and sinks in every layer."""
    return [dict(options) for _ in layers], f"every layer: {options['sink_len']} sink tokens and a window of {options['window']} tokens"


def fit_layer(layer: LayerContext, options: dict[str, Any]) -> LayerFit:
    """The original layer's weights with the streaming cache."""
    layer_opts = {"n_kv_heads": layer.shape.n_kv_heads, "window": options["window"], "sink_len": options["sink_len"]}
    return LayerFit(gqa_state(layer.weights, layer.shape.qkv_bias), [], {}, layer_opts)
