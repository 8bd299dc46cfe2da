"""GQA -> LRKV (slimkv ``lrkv`` layers, one residual group per source K/V head), one layer at a time,
float64.

Group g's key and value become k_g = W_s x + B_g (A_g x) (shared map plus a rank-r residual;
``rank_k`` for keys, ``rank_v`` for values). Two RoPE placements (``--to lrkv:rope_placement=...``, the layer's ``rope_placement``):

* ``full`` (default): RoPE turns the rebuilt key exactly as the source's, so
  positions are never approximated, but decode rebuilds and rotates every cached key at every step.
* ``decoupled``: the shared key's first 2 ``rope_pairs`` channels carry
  the rotation, chosen and mixed across K/V heads as the MLA conversion does
  (``mla.decouple_rotation``); the rest of each group's key loses its rotation (its queries take
  the rotation's expectation) and is fitted in the remaining d_h - 2 ``rope_pairs`` channels
  (``_decoupled_keys``), where the residual writes. Decode then reads the compact cache directly
  (exact factored decode), at the price of the lost rotations.

Per K and V the fit minimises

    sum_g E || M_g^1/2 (T_g - W_s - B_g A_g) x' ||^2

with T_g the group's (aligned) map and M_g what an error costs: for keys, per RoPE pair, the query
energy of the group's heads (RoPE turns the pairs, so only a weight that is the same on both
channels of a pair means something); for values W_o,h^T W_o,h summed over the group.

* **Alignment** first: maps the rest of the layer absorbs exactly. Keys: per frequency a complex
  scalar per group (the strongest mixed component's reconstruction, ``pairs.mix_pairs``), divided
  out of the key and multiplied (conjugated) into the group's queries. Values: v_g -> T_g^-1 v_g
  with T_g from the output-weighted rank-d_h fit of the stacked values, T_g folded into o_proj.
  The objective is unchanged, but one shared map can now match every group.
* **Alternating fit** (``ALTERNATING_STEPS``): W_s = (sum M_g)^-1 sum M_g (T_g - B_g A_g) (exact given
  the residuals), then each group's residual by the weighted low-rank fit; the relative
  objective falls monotonically (recorded in the manifest).
* **Decoupled keys** (``rope_placement=decoupled``): group g's unrotated residual keys (d_h rows) are first
  brought to the d_h - 2 ``rope_pairs`` channels left, by the fit weighted with the query energy
  of the group's heads (their queries absorb the map), then aligned across groups as the values are.
* **Key/value split** of each group's residual width: 2:1 for keys by default (``split=rule``);
  ``split=measured`` tries the shares of ``KEY_SHARES`` and gives each layer the one whose layer,
  converted alone, moved the model least (``convert.sensitivity``), at the same cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from slimkv.attention.lrkv import LowRankKVAttention, resolve_positions
from slimkv.attention.mha import MultiHeadAttention
from slimkv.common.checks import check_choice
from slimkv.convert.context import (
    AffineLayer,
    LayerContext,
    LayerFit,
    layer_budget,
    least_sensitive,
    linear_state,
    output_state,
    partial_rope_options,
)
from slimkv.convert.lowrank import damped_sqrt, weighted_factors
from slimkv.convert.mla import WEIGHT_DAMPING, DecoupledRotation, decouple_rotation
from slimkv.convert.pairs import from_complex, mix_pairs, pair_energy, to_complex
from slimkv.convert.source import Shape

ALTERNATING_STEPS = 10
ALIGN_MAX_CONDITION = 1e4  # a group whose alignment map (values; decoupled keys) is worse conditioned stays unaligned
SPLIT_CHOICES = ("rule", "measured")  # how each layer splits its residual width between keys and values
KEY_SHARES = (1 / 3, 1 / 2, 2 / 3, 5 / 6, 1.0)  # ``split=measured``: the keys' shares of the residual width tried
ROPE_CHOICES = ("full", "decoupled")  # where the rotation lives (module docstring)
METHOD_OPTIONS = {"split": "rule", "rope_placement": "full", "rope_pairs": None}  # rope_pairs: decoupled's rotated pairs, None = ``decoupled_pairs``


def min_ratio(shape: Shape) -> float:
    """The shared key and value alone: 2 d_h of the source's 2 G d_h elements."""
    return 1 / shape.n_kv_heads


