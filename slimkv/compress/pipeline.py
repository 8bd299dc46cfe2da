"""Layer-by-layer post-training compression of a transformers causal LM.

One decoder block at a time: capture its inputs' statistics on calibration tokens (float64,
chunked ``addmm``; projections reading the same input - q/k/v, gate/up - share one covariance),
factor, replace the ``nn.Linear``/``Conv1D`` leaves by factored modules, run the block forward to
produce the next block's inputs, free. The next block always sees the *compressed* model's
activations (recorded in the manifest as ``propagation``).

Methods (``METHODS``):
- ``svd``: truncated SVD of each weight (needs no data).
- ``asvd``: SVD of W diag(mean|x|^alpha), unscaled.
- ``rootcov``: local activation-aware RootCov, all of a block's statistics from one pass.
- ``latentllm``: RootCov with identity-block factors, joint QK (Tucker; averaged over RoPE offsets
  for RoPE models unless ``rope_aware_qk=False``) and joint MLP (``joint_mlp``), calibrated
  sequentially inside the block (q/k/v -> o -> gate/up -> down, each stage on the activations of
  the already-compressed stages before it). v and o always use RootCov (the paper's joint VO
  proxy did not help there).

What ``ratio`` means: weights removed from the compressed projections of the blocks
(q, k, v, o, gate, up, down) divided by their original count (biases, norms, embeddings and the LM
head are not counted and stay dense). Every matrix (or jointly factored pair) gets the rank that
fits (1 - ratio) of its own weights: dense factors r (d_in + d_out) <= (1 - ratio) d_in d_out,
identity-block factors r (d_in + d_out) - r^2 <= (1 - ratio) d_in d_out; joint QK and the shared
gate/up factor take the combined budget of their pair. The achieved ratio is therefore at least
the requested one and exceeds it by less than one rank step per matrix.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from slimkv.compress.arch import Architecture, Projection
from slimkv.compress.factored import SharedInputFactor, SplitOutputLinear, build_factored, fill_input_factor, make_input_factor
from slimkv.compress.joint_mlp import UD_DAMPING, SensitivityAccumulator, relu_ud, weighted_shared_factors
from slimkv.compress.joint_qk import RANK_RTOL, RopeAverage, joint_qk
from slimkv.compress.linalg import (
    FactorizationError,
    Factors,
    IdentityBlockFactors,
    Stats,
    StatsAccumulator,
    asvd_factors,
    bias_correction,
    factor_params,
    identity_block,
    rank_for_budget,
    rootcov_factors,
    svd_factors,
)

METHODS = ("svd", "asvd", "rootcov", "latentllm")
PROPAGATION = "compressed: each block is calibrated on the outputs of the already-compressed blocks before it"


@dataclass
class CompressOptions:
    """Everything that decides the result of ``compress_model`` (stored in the manifest)."""

    method: str
    ratio: float
    damping: float = UD_DAMPING  # relative damping (x mean diag C) of the least-squares maps of the ReLU joint MLP
    asvd_alpha: float = 0.5
    qk_iterations: int = 8
    mlp_iterations: int = 4
    joint_qk: bool = True  # latentllm components (ablations switch them off)
    rope_aware_qk: bool = True  # average the joint QK objective over RoPE offsets (models with RoPE)
    joint_mlp: bool = True
    identity_block: bool = True
    full_rank: bool = False  # keep every matrix at full rank: a check of the machinery

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not (isinstance(self.ratio, int | float) and 0.0 <= self.ratio < 1.0):
            raise ValueError(f"ratio must be in [0, 1); got {self.ratio!r}")
        if not self.damping >= 0:
            raise ValueError(f"damping must be >= 0; got {self.damping!r}")
        for name in ("qk_iterations", "mlp_iterations"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)!r}")

    @property
    def latent(self) -> bool:
        return self.method == "latentllm"

    @property
    def uses_identity_block(self) -> bool:
        return self.latent and self.identity_block


class _StopForward(Exception):
    """Raised by a hook once everything a calibration pass needs has been captured."""


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def _stop(*_args, **_kwargs) -> None:
    raise _StopForward


@torch.no_grad()
def capture_block_inputs(model: nn.Module, arch: Architecture, calib_ids: torch.Tensor) -> list[tuple[torch.Tensor, tuple, dict]]:
    """(hidden (1, T, d), extra positional args, keyword args) the first block receives, per sequence."""
    first = arch.blocks()[0]
    captured: list[tuple[torch.Tensor, tuple, dict]] = []

    def grab(_module, args, kwargs):
        captured.append((args[0], tuple(args[1:]), dict(kwargs)))
        raise _StopForward

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        for row in calib_ids:
            try:
                model(row[None].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return captured


@torch.no_grad()
def run_block(block: nn.Module, inputs: list[tuple[torch.Tensor, tuple, dict]],
              hooks: list[tuple[nn.Module, Callable[[torch.Tensor], None]]] = (), stop_at: nn.Module | None = None) -> list[tuple[torch.Tensor, tuple, dict]] | None:
    """Run ``block`` on every captured input, calling ``hooks`` on the inputs of their modules.

    With ``stop_at`` the pass ends at that module's input (after its hooks) and returns None;
    otherwise it returns the outputs in the same (hidden, args, kwargs) form.
    """
    handles = [module.register_forward_pre_hook(lambda m, a, k, fn=fn: fn(_first_tensor(a, k)), with_kwargs=True) for module, fn in hooks]
    if stop_at is not None:
        handles.append(stop_at.register_forward_pre_hook(_stop))
    outputs = []
    try:
        for hidden, args, kwargs in inputs:
            try:
                out = block(hidden, *args, **kwargs)
            except _StopForward:
                continue
            outputs.append((out[0] if isinstance(out, tuple) else out, args, kwargs))
    finally:
        for handle in handles:
            handle.remove()
    return None if stop_at is not None else outputs


@dataclass
class _Planned:
    """One projection's new factors, before its leaf is rebuilt."""

    proj: Projection
    factors: Factors | IdentityBlockFactors
    bias: torch.Tensor | None
    how: str  # svd, asvd, rootcov, joint_qk, joint_mlp_shared, joint_mlp_weighted, relu_ud
    info: dict = field(default_factory=dict)
    shared: str | None = None  # key of a shared input factor (gate/up)


