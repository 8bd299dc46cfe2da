"""``convert --cache-budget B [--at N]``: plan a hybrid conversion that holds at most B of the
bfloat16 original's cache bytes at N tokens.

The plan chooses the cache storage and the number of exact (retrieval) KV heads together, from a
byte model of ``HybridCache`` (every buffer as ``slimkv.ops.quantize`` stores it: sinks in full
precision, rows past the residual window as codes with a scale and a minimum per group):

* for each storage, most precise first (``full``, ``int8``, ``int4``): the most exact heads whose
  bytes at N stay within B (the rest keep sinks + a window);
* the first storage that keeps every head exact wins; otherwise the one that keeps the most heads
  exact (measured retrieval lives in a minority of heads, and transformers' int4 cache keeps the
  original's retrieval: ``docs/conversion.md``);
* which heads: the highest measured retrieval scores (``convert.hybrid``);
* with ``--budget-windows W1,W2,...``, the bounded heads' window too: every (window, storage) pair is
  a candidate, and the same rule takes the one with the most exact heads (ties to the longer window,
  then the more precise storage). A shorter window frees bytes for exact heads: at 2K tokens a
  bounded head's sinks and 256-token window cost 0.09 of an exact bfloat16 head's bytes.

``--cache-storage weighed`` (``WEIGHED``) decides between the candidates that fit by a measurement
instead (``weighed``): each one's conversion copies spans of calibration copy contexts through its
own cache, and the best copy accuracy wins, ties to the longer window, then the more precise
storage. Fewer exact heads in full precision or more in coarser codes, a longer window or more
exact heads: which loses less depends on the model, the task and the length (docs/conversion.md
says where each wins), so it is asked for, not the default.

The plan is said before any weights load; the conversion's manifest records it (and the weighing)
and the cache measured on a live cache beside it (its floating elements at bfloat16's size: the
bytes of a bfloat16 cache).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from slimkv.attention.streaming import kept_tokens
from slimkv.common.buffer import dtype_bytes
from slimkv.common.checks import check_float
from slimkv.convert.source import Shape
from slimkv.ops.quantize import KVStorage, parse_storage

CANDIDATE_STORAGES = ("full", "int8", "int4")
SERVED_DTYPE = torch.bfloat16
WEIGHED = "weighed"  # --cache-storage weighed: the candidates that fit, decided by measured copy accuracy


@dataclass(frozen=True)
class BudgetPlan:
    """The planner's answer: ``storage``, the bounded heads' ``window``, ``exact_heads`` of
    ``total_heads``, the element ratio that gives ``hybrid.plan`` that head count, and the predicted
    byte fraction at ``at`` tokens. Each candidate is named by ``candidate_name``.
    ``to_weigh``: the candidates still to be weighed by copy accuracy (``weighed`` decides);
    ``weighing``: what that measurement found."""

    budget: float
    at: int
    storage: str
    window: int
    exact_heads: int
    total_heads: int
    cache_ratio: float
    predicted_fraction: float
    candidates: list[dict[str, Any]]
    why: str
    to_weigh: bool = False
    weighing: dict[str, Any] | None = None

    def fitting(self) -> list[dict[str, Any]]:
        """The candidates whose heads fit the budget, the longest window and the most precise storage first."""
        return [c for c in self.candidates if c["exact_heads"] >= 0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rows_bytes(rows: int, dim: int, storage: KVStorage, dtype: torch.dtype = SERVED_DTYPE, appended: int | None = None) -> int:
    """Bytes of ``rows`` per-token rows of ``dim`` channels held by a buffer of ``storage`` into
    which ``appended`` rows (default ``rows``: nothing dropped) went: the newest ``residual`` and
    the rows of a block not yet full stay in full precision, the rest are codes."""
    size = dtype_bytes(dtype)
    if storage.bits is None:
        return rows * dim * size
    appended = rows if appended is None else appended
    full = appended if appended <= storage.residual else storage.residual + (appended - storage.residual) % storage.block
    quantized = rows - min(rows, full)
    return quantized * storage.row_bytes(dim, dtype) + (rows - quantized) * dim * size


def head_bytes(length: int, shape: Shape, storage: KVStorage, *, exact: bool, sink_len: int, window: int) -> int:
    """Keys and values of one KV head after ``length`` tokens: every token (exact) or sinks + window."""
    if exact:
        return 2 * rows_bytes(length, shape.head_dim, storage)
    sinks = min(sink_len, length)
    recent = kept_tokens(length, sink_len, window) - sinks
    size = dtype_bytes(SERVED_DTYPE)
    return 2 * (sinks * shape.head_dim * size + rows_bytes(recent, shape.head_dim, storage, appended=length - sinks))


def candidate_name(storage: str, window: int, windows: tuple[int, ...]) -> str:
    """A candidate's name in the plan's sentences and its weighing: the storage, and its window where several are planned."""
    return storage if len(windows) == 1 else f"{storage}, window {window}"


def plan_budget(shape: Shape, budget: float, at: int, *, window: int | tuple[int, ...], sink_len: int, storage: str | None = None) -> BudgetPlan:
    """The storage, bounded-head window and exact-head count for ``budget`` of the bfloat16 original's
    bytes at ``at`` tokens (module docstring); ``window`` one window or the candidates; ``storage``
    fixes the storage instead of choosing it, or (``WEIGHED``) leaves the choice to ``weighed``.
    ValueError naming --cache-budget when even every head streaming in int4 does not fit."""
    check_float("--cache-budget", budget, 0.0, 1.0, open_low=True)
    windows = tuple(sorted(set(window if isinstance(window, tuple) else (window,)), reverse=True))
    total = shape.n_layers * shape.n_kv_heads
    original = total * 2 * rows_bytes(at, shape.head_dim, KVStorage())
    fixed = storage is not None and storage != WEIGHED
    names = [parse_storage(storage, "--cache-storage").name] if fixed else list(CANDIDATE_STORAGES)
    candidates = []
    for size in windows:
        for name in names:
            kind = parse_storage(name)
            exact_cost = head_bytes(at, shape, kind, exact=True, sink_len=sink_len, window=size)
            stream_cost = head_bytes(at, shape, kind, exact=False, sink_len=sink_len, window=size)
            room = budget * original - total * stream_cost
            heads = -1 if room < 0 else min(total, int(room // max(1, exact_cost - stream_cost)))
            fraction = (heads * exact_cost + (total - heads) * stream_cost) / original if heads >= 0 else None
            candidates.append({"name": candidate_name(kind.name, size, windows), "storage": kind.name, "window": size, "exact_heads": heads,
                               "fraction": fraction, "cache_ratio": element_ratio(heads, total, at, sink_len, size) if heads >= 0 else None,
                               "exact_head_fraction": exact_cost / (original / total), "streaming_head_fraction": stream_cost / (original / total)})
    fitting = [c for c in candidates if c["exact_heads"] >= 0]
    if not fitting:
        smallest = min(c["streaming_head_fraction"] for c in candidates)
        raise ValueError(f"--cache-budget {budget} is below what a hybrid conversion can hold at {at} tokens: every KV head streaming "
                         f"(sinks {sink_len} + window {min(windows)}) in {names[-1]} storage needs {smallest:.4f} of the bfloat16 original's bytes")
    every = [c for c in fitting if c["exact_heads"] == total]
    chosen = every[0] if every else max(fitting, key=lambda c: c["exact_heads"])
    heads = chosen["exact_heads"]
    to_weigh = storage == WEIGHED and not every and len(fitting) > 1
    if to_weigh:
        weigh = ", ".join(f"{c['name']} keeps {c['exact_heads']} of {total} KV heads exact ({c['fraction']:.4f})" for c in fitting)
        why = f"to be weighed by copy accuracy once the roles are measured: {weigh} (fractions of the bfloat16 original's cache at {at} tokens)"
    else:
        if fixed and len(windows) == 1:
            why = f"storage {chosen['storage']} as asked: {heads} of {total} KV heads fit exact"
        elif every:
            why = f"{chosen['name']} is the most precise storage that keeps all {total} KV heads exact within the budget"
        else:
            others = ", ".join(f"{c['name']} {max(c['exact_heads'], 0)}" for c in candidates if c is not chosen)
            why = f"{chosen['name']} keeps the most KV heads exact ({heads} of {total}; {others})"
        why += f"; predicted {chosen['fraction']:.4f} of the bfloat16 original's cache at {at} tokens"
    return BudgetPlan(budget, at, chosen["storage"], chosen["window"], heads, total, chosen["cache_ratio"], chosen["fraction"], candidates, why,
                      to_weigh)


def element_ratio(exact_heads: int, total: int, at: int, sink_len: int, window: int) -> float:
    """The kept fraction of the original's cache elements at ``at`` tokens with ``exact_heads`` of
    ``total`` KV heads exact (the ratio ``hybrid.plan`` turns back into that head count)."""
    kept = kept_tokens(at, sink_len, window)
    return (exact_heads * at + (total - exact_heads) * kept) / (total * at)


def weighed(plan: BudgetPlan, accuracy: dict[str, float], measurement: dict[str, Any]) -> BudgetPlan:
    """``plan`` decided by measured copy accuracy (``accuracy``: candidate name -> the mean over the
    copy contexts ``measurement`` describes, of each fitting candidate's conversion through its own
    cache): the most accurate candidate, ties to the longer window, then the more precise storage."""
    fitting = plan.fitting()
    missing = [c["name"] for c in fitting if c["name"] not in accuracy]
    if missing:
        raise ValueError(f"weighing the budget's candidates: no copy accuracy for {', '.join(missing)}")
    best = max(fitting, key=lambda c: (accuracy[c["name"]], -fitting.index(c)))
    candidates = [{**c, "copy_accuracy": accuracy.get(c["name"])} for c in plan.candidates]
    scores = ", ".join(f"{c['name']} ({c['exact_heads']} exact heads) {accuracy[c['name']]:.3f}" for c in fitting)
    why = (f"{best['name']} copies best through its own cache ({scores}; {measurement['contexts']} calibration copy contexts "
           f"of {measurement['length']} tokens); predicted {best['fraction']:.4f} of the bfloat16 original's cache at {plan.at} tokens")
    return replace(plan, storage=best["storage"], window=best["window"], exact_heads=best["exact_heads"], cache_ratio=best["cache_ratio"],
                   predicted_fraction=best["fraction"], candidates=candidates, why=why, to_weigh=False,
                   weighing={**measurement, "copy_accuracy": {c["name"]: accuracy[c["name"]] for c in fitting}})
