"""Layer-by-layer post-training compression of a transformers causal LM.

One decoder block at a time: capture its inputs' statistics on calibration tokens (float64,
chunked ``addmm``; projections reading the same input - q/k/v, gate/up - share one covariance),
factor, replace the ``nn.Linear``/``Conv1D`` leaves by factored modules, run the block forward to
produce the next block's inputs, free. The next block always sees the *compressed* model's
activations (recorded in the manifest as ``propagation``).

Methods live in a registry (``slimkv.compress.methods``: svd, asvd, rootcov, latentllm); each is
a function of a ``BlockContext`` (``slimkv.compress.block``).

What ``ratio`` means: weights removed from the compressed projections of the blocks
(q, k, v, o, gate, up, down) divided by their original count (biases, norms, embeddings and the LM
head are not counted and stay dense). Every matrix (or jointly factored pair) gets the rank that
fits (1 - ratio) of its own weights: dense factors r (d_in + d_out) <= (1 - ratio) d_in d_out,
identity-block factors r (d_in + d_out) - r^2 <= (1 - ratio) d_in d_out; joint QK and the shared
gate/up factor take the combined budget of their pair. The achieved ratio is therefore at least
the requested one and exceeds it by less than one rank step per matrix.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict

import torch
from torch import nn
from tqdm import tqdm

from slimkv.compress.allocation import (
    PROBE_LENGTH,
    PROBE_SEQUENCES,
    SPECTRUM_SEQUENCES,
    allocate,
    allocate_by_sensitivity,
    measure_sensitivity,
    measure_spectra,
)
from slimkv.compress.arch import Architecture
from slimkv.compress.block import KEEP_DENSE, LOCAL_METHODS, BlockContext, capture_block_inputs, run_block
from slimkv.compress.cost import factor_params
from slimkv.compress.methods import get_method
from slimkv.compress.options import CompressOptions

PROPAGATION = "compressed: each block is calibrated on the outputs of the already-compressed blocks before it"
DENSE_PROPAGATION = "dense: every block is calibrated on the dense model's activations (not sequential)"
CORRECTION = "; corrected: every projection is fitted to the output the dense model computes from its own inputs"


def iter_leaf_entries(modules: list[dict]):
    """Every factored leaf description (split leaves expanded into their parts)."""
    for entry in modules:
        if entry["kind"] == "split":
            yield from entry["parts"]
        else:
            yield entry


def summarize_budget(modules: list[dict]) -> dict:
    """Weights before/after over the compressed projections, and the achieved ratio."""
    before = sum(e["params_before"] for e in iter_leaf_entries(modules))
    after = sum(e["params_after"] for e in iter_leaf_entries(modules))
    return {"weights_before": before, "weights_after": after, "achieved_ratio": 1.0 - after / before if before else 0.0}


def plan_budgets(model: nn.Module, arch: Architecture, calib_ids: torch.Tensor | None, options: CompressOptions, identity: bool, *,
                 progress: bool) -> tuple[dict[int, dict[str, float]], dict]:
    """Per-block projection budgets (weights to keep) and their description for the manifest:
    empty for the uniform rule, else from ``slimkv.compress.allocation`` on the dense model."""
    if options.rank_allocation == "uniform" or options.full_rank:
        return {}, {"rule": "uniform", "note": "every matrix keeps (1 - ratio) of its own weights"}
    if calib_ids is None:
        raise ValueError(f"rank_allocation={options.rank_allocation!r} measures spectra on calibration data; method {options.method!r} reads none")
    t0 = time.perf_counter()
    shapes = {}
    for index, block in enumerate(arch.blocks()):
        for proj in arch.layout.projections():
            shapes[(index, proj.name)] = arch.weight_shape(block, proj)
    names = [p.name for p in arch.layout.projections()]
    budgets: dict[int, dict[str, float]] = {}
    if options.rank_allocation == "spectrum":
        ranks = allocate(measure_spectra(model, calib_ids[:SPECTRUM_SEQUENCES], options, progress=progress), shapes, options.ratio, identity)
        for (index, name), rank in ranks.items():
            d_out, d_in = shapes[(index, name)]
            budgets.setdefault(index, {})[name] = factor_params(d_in, d_out, rank, identity)
        detail = {"spectrum_tokens": list(calib_ids[:SPECTRUM_SEQUENCES].shape), "ranks": {name: [ranks[(index, name)] for index in range(len(arch.blocks()))] for name in names}}
    else:
        local = options.method if options.method in LOCAL_METHODS else "rootcov"
        probe = calib_ids[:PROBE_SEQUENCES, :PROBE_LENGTH]
        sensitivity = measure_sensitivity(model, calib_ids, probe, options, local, progress=progress)
        keeps = allocate_by_sensitivity(sensitivity, {key: d_out * d_in for key, (d_out, d_in) in shapes.items()}, options.ratio)
        for (index, name), keep in keeps.items():
            d_out, d_in = shapes[(index, name)]
            budgets.setdefault(index, {})[name] = KEEP_DENSE if keep >= 1.0 else keep * d_out * d_in
        detail = {"factorization_probed": local, "probe_tokens": list(probe.shape),
                  "keep_fractions": {name: [keeps[(index, name)] for index in range(len(arch.blocks()))] for name in names},
                  "dense": sorted(f"{index}.{name}" for (index, name), keep in keeps.items() if keep >= 1.0),
                  "sensitivity_loss": {f"{index}.{name}": curve for (index, name), curve in sensitivity.items()}}
    return budgets, {"rule": options.rank_allocation, "identity_block_params": identity, "seconds": time.perf_counter() - t0, **detail}


def propagation(options: CompressOptions, needs_data: bool) -> str:
    """How each block's calibration inputs were produced (for the manifest)."""
    if not needs_data:
        return "none (the method uses no data)"
    if not options.sequential:
        return DENSE_PROPAGATION
    return PROPAGATION + (CORRECTION if options.correct_upstream else "")


