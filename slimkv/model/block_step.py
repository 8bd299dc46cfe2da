"""A decoder block's decode step in one native call (or two around the attention), where the block allows it.

A decode step of a small model is mostly calls: a SmolLM2 layer's module path makes some ten
kernel calls and tens of torch operations, about 300 us a layer in Python and dispatch on the
development machine. ``block_step`` runs a pre-norm block with a SwiGLU MLP (no biases, no
query/key norms, RoPE on some channels, plain ``Linear`` projections) for one token through
``slimkv.ops.native_block`` (csrc/decode_block.h) instead:
- the plain GQA/MHA/MQA block (no window), and ``hybrid``'s per-head roles (exact heads; sinks and
  a window), over a cache of full-precision rows, or of int8 / int4 codes with a full-precision
  window, holding at least one token (a hybrid one, its sinks): the whole block in one call
  (``native_block_step``), the new rows written into the cache (rows they push out of the window
  quantized before the call, as a store would), each role's heads attending over its segments as
  the module path's ``attend_rows`` reads them;
- any other attention of the ``MultiHeadAttention`` family that keeps its own cache (a sliding
  window; codes with no full-precision window): the norm, q/k/v and RoPE in one call, the
  attention's own ``attend_rows`` in Python, then the output projection, the residual and the
  SwiGLU half in one call (``native_block_input``, ``native_block_output``);
- ``mla`` as a conversion from a GQA model makes it (no query latent, no latent norm, no
  query/key norms, no biases): the norm, q, the cache row [k_pe | c] and RoPE in one call
  (``native_latent_input``), the layer's own absorbed attention over its cache in Python, then the
  output half in one call.
All need float32 or bfloat16 on the CPU, no autograd, no torch dispatch mode (a FLOP counter must
see the module path's operations), no forward hook on any of the block's modules and a backend
other than "reference". Otherwise ``block_step`` returns None and ``Block.forward`` takes the
module path, which is the reference: the native calls compute every value as the module path's
kernels do and round it where they round, so the two agree to the bit
(tests/model/test_block_step.py). ``Block.native_step`` (True by default) lets a test or
benchmark run the module path instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from slimkv.attention.hybrid import HybridAttention, HybridCache
from slimkv.attention.mha import GQA, MHA, MQA, KVCache, MultiHeadAttention
from slimkv.attention.mla import MultiHeadLatentAttention
from slimkv.common.buffer import GrowableBuffer
from slimkv.ops.linear import Linear
from slimkv.ops.native import decode_kernel
from slimkv.ops.native_block import (
    BlockShape,
    BlockWeights,
    CacheRole,
    LatentShape,
    LatentWeights,
    block_fields,
    native_block_input,
    native_block_output,
    native_block_step,
    native_latent_input,
)
from slimkv.ops.norm import RMSNorm
from slimkv.ops.quantize import QuantizedBuffer

KINDS = (MHA, GQA, MQA)
"""Attention kinds whose whole block step is one call with no window (and ``hybrid``, whose
per-head roles are each a few segments of rows or codes)."""
HALVES = (MultiHeadAttention._forward, HybridAttention._forward)
"""The ``_forward`` methods that are ``project_qkv``, ``attend_rows`` and ``o_proj`` in turn: a class
that runs one of them takes the two-call step."""


class StepPlan(NamedTuple):
    """What a block's one-call step keeps between steps: its weights, shape and the entry's fixed fields."""

    weights: BlockWeights
    shape: BlockShape
    fields: tuple[int, ...]
    requires_grad: bool
    modules: tuple[torch.nn.Module, ...]
    children: tuple[tuple[torch.nn.Module, str, torch.nn.Module], ...]
    owners: tuple[torch.nn.Module, ...]
    whole: bool  # the whole block in one call (KINDS with no window, hybrid); else two calls around attend_rows
    latent: bool = False  # an MLA block: two calls around its absorbed attention (weights and shape: LatentWeights, LatentShape)


CHILDREN = (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("attn_norm", ()), ("mlp", ("gate_proj", "up_proj", "down_proj")), ("mlp_norm", ()))
OWNERS = ("attn_norm", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""The modules whose ``weight`` the entry reads, in ``BlockWeights``' order."""
LATENT_CHILDREN = (("attn", ("q_proj", "kv_down", "kv_norm", "q_norm", "k_norm", "o_proj")), ("attn_norm", ()), ("mlp", ("gate_proj", "up_proj", "down_proj")),
                   ("mlp_norm", ()))