def ranks_for(shape: Shape, budget: int) -> tuple[int, int]:
    """(rank_k, rank_v) filling a layer budget: the residual width s = (budget - 2 d_h) // G split
    2:1 in favour of keys (r_k = round(2 s / 3); 14/7 measured best of 10/11, 7/14, 14/7 on SmolLM2 at 1/2)."""
    total = max(0, (budget - 2 * shape.head_dim) // shape.n_kv_heads)
    rank_k = round(2 * total / 3)
    return rank_k, total - rank_k


def check_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None = None) -> None:
    """``split`` one of SPLIT_CHOICES, ``rope_placement`` one of ROPE_CHOICES, ``rope_pairs`` (decoupled only)
    leaving channels for the residual: ValueError naming the option."""
    check_choice("--to lrkv: split", options["split"], SPLIT_CHOICES)
    check_choice("--to lrkv: rope_placement", options["rope_placement"], ROPE_CHOICES)
    pairs = options["rope_pairs"]
    if pairs is None:
        return
    if options["rope_placement"] != "decoupled":
        raise ValueError(f"--to lrkv: rope_pairs={pairs!r} applies only with rope_placement=decoupled (rope_placement=full keeps every pair's rotation)")
    if isinstance(pairs, bool) or not isinstance(pairs, int) or not 1 <= pairs < shape.head_dim // 2:
        raise ValueError(f"--to lrkv: rope_pairs={pairs!r} must be an integer from 1 to {shape.head_dim // 2 - 1}: the shared key rotates that "
                         f"many of the model's {shape.head_dim // 2} pairs and the residual writes the channels left")


