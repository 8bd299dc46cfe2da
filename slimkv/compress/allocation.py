"""Non-uniform rank allocation: one total weight budget spread over all blocks and projections.

Two rules besides the uniform one (``CompressOptions.rank_allocation``): ``spectrum`` (below) and
``sensitivity``, ASVD's search (``measure_sensitivity`` + ``allocate_by_sensitivity``), which
measures the calibration loss of every matrix truncated alone and may leave matrices dense.

The uniform rule gives every matrix (1 - ratio) of its own weights. Matrices differ in how much of
their activation-weighted output energy a given rank keeps: the eigenvalues lambda_1 >= ... of
W C W^T (C = E[x x^T] of the matrix's input) are exactly what RootCov keeps and drops, so the
relative error of matrix p at rank r is

    e_p(r) = sum_{i > r} lambda_i / sum_i lambda_i.

``allocate`` minimises sum_p e_p(r_p) under the same total weights as the uniform rule, greedily:
starting from a floor, each step raises the rank of the matrix with the largest error reduction
per stored weight. The spectra come from one pass of the *dense* model over the calibration
windows (``measure_spectra``), before the block-by-block compression, which then reads its
budgets from the allocation (``BlockContext.keep``). The pass costs about as much as computing
RootCov's statistics once more.
"""

from __future__ import annotations

import heapq
import math

import torch
from torch import nn
from tqdm import tqdm

from slimkv.compress.arch import Architecture
from slimkv.compress.block import BlockContext, capture_block_inputs, run_block
from slimkv.compress.cost import factor_params, rank_for_budget
from slimkv.compress.linalg import top_eigh
from slimkv.compress.options import CompressOptions

# The spectra are measured on the first SPECTRUM_SEQUENCES calibration windows: their shape (the
# relative error at each rank) settles on far fewer tokens than the factors need.
SPECTRUM_SEQUENCES = 2
# Every matrix keeps at least this fraction of the rank the uniform rule would give it: the
# relative-error proxy says nothing about how a nearly removed matrix hurts downstream blocks.
RANK_FLOOR = 0.25


def spectrum(ctx: BlockContext, name: str, stats) -> torch.Tensor:
    """Eigenvalues (descending, >= 0) of W C W^T for projection ``name`` (the nonzero ones of
    C^{1/2} W^T W C^{1/2} when d_out > d_in: the smaller Gram is decomposed)."""
    W = ctx.original[name][0]
    centered = ctx.has_bias(name)
    if W.shape[0] <= W.shape[1]:
        gram = stats.weighted_gram(W, centered)
    else:
        root = stats.root(centered)
        gram = root @ W.T @ W @ root
    values, _ = top_eigh(gram, gram.shape[0], f"{ctx.path(name)} spectrum")
    return values.clamp_min(0)


@torch.no_grad()
def measure_spectra(model: nn.Module, calib_ids: torch.Tensor, options: CompressOptions, *, progress: bool = True) -> dict[tuple[int, str], torch.Tensor]:
    """(block index, projection) -> eigenvalues of W C W^T on the dense model's calibration activations."""
    arch = Architecture(model)
    inputs = capture_block_inputs(model, arch, calib_ids)
    blocks = arch.blocks()
    names = [p.name for p in arch.layout.projections()]
    spectra: dict[tuple[int, str], torch.Tensor] = {}
    for index in tqdm(range(len(blocks)), desc="rank allocation: spectra", unit="layer", disable=not progress):
        ctx = BlockContext(arch, blocks[index], index, options, inputs)
        stats = ctx.collect(names, stop=None)
        for name in names:
            spectra[(index, name)] = spectrum(ctx, name, stats[name])
        if index + 1 < len(blocks):
            inputs = run_block(blocks[index], inputs)
    return spectra


def allocate(spectra: dict[tuple[int, str], torch.Tensor], shapes: dict[tuple[int, str], tuple[int, int]], ratio: float,
             identity: bool) -> dict[tuple[int, str], int]:
    """Ranks minimising the summed relative error within the uniform rule's total weights.

    ``shapes`` (d_out, d_in) per matrix. Each matrix starts at ``RANK_FLOOR`` of its uniform rank
    and never exceeds the rank at which its factors stop saving weights.
    """
    budget = sum((1.0 - ratio) * d_out * d_in for d_out, d_in in shapes.values())
    ranks, tails, caps = {}, {}, {}
    for key, (d_out, d_in) in shapes.items():
        values = spectra[key].to(torch.float64)
        total = float(values.sum())
        tails[key] = [1.0 - float(x) / total for x in torch.cumsum(values, 0)] if total > 0 else [0.0] * values.numel()
        caps[key] = min(d_in, d_out, rank_for_budget(d_in, d_out, d_in * d_out, identity))
        uniform = rank_for_budget(d_in, d_out, (1.0 - ratio) * d_in * d_out, identity)
        ranks[key] = max(1, math.floor(RANK_FLOOR * uniform))
    used = sum(factor_params(d_in, d_out, ranks[k], identity) for k, (d_out, d_in) in shapes.items())

    def error(key, rank: int) -> float:
        return tails[key][rank - 1] if rank >= 1 else 1.0

    def gain(key) -> tuple[float, int]:
        d_out, d_in = shapes[key]
        rank = ranks[key]
        cost = factor_params(d_in, d_out, rank + 1, identity) - factor_params(d_in, d_out, rank, identity)
        return (error(key, rank) - error(key, rank + 1)) / max(cost, 1), cost

    heap = [(-gain(key)[0], key) for key in shapes if ranks[key] < caps[key]]
    heapq.heapify(heap)
    while heap:
        _, key = heapq.heappop(heap)
        _, cost = gain(key)
        if used + cost > budget:
            continue
        ranks[key] += 1
        used += cost
        if ranks[key] < caps[key]:
            heapq.heappush(heap, (-gain(key)[0], key))
    return ranks


