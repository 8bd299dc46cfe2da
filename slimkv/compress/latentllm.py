"""LatentLLM's stages for one block (docs/compression.md): RootCov with identity-block factors,
joint QK (Tucker; averaged over RoPE offsets for RoPE models unless ``rope_aware_qk=False``) and
joint MLP (``joint_mlp``), calibrated sequentially inside the block: q/k/v -> o -> gate/up ->
down, each stage on the activations of the already-compressed stages before it. v and o always
use RootCov (the paper's joint VO proxy did not help there). ``latentllm`` in
``slimkv.compress.methods`` chains them."""

from __future__ import annotations

import torch
from torch import nn

from slimkv.compress.block import BlockContext, run_block
from slimkv.compress.cost import factor_params
from slimkv.compress.joint_mlp import SensitivityAccumulator, relu_ud, weighted_shared_factors
from slimkv.compress.joint_qk import RANK_RTOL, RopeAverage, joint_qk
from slimkv.compress.linalg import (
    FactorizationError,
    Factors,
    IdentityBlockFactors,
    Stats,
    StatsAccumulator,
)

# The joint MLP's channel weights are averages over tokens: the first few calibration sequences
# estimate them well, at a fraction of the cost of recomputing every sequence's pre-activations.
SENSITIVITY_SEQUENCES = 4
# Sequences on which the joint MLP is compared with separate factors (``mlp_output_errors``).
CHECK_SEQUENCES = 2


def attention_stage(ctx: BlockContext) -> None:
    """q/k/v on the block input (q and k jointly unless ablated), then o on its compressed-upstream input."""
    identity = ctx.options.identity_block
    qkv = [p.name for p in ctx.layout.attn_in]
    stats = ctx.collect(qkv, stop=qkv[0])[qkv[0]]
    if ctx.options.joint_qk:
        joint_qk_stage(ctx, stats)
    else:
        ctx.factor_local("q", "rootcov", stats, identity=identity)
        ctx.factor_local("k", "rootcov", stats, identity=identity)
    ctx.factor_local("v", "rootcov", stats, identity=identity)
    ctx.install(qkv)
    o = ctx.layout.attn_out.name
    ctx.factor_local(o, "rootcov", ctx.collect([o], stop=o)[o], identity=identity)
    ctx.install([o])


def joint_qk_stage(ctx: BlockContext, stats: Stats) -> None:
    """Plan q and k jointly (one combined budget, the leftover spent rank by rank)."""
    (_, bq), (_, bk) = ctx.original["q"], ctx.original["k"]
    Wq, Wk = ctx.target_weight("q", stats), ctx.target_weight("k", stats)
    identity = ctx.options.identity_block
    layout = ctx.layout
    if ctx.options.full_rank:
        rank_q, rank_k = min(Wq.shape), min(Wk.shape)
    else:
        rank_q, rank_k = spend_leftover([ctx.rank("q", identity), ctx.rank("k", identity)], [Wq.shape, Wk.shape], ctx.keep("q") + ctx.keep("k"), identity)
    centered = bq is not None or bk is not None
    cov = stats.centered() if centered else stats.cov
    label = f"{ctx.path('q')} + {ctx.path('k')} (joint QK)"
    inv_freq = ctx.arch.rope_inv_freq() if ctx.options.rope_aware_qk else None
    seq_len = ctx.inputs[0][0].shape[1]
    rope = RopeAverage(inv_freq, seq_len) if inv_freq is not None else None
    try:
        result = joint_qk(Wq, Wk, cov, layout.num_heads, layout.num_kv_heads, rank_q, rank_k, ctx.options.qk_iterations, rope=rope)
    except FactorizationError as err:
        raise FactorizationError(f"{label}: {err}") from err
    info = {"objective": result.objective, "numerical_ranks": list(result.numerical_ranks), "statistics": "centered" if centered else "uncentered",
            "combined_budget": True, "damping": {"pseudo_inverse_rtol": RANK_RTOL},
            "rope": f"aware (offsets 0..{seq_len - 1}, pair-count weights)" if rope is not None else ("blind" if ctx.arch.rope_inv_freq() is not None else "none")}
    ctx.plan("q", result.q, "joint_qk", stats, info, identity=identity)
    ctx.plan("k", result.k, "joint_qk", stats, info, identity=identity)


