"""GQA + RoPE -> MLA (slimkv ``mla`` layers without latent norm), one layer at a time, float64.

The converted layer caches, per token, ``rope_dim`` rotated channels shared by all heads and a
latent c (``kv_rank``, no RMSNorm, so it is linear in x); head h's key is [k_pe | W_UK_h c] and its
value W_UV_h c (docs/conversion.md has the reasoning and the measurements):

1. **Rotated part.** Per RoPE frequency, the K/V heads' complex pairs are mixed into components
   (``pairs.mix_pairs``, weighted by the query energy that reads them). ``rope_dim / 2`` components
   keep their rotation: ``select="error"`` (method ``mla``) keeps, over all frequencies of the layer,
   those whose loss would cost the most: each head's query energy is multiplied by
   1 - |rho|^2, the error of replacing the rotation by its expectation rho, so slow pairs (|rho|
   ~ 1) are left to step 2. ``select="prefix"`` (``mla-prefix``) keeps the strongest component of
   each of the fastest frequencies (the same ladder in every layer: DeepSeek-V3 can express it).
2. **Residual keys**, what the kept components do not reconstruct, lose their rotation; head h
   reads them with its query times rho[h, i] = E[exp(1j delta w_i)] under the head's measured
   attention distances (``pairs.rotation_expectation``).
3. **Latent** of the stacked [residual keys; values] (2 G d_h rows), balanced: key rows weighted by
   what a logit error does to the output (sigma_h^2 E[qn qn^T], sigma_h^2 = E||W_o,h (v - E v)||^2),
   value rows by W_o,h^T W_o,h, keys x ``KV_BALANCE``; ``lowrank.weighted_factors``.

The softmax scale of the source (1/sqrt(d_h)) is folded into q_proj together with slimkv's
1/sqrt(rope_dim + head_dim) (head_dim = the nope width = d_h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from slimkv.common.checks import check_choice
from slimkv.convert.context import AffineLayer, LayerContext, LayerFit, layer_budget, least_sensitive, linear_state, output_state
from slimkv.convert.lowrank import damped_sqrt, weighted_error, weighted_factors
from slimkv.convert.pairs import from_complex, mix_pairs, pair_energy, rotation_expectation, to_complex
from slimkv.convert.source import Shape

KV_BALANCE = 0.3  # weight of key rows against value rows in the latent fit (chosen on dev windows, docs/conversion.md)
WEIGHT_DAMPING = 1e-4  # relative damping of the latent's row weights
SELECTIONS = ("error", "prefix")  # which pairs keep their rotation (module docstring)
PAIR_CHOICES = ("rule", "measured")  # how many pairs each layer rotates (``plan_uniform``)
PAIR_OFFSETS = (-8, -4, 0, 4, 8)  # ``pairs=measured``: the counts tried around the rule's
METHOD_OPTIONS = {"pairs": "rule"}


def rope_pairs_for(shape: Shape, ratio: float, budget: int, *, prefix: bool = False) -> int:
    """How many rotated pairs a layer keeps: d_h / 4 up to ratio 1/3, then linearly more (5 d_h / 16
    at 1/2, every frequency at 1), at most a third of the layer's cache, at least one, and no more
    than there are components (one per frequency for ``prefix``). The measured optimum on SmolLM2
    (d_h 64): 20 pairs at 1/2, 16 at 1/3 and 1/4 (docs/conversion.md)."""
    pairs = round(shape.head_dim / 4 * (1 + 1.5 * max(0.0, ratio - 1 / 3)))
    pairs = min(pairs, budget // 6, (budget - 1) // 2, shape.head_dim // 2 * (1 if prefix else shape.n_kv_heads))
    return max(1, pairs)


def min_ratio(shape: Shape) -> float:
    """One rotated pair and a one-wide latent per layer."""
    return 3 / shape.cache_elements


def check_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None = None) -> None:
    """``pairs`` one of PAIR_CHOICES: ValueError naming the option."""
    check_choice("--to mla: pairs", options["pairs"], PAIR_CHOICES)


def pair_candidates(shape: Shape, ratio: float) -> list[int]:
    """The rotated-pair counts ``pairs=measured`` tries in every layer: the rule's
    (``rope_pairs_for``) moved by PAIR_OFFSETS, each leaving at least one latent channel."""
    budget = layer_budget(shape, ratio)
    top = min((budget - 1) // 2, shape.head_dim // 2 * shape.n_kv_heads)
    base = rope_pairs_for(shape, ratio, budget)
    return sorted({min(top, max(1, base + offset)) for offset in PAIR_OFFSETS})


def _split(budget: int, pairs: int) -> dict[str, int]:
    return {"kv_rank": budget - 2 * pairs, "rope_dim": 2 * pairs}


def plan_uniform(layers: list[LayerContext], ratio: float, *, prefix: bool = False, pairs: str = "rule") -> tuple[list[dict[str, Any]], str]:
    """Every layer's cache is floor(ratio x 2 G d_h): ``pairs=rule`` keeps the same rope pairs and
    latent width in every layer (``rope_pairs_for``; per-layer allocations by spectrum were worse);
    ``pairs=measured`` gives each layer the count of ``pair_candidates`` whose layer, converted
    alone, moved the model least (``LayerContext.sensitivity``, one KL per candidate)."""
    shape = layers[0].shape
    budget = layer_budget(shape, ratio)
    chosen = "the fastest frequencies" if prefix else "chosen by the error their loss leaves"
    if pairs == "measured":
        candidates = pair_candidates(shape, ratio)
        counts = least_sensitive(layers, candidates, "mla:pairs=measured")
        return [_split(budget, n) for n in counts], (
            f"measured: each layer keeps the number of rotated pairs ({chosen}) of {candidates} whose layer alone moved the model least "
            f"(from {min(counts)} to {max(counts)}), the rest of its cache ({budget} = floor(ratio x {shape.cache_elements})) in the latent")
    count = rope_pairs_for(shape, ratio, budget, prefix=prefix)
    return [_split(budget, count) for _ in layers], (
        f"uniform: every layer keeps {count} rotated pairs ({chosen}) "
        f"and a latent of {budget - 2 * count} (cache {budget} = floor(ratio x {shape.cache_elements}) per layer)")


def probe_plans(layers: list[LayerContext], ratio: float, *, pairs: str = "rule") -> list[list[dict[str, Any]]] | None:
    """``pairs=measured``: one uniform plan per candidate count; nothing otherwise."""
    if pairs != "measured":
        return None
    budget = layer_budget(layers[0].shape, ratio)
    return [[_split(budget, n) for _ in layers] for n in pair_candidates(layers[0].shape, ratio)]


def fit_layer(layer: LayerContext, options: dict[str, Any], *, select: str = "error", kv_balance: float = KV_BALANCE) -> LayerFit:
    """The mla layer with ``options`` kv_rank and rope_dim fitted to ``layer`` (module docstring).
    ``select``: ``error`` or ``prefix``. Returns the state, and the options with the layer's
    rope_frequencies."""
    if select not in SELECTIONS:
        raise ValueError(f"select={select!r} is not one of {', '.join(SELECTIONS)}")
    s, a = layer.shape, layer.affine()
    groups, hd = s.n_kv_heads, s.head_dim
    pairs, rank = options["rope_dim"] // 2, options["kv_rank"]
    group_of = layer.head_group
    q = to_complex(a.q) * hd**-0.5  # (H, F, d'), logits in their own units
    split = decouple_rotation(layer, a, q, pairs, select)  # 1-2. the rotated part and the unrotated residual
    kept, q_nope = split.kept, split.q_nope

    # 3. balanced latent of [residual keys; values]
    target = torch.cat((split.residual.flatten(0, 1), a.v.flatten(0, 1)))  # (2 G d_h, d')
    weight = _balanced_weight(a, s, q_nope, kv_balance)
    down, up = weighted_factors(target, a.cov, weight, rank)

    qk_scale = math.sqrt(2 * pairs + hd)
    q_rows = torch.cat((from_complex(split.q_pe), q_nope), dim=1) * qk_scale  # (H, rope_dim + d_h, d')
    k_up, v_up = up[: groups * hd].view(groups, hd, rank), up[groups * hd:].view(groups, hd, rank)
    state = {
        **linear_state("q_proj", q_rows.flatten(0, 1), s.qkv_bias),
        **linear_state("kv_down", torch.cat((from_complex(split.k_pe), down)), s.qkv_bias),
        "k_up.weight": k_up[group_of].flatten(0, 1),
        "v_up.weight": v_up[group_of].flatten(0, 1),
        **output_state(a.o, s.qkv_bias),
    }
    info = {
        "rope_pairs": [[int(i), int(j)] for i, j in kept],
        "latent_relative_error": weighted_error(target, up @ down, a.cov, weight),
        "rotation_expectation_abs": [round(float(x), 4) for x in split.rho.abs().mean(0)],
    }
    frequencies = [float(layer.inv_freq[i]) for i, _ in kept]
    return LayerFit(state, [n for n in state if not n.startswith("o_proj")], info, {**options, "rope_frequencies": frequencies})


@dataclass(frozen=True)
class DecoupledRotation:
    """A layer's keys as a rotated part shared by every head and an unrotated residual (steps 1-2
    of the module docstring). P rotated pairs, F frequencies, real rows in RoPE pair order."""

    kept: list[tuple[int, int]]  # (frequency, component) of each rotated pair, in order
    k_pe: torch.Tensor  # (P, d') complex: the shared rotated key pairs
    q_pe: torch.Tensor  # (H, P, d') complex: each head's query for them
    residual: torch.Tensor  # (G, d_h, d') real: the keys less what the kept pairs reconstruct, read without rotation
    q_nope: torch.Tensor  # (H, d_h, d') real: each head's query for its group's residual, the rotation's expectation folded in
    rho: torch.Tensor  # (H, F) complex: E[exp(1j delta w_i)] under each head's attention distances


def decouple_rotation(layer: LayerContext, a: AffineLayer, q: torch.Tensor, pairs: int, select: str = "error") -> DecoupledRotation:
    """Steps 1-2 of the module docstring for ``pairs`` rotated pairs chosen by ``select``
    (``error`` or ``prefix``); ``q`` (H, F, d') complex are the queries the logits are read with.
    Shared by ``mla`` and ``lrkv:rope_placement=decoupled``."""
    groups, hd = layer.shape.n_kv_heads, layer.shape.head_dim
    group_of = layer.head_group
    k = to_complex(a.k)  # (G, F, d')
    rho = rotation_expectation(layer.stats.distance, layer.inv_freq)  # (H, F)
    loss = (1 - rho.abs() ** 2).clamp_min(1e-6)
    query_energy = (pair_energy(q, a.cov) * loss).view(groups, layer.shape.group, -1).sum(1)  # (G, F)
    mix = mix_pairs(k, query_energy, a.cov)
    if select == "prefix":
        if pairs > hd // 2:
            raise ValueError(f"rope_dim={2 * pairs}: a prefix of the ladder has at most {hd // 2} pairs")
        kept = [(i, 0) for i in range(pairs)]
    else:
        order = torch.argsort(mix.energy.flatten(), descending=True, stable=True)[:pairs]
        kept = sorted((int(n) // groups, int(n) % groups) for n in order)
    freq = torch.tensor([i for i, _ in kept], dtype=torch.long)
    comp = torch.tensor([j for _, j in kept], dtype=torch.long)
    k_pe = mix.keys[freq, comp]  # (P, d')
    q_pe = mix.recon[freq[None], group_of[:, None], comp[None]].conj()[..., None] * q[:, freq]  # (H, P, d')
    residual = k.clone()
    residual.index_add_(1, freq, -(mix.recon[freq, :, comp].T[..., None] * k_pe[None]))
    return DecoupledRotation(kept, k_pe, q_pe, from_complex(residual), from_complex(rho[..., None] * q), rho)


def _balanced_weight(a: AffineLayer, s: Shape, q_nope: torch.Tensor, kv_balance: float) -> torch.Tensor:
    """Row weight (2 G d_h square) putting key and value errors in output units: key rows of group
    g by kv_balance sum_h sigma_h^2 E[qn_h qn_h^T], value rows by sum_h W_o,h^T W_o,h."""
    blocks_k, blocks_v = [], []
    for g in range(s.n_kv_heads):
        heads = range(g * s.group, (g + 1) * s.group)
        outputs = [a.output_block(h).T @ a.output_block(h) for h in heads]  # W_o,h^T W_o,h (d_h, d_h)
        value_cov = a.centered_moment(a.v[g])
        sigma = [torch.trace(o @ value_cov) for o in outputs]  # E||W_o,h (v - E v)||^2
        blocks_k.append(kv_balance * sum(sg * (q_nope[h] @ a.cov @ q_nope[h].T) for sg, h in zip(sigma, heads)))
        blocks_v.append(sum(outputs))
    return torch.block_diag(*[damped_sqrt(b, WEIGHT_DAMPING) for b in blocks_k + blocks_v])