# The sensitivity probe: the first PROBE_LENGTH tokens of the first PROBE_SEQUENCES calibration
# windows (ASVD measures perplexity on its calibration set; a small probe keeps 30 x 7 x 9 forwards affordable on a CPU:
# about 10 minutes for SmolLM2 on one thread).
PROBE_SEQUENCES, PROBE_LENGTH = 1, 256
# ASVD's candidate fractions of a matrix's weights to keep, each measured alone (its STRS search).
SENSITIVITY_KEEPS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@torch.no_grad()
def measure_sensitivity(model: nn.Module, calib_ids: torch.Tensor, probe_ids: torch.Tensor, options: CompressOptions, method: str,
                        keeps: tuple[float, ...] = SENSITIVITY_KEEPS, *, progress: bool = True) -> dict[tuple[int, str], dict[float, float]]:
    """(block, projection) -> {fraction of weights kept: calibration loss with that matrix alone
    replaced by its rank-limited factors} on the dense model (ASVD's sensitivity, measured as the
    mean cross-entropy on ``probe_ids`` (sequences, length)). ``method`` is a per-matrix
    factorization (svd, asvd, rootcov); its statistics come from the dense model's activations.
    One model forward per matrix and fraction: the costly part of ASVD."""
    arch = Architecture(model)
    if any(p.rows is not None or p.conv1d for p in arch.layout.projections()):
        raise ValueError(f"rank_allocation='sensitivity' replaces weights in place; the {arch.family} family's fused/Conv1D leaves are not supported")
    inputs = capture_block_inputs(model, arch, calib_ids)
    blocks = arch.blocks()
    names = [p.name for p in arch.layout.projections()]
    need = "mean_abs" if method == "asvd" else "cov"
    sensitivity: dict[tuple[int, str], dict[float, float]] = {}
    bar = tqdm(total=len(blocks) * len(names) * len(keeps), desc="rank allocation: sensitivity", unit="probe", disable=not progress)
    for index, block in enumerate(blocks):
        ctx = BlockContext(arch, block, index, options, inputs)
        stats = ctx.collect(names, stop=None, need=need) if method != "svd" else {}
        for name in names:
            weight = arch.leaf(block, arch.layout.get(name)).weight
            saved = weight.detach().clone()
            W = ctx.original[name][0]
            sensitivity[(index, name)] = {}
            for keep in keeps:
                rank = max(1, rank_for_budget(W.shape[1], W.shape[0], keep * W.numel(), False))
                weight.copy_(ctx.local_factors(name, method, stats.get(name), rank).product().to(weight.dtype))
                sensitivity[(index, name)][keep] = float(model(probe_ids, labels=probe_ids).loss)
                bar.update(1)
            weight.copy_(saved)
        if index + 1 < len(blocks):
            inputs = run_block(block, inputs)
    bar.close()
    return sensitivity


def allocate_by_sensitivity(sensitivity: dict[tuple[int, str], dict[float, float]], sizes: dict[tuple[int, str], int],
                            ratio: float) -> dict[tuple[int, str], float]:
    """ASVD's threshold search: for a loss threshold t every matrix keeps the smallest fraction whose
    measured loss is <= t, and stays dense (fraction 1) if none is; the smallest t whose total
    weights fit (1 - ratio) of all of them wins. ``sizes``: weights per matrix. Returns the fraction
    kept per matrix (1.0: uncompressed)."""
    budget = (1.0 - ratio) * sum(sizes.values())

    def keeps_at(threshold: float) -> dict[tuple[int, str], float]:
        return {key: min((k for k, loss in curve.items() if loss <= threshold), default=1.0) for key, curve in sensitivity.items()}

    def total(keeps: dict[tuple[int, str], float]) -> float:
        return sum(keeps[key] * sizes[key] for key in sizes)

    thresholds = sorted({loss for curve in sensitivity.values() for loss in curve.values()})
    low, high = 0, len(thresholds) - 1
    if total(keeps_at(thresholds[high])) > budget:
        raise ValueError(f"ratio {ratio}: even the smallest measured fractions ({min(next(iter(sensitivity.values())))}) keep more weights than allowed")
    while low < high:
        mid = (low + high) // 2
        if total(keeps_at(thresholds[mid])) <= budget:
            high = mid
        else:
            low = mid + 1
    return keeps_at(thresholds[low])