def mlp_stage(ctx: BlockContext) -> None:
    """Capture the MLP input once (attention already compressed), factor the input projections
    (jointly or not), then down on its actual, compressed-upstream input."""
    layout = ctx.layout
    identity = ctx.options.identity_block
    ins = [p.name for p in layout.mlp_in]
    down = layout.mlp_out.name
    act = ctx.arch.activation(ctx.block, layout)
    mlp_inputs: list[torch.Tensor] = []
    run_block(ctx.block, ctx.inputs, [(ctx.leaf(ins[0]), mlp_inputs.append)], stop_at=ctx.leaf(ins[0]))
    if ctx.options.joint_mlp and not layout.gated and isinstance(act, nn.ReLU):
        relu_stage(ctx, mlp_inputs)
        ctx.install([*ins, down])
        return
    stats_acc = StatsAccumulator(mlp_inputs[0].shape[-1], ctx.device, mean_abs=False, cross=ctx.dense is not None)
    add = ctx.feeder(stats_acc, ins[0])
    for x in mlp_inputs:
        add(x)
    stats = ctx.finish(stats_acc, f"{ctx.arch.block_prefix(ctx.index)} mlp_in activations")
    input_projections_stage(ctx, act, mlp_inputs, stats)
    ctx.install(ins)
    ctx.factor_local(down, "rootcov", down_stats(ctx, mlp_inputs), identity=identity)
    ctx.install([down])


def input_projections_stage(ctx: BlockContext, act: nn.Module, mlp_inputs: list[torch.Tensor], stats: Stats) -> None:
    """Plan gate/up (or up): the joint factors, separate RootCov factors, or - with
    ``joint_mlp_check`` - whichever gives the lower MLP output error on calibration windows."""
    ins = [p.name for p in ctx.layout.mlp_in]
    identity = ctx.options.identity_block
    joint = weighted_inputs_stage(ctx, act, mlp_inputs, stats) if ctx.options.joint_mlp else None
    separate = None
    if joint is None or ctx.options.joint_mlp_check:
        separate = {name: ctx.local_factors(name, "rootcov", stats, ctx.rank(name, identity)) for name in ins}
    info = {"statistics": "centered" if ctx.has_bias(*ins) else "uncentered"}
    chosen = "separate" if joint is None else "joint"
    if joint is not None and separate is not None:
        errors = mlp_output_errors(ctx, act, mlp_inputs[:CHECK_SEQUENCES],
                                   {form: {n: f.product() for n, f in parts.items()} for form, parts in (("joint", joint[0]), ("separate", separate))})
        chosen = min(errors, key=errors.get)
        info |= {"mlp_output_error": errors, "chosen": chosen}
    if chosen == "joint":
        parts, joint_info, key = joint
        for name, part in parts.items():
            part = ctx.refit(name, part, stats)
            ctx.plan_factors(name, part, ctx.corrected_bias(name, part, stats), "joint_mlp_shared" if key else "joint_mlp_weighted",
                             joint_info | info, shared=key)
    else:
        for name in ins:
            ctx.plan(name, separate[name], "rootcov", stats, info, identity=identity)


def down_stats(ctx: BlockContext, mlp_inputs: list[torch.Tensor]) -> Stats:
    """Stats of down's input with gate/up compressed: from the stored MLP inputs through the MLP
    submodule alone when the family has one, else through the whole block again."""
    down = ctx.layout.mlp_out.name
    down_leaf = ctx.leaf(down)
    acc = ctx.accumulator([down])
    if ctx.layout.mlp_path is not None:
        run_block(ctx.block.get_submodule(ctx.layout.mlp_path), [(x, (), {}) for x in mlp_inputs], [(down_leaf, ctx.feeder(acc, down))], stop_at=down_leaf)
    else:
        run_block(ctx.block, ctx.inputs, [(down_leaf, ctx.feeder(acc, down))], stop_at=down_leaf)
    return ctx.finish(acc, f"{ctx.path(down)} input activations")


def mlp_pre_activations(ctx: BlockContext, x: torch.Tensor) -> list[torch.Tensor]:
    """Original pre-activations [gate, up] (gated) or [up] of MLP input x, in the model's dtype
    (as the uncompressed block computes them; statistics are accumulated in float64 after)."""
    out = []
    for proj in ctx.layout.mlp_in:
        W, b = ctx.original[proj.name]
        out.append(torch.nn.functional.linear(x, W.to(x.dtype), None if b is None else b.to(x.dtype)))
    return out