@torch.no_grad()
def compress_model(model: nn.Module, calib_ids: torch.Tensor | None, options: CompressOptions, *, progress: bool = True) -> dict:
    """Compress ``model`` in place; returns the manifest body (modules, budget, timings, options).

    ``calib_ids`` (n_sequences, seq_len) LongTensor of calibration tokens (unused by ``svd``).
    """
    options.validate()
    method = get_method(options.method)
    arch = Architecture(model)
    model.eval()
    needs_data = method.needs_data
    if needs_data and (calib_ids is None or calib_ids.ndim != 2 or calib_ids.numel() == 0):
        raise ValueError(f"method {options.method!r} needs calibration token ids of shape (sequences, seq_len)")
    t0 = time.perf_counter()
    blocks = arch.blocks()
    budgets, allocation = plan_budgets(model, arch, calib_ids, options, method.identity_blocks and options.identity_block, progress=progress)
    inputs = capture_block_inputs(model, arch, calib_ids) if needs_data else []
    modules: list[dict] = []
    bar = tqdm(range(len(blocks)), desc=f"{options.method} ratio {options.ratio}", unit="layer", disable=not progress)
    dense_inputs = inputs if options.correct_upstream and needs_data else None
    for index in bar:
        block = blocks[index]
        original = copy.deepcopy(block) if dense_inputs is not None or (needs_data and not options.sequential) else None
        context = BlockContext(arch, block, index, options, inputs, budgets.get(index), dense=None if dense_inputs is None else (original, dense_inputs))
        method.compress_block(context)
        modules += context.entries
        if needs_data and index + 1 < len(blocks):
            inputs = run_block(block if options.sequential else original, inputs)
            if original is not None and options.sequential:
                dense_inputs = run_block(original, dense_inputs)
        del context, original
    budget = summarize_budget(modules)
    return {
        "method": options.method,
        "ratio": options.ratio,
        "achieved_ratio": budget["achieved_ratio"],
        "budget": budget,
        "options": asdict(options),
        "family": arch.family,
        "propagation": propagation(options, needs_data),
        "within_block": method.within_block,
        "allocation": allocation,
        "seconds": time.perf_counter() - t0,
        "modules": modules,
    }