LATENT_OWNERS = ("attn_norm", "attn.q_proj", "attn.kv_down", "attn.o_proj", "mlp_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""An MLA block's modules whose ``weight`` its two calls read, in ``LatentWeights``' order."""


def _still_valid(plan: StepPlan) -> bool:
    """Whether the block still has the modules and weights its plan was made from (a weight replaced
    or moved by .to() or load_state_dict, or a module swapped, means a new plan)."""
    return (all(parent._modules.get(name) is child for parent, name, child in plan.children)
            and all(owner._parameters.get("weight") is w and w.data_ptr() == f for owner, w, f in zip(plan.owners, plan.weights, plan.fields)))


def _plan(block) -> StepPlan | None:
    """The block's plan, or None when its modules are not the ones the entry computes."""
    attn, mlp = block.attn, block.mlp
    if type(attn) is MultiHeadLatentAttention:
        return _latent_plan(block)
    if not isinstance(attn, MultiHeadAttention) or type(attn)._forward not in HALVES or attn.use_qk_norm or attn.use_bias:
        return None
    if type(attn).project_qkv is not MultiHeadAttention.project_qkv:  # what BLOCK_INPUT_ENTRY computes
        return None
    if attn.rotary.rot_dim == 0:
        return None
    parts = _block_parts(block, (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj), OWNERS, CHILDREN, BlockWeights)
    if parts is None:
        return None
    owners, weights, children = parts
    shape = BlockShape(attn.d_model, attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.rotary.rot_dim, mlp.gate_proj.out_features,
                       block.attn_norm.eps, block.mlp_norm.eps, 1.0 / math.sqrt(attn.head_dim))  # decode_attention's default scale
    return StepPlan(weights, shape, block_fields(weights, shape), any(w.requires_grad for w in weights), tuple(block.modules()), children, owners,
                    (type(attn) in KINDS and attn.window is None) or type(attn) is HybridAttention)


def _block_parts(block, projections: tuple, owner_names: tuple[str, ...], children_spec: tuple, weights_type: type) -> tuple | None:
    """What every plan checks and keeps: RMSNorms before the attention and the MLP, a SwiGLU MLP,
    plain bias-free ``Linear`` projections (the attention's ``projections`` and the MLP's), the
    owners' weights as ``weights_type`` (one dtype, contiguous, on the CPU) and the children whose
    swap means a new plan; (owners, weights, children), or None where the block is not that."""
    mlp = block.mlp
    if type(block.attn_norm) is not RMSNorm or type(block.mlp_norm) is not RMSNorm or mlp.gate_proj is None:
        return None
    if any(type(p) is not Linear or p.bias is not None for p in (*projections, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        return None
    owners = tuple(block.get_submodule(name) for name in owner_names)
    weights = weights_type(*(owner.weight for owner in owners))
    dtype = weights[0].dtype
    if any(w.dtype != dtype or w.device.type != "cpu" or not w.is_contiguous() for w in weights):
        return None
    children = tuple((block, name, block._modules[name]) for name, _ in children_spec)
    children += tuple((block._modules[name], sub, block._modules[name]._modules[sub]) for name, subs in children_spec for sub in subs)
    return owners, weights, children


def _latent_plan(block) -> StepPlan | None:
    """An MLA block's plan (two calls around its absorbed attention), or None: the entry computes
    MLA as a conversion from a GQA model makes it (no query latent, no latent norm, no query/key
    norms, no biases, rotary channels) in a pre-norm block with a SwiGLU MLP."""
    attn, mlp = block.attn, block.mlp
    if attn.q_rank is not None or attn.latent_norm or attn.use_qk_norm or attn.use_bias or attn.rope_dim == 0:
        return None
    if any(type(norm) is not nn.Identity for norm in (attn.kv_norm, attn.q_norm, attn.k_norm)):  # what the options say, as the modules are
        return None
    parts = _block_parts(block, (attn.q_proj, attn.kv_down, attn.o_proj), LATENT_OWNERS, LATENT_CHILDREN, LatentWeights)
    if parts is None:
        return None
    owners, weights, children = parts
    shape = LatentShape(attn.d_model, attn.n_heads, attn.qk_dim, attn.rope_dim + attn.kv_rank, attn.rope_dim, mlp.gate_proj.out_features,
                        block.attn_norm.eps, block.mlp_norm.eps)
    return StepPlan(weights, shape, tuple(w.data_ptr() for w in weights), any(w.requires_grad for w in weights), tuple(block.modules()), children,
                    owners, False, latent=True)


def block_step_counts(model: torch.nn.Module) -> dict[str, int]:
    """How ``model``'s decoder blocks take a decode step: ``one_call`` (the whole block, over
    full-precision rows or int8 / int4 codes; a step whose new row would be quantized at once, with
    no full-precision window, still takes two), ``two_calls`` (around the attention's own cache
    code: a sliding window) and ``module_path`` (a block the native calls do not compute, or with
    ``native_step`` off). What a benchmark or ``slimkv eval cache`` records beside a decode time, so
    a reader knows which path ran."""
    counts = {"one_call": 0, "two_calls": 0, "module_path": 0}
    for block in (m for m in model.modules() if hasattr(m, "native_step")):  # slimkv.model.modeling.Block (which imports this module)
        plan = _plan(block) if block.native_step else None
        counts["module_path" if plan is None else "one_call" if plan.whole else "two_calls"] += 1
    return counts


def _hooked(modules: tuple[torch.nn.Module, ...]) -> bool:
    """Whether a forward hook would see any of these modules' calls (the one-call step makes none)."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def block_step(block, x: torch.Tensor, cache) -> torch.Tensor | None:
    """``block(x, cache)`` for one token in one or two native calls, or None when the call is not
    one they take (the caller then runs the module path). x (1, 1, d_model); ``cache`` the block's
    attention cache, advanced by the token as the module path would advance it."""
    if not block.native_step or x.shape[:2] != (1, 1) or torch._C._len_torch_dispatch_stack() > 0:
        return None
    plan = block.__dict__.get("_step_plan")
    if plan is None or (plan and not _still_valid(plan)):
        plan = block.__dict__["_step_plan"] = _plan(block) or False
    if plan is False or x.dtype != plan.weights.wq.dtype or not x.is_contiguous() or x.device.type != "cpu":
        return None
    if (torch.is_grad_enabled() and (plan.requires_grad or x.requires_grad)) or block.attn.backend == "reference" or _hooked(plan.modules):
        return None
    library = decode_kernel(x.dtype)
    if library is None:
        return None
    attn = block.attn
    spec = attn.__dict__.get("_spec")
    if spec is None:
        spec = attn.__dict__["_spec"] = attn.cache_spec()
    cache.check_compatible(spec, x)
    rotation = attn.rotary.rotation(cache.seq_len, 1, x.device, torch.float32)
    if plan.latent:
        return _latent_two_calls(plan, attn, x, cache, rotation, library)
    if plan.whole and x.dtype == cache.dtype:
        mark = cache.mark() if _quantizes_ahead(cache) else None  # quantizing ahead changes the cache before the call
        try:
            roles = _cache_roles(attn, cache)
            if roles is not None:
                roles, commit = roles
                out = native_block_step(x, plan.fields, plan.weights, plan.shape, rotation, roles, library)
                commit()
                return out
        except BaseException:
            if mark is not None:
                cache.rollback(mark)
            raise
    return _two_calls(plan, attn, x, cache, rotation, library)


def _quantizes_ahead(cache) -> bool:
    """Whether a whole-block step over ``cache`` may quantize rows before its call (``_role``), so
    a failed call must roll them back; most steps quantize nothing and need no mark."""
    return cache.storage.bits is not None and any(isinstance(t, QuantizedBuffer) and t.rows_ahead() > 0 for t in cache.tensors())


def _cache_roles(attn: MultiHeadAttention, cache) -> tuple[list[CacheRole], Callable[[], None]] | None:
    """The cache roles of a whole-block step over ``cache`` (``native_block_step``) and what counts
    the new token once the call succeeds, or None where the step takes two calls: a cache that is
    not rows (or int8 / int4 codes and a full-precision window) in the buffers its storage makes,
    and the first token (its attention is the prefill's kernel; a hybrid cache's too until its
    sinks are full, whose rows go elsewhere). The segments are those ``attend_rows`` reads, as spans."""
    if cache.seq_len < 1:
        return None
    buffer = GrowableBuffer if cache.storage.bits is None else QuantizedBuffer
    if type(cache) is KVCache and type(attn) in KINDS:
        if cache.keep is not None or type(cache.k) is not buffer or type(cache.v) is not buffer:
            return None
        role = _role(tuple(range(attn.n_kv_heads)), cache.k, cache.v)
        if role is None:
            return None

        def commit() -> None:
            cache.k.commit(1)
            cache.v.commit(1)
            cache.seq_len += 1
        return [role], commit
    if type(cache) is not HybridCache or type(attn) is not HybridAttention or cache.seq_len < cache.sink_len:
        return None
    if any(type(b) is not buffer for b in (cache.full_k, cache.full_v, cache.recent_k, cache.recent_v)) \
            or type(cache.sink_k) is not GrowableBuffer or type(cache.sink_v) is not GrowableBuffer:
        return None
    roles = []
    if attn.full_heads:
        roles.append(_role(tuple(attn.full_heads), cache.full_k, cache.full_v))
    if attn.streaming_heads:  # the sinks and the window as the module path reads them (stored_segments, as spans), then the new token's rows
        roles.append(_role(tuple(attn.streaming_heads), cache.recent_k, cache.recent_v, cache.stored_spans))
    if None in roles:
        return None

    def commit() -> None:
        if attn.full_heads:
            cache.full_k.commit(1)
            cache.full_v.commit(1)
        if attn.streaming_heads:  # as StreamingCache.add stores the token after the attention read the window
            for rows in (cache.recent_k, cache.recent_v):
                rows.commit(1)
                rows.keep_last(cache.window - 1)
        cache.seq_len += 1
    return roles, commit


def _role(heads: tuple[int, ...], keys, values, before: Callable[[], list] | None = None) -> CacheRole | None:
    """A role whose new rows go at the end of ``keys`` / ``values`` (``GrowableBuffer`` or
    ``QuantizedBuffer``: room reserved, not yet counted). Without ``before``, its attention reads
    the buffers as a store of the new rows leaves them (quantized rows first: the rows the new one
    pushes out of the window are quantized now), the live rows with the new one as one segment;
    with it, the segments ``before()`` gives (spans, read after the reserve, which may move the
    storage) and then the new rows as a segment of their own, stored after the call. None when the
    two buffers' rows are not in step, or a new row would be quantized at once."""
    if before is None and isinstance(keys, QuantizedBuffer) and not (keys.quantize_ahead() and values.quantize_ahead()):
        return None
    k_storage, first, row = keys.reserve(1)
    v_storage, v_first, v_row = values.reserve(1)
    if (v_first, v_row) != (first, row) or k_storage.stride(3) != 1 or v_storage.stride(3) != 1:
        return None
    new_keys, new_values = keys.span(row, 1), values.span(row, 1)
    if before is not None:
        return CacheRole(heads, new_keys, new_values, [*before(), (new_keys, new_values)])
    segments = [(keys.span(first, row + 1 - first), values.span(first, row + 1 - first))]
    if isinstance(keys, QuantizedBuffer) and keys.quantized_len():
        segments.insert(0, (keys.spans()[0], values.spans()[0]))
    return CacheRole(heads, new_keys, new_values, segments)


def _two_calls(plan: StepPlan, attn: MultiHeadAttention, x: torch.Tensor, cache, rotation: torch.Tensor, library) -> torch.Tensor:
    """The block around ``attn.attend_rows``: one native call before it, one after (the views between
    them are the module path's, so the attention sees the tensors it would see there). A failure
    leaves the cache as it was, as ``Attention.forward`` does."""
    shape = plan.shape
    qkv = native_block_input(x, plan.weights, shape, rotation, library)
    q_width, kv_width = shape.n_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    q, k, v = qkv.split_with_sizes((q_width, kv_width, kv_width), -1)
    q = q.view(1, 1, shape.n_heads, shape.head_dim).transpose(1, 2)
    k = k.view(1, 1, shape.kv_heads, shape.head_dim).transpose(1, 2)
    v = v.view(1, 1, shape.kv_heads, shape.head_dim).transpose(1, 2)
    mark = cache.mark()
    try:
        out = attn.attend_rows(q, k, v, cache)
        return native_block_output(x, out.transpose(1, 2).reshape(1, 1, q_width), plan.weights, shape, library)
    except BaseException:
        cache.rollback(mark)
        raise


def _latent_two_calls(plan: StepPlan, attn: MultiHeadLatentAttention, x: torch.Tensor, cache, rotation: torch.Tensor, library) -> torch.Tensor:
    """An MLA block around its absorbed attention: one native call for the norm, q, the cache row
    and RoPE, the module path's own cache append and attention (``_attend``) on views of them, one
    native call for Wo, the residual and the SwiGLU half. A failure leaves the cache as it was."""
    shape = plan.shape
    q_width = shape.n_heads * shape.qk_dim
    q_and_row = native_latent_input(x, plan.weights, shape, rotation, library)
    q = q_and_row[..., :q_width].view(1, 1, shape.n_heads, shape.qk_dim).transpose(1, 2)
    row = q_and_row[..., q_width:].view(1, 1, 1, shape.row_width).transpose(1, 2)
    mark = cache.mark()
    try:
        out = attn._attend(q, cache.extend(row))
        return native_block_output(x, out.transpose(1, 2).reshape(1, 1, shape.n_heads * attn.v_head_dim), plan.weights, shape, library)
    except BaseException:
        cache.rollback(mark)
        raise
