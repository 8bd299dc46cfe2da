"""A decoder block's decode step in one native call, where the block allows it.

A decode step of a small model is mostly calls: a SmolLM2 layer's module path makes some ten
kernel calls and tens of torch operations, about 300 us a layer in Python and dispatch on the
development machine. ``block_step`` runs the whole block for one token through
``slimkv.ops.native_block.native_block_step`` (csrc/decode_block.h) instead, when the block is the
plain pre-norm GQA/MHA/MQA block with a SwiGLU MLP (no biases, no query/key norms, no window,
RoPE on some channels) over a full-precision cache holding at least one token, in float32 or
bfloat16 on the CPU, with no autograd, no torch dispatch mode (a FLOP counter must see the module
path's operations), no forward hook on any of the block's modules and a backend other than
"reference". Otherwise it returns None and ``Block.forward`` takes the module path,
which is the reference: the one-call step computes every value as the module path's kernels do
and rounds it where they round, so the two agree to the bit (tests/model/test_block_step.py).
``Block.one_call_step`` (True by default) lets a test or benchmark run the module path instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.nn.modules import module as nn_module

from slimkv.attention.mha import GQA, MHA, MQA, KVCache
from slimkv.common.buffer import GrowableBuffer
from slimkv.ops.linear import Linear
from slimkv.ops.native import decode_kernel
from slimkv.ops.native_block import BlockShape, BlockWeights, block_fields, native_block_step
from slimkv.ops.norm import RMSNorm

KINDS = (MHA, GQA, MQA)


class StepPlan(NamedTuple):
    """What a block's one-call step keeps between steps: its weights, shape and the entry's fixed fields."""

    weights: BlockWeights
    shape: BlockShape
    fields: tuple[int, ...]
    requires_grad: bool
    modules: tuple[torch.nn.Module, ...]
    children: tuple[tuple[torch.nn.Module, str, torch.nn.Module], ...]
    owners: tuple[torch.nn.Module, ...]


CHILDREN = (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("attn_norm", ()), ("mlp", ("gate_proj", "up_proj", "down_proj")), ("mlp_norm", ()))
OWNERS = ("attn_norm", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""The modules whose ``weight`` the entry reads, in ``BlockWeights``' order."""


def _still_valid(plan: StepPlan) -> bool:
    """Whether the block still has the modules and weights its plan was made from (a weight replaced
    or moved by .to() or load_state_dict, or a module swapped, means a new plan)."""
    return (all(parent._modules.get(name) is child for parent, name, child in plan.children)
            and all(owner._parameters.get("weight") is w and w.data_ptr() == f for owner, w, f in zip(plan.owners, plan.weights, plan.fields)))


def _plan(block) -> StepPlan | None:
    """The block's plan, or None when its modules are not the ones the entry computes."""
    attn, mlp = block.attn, block.mlp
    if type(attn) not in KINDS or attn.window is not None or attn.use_qk_norm or attn.use_bias:
        return None
    if type(block.attn_norm) is not RMSNorm or type(block.mlp_norm) is not RMSNorm or mlp.gate_proj is None:
        return None
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(type(p) is not Linear or p.bias is not None for p in projections) or attn.rotary.rot_dim == 0:
        return None
    owners = tuple(block.get_submodule(name) for name in OWNERS)
    weights = BlockWeights(*(owner.weight for owner in owners))
    dtype = weights[0].dtype
    if any(w.dtype != dtype or w.device.type != "cpu" or not w.is_contiguous() for w in weights):
        return None
    shape = BlockShape(attn.d_model, attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.rotary.rot_dim, mlp.gate_proj.out_features,
                       block.attn_norm.eps, block.mlp_norm.eps, 1.0 / math.sqrt(attn.head_dim))  # decode_attention's default scale
    children = tuple((block, name, block._modules[name]) for name, _ in CHILDREN)
    children += tuple((block._modules[name], sub, block._modules[name]._modules[sub]) for name, subs in CHILDREN for sub in subs)
    return StepPlan(weights, shape, block_fields(weights, shape), any(w.requires_grad for w in weights), tuple(block.modules()), children, owners)


def one_call_blocks(model: torch.nn.Module) -> tuple[int, int]:
    """(blocks whose modules the one-call step computes and that have it switched on, all blocks) of
    ``model``: what a benchmark records beside a decode time, so a reader knows which path ran."""
    blocks = [m for m in model.modules() if hasattr(m, "one_call_step")]  # slimkv.model.modeling.Block (which imports this module)
    return sum(1 for b in blocks if b.one_call_step and _plan(b) is not None), len(blocks)


def _hooked(modules: tuple[torch.nn.Module, ...]) -> bool:
    """Whether a forward hook would see any of these modules' calls (the one-call step makes none)."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def block_step(block, x: torch.Tensor, cache) -> torch.Tensor | None:
    """``block(x, cache)`` for one token in one native call, or None when the call is not one the
    entry takes (the caller then runs the module path). x (1, 1, d_model); ``cache`` the block's
    attention cache, advanced by the token as the module path would advance it."""
    if not block.one_call_step or type(cache) is not KVCache or x.shape[:2] != (1, 1) or cache.keep is not None or cache.storage.bits is not None:
        return None
    if len(cache.k) < 1 or type(cache.k) is not GrowableBuffer or torch._C._len_torch_dispatch_stack() > 0:
        return None  # the first token takes the module path (its attention is the prefill's kernel, not the decode kernel)
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
    k_storage, first, row = cache.k.reserve(1)
    v_storage, v_first, v_row = cache.v.reserve(1)
    if (v_first, v_row) != (first, row) or k_storage.stride(3) != 1 or v_storage.stride(3) != 1:
        return None
    rotation = attn.rotary.rotation(cache.seq_len, 1, x.device, torch.float32)
    out = native_block_step(x, plan.fields, plan.weights, plan.shape, rotation, k_storage, v_storage, first, row, library)
    cache.k.commit(1)
    cache.v.commit(1)
    cache.seq_len += 1
    return out