def decoupled_pairs(shape: Shape, rope_pairs: int | None) -> int:
    """The rotated pairs of ``rope_placement=decoupled``: ``rope_pairs``, or 5 head_dim / 16 (20 of SmolLM2's
    32 pairs, the best of 4 to 28 at R = 1/2, docs/conversion.md), at least one, leaving a channel."""
    if rope_pairs is not None:
        return rope_pairs
    return min(max(1, round(5 * shape.head_dim / 16)), shape.head_dim // 2 - 1)


def _layer_plan(shape: Shape, rank_k: int, width: int, rope_placement: str, rope_pairs: int | None) -> dict[str, Any]:
    """One layer's planned options: the key rank (at most the channels the residual writes) and
    the value rank sharing ``width``, with the rotated pairs for ``rope_placement=decoupled``."""
    if rope_placement != "decoupled":
        return {"rank_k": rank_k, "rank_v": width - rank_k}
    pairs = decoupled_pairs(shape, rope_pairs)
    rank_k = min(rank_k, shape.head_dim - 2 * pairs)
    return {"rank_k": rank_k, "rank_v": width - rank_k, "rope_pairs": pairs}


def residual_width(shape: Shape, ratio: float) -> int:
    """rank_k + rank_v per K/V group at ``ratio`` (``ranks_for``'s total)."""
    return sum(ranks_for(shape, layer_budget(shape, ratio)))


def split_candidates(shape: Shape, ratio: float) -> list[int]:
    """The key ranks ``split=measured`` tries in every layer: KEY_SHARES of the residual width, each once."""
    width = residual_width(shape, ratio)
    return sorted({round(share * width) for share in KEY_SHARES})


def plan_uniform(layers: list[LayerContext], ratio: float, *, split: str = "rule", rope_placement: str = "full", rope_pairs: int | None = None
                 ) -> tuple[list[dict[str, Any]], str]:
    """Every layer keeps the shared key and value and the same residual width per K/V group;
    ``split=rule`` divides it 2:1 for keys in every layer (``ranks_for``), ``split=measured`` gives
    each layer the key rank of ``split_candidates`` whose layer alone moved the model least
    (``LayerContext.sensitivity``, one KL per candidate). ``rope_placement=decoupled`` adds the rotated
    pairs (``decoupled_pairs``) and caps the key rank at the channels the residual writes."""
    shape = layers[0].shape
    budget = layer_budget(shape, ratio)
    rank_k, rank_v = ranks_for(shape, budget)
    width = rank_k + rank_v
    cache = 2 * shape.head_dim + shape.n_kv_heads * width
    rotation = (f"; the shared key rotates {decoupled_pairs(shape, rope_pairs)} pairs, the residual keys none" if rope_placement == "decoupled" else "")
    if split == "measured":
        candidates = split_candidates(shape, ratio)
        plans = [_layer_plan(shape, r, width, rope_placement, rope_pairs) for r in least_sensitive(layers, candidates, "lrkv:split=measured")]
        ranks = [p["rank_k"] for p in plans]
        return plans, (
            f"measured: every layer keeps the shared key and value and a residual of {width} per K/V group, split between keys and "
            f"values by the key rank of {candidates} whose layer alone moved the model least (rank_k from {min(ranks)} to {max(ranks)}; "
            f"cache {cache} <= floor(ratio x {shape.cache_elements}) per layer){rotation}")
    plan = _layer_plan(shape, rank_k, width, rope_placement, rope_pairs)
    return [dict(plan) for _ in layers], (
        f"uniform: every layer keeps the shared key and value and rank_k={plan['rank_k']}, rank_v={plan['rank_v']} per K/V group "
        f"(cache {cache} <= floor(ratio x {shape.cache_elements}) per layer){rotation}")


def probe_plans(layers: list[LayerContext], ratio: float, *, split: str = "rule", rope_placement: str = "full", rope_pairs: int | None = None
                ) -> list[list[dict[str, Any]]] | None:
    """``split=measured``: one uniform plan per candidate key rank; nothing otherwise."""
    if split != "measured":
        return None
    shape = layers[0].shape
    width = residual_width(shape, ratio)
    return [[_layer_plan(shape, r, width, rope_placement, rope_pairs) for _ in layers] for r in split_candidates(shape, ratio)]


def fit_layer(layer: LayerContext, options: dict[str, Any], *, align: bool = True, steps: int = ALTERNATING_STEPS) -> LayerFit:
    """The lrkv layer with ``options`` rank_k and rank_v fitted to ``layer`` (module docstring);
    with ``rope_pairs`` (``rope_placement=decoupled``) the layer's options come back with its rotation
    (``rope_placement``, the rotated pairs' original frequencies)."""
    s, a = layer.shape, layer.affine()
    pairs = options.get("rope_pairs")
    if pairs is None:
        queries, key_targets, key_weights = _aligned_keys(layer, a) if align else _keys(s, a, to_complex(a.q), to_complex(a.k))
        q_rows = from_complex(queries)  # (H, d_h, d')
    else:
        split = decouple_rotation(layer, a, to_complex(a.q), pairs)
        queries, key_targets, key_weights, aligned_keys = _decoupled_keys(layer, a, split, s.head_dim - 2 * pairs)
        q_rows = torch.cat((from_complex(split.q_pe), queries), dim=1)  # (H, d_h, d'): [rotated pairs | unrotated channels]
    o, value_targets, value_weights, aligned = _aligned_values(s, a, align)
    keys = shared_plus_residual(key_targets, key_weights, a.cov, options["rank_k"], steps)
    values = shared_plus_residual(value_targets, value_weights, a.cov, options["rank_v"], steps)
    if pairs is not None:  # the shared key, like the queries: [rotated pairs | unrotated channels]
        keys = keys._replace(shared=torch.cat((from_complex(split.k_pe), keys.shared)))
    state = {
        **linear_state("q_proj", q_rows.flatten(0, 1), s.qkv_bias),
        **linear_state("k_shared", keys.shared, s.qkv_bias),
        **linear_state("v_shared", values.shared, s.qkv_bias),
        **output_state(o, s.qkv_bias),
    }
    for name, fit, rank in (("k", keys, options["rank_k"]), ("v", values, options["rank_v"])):
        if rank:
            state.update(linear_state(f"{name}_latent", torch.cat(fit.downs), s.qkv_bias))
            state[f"{name}_up"] = torch.stack(fit.ups)
    changed = [n for n in state if aligned or not n.startswith("o_proj")]
    info = {"relative_error_keys": [keys.history[0], keys.history[-1]], "relative_error_values": [values.history[0], values.history[-1]],
            "aligned_value_groups": aligned}
    if pairs is None:
        return LayerFit(state, changed, info)
    info.update(aligned_key_groups=aligned_keys, rope_pairs=[[int(i), int(j)] for i, j in split.kept])
    layer_options = {"rank_k": options["rank_k"], "rank_v": options["rank_v"], "rope_placement": "decoupled", **partial_rope_options(s, pairs),
                     "rope_frequencies": [float(layer.inv_freq[i]) for i, _ in split.kept]}
    return LayerFit(state, changed, info, layer_options)


def _decoupled_keys(layer: LayerContext, a: AffineLayer, split: DecoupledRotation, width: int
                    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], int]:
    """Each group's unrotated residual keys in ``width`` channels (module docstring): (queries
    (H, width, d'), key targets [(width, d')] and weights [(width, width)] per group, groups aligned).

    Group g's residual R_g (d_h, d') is read by its heads' queries n_h (the rotation's expectation
    folded in) with energy E_g = sum_h E[n_h n_h^T]; R_g ~= U_g D_g is its E_g-weighted rank-width
    fit, the key becomes D_g and each head's query U_g^T n_h. The D_g are then aligned (D_g ->
    T_g^-1 D_g, U_g -> U_g T_g) to the best common rank-width basis, as the values are."""
    s = layer.shape
    targets, weights, readers = [], [], []
    for g in range(s.n_kv_heads):
        energy = sum(split.q_nope[h] @ a.cov @ split.q_nope[h].T for h in range(g * s.group, (g + 1) * s.group))
        down, up = weighted_factors(split.residual[g], a.cov, damped_sqrt(energy, WEIGHT_DAMPING), width)
        targets.append(down)
        weights.append(up.T @ energy @ up)
        readers.append(up)
    _, common = weighted_factors(torch.cat(targets), a.cov, torch.block_diag(*[damped_sqrt(m, WEIGHT_DAMPING) for m in weights]), width)
    aligned = 0
    for g, t in enumerate(common.view(s.n_kv_heads, width, width)):
        if torch.linalg.cond(t) > ALIGN_MAX_CONDITION:
            continue
        targets[g], weights[g], readers[g] = torch.linalg.solve(t, targets[g]), t.T @ weights[g] @ t, readers[g] @ t
        aligned += 1
    queries = torch.stack([readers[g].T @ split.q_nope[h] for h, g in enumerate(layer.head_group.tolist())])
    return queries, targets, weights, aligned