class BlockCompressor:
    """Compresses one decoder block in place and describes what it did (manifest entries)."""

    def __init__(self, arch: Architecture, block: nn.Module, index: int, options: CompressOptions, inputs):
        self.arch, self.block, self.index, self.options, self.inputs = arch, block, index, options, inputs
        self.layout = arch.layout
        self.original = {p.name: (arch.weight(block, p), arch.bias(block, p)) for p in self.layout.projections()}
        for name, (W, b) in self.original.items():
            if not bool(torch.isfinite(W).all()) or (b is not None and not bool(torch.isfinite(b).all())):
                raise FactorizationError(f"{self._path(name)}: the weights of this projection are not finite (NaN/inf) before compression")
        param = next(block.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.planned: dict[str, _Planned] = {}
        self.entries: list[dict] = []

    # -- budgets -------------------------------------------------------------------------------

    def _keep(self, name: str) -> float:
        W = self.original[name][0]
        return (1.0 - self.options.ratio) * W.numel()

    def _rank(self, name: str, identity: bool, keep: float | None = None, d_out: int | None = None) -> int:
        W = self.original[name][0]
        d_out = W.shape[0] if d_out is None else d_out
        if self.options.full_rank:
            return min(W.shape[1], d_out)
        rank = rank_for_budget(W.shape[1], d_out, self._keep(name) if keep is None else keep, identity)
        if rank < 1:
            raise ValueError(f"ratio {self.options.ratio} leaves no rank for {self._path(name)} ({d_out}x{W.shape[1]})")
        return rank

    def _path(self, name: str) -> str:
        return f"{self.arch.block_prefix(self.index)}.{self.layout.get(name).path}"

    # -- statistics ----------------------------------------------------------------------------

    def _leaf(self, name: str) -> nn.Module:
        return self.arch.leaf(self.block, self.layout.get(name))

    def _group_leaf(self, name: str) -> tuple[str, nn.Module]:
        """(input group, the leaf whose input is that group's input) of projection ``name``."""
        layout = self.layout
        for group, projs in (("attn_in", layout.attn_in), ("attn_out", (layout.attn_out,)), ("mlp_in", layout.mlp_in), ("mlp_out", (layout.mlp_out,))):
            if any(p.name == name for p in projs):
                return group, self.arch.leaf(self.block, projs[0])
        raise KeyError(name)

    def _accumulator(self, names: list[str]) -> StatsAccumulator:
        """What the method needs of the statistics of one input read by ``names``: ASVD only E|x|
        (and the mean); RootCov the covariance, or just W C W^T when the input is read by a
        single projection with d_out < d_in (the MLP down projection: a 576 x 576 instead of a
        1536 x 1536 accumulation for SmolLM2)."""
        W = self.original[names[0]][0]
        if self.options.method == "asvd":
            return StatsAccumulator(W.shape[1], self.device, cov=False, mean_abs=True)
        if len(names) == 1 and W.shape[0] < W.shape[1]:
            return StatsAccumulator(W.shape[1], self.device, cov=False, mean_abs=False, out_weight=W)
        return StatsAccumulator(W.shape[1], self.device, mean_abs=False)

    def _collect(self, names: list[str], stop: str | None) -> dict[str, Stats]:
        """Stats of the inputs of ``names``: one float64 accumulator per input group (q/k/v share one)."""
        groups: dict[str, list[str]] = {}
        leaves: dict[str, nn.Module] = {}
        for name in names:
            group, leaves[group] = self._group_leaf(name)
            groups.setdefault(group, []).append(name)
        accumulators = {group: self._accumulator(members) for group, members in groups.items()}
        run_block(self.block, self.inputs, [(leaves[group], acc.add) for group, acc in accumulators.items()], stop_at=self._leaf(stop) if stop else None)
        finished = {group: acc.finish(f"{self.arch.block_prefix(self.index)} {group} activations") for group, acc in accumulators.items()}
        return {name: finished[group] for group, members in groups.items() for name in members}

    # -- factor helpers ------------------------------------------------------------------------

    def _has_bias(self, *names: str) -> bool:
        return any(self.original[n][1] is not None for n in names)

    def _finish(self, name: str, factors: Factors, how: str, stats: Stats | None, info: dict | None = None) -> None:
        """Bias correction, identity block, and plan the leaf."""
        W, b = self.original[name]
        if b is not None and stats is not None:
            b = bias_correction(W, factors.product(), b, stats.mean)
        self.planned[name] = _Planned(self.layout.get(name), self._maybe_identity(factors, name), b, how, dict(info or {}))

    def _maybe_identity(self, factors: Factors, name: str) -> Factors | IdentityBlockFactors:
        if not self.options.uses_identity_block:
            return factors
        return identity_block(factors, name=f"{self._path(name)} identity block")

    def _local(self, name: str, stats: Stats | None) -> None:
        """The per-matrix method: svd, asvd or rootcov (rootcov also inside latentllm)."""
        W = self.original[name][0]
        method = "rootcov" if self.options.latent else self.options.method
        rank = self._rank(name, self.options.uses_identity_block)
        label = f"{self._path(name)} ({method})"
        try:
            if method == "svd":
                factors = svd_factors(W, rank)
            elif method == "asvd":
                factors = asvd_factors(W, stats.mean_abs, rank, self.options.asvd_alpha)
            else:
                centered = self._has_bias(name)
                if W.shape[0] > W.shape[1]:  # the d_out > d_in path needs a root of C (shared by the group)
                    factors = rootcov_factors(W, None, rank, root=stats.root(centered), name=label)
                else:
                    factors = rootcov_factors(W, None, rank, gram=stats.weighted_gram(W, centered), name=label)
        except FactorizationError as err:
            raise FactorizationError(f"{label}: {err}") from err
        info = {"statistics": "centered" if self._has_bias(name) else "uncentered"} if method == "rootcov" else {}
        self._finish(name, factors, method, stats, info)

    # -- stages --------------------------------------------------------------------------------

    def run(self) -> list[dict]:
        names = [p.name for p in self.layout.projections()]
        if self.options.method == "svd":
            for name in names:
                self._local(name, None)
            self._install(names)
        elif not self.options.latent:
            stats = self._collect(names, stop=self.layout.mlp_out.name)
            for name in names:
                self._local(name, stats[name])
            self._install(names)
        else:
            self._latent_attention()
            self._latent_mlp()
        return self.entries

    def _latent_attention(self) -> None:
        layout = self.layout
        qkv = [p.name for p in layout.attn_in]
        stats = self._collect(qkv, stop=qkv[0])[qkv[0]]
        if self.options.joint_qk:
            self._joint_qk(stats)
        else:
            self._local("q", stats)
            self._local("k", stats)
        self._local("v", stats)
        self._install(qkv)
        o = layout.attn_out.name
        self._local(o, self._collect([o], stop=o)[o])
        self._install([o])

    def _joint_qk(self, stats: Stats) -> None:
        (Wq, bq), (Wk, bk) = self.original["q"], self.original["k"]
        identity = self.options.uses_identity_block
        layout = self.layout
        if self.options.full_rank:
            rank_q, rank_k = min(Wq.shape), min(Wk.shape)
        else:
            rank_q, rank_k = spend_leftover([self._rank("q", identity), self._rank("k", identity)], [Wq.shape, Wk.shape],
                                            self._keep("q") + self._keep("k"), identity)
        centered = bq is not None or bk is not None
        cov = stats.centered() if centered else stats.cov
        label = f"{self._path('q')} + {self._path('k')} (joint QK)"
        inv_freq = self.arch.rope_inv_freq() if self.options.rope_aware_qk else None
        seq_len = self.inputs[0][0].shape[1]
        rope = RopeAverage(inv_freq, seq_len) if inv_freq is not None else None
        try:
            result = joint_qk(Wq, Wk, cov, layout.num_heads, layout.num_kv_heads, rank_q, rank_k, self.options.qk_iterations, rope=rope)
        except FactorizationError as err:
            raise FactorizationError(f"{label}: {err}") from err
        info = {"objective": result.objective, "numerical_ranks": list(result.numerical_ranks), "statistics": "centered" if centered else "uncentered",
                "combined_budget": True, "damping": {"pseudo_inverse_rtol": RANK_RTOL},
                "rope": f"aware (offsets 0..{seq_len - 1}, pair-count weights)" if rope is not None else ("blind" if self.arch.rope_inv_freq() is not None else "none")}
        self._finish("q", result.q, "joint_qk", stats, info)
        self._finish("k", result.k, "joint_qk", stats, info)

    def _latent_mlp(self) -> None:
        """MLP stages: capture the MLP input once (attention already compressed), factor the input
        projections (jointly or not), then down on its actual, compressed-upstream input."""
        layout = self.layout
        ins = [p.name for p in layout.mlp_in]
        down = layout.mlp_out.name
        act = self.arch.activation(self.block, layout)
        mlp_inputs: list[torch.Tensor] = []
        run_block(self.block, self.inputs, [(self._leaf(ins[0]), mlp_inputs.append)], stop_at=self._leaf(ins[0]))
        if self.options.joint_mlp and not layout.gated and isinstance(act, nn.ReLU):
            self._relu_ud(mlp_inputs)
            self._install([*ins, down])
            return
        stats_acc = StatsAccumulator(mlp_inputs[0].shape[-1], self.device, mean_abs=False)
        for x in mlp_inputs:
            stats_acc.add(x)
        stats = stats_acc.finish(f"{self.arch.block_prefix(self.index)} mlp_in activations")
        if self.options.joint_mlp:
            self._weighted_inputs(act, mlp_inputs, stats)
        else:
            for name in ins:
                self._local(name, stats)
        self._install(ins)
        self._local(down, self._down_stats(mlp_inputs))
        self._install([down])

    def _down_stats(self, mlp_inputs: list[torch.Tensor]) -> Stats:
        """Stats of down's input with gate/up compressed: from the stored MLP inputs through the MLP
        submodule alone when the family has one, else through the whole block again."""
        down_leaf = self._leaf(self.layout.mlp_out.name)
        acc = self._accumulator([self.layout.mlp_out.name])
        if self.layout.mlp_path is not None:
            run_block(self.block.get_submodule(self.layout.mlp_path), [(x, (), {}) for x in mlp_inputs], [(down_leaf, acc.add)], stop_at=down_leaf)
        else:
            run_block(self.block, self.inputs, [(down_leaf, acc.add)], stop_at=down_leaf)
        return acc.finish(f"{self._path(self.layout.mlp_out.name)} input activations")

    def _mlp_pre(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Original pre-activations [gate, up] (gated) or [up] of MLP input x, in the model's dtype
        (as the uncompressed block computes them; statistics are accumulated in float64 after)."""
        out = []
        for proj in self.layout.mlp_in:
            W, b = self.original[proj.name]
            out.append(torch.nn.functional.linear(x, W.to(x.dtype), None if b is None else b.to(x.dtype)))
        return out

    def _weighted_inputs(self, act: nn.Module, mlp_inputs: list[torch.Tensor], stats: Stats) -> None:
        """Gated: one shared, sensitivity-weighted input factor for gate and up. Plain: weighted up."""
        layout = self.layout
        ins = [p.name for p in layout.mlp_in]
        mats = [self.original[n][0] for n in ins]
        sens = SensitivityAccumulator(mats[0].shape[0], layout.gated, self.device)
        for x in mlp_inputs:
            pre = self._mlp_pre(x)
            sens.add(act, pre[0], pre[1] if layout.gated else None)
        weights = sens.row_weights(self.original[layout.mlp_out.name][0])
        identity = self.options.uses_identity_block
        d_in, stacked_out = mats[0].shape[1], sum(W.shape[0] for W in mats)
        rank = min(d_in, stacked_out) if self.options.full_rank else self._rank(ins[0], identity, keep=sum(self._keep(n) for n in ins), d_out=stacked_out)
        centered = self._has_bias(*ins)
        cov = stats.centered() if centered else stats.cov
        label = f"{self.arch.block_prefix(self.index)} MLP input (joint, {'shared gate/up' if layout.gated else 'weighted'})"
        try:
            stacked, rows = weighted_shared_factors(mats, weights, cov, rank)
            shared_factors = self._maybe_identity(stacked, ins[0])
        except FactorizationError as err:
            raise FactorizationError(f"{label}: {err}") from err
        key = "+".join(self._path(n) for n in ins) if len(ins) > 1 else None
        info = {"statistics": "centered" if centered else "uncentered",
                "row_weights": "first-order sensitivity of the gated product" if layout.gated else "activation derivative", "combined_budget": key is not None}
        start = 0
        for name, count in zip(ins, rows):
            part = _slice_rows(shared_factors, start, start + count)
            start += count
            W, b = self.original[name]
            if b is not None:
                b = bias_correction(W, part.product(), b, stats.mean)
            self.planned[name] = _Planned(self.layout.get(name), part, b, "joint_mlp_shared" if key else "joint_mlp_weighted", dict(info), shared=key)

    def _relu_ud(self, mlp_inputs: list[torch.Tensor]) -> None:
        """The paper's ReLU alternation (needs the MLP inputs themselves, not only their covariance)."""
        up_name = self.layout.mlp_in[0].name
        down = self.layout.mlp_out.name
        X = torch.cat([x.reshape(-1, x.shape[-1]).double() for x in mlp_inputs])
        identity = self.options.uses_identity_block
        W_u, b_u = self.original[up_name]
        W_d = self.original[down][0]
        label = f"{self._path(up_name)} + {self._path(down)} (joint MLP, ReLU alternation)"
        try:
            result = relu_ud(X, W_u, b_u, W_d, self._rank(up_name, identity), self._rank(down, identity), self.options.mlp_iterations, self.options.damping)
        except FactorizationError as err:
            raise FactorizationError(f"{label}: {err}") from err
        info = {"objective": result.objective, "penalties": {"alpha": 1.0, "beta": 1.0, "gamma": 1.0},
                "damping": {"relative": self.options.damping, "lambda": result.damping}}
        self._finish(up_name, result.up, "relu_ud", None, info)
        self._finish(down, result.down, "relu_ud", None, info)

    # -- installation --------------------------------------------------------------------------

    def _install(self, names: list[str]) -> None:
        """Rebuild the leaves of ``names`` from their planned factors and describe them."""
        shared_modules: dict[str, SharedInputFactor] = {}
        for path, projs in self.arch.leaf_groups().items():
            if not any(p.name in names for p in projs):
                continue
            parts, described = [], []
            for proj in projs:
                plan = self.planned.pop(proj.name)
                shared = None
                owner = False
                if plan.shared is not None:
                    if plan.shared not in shared_modules:
                        identity = isinstance(plan.factors, IdentityBlockFactors)
                        d_in = plan.factors.perm.numel() if identity else plan.factors.A.shape[1]
                        factor = make_input_factor(d_in, plan.factors.rank, identity).to(dtype=self.dtype, device=self.device)
                        with torch.no_grad():
                            fill_input_factor(factor, plan.factors)
                        shared_modules[plan.shared] = SharedInputFactor(factor)
                        owner = True
                    shared = shared_modules[plan.shared]
                module = build_factored(plan.factors, plan.bias, self.dtype, self.device, shared=shared)
                parts.append(module)
                described.append(self._describe(plan, module, owner or shared is None))
            full_path = f"{self.arch.block_prefix(self.index)}.{path}"
            if len(parts) == 1:
                self.arch.set_leaf(self.block, path, parts[0])
                self.entries.append({"module": full_path, **described[0]})
            else:
                self.arch.set_leaf(self.block, path, SplitOutputLinear(parts))
                self.entries.append({"module": full_path, "kind": "split", "parts": described})

    def _describe(self, plan: _Planned, module: nn.Module, counts_input: bool) -> dict:
        W = self.original[plan.proj.name][0]
        identity = isinstance(plan.factors, IdentityBlockFactors)
        entry = {
            "kind": "factored",
            "projection": plan.proj.name,
            "how": plan.how,
            "in_features": W.shape[1],
            "out_features": W.shape[0],
            "rank": plan.factors.rank,
            "identity_block": identity,
            "bias": plan.bias is not None,
            "shared_input": plan.shared,
            "owns_input_factor": counts_input,
            "params_before": W.numel(),
            "params_after": module.num_weights(count_input=counts_input),
            "permutation": plan.factors.perm.tolist() if identity else None,
            "pivot_ratio": plan.factors.pivot_ratio if identity else None,
            "damping": None,
        }
        entry.update(plan.info)
        return entry


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


def _slice_rows(factors: Factors | IdentityBlockFactors, start: int, stop: int) -> Factors | IdentityBlockFactors:
    """The rows start:stop of a stacked factorization (same input factor)."""
    if isinstance(factors, IdentityBlockFactors):
        return IdentityBlockFactors(B=factors.B[start:stop], perm=factors.perm, A_rest=factors.A_rest, pivot_ratio=factors.pivot_ratio)
    return Factors(B=factors.B[start:stop], A=factors.A)


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
    arch = Architecture(model)
    model.eval()
    needs_data = options.method != "svd"
    if needs_data and (calib_ids is None or calib_ids.ndim != 2 or calib_ids.numel() == 0):
        raise ValueError(f"method {options.method!r} needs calibration token ids of shape (sequences, seq_len)")
    t0 = time.perf_counter()
    inputs = capture_block_inputs(model, arch, calib_ids) if needs_data else []
    blocks = arch.blocks()
    modules: list[dict] = []
    bar = tqdm(range(len(blocks)), desc=f"{options.method} ratio {options.ratio}", unit="layer", disable=not progress)
    for index in bar:
        block = blocks[index]
        modules += BlockCompressor(arch, block, index, options, inputs).run()
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
        "within_block": "sequential (q/k/v, then o, then the MLP input, then down, each on the activations of the stages already compressed)" if options.latent else ("one pass on the block's inputs" if needs_data else "none"),
        "seconds": time.perf_counter() - t0,
        "modules": modules,
    }


def rank_step_slack(modules: list[dict]) -> float:
    """How much one more rank on every matrix would change the achieved ratio (the test tolerance)."""
    before = sum(e["params_before"] for e in iter_leaf_entries(modules))
    step = sum(e["in_features"] + e["out_features"] for e in iter_leaf_entries(modules))
    return step / before if before else math.inf
