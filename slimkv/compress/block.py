"""One decoder block under compression: its original weights, budgets, activation statistics,
planned factors and the installation of factored leaves (``BlockContext``), plus running blocks on
captured calibration inputs. A compression method (``slimkv.compress.methods``) is a function of a
``BlockContext``; see ``slimkv.compress.pipeline`` for what the ratio means.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from slimkv.compress.arch import Architecture, Projection
from slimkv.compress.cost import rank_for_budget
from slimkv.compress.factored import SharedInputFactor, SplitOutputLinear, build_factored, fill_input_factor, make_input_factor
from slimkv.compress.linalg import (
    FactorizationError,
    Factors,
    IdentityBlockFactors,
    Stats,
    StatsAccumulator,
    asvd_factors,
    bias_correction,
    identity_block,
    refit_output_factor,
    rootcov_factors,
    svd_factors,
)
from slimkv.compress.options import CompressOptions

LOCAL_METHODS = ("svd", "asvd", "rootcov")
KEEP_DENSE = math.inf  # a budget meaning: leave this projection uncompressed (``BlockContext.stays_dense``)


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


class BlockContext:
    """One decoder block being compressed in place: a method reads its weights and statistics,
    ``plan``s factors for projections and ``install``s them; ``entries`` describes what was done
    (manifest entries)."""

    def __init__(self, arch: Architecture, block: nn.Module, index: int, options: CompressOptions, inputs, budgets: dict[str, float] | None = None,
                 dense: tuple[nn.Module, list] | None = None):
        self.arch, self.block, self.index, self.options, self.inputs = arch, block, index, options, inputs
        self.budgets = budgets or {}  # projection -> weights it may keep, from a non-uniform allocation (default: (1 - ratio) of its own)
        # (an uncompressed copy of the block, the dense model's inputs to it): with it, every projection is fitted to the
        # output the dense model computes (upstream correction, ``Stats.corrected_weight``)
        self.dense = dense
        self._dense_inputs: dict[str, list[torch.Tensor]] | None = None
        self.layout = arch.layout
        self.original = {p.name: (arch.weight(block, p), arch.bias(block, p)) for p in self.layout.projections()}
        for name, (W, b) in self.original.items():
            if not bool(torch.isfinite(W).all()) or (b is not None and not bool(torch.isfinite(b).all())):
                raise FactorizationError(f"{self.path(name)}: the weights of this projection are not finite (NaN/inf) before compression")
        param = next(block.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.planned: dict[str, _Planned] = {}
        self.entries: list[dict] = []

    # -- budgets -------------------------------------------------------------------------------

    def keep(self, name: str) -> float:
        """Weights projection ``name`` may keep: its allocated budget, else (1 - ratio) of its own."""
        W = self.original[name][0]
        if name in self.budgets:
            return float(W.numel()) if self.budgets[name] == KEEP_DENSE else self.budgets[name]
        return (1.0 - self.options.ratio) * W.numel()

    def rank(self, name: str, identity: bool, keep: float | None = None, d_out: int | None = None) -> int:
        """The largest rank whose factors fit ``keep`` weights (default: the projection's own budget)."""
        W = self.original[name][0]
        d_out = W.shape[0] if d_out is None else d_out
        if self.options.full_rank:
            return min(W.shape[1], d_out)
        rank = rank_for_budget(W.shape[1], d_out, self.keep(name) if keep is None else keep, identity)
        if rank < 1:
            raise ValueError(f"ratio {self.options.ratio} leaves no rank for {self.path(name)} ({d_out}x{W.shape[1]})")
        return rank

    def path(self, name: str) -> str:
        return f"{self.arch.block_prefix(self.index)}.{self.layout.get(name).path}"

    # -- statistics ----------------------------------------------------------------------------

    def leaf(self, name: str) -> nn.Module:
        return self.arch.leaf(self.block, self.layout.get(name))

    def input_groups(self) -> dict[str, tuple[Projection, ...]]:
        """The block's four inputs and the projections reading each (q/k/v share one, gate/up one)."""
        layout = self.layout
        return {"attn_in": layout.attn_in, "attn_out": (layout.attn_out,), "mlp_in": layout.mlp_in, "mlp_out": (layout.mlp_out,)}

    def group_leaf(self, name: str) -> tuple[str, nn.Module]:
        """(input group, the leaf whose input is that group's input) of projection ``name``."""
        for group, projs in self.input_groups().items():
            if any(p.name == name for p in projs):
                return group, self.arch.leaf(self.block, projs[0])
        raise KeyError(name)

    def accumulator(self, names: list[str], need: str = "cov") -> StatsAccumulator:
        """What a method needs of the statistics of one input read by ``names``: ``need="mean_abs"``
        (ASVD) only E|x| and the mean; ``"cov"`` (RootCov) the covariance, or just W C W^T when the
        input is read by a single projection with d_out < d_in (the MLP down projection: a
        576 x 576 instead of a 1536 x 1536 accumulation for SmolLM2). With upstream correction the
        full covariance and the cross term with the dense model's input are needed."""
        W = self.original[names[0]][0]
        cross = self.dense is not None
        if need == "mean_abs":
            return StatsAccumulator(W.shape[1], self.device, cov=cross, mean_abs=True, cross=cross)
        if len(names) == 1 and W.shape[0] < W.shape[1] and not cross:
            return StatsAccumulator(W.shape[1], self.device, cov=False, mean_abs=False, out_weight=W)
        return StatsAccumulator(W.shape[1], self.device, mean_abs=False, cross=cross)

    def dense_inputs(self, name: str) -> list[torch.Tensor] | None:
        """The dense model's inputs to projection ``name``, one tensor per calibration sequence (None
        without upstream correction). One pass of the uncompressed block captures all four inputs."""
        if self.dense is None:
            return None
        if self._dense_inputs is None:
            original, inputs = self.dense
            groups = self.input_groups()
            captured: dict[str, list[torch.Tensor]] = {group: [] for group in groups}
            run_block(original, inputs, [(self.arch.leaf(original, projs[0]), captured[group].append) for group, projs in groups.items()])
            self._dense_inputs = captured
        return self._dense_inputs[self.group_leaf(name)[0]]

    def feeder(self, accumulator: StatsAccumulator, name: str) -> Callable[[torch.Tensor], None]:
        """A hook body adding each captured input of projection ``name`` to ``accumulator``, with the
        dense model's input for the same sequence when correcting upstream (calls arrive in sequence order)."""
        dense = self.dense_inputs(name)
        if dense is None:
            return accumulator.add
        calls = iter(dense)
        return lambda x: accumulator.add(x, next(calls))

    def target_weight(self, name: str, stats: Stats | None) -> torch.Tensor:
        """The matrix to factor for projection ``name``: W, or with upstream correction the map W*
        from the compressed model's input to the dense model's output (``Stats.corrected_weight``)."""
        W = self.original[name][0]
        if stats is None or stats.cross is None:
            return W
        return stats.corrected_weight(W, self.options.correction_damping, centered=self.has_bias(name))

    def finish(self, accumulator: StatsAccumulator, label: str) -> Stats:
        """The accumulated statistics, shrunk by ``options.cov_shrinkage`` (``Stats.shrunk``)."""
        return accumulator.finish(label).shrunk(self.options.cov_shrinkage)

    def collect(self, names: list[str], stop: str | None, need: str = "cov") -> dict[str, Stats]:
        """Stats of the inputs of ``names`` (run up to the input of ``stop``, or through the block):
        one float64 accumulator per input group (q/k/v share one)."""
        groups: dict[str, list[str]] = {}
        leaves: dict[str, nn.Module] = {}
        for name in names:
            group, leaves[group] = self.group_leaf(name)
            groups.setdefault(group, []).append(name)
        accumulators = {group: self.accumulator(members, need) for group, members in groups.items()}
        run_block(self.block, self.inputs, [(leaves[group], self.feeder(acc, groups[group][0])) for group, acc in accumulators.items()],
                  stop_at=self.leaf(stop) if stop else None)
        finished = {group: self.finish(acc, f"{self.arch.block_prefix(self.index)} {group} activations") for group, acc in accumulators.items()}
        return {name: finished[group] for group, members in groups.items() for name in members}

    # -- factor helpers ------------------------------------------------------------------------

    def has_bias(self, *names: str) -> bool:
        return any(self.original[n][1] is not None for n in names)

    def plan(self, name: str, factors: Factors, how: str, stats: Stats | None, info: dict | None = None, *, identity: bool = False) -> None:
        """Refit (``options.refit``), bias correction, identity block (if ``identity``), and plan the leaf."""
        factors = self.refit(name, factors, stats)
        self.planned[name] = _Planned(self.layout.get(name), self.maybe_identity(factors, name, identity), self.corrected_bias(name, factors, stats),
                                      how, dict(info or {}))

    def corrected_bias(self, name: str, factors: Factors | IdentityBlockFactors, stats: Stats | None) -> torch.Tensor | None:
        """The bias that keeps the mean output exact: b + W mu_dense - BA mu (mu_dense = mu without upstream correction)."""
        W, b = self.original[name]
        if b is None or stats is None:
            return b
        dense_mean = stats.mean if stats.dense_mean is None else stats.dense_mean
        return bias_correction(W, factors.product(), b, stats.mean) + W @ (dense_mean - stats.mean)

    def refit(self, name: str, factors: Factors | IdentityBlockFactors, stats: Stats | None) -> Factors | IdentityBlockFactors:
        """With ``options.refit``: keep the input factor A, refit B in closed form to the output the
        projection should produce (the dense model's, under upstream correction) on the calibration
        inputs (``refit_output_factor``). Needs the input covariance; a no-op for RootCov's own
        factors, which are already optimal for their input factor."""
        if not self.options.refit or stats is None or stats.cov is None:
            return factors
        W = self.original[name][0]
        cross = stats.cov if stats.cross is None else stats.cross
        if self.has_bias(name):
            dense_mean = stats.mean if stats.dense_mean is None else stats.dense_mean
            cross = cross - torch.outer(dense_mean, stats.mean)
        cov = stats.centered() if self.has_bias(name) else stats.cov
        return refit_output_factor(factors, W @ cross, cov, self.options.correction_damping * stats.energy, f"{self.path(name)} refit")

    def plan_factors(self, name: str, factors: Factors | IdentityBlockFactors, bias: torch.Tensor | None, how: str, info: dict, *, shared: str | None = None) -> None:
        """Plan projection ``name`` with final factors and bias (no correction); ``shared`` names
        an input factor several projections read (gate/up)."""
        self.planned[name] = _Planned(self.layout.get(name), factors, bias, how, dict(info), shared=shared)

    def maybe_identity(self, factors: Factors, name: str, identity: bool) -> Factors | IdentityBlockFactors:
        """``factors`` in identity-block form (pivoted columns kept exactly) when ``identity``."""
        if not identity:
            return factors
        return identity_block(factors, name=f"{self.path(name)} identity block")

    def stays_dense(self, name: str) -> bool:
        """Whether the allocation leaves projection ``name`` uncompressed (sensitivity allocation:
        no factorization of it stayed within the loss threshold)."""
        return self.budgets.get(name) == KEEP_DENSE

    def keep_dense(self, names: list[str]) -> None:
        """Describe projections left uncompressed (their leaves are not touched)."""
        for name in names:
            W = self.original[name][0]
            self.entries.append({"module": f"{self.arch.block_prefix(self.index)}.{self.layout.get(name).path}", "kind": "dense", "projection": name,
                                 "in_features": W.shape[1], "out_features": W.shape[0], "params_before": W.numel(), "params_after": W.numel()})

    def factor_local(self, name: str, method: str, stats: Stats | None, *, identity: bool = False) -> None:
        """Plan projection ``name`` alone with a per-matrix method: svd, asvd or rootcov."""
        factors = self.local_factors(name, method, stats, self.rank(name, identity))
        info = {"statistics": "centered" if self.has_bias(name) else "uncentered"} if method == "rootcov" else {}
        self.plan(name, factors, method, stats, info, identity=identity)

    def local_factors(self, name: str, method: str, stats: Stats | None, rank: int) -> Factors:
        """Rank-``rank`` factors of projection ``name`` by a per-matrix method: svd, asvd or rootcov."""
        W = self.target_weight(name, stats)
        label = f"{self.path(name)} ({method})"
        try:
            if method == "svd":
                factors = svd_factors(W, rank)
            elif method == "asvd":
                factors = asvd_factors(W, stats.mean_abs, rank, self.options.asvd_alpha)
            else:
                centered = self.has_bias(name)
                if W.shape[0] > W.shape[1]:  # the d_out > d_in path needs a root of C (shared by the group)
                    factors = rootcov_factors(W, None, rank, root=stats.root(centered), name=label)
                else:
                    factors = rootcov_factors(W, None, rank, gram=stats.weighted_gram(W, centered), name=label)
        except FactorizationError as err:
            raise FactorizationError(f"{label}: {err}") from err
        return factors

    # -- installation --------------------------------------------------------------------------

    def install(self, names: list[str]) -> None:
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