def _keys(s: Shape, a: AffineLayer, queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(queries (H, F, d') complex, per-group key targets (d_h, d'), per-group pair-isotropic weights)."""
    energy = pair_energy(queries, a.cov).view(s.n_kv_heads, s.group, -1).sum(1)  # (G, F)
    targets = list(from_complex(keys))
    weights = [torch.diag(e.repeat_interleave(2)) for e in energy]
    return queries, targets, weights


def _aligned_keys(layer: LayerContext, a: AffineLayer) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Keys divided, per frequency and group, by the complex scale b_g of the strongest mixed
    component; the group's queries times conj(b_g) (every logit unchanged)."""
    s = layer.shape
    q, k = to_complex(a.q), to_complex(a.k)
    energy = pair_energy(q, a.cov).view(s.n_kv_heads, s.group, -1).sum(1)
    scale = mix_pairs(k, energy, a.cov).recon[:, :, 0].T  # (G, F): head g's pair ~= scale[g] x component 0
    size = scale.abs()
    floor = 1e-3 * size.amax(0, keepdim=True)
    scale = torch.where(size < floor, floor.to(scale.dtype).expand_as(scale), scale)
    return _keys(s, a, q * scale.conj()[layer.head_group][..., None], k / scale[..., None])


def _aligned_values(s: Shape, a: AffineLayer, align: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], int]:
    """(o_proj weight, per-group value targets (d_h, d'), output weights, groups aligned): v_g ->
    T_g^-1 v_g with v_g ~= T_g v from the output-weighted rank-d_h fit, W_o,h <- W_o,h T_g."""
    outputs = [sum(a.output_block(h).T @ a.output_block(h) for h in range(g * s.group, (g + 1) * s.group)) for g in range(s.n_kv_heads)]
    targets, o, aligned = list(a.v), a.o.clone(), 0
    if align:
        weight = torch.block_diag(*[damped_sqrt(m, 1e-4) for m in outputs])
        _, up = weighted_factors(a.v.flatten(0, 1), a.cov, weight, s.head_dim)
        for g, t in enumerate(up.view(s.n_kv_heads, s.head_dim, s.head_dim)):
            if torch.linalg.cond(t) > ALIGN_MAX_CONDITION:
                continue
            targets[g] = torch.linalg.solve(t, targets[g])
            outputs[g] = t.T @ outputs[g] @ t
            for h in range(g * s.group, (g + 1) * s.group):
                o[:, h * s.head_dim:(h + 1) * s.head_dim] = a.output_block(h) @ t
            aligned += 1
    return o, targets, outputs, aligned


class SharedResidual(NamedTuple):
    """``shared_plus_residual``'s fit: W_s (n, d'), [A_g (rank, d')], [B_g (n, rank)] and the
    relative weighted error after each alternating step."""

    shared: torch.Tensor
    downs: list[torch.Tensor]
    ups: list[torch.Tensor]
    history: list[float]


