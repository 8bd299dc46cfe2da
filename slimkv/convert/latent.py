"""GQA + RoPE -> ``latent`` (a cached joint K/V latent, keys rebuilt then rotated: exact RoPE),
one layer at a time, float64.

The whole layer budget is one latent c = A x' (``kv_rank`` = floor(ratio x 2 G d_h)); group g's key
is rotate(B_k,g c) and its value B_v,g c. Queries and the output projection are the source's,
unchanged. [B_k; B_v] A is the weighted low-rank fit (``lowrank.weighted_factors``) of the stacked
[W_k; W_v] under the attention input's second moment (RootCov), with row weights that put both
errors in output units (``weighting="output"``, as ``mla``'s latent):

* key rows: RoPE turns every pair by a position-dependent angle, so only a weight that is the same
  on both channels of a pair and ignores cross-pair terms survives averaging over positions: pair
  i of group g weighs kv_balance x sum_h sigma_h^2 E|q_h,i|^2 / d_h (the logit error a key error
  makes, times what a logit error does to head h's output, sigma_h^2 = E||W_o,h (v - E v)||^2);
* value rows: sum_h W_o,h^T W_o,h over the group's heads.

``weighting="rootcov"`` drops both weights (L = I: the plain RootCov-whitened joint low-rank).
Nothing is approximated about positions, so this is the quality ceiling of a latent cache of
this size; its decode rebuilds every cached key per step (``slimkv.attention.latent``).
"""

from __future__ import annotations

from typing import Any

import torch

from slimkv.common.checks import check_choice, check_float
from slimkv.convert.context import (
    AffineLayer,
    LayerContext,
    LayerFit,
    layer_budget,
    linear_state,
    measured_sensitivities,
    output_state,
)
from slimkv.convert.lowrank import damped_sqrt, weighted_error, weighted_factors
from slimkv.convert.mla import KV_BALANCE, WEIGHT_DAMPING
from slimkv.convert.pairs import pair_energy, to_complex
from slimkv.convert.source import Shape

WEIGHTINGS = ("output", "rootcov")
ALLOCATIONS = ("uniform", "spectrum", "sensitivity")
METHOD_OPTIONS = {"weighting": "output", "kv_balance": KV_BALANCE, "allocation": "uniform"}
MIN_LAYER_SHARE = 0.5  # ``allocation=spectrum|sensitivity``: every layer keeps at least this share of the uniform latent


def min_ratio(shape: Shape) -> float:
    """A one-wide latent."""
    return 1 / shape.cache_elements


def check_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None = None) -> None:
    """``weighting`` one of WEIGHTINGS, ``kv_balance`` > 0, ``allocation`` one of ALLOCATIONS: ValueError naming the option."""
    check_choice("--to latent: weighting", options["weighting"], WEIGHTINGS)
    check_choice("--to latent: allocation", options["allocation"], ALLOCATIONS)
    check_float("--to latent: kv_balance", options["kv_balance"], 0.0, open_low=True)


def plan(layers: list[LayerContext], ratio: float, **options: Any) -> tuple[list[dict[str, Any]], str]:
    """Every layer's whole budget is its latent, the model's total = floor(ratio x 2 G d_h) per
    layer on average:

    * ``allocation=uniform``: the same latent in every layer;
    * ``spectrum``: each channel beyond MIN_LAYER_SHARE of the uniform latent goes to the layer whose
      next channel removes the largest share of its OWN weighted error (the next eigenvalue of
      L T C T^T L^T over their sum, the measure of ``latent_relative_error``): every layer's
      relative error counts the same;
    * ``sensitivity``: the same greedy rule on what each channel is worth to the MODEL: the
      layer's measured KL alone at the uniform latent (``LayerContext.sensitivity[0]``) spread over
      its channels in proportion to their eigenvalues (the weighted error the channel removes),
      scaled so that the channels the uniform latent leaves out sum to that KL.

    A layer never gets more than 2 G d_h channels."""
    shape = layers[0].shape
    rank = layer_budget(shape, ratio)
    if options["allocation"] == "uniform":
        return [{"kv_rank": rank, **options} for _ in layers], (
            f"uniform: every layer caches a latent of {rank} (= floor(ratio x {shape.cache_elements})); keys rebuilt and rotated exactly, "
            f"{options['weighting']} weighting")
    if options["allocation"] == "spectrum":
        values = [spectrum / spectrum.sum().clamp_min(1e-300) for spectrum in (_weighted_spectrum(layer, options) for layer in layers)]
        rule = "the largest shares of each layer's weighted error"
    else:
        values = []
        for layer, kl in zip(layers, measured_sensitivities(layers, "latent:allocation=sensitivity")):
            spectrum = _weighted_spectrum(layer, options)
            values.append(spectrum * (kl[0] / float(spectrum[rank:].sum().clamp_min(1e-300))))
        rule = "the layers whose measured KL per unit of weighted error is largest"
    floor = max(1, int(MIN_LAYER_SHARE * rank))
    ranks = [min(floor, len(v)) for v in values]
    candidates = sorted(((float(v[k]), i) for i, v in enumerate(values) for k in range(ranks[i], len(v))), reverse=True)
    for _, i in candidates[: rank * len(layers) - sum(ranks)]:
        ranks[i] += 1
    return [{"kv_rank": r, **options} for r in ranks], (
        f"{options['allocation']}: {rank * len(layers)} latent channels in all (floor(ratio x {shape.cache_elements}) per layer on average), "
        f"at least {floor} per layer, the rest to {rule}; latents from {min(ranks)} to {max(ranks)}")