@torch.no_grad()
def mlp_output_errors(ctx: BlockContext, act: nn.Module, mlp_inputs: list[torch.Tensor], candidates: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Relative squared error of the MLP output (down still dense) on ``mlp_inputs`` for each
    candidate (a name -> {projection: its replacement weight}): the objective the joint MLP
    approximates. Computed in the activations' dtype (a comparison of candidates, not a statistic
    to keep); the original output is computed once per window."""
    layout = ctx.layout
    dtype = mlp_inputs[0].dtype
    W_down = ctx.original[layout.mlp_out.name][0].to(dtype)
    biases = [None if ctx.original[p.name][1] is None else ctx.original[p.name][1].to(dtype) for p in layout.mlp_in]

    def output(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        pre = [x @ W.T + (0.0 if b is None else b) for W, b in zip(weights, biases)]
        hidden = act(pre[0]) * pre[1] if layout.gated else act(pre[0])
        return hidden @ W_down.T

    errors = dict.fromkeys(candidates, 0.0)
    total = 0.0
    for x in mlp_inputs:
        x = x.reshape(-1, x.shape[-1])
        reference = output(x, [ctx.original[p.name][0].to(dtype) for p in layout.mlp_in])
        total += float((reference**2).sum(dtype=torch.float64))
        for name, products in candidates.items():
            errors[name] += float(((output(x, [products[p.name].to(dtype) for p in layout.mlp_in]) - reference) ** 2).sum(dtype=torch.float64))
    return {name: error / max(total, 1e-300) for name, error in errors.items()}


def weighted_inputs_stage(ctx: BlockContext, act: nn.Module, mlp_inputs: list[torch.Tensor], stats: Stats) -> tuple[dict, dict, str | None]:
    """Gated: one shared, sensitivity-weighted input factor for gate and up. Plain: weighted up.
    Returns (projection -> its rows of the factors, manifest info, shared-factor key or None)."""
    layout = ctx.layout
    ins = [p.name for p in layout.mlp_in]
    mats = [ctx.target_weight(n, stats) for n in ins]
    sens = SensitivityAccumulator(mats[0].shape[0], layout.gated, ctx.device)
    for x in mlp_inputs[:SENSITIVITY_SEQUENCES]:
        pre = mlp_pre_activations(ctx, x)
        sens.add(act, pre[0], pre[1] if layout.gated else None)
    weights = sens.row_weights(ctx.original[layout.mlp_out.name][0])
    identity = ctx.options.identity_block
    d_in, stacked_out = mats[0].shape[1], sum(W.shape[0] for W in mats)
    rank = min(d_in, stacked_out) if ctx.options.full_rank else ctx.rank(ins[0], identity, keep=sum(ctx.keep(n) for n in ins), d_out=stacked_out)
    centered = ctx.has_bias(*ins)
    cov = stats.centered() if centered else stats.cov
    label = f"{ctx.arch.block_prefix(ctx.index)} MLP input (joint, {'shared gate/up' if layout.gated else 'weighted'})"
    try:
        stacked, rows = weighted_shared_factors(mats, weights, cov, rank)
        shared_factors = ctx.maybe_identity(stacked, ins[0], identity)
    except FactorizationError as err:
        raise FactorizationError(f"{label}: {err}") from err
    key = "+".join(ctx.path(n) for n in ins) if len(ins) > 1 else None
    info = {"statistics": "centered" if centered else "uncentered",
            "row_weights": "first-order sensitivity of the gated product" if layout.gated else "activation derivative", "combined_budget": key is not None}
    parts, start = {}, 0
    for name, count in zip(ins, rows):
        parts[name] = slice_rows(shared_factors, start, start + count)
        start += count
    return parts, info, key


def relu_stage(ctx: BlockContext, mlp_inputs: list[torch.Tensor]) -> None:
    """The paper's ReLU alternation (needs the MLP inputs themselves, not only their covariance)."""
    up_name = ctx.layout.mlp_in[0].name
    down = ctx.layout.mlp_out.name
    X = torch.cat([x.reshape(-1, x.shape[-1]).double() for x in mlp_inputs])
    identity = ctx.options.identity_block
    W_u, b_u = ctx.original[up_name]
    W_d = ctx.original[down][0]
    label = f"{ctx.path(up_name)} + {ctx.path(down)} (joint MLP, ReLU alternation)"
    try:
        result = relu_ud(X, W_u, b_u, W_d, ctx.rank(up_name, identity), ctx.rank(down, identity), ctx.options.mlp_iterations, ctx.options.damping)
    except FactorizationError as err:
        raise FactorizationError(f"{label}: {err}") from err
    info = {"objective": result.objective, "penalties": {"alpha": 1.0, "beta": 1.0, "gamma": 1.0},
            "damping": {"relative": ctx.options.damping, "lambda": result.damping}}
    ctx.plan(up_name, result.up, "relu_ud", None, info, identity=identity)
    ctx.plan(down, result.down, "relu_ud", None, info, identity=identity)


def spend_leftover(ranks: list[int], shapes: list[tuple[int, int]], budget: float, identity: bool) -> list[int]:
    """Jointly factored matrices share one budget: starting from each matrix's own rank, raise the
    ranks one step at a time (in order) while the combined weights still fit ``budget``."""
    ranks = list(ranks)
    grown = True
    while grown:
        grown = False
        for i, (d_out, d_in) in enumerate(shapes):
            trial = ranks[:i] + [ranks[i] + 1] + ranks[i + 1:]
            if trial[i] <= min(d_out, d_in) and sum(factor_params(c, o, r, identity) for (o, c), r in zip(shapes, trial)) <= budget:
                ranks, grown = trial, True
    return ranks


def slice_rows(factors: Factors | IdentityBlockFactors, start: int, stop: int) -> Factors | IdentityBlockFactors:
    """The rows start:stop of a stacked factorization (same input factor)."""
    if isinstance(factors, IdentityBlockFactors):
        return IdentityBlockFactors(B=factors.B[start:stop], perm=factors.perm, A_rest=factors.A_rest, pivot_ratio=factors.pivot_ratio)
    return Factors(B=factors.B[start:stop], A=factors.A)
