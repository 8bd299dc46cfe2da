"""Where a decode step's time goes: the native linear layers (with a SwiGLU block's norm and sum,
which its one call does too, and a block's halves around its attention, ``native_block_input`` and
``native_block_output``, with their norms, RoPE and residual, and an MLA block's ``native_latent_input``), the native attention kernel, the blocks that ran as one native call
(``slimkv.model.block_step``: their linears and attention together), and the rest (the attention's norm, RoPE, cache appends, MLA's absorbed query and context products, the logits' argmax,
Python between the calls).

``timed_parts`` times every call of the kernels' Python entry points during a block, at the names
the model's code calls them by (``slimkv.ops.linear`` and ``slimkv.ops.attention``, ``slimkv.ops.kvm.core``),
and counts the weight bytes each linear call read. It adds two clock reads per call (about 0.1 us each,
some 130 calls in a SmolLM2 step), so the parts it reports are of an instrumented step; the benchmark
says so beside them. ``split_step`` turns one step's parts into times and bounds: the linears' weight
bytes over the read bandwidth, the attention's cache bytes over it (or its FLOPs over the FMA rate),
and the rest, whose bound is zero; their sum is the step's bound by parts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import slimkv.model.block_step as block_step
import slimkv.ops.attention as attention_ops
import slimkv.ops.kvm.core as kvm_ops
import slimkv.ops.linear as linear_ops

LINEAR_ENTRIES = ((linear_ops, "native_linear"), (linear_ops, "native_project"), (linear_ops, "native_swiglu_residual"),
                  (block_step, "native_block_input"), (block_step, "native_latent_input"), (block_step, "native_block_output"))
ATTENTION_ENTRIES = ((attention_ops, "native_decode_attention"), (attention_ops, "native_stored_attention"), (kvm_ops, "native_decode_attention"))
BLOCK_ENTRIES = ((block_step, "native_block_step"),)


def _weights(name: str, args: tuple) -> list:
    """The weights one linear entry's call reads: its second argument (a weight or a list of them),
    or a SwiGLU block's gate, up and down (its norm and sum are counted in the call's time)."""
    if name == "native_swiglu_residual":
        return list(args[3:6])
    if name == "native_block_step":  # its projections and MLP (the norms' gains are counted in the call's time)
        weights = args[2]
        return [weights.wq, weights.wk, weights.wv, weights.wo, weights.gate, weights.up, weights.down]
    if name == "native_block_input":  # a block's half before its attention: q/k/v (with the norm and RoPE)
        return [args[1].wq, args[1].wk, args[1].wv]
    if name == "native_latent_input":  # an MLA block's half before its attention: q and the cache row (with the norm and RoPE)
        return [args[1].wq, args[1].w_kv]
    if name == "native_block_output":  # the half after it: Wo and the SwiGLU half
        return [args[2].wo, args[2].gate, args[2].up, args[2].down]
    return list(args[1]) if name == "native_project" else [args[1]]


@contextlib.contextmanager
def timed_parts() -> Iterator[dict[str, Any]]:
    """Within the block, every native linear and attention call is timed; yields the totals
    ``{"linear_s", "linear_calls", "linear_weight_bytes", "linear_weight_elements", "attention_s", "attention_calls", "block_s",
    "block_calls", "block_weight_bytes", "block_weight_elements"}``, filled as the block runs. The entries are restored on exit,
    whatever happens in the block."""
    totals = {"linear_s": 0.0, "linear_calls": 0, "linear_weight_bytes": 0, "linear_weight_elements": 0, "attention_s": 0.0, "attention_calls": 0,
              "block_s": 0.0, "block_calls": 0, "block_weight_bytes": 0, "block_weight_elements": 0}
    originals = []

    def timed(part: str, name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            totals[f"{part}_s"] += time.perf_counter() - t0
            totals[f"{part}_calls"] += 1
            if part in ("linear", "block"):
                for weight in _weights(name, args):
                    totals[f"{part}_weight_bytes"] += weight.numel() * weight.element_size()
                    totals[f"{part}_weight_elements"] += weight.numel()
            return out
        return call

    try:
        for part, entries in (("linear", LINEAR_ENTRIES), ("attention", ATTENTION_ENTRIES), ("block", BLOCK_ENTRIES)):
            for module, name in entries:
                fn = getattr(module, name)
                originals.append((module, name, fn))
                setattr(module, name, timed(part, name, fn))
        yield totals
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def split_step(step_s: float, parts: dict[str, Any], *, cache_bytes: float, attention_flops: float, rates: dict[str, Any]) -> dict[str, Any]:
    """One instrumented step of ``step_s`` seconds cut into its parts, each with its bound (seconds)
    and its time over the bound. ``parts`` holds one step's totals from ``timed_parts``;
    ``attention_flops`` are the FLOPs of the step's attention (the step's FLOPs less its linears' and
    its blocks' projections', 2 per weight element). Blocks that ran as one call did their layer's
    attention inside it: the attention's bound is shared between the attention calls and the
    block calls by their counts (one of each per layer), and a block's bound is its weights over the
    read rate plus its share."""
    bandwidth, fma = rates["read_bytes_per_s"], rates["fma_flop_per_s"]
    linear_bound = parts["linear_weight_bytes"] / bandwidth
    whole_attention_bound = max(cache_bytes / bandwidth, attention_flops / fma)
    block_calls = parts.get("block_calls", 0)
    in_blocks = block_calls / (block_calls + parts["attention_calls"]) if block_calls else 0.0
    attention_bound = (1 - in_blocks) * whole_attention_bound
    block_bound = parts.get("block_weight_bytes", 0) / bandwidth + in_blocks * whole_attention_bound
    block_s = parts.get("block_s", 0.0)
    rest_s = step_s - parts["linear_s"] - parts["attention_s"] - block_s
    return {
        "step_s": step_s,
        "linear_s": parts["linear_s"], "linear_bound_s": linear_bound, "linear_over_bound": parts["linear_s"] / linear_bound if linear_bound else None,
        "linear_calls": parts["linear_calls"], "linear_weight_bytes": parts["linear_weight_bytes"],
        "attention_s": parts["attention_s"], "attention_bound_s": attention_bound,
        "attention_over_bound": parts["attention_s"] / attention_bound if attention_bound else None,
        "attention_bound": "compute" if attention_flops / fma > cache_bytes / bandwidth else "memory",
        "attention_calls": parts["attention_calls"],
        "block_s": block_s, "block_bound_s": block_bound, "block_over_bound": block_s / block_bound if block_bound else None,
        "block_calls": block_calls, "block_weight_bytes": parts.get("block_weight_bytes", 0),
        "rest_s": rest_s,
        # the parts run one after the other, each against its own limit: the sum of their bounds is the
        # step's bound by parts (tighter than one max over the whole step's bytes and FLOPs when one part
        # is compute-bound and another memory-bound, as MLA's are)
        "parts_bound_s": linear_bound + attention_bound + block_bound,
        "step_over_parts_bound": step_s / (linear_bound + attention_bound + block_bound) if linear_bound + attention_bound + block_bound else None,
    }
