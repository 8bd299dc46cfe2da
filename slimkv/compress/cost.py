"""What a (compressed) model costs: parameters, analytic FLOPs per token, measured prefill latency;
and what one factorization costs (``factor_params``) and the rank a budget allows (``rank_for_budget``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from slimkv.common.timing import time_fn
from slimkv.compress.arch import Architecture
from slimkv.compress.factored import DenseInputFactor, FactoredLinear, IdentityBlockInputFactor, SharedInputFactor


def unique_parameters(model: nn.Module) -> int:
    """Parameters of the model, each shared tensor (tied embeddings, shared factors) counted once."""
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


def _input_factor_flops(factor: nn.Module) -> int:
    if isinstance(factor, DenseInputFactor):
        return 2 * factor.rank * factor.in_features
    if isinstance(factor, IdentityBlockInputFactor):
        # r (d - r) multiply-adds, plus r additions of the identity part
        return 2 * factor.rank * (factor.in_features - factor.rank) + factor.rank
    raise TypeError(f"unknown input factor {type(factor).__name__}")


def linear_flops_per_token(model: nn.Module) -> int:
    """FLOPs (2 per multiply-add) of every linear map for one token: dense leaves, factored leaves
    (a shared input factor counted once), GPT-2 Conv1D, and the LM head."""
    from transformers.pytorch_utils import Conv1D

    total = 0
    counted_shared: set[int] = set()
    for module in model.modules():
        if isinstance(module, FactoredLinear):
            total += 2 * module.out_features * module.rank
            factor = module.input_factor
            if isinstance(factor, SharedInputFactor):
                if id(factor) in counted_shared:
                    continue
                counted_shared.add(id(factor))
                factor = factor.factor
            total += _input_factor_flops(factor)
        elif isinstance(module, nn.Linear):
            total += 2 * module.in_features * module.out_features
        elif isinstance(module, Conv1D):
            total += 2 * module.nx * module.nf
    return total


def attention_flops_per_token(model: nn.Module, context: float) -> float:
    """Score and value products (2 x 2 x heads x head_dim x context per layer) at ``context`` keys."""
    arch = Architecture(model)
    layout = arch.layout
    return 4.0 * layout.num_heads * layout.head_dim * context * len(arch.blocks())


def cost_summary(model: nn.Module, prefill_len: int) -> dict[str, Any]:
    """Parameters and analytic FLOPs per token of a prefill of ``prefill_len`` tokens (mean context
    (L + 1) / 2; norms, activations and softmax are not counted)."""
    linear = linear_flops_per_token(model)
    attention = attention_flops_per_token(model, (prefill_len + 1) / 2)
    return {
        "parameters": unique_parameters(model),
        "linear_flops_per_token": linear,
        "attention_flops_per_token": attention,
        "flops_per_token": linear + attention,
        "flops_prefill_len": prefill_len,
    }


@torch.no_grad()
def prefill_latency(model: nn.Module, prefill_len: int, *, repeats: int = 7, warmup: int = 2, seed: int = 0) -> dict[str, Any]:
    """Median wall time of one prefill forward (batch 1, ``prefill_len`` random tokens, logits of
    the last position only, no KV cache kept)."""
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, prefill_len), generator=torch.Generator().manual_seed(seed)).to(device)
    stats = time_fn(lambda: model(ids, use_cache=False, logits_to_keep=1), warmup=warmup, repeats=repeats, device=device)
    stats["prefill_len"] = prefill_len
    stats["tokens_per_s"] = prefill_len / stats["median_s"]
    return stats


def factor_params(d_in: int, d_out: int, rank: int, identity: bool) -> int:
    """Stored weights of a rank-``rank`` factorization: r(d_in + d_out), minus r^2 with an identity block."""
    return rank * (d_in + d_out) - (rank * rank if identity else 0)


def rank_for_budget(d_in: int, d_out: int, keep_params: float, identity: bool) -> int:
    """Largest rank whose factors fit ``keep_params`` weights (at most min(d_in, d_out); >= 0)."""
    full = min(d_in, d_out)
    if identity:
        # r(d_in + d_out) - r^2 <= keep  <=>  r <= smaller root of r^2 - (d_in + d_out) r + keep = 0
        s = d_in + d_out
        disc = s * s - 4.0 * keep_params
        rank = full if disc <= 0 else math.floor((s - math.sqrt(disc)) / 2 + 1e-9)
    else:
        rank = math.floor(keep_params / (d_in + d_out) + 1e-9)
    rank = max(0, min(full, rank))
    while rank > 0 and factor_params(d_in, d_out, rank, identity) > keep_params:
        rank -= 1
    return rank
