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

import time
from dataclasses import asdict

import torch
from torch import nn
from tqdm import tqdm

from slimkv.compress.arch import Architecture
from slimkv.compress.block import BlockContext, capture_block_inputs, run_block
from slimkv.compress.methods import get_method
from slimkv.compress.options import CompressOptions

PROPAGATION = "compressed: each block is calibrated on the outputs of the already-compressed blocks before it"


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
    inputs = capture_block_inputs(model, arch, calib_ids) if needs_data else []
    blocks = arch.blocks()
    modules: list[dict] = []
    bar = tqdm(range(len(blocks)), desc=f"{options.method} ratio {options.ratio}", unit="layer", disable=not progress)
    for index in bar:
        block = blocks[index]
        context = BlockContext(arch, block, index, options, inputs)
        method.compress_block(context)
        modules += context.entries
        if needs_data and index + 1 < len(blocks):
            inputs = run_block(block, inputs)
    budget = summarize_budget(modules)
    return {
        "method": options.method,
        "ratio": options.ratio,
        "achieved_ratio": budget["achieved_ratio"],
        "budget": budget,
        "options": asdict(options),
        "family": arch.family,
        "propagation": PROPAGATION if needs_data else "none (svd uses no data)",
        "within_block": method.within_block,
        "seconds": time.perf_counter() - t0,
        "modules": modules,
    }