def probe_plans(layers: list[LayerContext], ratio: float, **options: Any) -> list[list[dict[str, Any]]] | None:
    """``allocation=sensitivity`` measures every layer alone at the uniform latent; nothing otherwise."""
    if options["allocation"] != "sensitivity":
        return None
    return [plan(layers, ratio, **{**options, "allocation": "uniform"})[0]]


def _weighted_spectrum(layer: LayerContext, options: dict[str, Any]) -> torch.Tensor:
    """The eigenvalues of the layer's weighted target second moment L T C T^T L^T, descending: the
    weighted error each further latent channel removes."""
    s, a = layer.shape, layer.affine()
    target = torch.cat((a.k.flatten(0, 1), a.v.flatten(0, 1)))
    weighted = target if options["weighting"] == "rootcov" else output_weight(a, s, options["kv_balance"]) @ target
    return torch.linalg.eigvalsh(weighted @ a.cov @ weighted.T).flip(0).clamp_min(0)


def fit_layer(layer: LayerContext, options: dict[str, Any]) -> LayerFit:
    """The latent layer with ``options['kv_rank']`` fitted to ``layer`` (module docstring)."""
    s, a = layer.shape, layer.affine()
    groups, hd, rank = s.n_kv_heads, s.head_dim, options["kv_rank"]
    target = torch.cat((a.k.flatten(0, 1), a.v.flatten(0, 1)))  # (2 G d_h, d + 1)
    weight = output_weight(a, s, options["kv_balance"]) if options["weighting"] == "output" else None
    down, up = weighted_factors(target, a.cov, weight, rank)
    state = {
        **linear_state("q_proj", a.q.flatten(0, 1), s.qkv_bias),
        **linear_state("kv_down", down, s.qkv_bias),
        "k_up.weight": up[: groups * hd],
        "v_up.weight": up[groups * hd:],
        **output_state(a.o, s.qkv_bias),
    }
    info = {"latent_relative_error": weighted_error(target, up @ down, a.cov, weight),
            "latent_relative_error_rootcov": weighted_error(target, up @ down, a.cov, None)}
    layer_options = {"kv_rank": rank, "n_kv_heads": groups}
    return LayerFit(state, [n for n in state if n.startswith(("kv_down", "k_up", "v_up"))], info, layer_options)


def output_weight(a: AffineLayer, s: Shape, kv_balance: float) -> torch.Tensor:
    """Row weight (2 G d_h square) of the stacked [keys; values] in output units (module
    docstring): block-diagonal, a damped square root per group and side."""
    energy = pair_energy(to_complex(a.q), a.cov) / s.head_dim  # (H, F): E|q_h,i|^2 in logit units
    blocks_k, blocks_v = [], []
    for g in range(s.n_kv_heads):
        heads = range(g * s.group, (g + 1) * s.group)
        outputs = [a.output_block(h).T @ a.output_block(h) for h in heads]  # W_o,h^T W_o,h (d_h, d_h)
        value_cov = a.centered_moment(a.v[g])
        sigma = [torch.trace(o @ value_cov) for o in outputs]
        per_pair = sum(sg * energy[h] for sg, h in zip(sigma, heads))  # (F,)
        blocks_k.append(kv_balance * torch.diag(per_pair.repeat_interleave(2)))
        blocks_v.append(sum(outputs))
    return torch.block_diag(*[damped_sqrt(b, WEIGHT_DAMPING) for b in blocks_k + blocks_v])

