"""GQA with fewer K/V heads: each layer keeps its K/V heads or merges groups of them, float64.

Merging m neighbouring K/V heads into one (every query head that read one of them reads the merged
head):

* ``mean``: the mean of the heads' maps; queries and outputs untouched.
* ``aware``: keys per RoPE frequency by the query-weighted rank-1 fit of the m heads' complex
  pairs, z_g ~= b_g z (the strongest component of ``pairs.mix_pairs``): the merged key is z and a
  query head reading head g is multiplied by conj(b_g) (a complex scalar per pair commutes with
  RoPE, so nothing else changes). Values by the output-weighted fit v_g ~= T_g v of the stacked
  values (``lowrank.weighted_factors``, rank d_h), T_g folded into the output projection
  (W_o,h <- W_o,h T_g).

The relative merge error (``merge_error``) is measured the same way for both: what the heads'
logits lose (query energy per pair times the key error) and what the output loses (W_o,h times
the value error), each relative to its total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slimkv.convert.context import AffineLayer, LayerContext, LayerFit, linear_state, output_state
from slimkv.convert.lowrank import damped_sqrt, weighted_factors
from slimkv.convert.pairs import from_complex, mix_pairs, pair_energy, to_complex
from slimkv.convert.source import Shape


def choices(shape: Shape) -> list[int]:
    """K/V head counts a layer can be merged to: divisors of the source's K/V heads, largest first."""
    return [g for g in range(shape.n_kv_heads, 0, -1) if shape.n_kv_heads % g == 0]


def min_ratio(shape: Shape) -> float:
    return 1 / shape.n_kv_heads


@dataclass(frozen=True)
class Merged:
    """A layer with merged K/V heads: its maps (``layer``: q (H, d_h, d'), k and v (G', d_h, d'),
    o) and ``key_scale`` (G, F) complex: the readers of source head g see, in RoPE pair i,
    key_scale[g, i] times the merged head's pair (1 for the mean merge)."""

    layer: AffineLayer
    key_scale: torch.Tensor


