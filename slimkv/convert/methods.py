"""Conversion methods in a registry: a method turns each attention layer of a source model into
one of slimkv's compact kinds. A method is three functions and a registration:

* ``min_ratio(shape)``: the smallest cache ratio it can represent (checked before any work);
* ``plan(layers, ratio)``: per-layer options whose total cache meets the ratio (how sizes are
  allocated across layers is the method's choice, recorded in the manifest);
* ``fit(layer, options)``: the state dict of one converted layer (``LayerFit``).

``LayerContext`` hands a method one source layer in slimkv's conventions (``slimkv.convert.source``)
with its calibration statistics. docs/conversion.md describes the built-in methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from slimkv.common.checks import close_matches
from slimkv.convert.calibrate import LayerStats
from slimkv.convert.source import LayerWeights, Shape, gqa_state


@dataclass
class LayerContext:
    """One source attention layer: its weights (float64, slimkv conventions), statistics, shape."""

    index: int
    shape: Shape
    weights: LayerWeights
    stats: LayerStats
    inv_freq: torch.Tensor  # (head_dim / 2,) RoPE frequency of each adjacent pair


@dataclass
class LayerFit:
    """A converted layer: its attention state dict, the parameter names the conversion changed
    (what healing trains by default) and facts for the manifest."""

    state: dict[str, torch.Tensor]
    changed: list[str]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Conversion:
    """A registered conversion method (module docstring); ``kind`` is the slimkv kind of its layers
    and ``options`` the options every layer shares."""

    name: str
    kind: str
    min_ratio: Callable[[Shape], float]
    plan: Callable[[list[LayerContext], float], tuple[list[dict[str, Any]], str]]
    fit: Callable[[LayerContext, dict[str, Any]], LayerFit]
    options: Callable[[Shape], dict[str, Any]]
    description: str


CONVERSIONS: dict[str, Conversion] = {}


def register_conversion(name: str, *, kind: str, min_ratio: Callable[[Shape], float], plan: Callable, fit: Callable,
                        options: Callable[[Shape], dict[str, Any]] = lambda shape: {}, description: str = "") -> None:
    """Add a conversion method (``slimkv convert --to NAME``)."""
    if name in CONVERSIONS:
        raise ValueError(f"conversion method {name!r} is already registered")
    CONVERSIONS[name] = Conversion(name, kind, min_ratio, plan, fit, options, description)


def get_conversion(name: str) -> Conversion:
    if name not in CONVERSIONS:
        raise ValueError(f"--to {name!r} is not a conversion method{close_matches(name, CONVERSIONS)}; allowed values: {', '.join(CONVERSIONS)}")
    return CONVERSIONS[name]


# ---------------------------------------------------------------- shared numerics


def rotation_averaged(m: torch.Tensor) -> torch.Tensor:
    """The average of R(a)^T M R(a) over rotation angles a of every RoPE pair (adjacent channels
    (2i, 2i+1), each pair its own frequency): within a pair's 2x2 block the isotropic and
    antisymmetric parts survive, blocks between pairs (other frequencies) average to zero.
    (..., d, d) -> (..., d, d)."""
    a, b, c, d = m[..., 0::2, 0::2].diagonal(dim1=-2, dim2=-1), m[..., 0::2, 1::2].diagonal(dim1=-2, dim2=-1), m[..., 1::2, 0::2].diagonal(dim1=-2, dim2=-1), m[..., 1::2, 1::2].diagonal(dim1=-2, dim2=-1)
    iso, anti = (a + d) / 2, (c - b) / 2
    out = torch.zeros_like(m)
    out[..., 0::2, 0::2] = torch.diag_embed(iso)
    out[..., 1::2, 1::2] = torch.diag_embed(iso)
    out[..., 1::2, 0::2] = torch.diag_embed(anti)
    out[..., 0::2, 1::2] = torch.diag_embed(-anti)
    return out


def query_weights(layer: LayerContext) -> torch.Tensor:
    """E[q q^T] of every query head, averaged over RoPE rotations: (H, d_h, d_h). A key error
    dk costs E[(q . dk)^2] = dk^T Q dk in the logits of that query head."""
    w = layer.weights
    q = torch.einsum("hcd,de,hfe->hcf", w.q, layer.stats.cov, w.q)
    return rotation_averaged(q)


def output_weights(layer: LayerContext) -> torch.Tensor:
    """W_o,h^T W_o,h of every query head: (H, d_h, d_h). A value error dv of head h moves the
    layer output by W_o,h dv."""
    s = layer.shape
    o = layer.weights.o.view(s.d_model, s.n_heads, s.head_dim).permute(1, 2, 0)  # (H, d_h, d)
    return o @ o.transpose(1, 2)


# ---------------------------------------------------------------- gqa: fewer K/V heads by merging


def merged_heads(weights: torch.Tensor, bias: torch.Tensor | None, metric: torch.Tensor | None, new_heads: int, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge K/V heads (G, d_h, d) into ``new_heads`` (each merging G / new_heads neighbours).

    ``metric`` None: the mean. Otherwise metric (H, d_h, d_h) weights every query head's error
    (``query_weights`` for keys, ``output_weights`` for values): the merged map minimising
    sum_h tr(M_h (W_g(h) - W') C (W_g(h) - W')^T) is W' = (sum_h M_h)^-1 sum_h M_h W_g(h) (C drops out)."""
    old = weights.shape[0]
    merge = old // new_heads
    heads = weights.repeat_interleave(group, 0)  # (H, d_h, d): each query head's original K/V map
    biases = bias.repeat_interleave(group, 0) if bias is not None else None
    per_new = heads.shape[0] // new_heads
    out_w, out_b = [], []
    for g in range(new_heads):
        span = slice(g * per_new, (g + 1) * per_new)
        if metric is None:
            out_w.append(weights[g * merge : (g + 1) * merge].mean(0))
            out_b.append(bias[g * merge : (g + 1) * merge].mean(0) if bias is not None else None)
            continue
        m = metric[span]
        total = m.sum(0) + 1e-12 * m.sum(0).diagonal().mean() * torch.eye(m.shape[-1], dtype=m.dtype)
        out_w.append(torch.linalg.solve(total, (m @ heads[span]).sum(0)))
        out_b.append(torch.linalg.solve(total, (m @ biases[span, :, None]).sum(0))[:, 0] if biases is not None else None)
    return torch.stack(out_w), (torch.stack(out_b) if bias is not None else None)