def shared_plus_residual(targets: list[torch.Tensor], weights: list[torch.Tensor], cov: torch.Tensor, rank: int, steps: int) -> SharedResidual:
    """Alternating fit of T_g ~= W_s + B_g A_g (module docstring)."""
    total_weight = sum(weights)
    total_weight = total_weight + 1e-9 * float(total_weight.diagonal().mean()) * torch.eye(total_weight.shape[0], dtype=total_weight.dtype)
    roots = [damped_sqrt(m, 1e-6) for m in weights]
    scale = sum(float(torch.trace(r @ t @ cov @ t.T @ r.T)) for r, t in zip(roots, targets))
    fits = [weighted_factors(t, cov, None, 0) for t in targets]
    history, shared = [], None
    for _ in range(steps + 1):
        shared = torch.linalg.solve(total_weight, sum(m @ (t - up @ down) for m, t, (down, up) in zip(weights, targets, fits)))
        fits = [weighted_factors(t - shared, cov, r, rank) for t, r in zip(targets, roots)]
        left = [r @ (t - shared - up @ down) for r, t, (down, up) in zip(roots, targets, fits)]
        history.append(sum(float(torch.trace(e @ cov @ e.T)) for e in left) / max(scale, 1e-300))
    return SharedResidual(shared, [down for down, _ in fits], [up for _, up in fits], history)


def lrkv_from_mha(mha: MultiHeadAttention, *, rope_placement: str = "full") -> LowRankKVAttention:
    """An lrkv layer that computes exactly what ``mha`` (or gqa/mqa) computes.

    One residual group per K/V head of ``mha``: W_shared = the mean of the K/V heads' maps,
    U_g = W_g - W_shared, B_g = I, so the ranks are the channel counts the residuals write
    (head_dim; for keys in ``decoupled`` mode the non-rotary channels, which needs the rotary
    key channels of every head to be equal). The cache is then larger than the original's (the
    constructor warns): exact, for testing the algebra and as the start of a conversion.
    """
    if mha.window is not None:
        raise ValueError("lrkv_from_mha needs a layer without a sliding window")
    common = {"rope": mha.rope, "rope_fraction": mha.rope_fraction, "rope_theta": mha.rope_theta, "rope_frequencies": mha.rope_frequencies,
              "qk_norm": mha.use_qk_norm, "bias": mha.use_bias}
    hd, heads = mha.head_dim, mha.n_heads
    rotary, placement = resolve_positions(hd, rope_placement, mha.rope, mha.rope_fraction, mha.rope_theta, mha.rope_frequencies)
    if rotary.rot_dim != mha.rotary.rot_dim:
        raise ValueError(
            f"rope_placement={rope_placement!r} rotates {rotary.rot_dim} channels per head, the mha layer {mha.rotary.rot_dim}; "
            "they cannot compute the same function"
        )
    writable = hd - (rotary.rot_dim if placement == "decoupled" else 0)
    lrkv = LowRankKVAttention(mha.d_model, heads, hd, rank_k=writable, rank_v=hd, rope_placement=rope_placement, n_kv_heads=mha.n_kv_heads, **common)
    lrkv.to(dtype=mha.q_proj.weight.dtype, device=mha.q_proj.weight.device)
    state = {k: v for k, v in mha.state_dict().items() if k.split(".")[0] in ("q_proj", "o_proj", "q_norm", "k_norm")}
    for name in ("k", "v"):
        proj = getattr(mha, f"{name}_proj")
        start = lrkv.key_residual_start if name == "k" else 0
        weights = [proj.weight.view(mha.n_kv_heads, hd, -1)]  # (G, hd, d)
        if mha.use_bias:
            weights.append(proj.bias.view(mha.n_kv_heads, hd, 1))
        for suffix, w in zip(("weight", "bias"), weights):
            if start and not torch.equal(w[:, :start], w[:1, :start].expand_as(w[:, :start])):
                raise ValueError("rope_placement='decoupled' shares the rotary key channels; the mha heads' rotary key maps differ")
            shared = torch.cat((w[0, :start], w[:, start:].mean(0)))
            state[f"{name}_shared.{suffix}"] = shared if suffix == "weight" else shared[:, 0]
            residual = (w - shared)[:, start:]  # (G, writable, d) = U_g^T with B_g = I
            state[f"{name}_latent.{suffix}"] = residual.reshape(-1, residual.shape[-1]) if suffix == "weight" else residual.reshape(-1)
        eye = torch.eye(hd - start, dtype=proj.weight.dtype, device=proj.weight.device)
        state[f"{name}_up"] = eye.expand(mha.n_kv_heads, -1, -1).clone()
    lrkv.load_state_dict(state)
    return lrkv