def merge_mean(layer: LayerContext, new_heads: int) -> Merged:
    """Each run of G / new_heads neighbouring K/V heads replaced by their mean."""
    a = layer.affine()
    merge = layer.shape.n_kv_heads // new_heads
    k = a.k.view(new_heads, merge, *a.k.shape[1:]).mean(1)
    v = a.v.view(new_heads, merge, *a.v.shape[1:]).mean(1)
    ones = torch.ones(layer.shape.n_kv_heads, layer.shape.head_dim // 2, dtype=torch.complex128)
    return Merged(AffineLayer(a.q, k, v, a.o, a.cov, a.mean), ones)


def merge_aware(layer: LayerContext, new_heads: int) -> Merged:
    """Each run of G / new_heads neighbouring K/V heads merged query/output-aware (module docstring)."""
    s, a = layer.shape, layer.affine()
    merge, hd = s.n_kv_heads // new_heads, s.head_dim
    q, k = to_complex(a.q), to_complex(a.k)  # (H, F, d'), (G, F, d')
    energy = _group_energy(s, a)
    outputs = _group_outputs(s, a)
    keys, values, o = [], [], a.o.clone()
    scale = torch.empty(s.n_kv_heads, k.shape[1], dtype=k.dtype)
    for n in range(new_heads):
        span = slice(n * merge, (n + 1) * merge)
        mix = mix_pairs(k[span], energy[span], a.cov)
        keys.append(mix.keys[:, 0])
        scale[span] = mix.recon[:, :, 0].T
        weight = torch.block_diag(*[damped_sqrt(m, 1e-4) for m in outputs[span]])
        down, up = weighted_factors(a.v[span].flatten(0, 1), a.cov, weight, hd)
        values.append(down)
        for g, t in zip(range(span.start, span.stop), up.view(merge, hd, hd)):
            for h in range(g * s.group, (g + 1) * s.group):
                o[:, h * hd:(h + 1) * hd] = a.output_block(h) @ t
    queries = from_complex(q * scale.conj()[layer.head_group][..., None])
    return Merged(AffineLayer(queries, from_complex(torch.stack(keys)), torch.stack(values), o, a.cov, a.mean), scale)


def merge_error(layer: LayerContext, merged: Merged) -> float:
    """Relative key error + relative value error of a merge (module docstring): keys
    sum_g,i D_g,i E|z_g,i - key_scale[g, i] z'_i|^2 / sum_g,i D_g,i E|z_g,i|^2 with D the query
    energy of head g's readers, values sum_h E||W_o,h v_g - W'_o,h v'||^2 / sum_h E||W_o,h v_g||^2."""
    s, a, m = layer.shape, layer.affine(), merged.layer
    new_of = torch.arange(s.n_kv_heads) // (s.n_kv_heads // m.k.shape[0])  # the merged head replacing source head g
    k_old = to_complex(a.k)
    seen = merged.key_scale[..., None] * to_complex(m.k)[new_of]
    energy = _group_energy(s, a)
    key_error = float((energy * pair_energy(k_old - seen, a.cov)).sum() / (energy * pair_energy(k_old, a.cov)).sum().clamp_min(1e-300))
    lost = total = 0.0
    for h in range(s.n_heads):
        g = h // s.group
        # W_o,h v_g - W'_o,h v' = [W_o,h, -W'_o,h] [v_g; v']: traces over 2 d_h instead of d
        outputs = torch.cat((a.output_block(h), -m.o[:, h * s.head_dim:(h + 1) * s.head_dim]), dim=1)
        values = torch.cat((a.v[g], m.v[new_of[g]]))
        lost += float(torch.trace((outputs.T @ outputs) @ (values @ a.cov @ values.T)))
        total += float(torch.trace((a.output_block(h).T @ a.output_block(h)) @ (a.v[g] @ a.cov @ a.v[g].T)))
    return key_error + lost / max(total, 1e-300)


def _group_energy(s: Shape, a: AffineLayer) -> torch.Tensor:
    """Query energy per RoPE pair summed over each K/V head's readers: (G, F)."""
    return pair_energy(to_complex(a.q), a.cov).view(s.n_kv_heads, s.group, -1).sum(1)


def _group_outputs(s: Shape, a: AffineLayer) -> list[torch.Tensor]:
    """sum over each K/V head's readers of W_o,h^T W_o,h: G matrices (d_h, d_h)."""
    return [sum(a.output_block(h).T @ a.output_block(h) for h in range(g * s.group, (g + 1) * s.group)) for g in range(s.n_kv_heads)]


def merged_state(layer: LayerContext, merged: Merged) -> dict[str, torch.Tensor]:
    """The state dict of a gqa layer computing ``merged``."""
    m, bias = merged.layer, layer.shape.qkv_bias
    return {
        **linear_state("q_proj", m.q.flatten(0, 1), bias),
        **linear_state("k_proj", m.k.flatten(0, 1), bias),
        **linear_state("v_proj", m.v.flatten(0, 1), bias),
        **output_state(m.o, bias),
    }


MERGES = {"aware": merge_aware, "mean": merge_mean}


def plan_greedy(layers: list[LayerContext], ratio: float, merge: str) -> tuple[list[dict[str, Any]], str]:
    """Start every layer at its K/V heads; merge, one step at a time, the layer whose next step has
    the lowest relative merge error, until the model's cache meets ``ratio``. (With two choices, as
    SmolLM2's 3 or 1, this keeps every K/V head in the layers whose merge would cost the most.)"""
    shape = layers[0].shape
    options = choices(shape)
    level = [0] * len(layers)
    cost: dict[tuple[int, int], float] = {}

    def step_cost(i: int) -> float:
        key = (i, level[i] + 1)
        if key not in cost:
            cost[key] = merge_error(layers[i], MERGES[merge](layers[i], options[level[i] + 1]))
        return cost[key]

    while sum(options[lv] for lv in level) > ratio * shape.n_kv_heads * len(layers) + 1e-9:
        candidates = [i for i in range(len(layers)) if level[i] + 1 < len(options)]
        if not candidates:
            break
        level[min(candidates, key=step_cost)] += 1
    return [{"n_kv_heads": options[lv]} for lv in level], (
        f"greedy: merge K/V heads ({merge} merge) in the layer whose next merge has the lowest relative key + value error "
        f"until the cache meets the ratio; {sum(lv == 0 for lv in level)} of {len(layers)} layers keep all {shape.n_kv_heads}")


def fit_layer(layer: LayerContext, options: dict[str, Any], *, merge: str) -> LayerFit:
    """The gqa layer with ``options`` n_kv_heads: the source's own heads (unchanged), or merged."""
    heads = options["n_kv_heads"]
    if heads == layer.shape.n_kv_heads:
        merged = Merged(layer.affine(), torch.ones(heads, layer.shape.head_dim // 2, dtype=torch.complex128))
        return LayerFit(merged_state(layer, merged), [], {"relative_merge_error": 0.0, "merge": "none"})
    merged = MERGES[merge](layer, heads)
    state = merged_state(layer, merged)
    changed = [n for n in state if merge == "aware" or n.startswith(("k_proj", "v_proj"))]
    return LayerFit(state, changed, {"relative_merge_error": merge_error(layer, merged), "merge": merge})