def _gqa_layer(layer: LayerContext, new_heads: int, aware: bool) -> tuple[dict[str, torch.Tensor], float]:
    """State of a gqa layer with ``new_heads`` K/V heads, and its relative (weighted) merge error."""
    w, s = layer.weights, layer.shape
    qw, ow = (query_weights(layer), output_weights(layer)) if aware else (None, None)
    k, kb = merged_heads(w.k, w.k_bias, qw, new_heads, s.group)
    v, vb = merged_heads(w.v, w.v_bias, ow, new_heads, s.group)
    merged = LayerWeights(w.q, k, v, w.o, w.q_bias, kb, vb)
    error = 0.0
    for old, new, metric in ((w.k, k, query_weights(layer)), (w.v, v, output_weights(layer))):
        expanded_old = old.repeat_interleave(s.group, 0)
        expanded_new = new.repeat_interleave(s.n_heads // new_heads, 0)
        diff = expanded_old - expanded_new
        cost = torch.einsum("hab,hbd,de,hae->", metric, diff, layer.stats.cov, diff)
        scale = torch.einsum("hab,hbd,de,hae->", metric, expanded_old, layer.stats.cov, expanded_old)
        error += float(cost / scale.clamp_min(1e-300)) / 2
    return gqa_state(merged, s.qkv_bias), error


def _gqa_choices(shape: Shape) -> list[int]:
    """K/V head counts a layer can be merged to: divisors of the source's K/V heads, largest first."""
    return [g for g in range(shape.n_kv_heads, 0, -1) if shape.n_kv_heads % g == 0]


def _gqa_plan(layers: list[LayerContext], ratio: float, aware: bool = True) -> tuple[list[dict[str, Any]], str]:
    """Start every layer at its K/V heads; merge, one step at a time, the layer whose next step costs
    the least relative merge error, until the model's cache meets ``ratio``."""
    shape = layers[0].shape
    choices = _gqa_choices(shape)
    level = [0] * len(layers)
    cost = {}

    def step_cost(i: int) -> float:
        key = (i, level[i] + 1)
        if key not in cost:
            cost[key] = _gqa_layer(layers[i], choices[level[i] + 1], aware)[1]
        return cost[key]

    while sum(choices[lv] for lv in level) > ratio * shape.n_kv_heads * len(layers):
        candidates = [i for i in range(len(layers)) if level[i] + 1 < len(choices)]
        if not candidates:
            break
        best = min(candidates, key=step_cost)
        level[best] += 1
    return [{"n_kv_heads": choices[lv]} for lv in level], "greedy: merge heads in the layer whose next merge has the lowest query/output-weighted relative error"


def _gqa_fit(layer: LayerContext, options: dict[str, Any], aware: bool = True) -> LayerFit:
    state, error = _gqa_layer(layer, options["n_kv_heads"], aware)
    changed = [] if options["n_kv_heads"] == layer.shape.n_kv_heads else [n for n in state if n.startswith(("k_proj", "v_proj"))]
    return LayerFit(state, changed, {"relative_merge_error": error, "merge": "query/output-weighted" if aware else "mean"})


def _gqa_min_ratio(shape: Shape) -> float:
    return 1 / shape.n_kv_heads


register_conversion(
    "gqa", kind="gqa", min_ratio=_gqa_min_ratio, plan=_gqa_plan, fit=_gqa_fit,
    description="fewer K/V heads per layer, merged query/output-weighted (the simple baseline)",
)
register_conversion(
    "gqa-mean", kind="gqa", min_ratio=_gqa_min_ratio, plan=lambda layers, ratio: _gqa_plan(layers, ratio, aware=False),
    fit=lambda layer, options: _gqa_fit(layer, options, aware=False), description="fewer K/V heads per layer, merged by the mean",
)
