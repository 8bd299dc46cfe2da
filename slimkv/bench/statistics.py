"""Seed statistics of a comparison and the rule for claiming that one entry beats another."""

from __future__ import annotations

import statistics
from typing import Any

from slimkv.bench.entries import Entry

MIN_SEEDS_FOR_CLAIM = 3  # fewer seeds never support "A beats B"
REFERENCE = "mha"


def summarize(values: list[float]) -> dict[str, Any]:
    """mean, sample std (n - 1; None for one value), min, max and n of ``values``."""
    if not values:
        raise ValueError("nothing to summarize: no values")
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def aggregate(entries: list[Entry], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per entry: seed statistics of val BPB, val CE and head diversity; the cache figures
    (the same for every seed: they depend on the shape only)."""
    out = []
    for entry in entries:
        mine = [r for r in runs if r["label"] == entry.label]
        if not mine:
            continue  # every run of this entry was held by another process
        first = mine[0]
        ratios = {round(r["cache"]["ratio_to_mha"], 12) for r in mine}
        if len(ratios) != 1:
            raise ValueError(f"entry {entry.label!r}: the cache size differs between seeds ({sorted(ratios)}); the runs do not share one shape")
        diversity = [r["diversity"]["mean_r_eff_over_heads"] for r in mine if r["diversity"]["mean_r_eff_over_heads"] is not None]
        speeds = [r["train_tokens_per_s"] for r in mine if r.get("train_tokens_per_s")]
        other = [r["other"]["bpb"] for r in mine if r.get("other")]
        out.append(
            {
                "label": entry.label,
                "seeds": [r["seed"] for r in mine],
                "parameters": first["parameters"],
                "cache": first["cache"],
                "val_bpb": summarize([r["val_bpb"] for r in mine]),
                "val_ce": summarize([r["val_ce"] for r in mine]),
                "other_bpb": summarize(other) if other else None,
                "r_eff_over_heads": summarize(diversity) if diversity else None,
                "train_tokens_per_s": summarize(speeds) if speeds else None,
            }
        )
    return out


def compare_pair(a: dict[str, Any], b: dict[str, Any], metric: str = "val_bpb") -> dict[str, Any]:
    """Whether the seeds resolve the val-BPB difference of aggregate rows ``a`` and ``b``.

    The rule: both need >= ``MIN_SEEDS_FOR_CLAIM`` seeds, every seed of one must lie below every
    seed of the other (the [min, max] ranges do not overlap) and the difference of the means must
    exceed the sum of the two stds. Otherwise no claim is made. ``delta`` = mean(a) - mean(b)
    (negative: a has lower BPB)."""
    sa, sb = a[metric], b[metric]
    delta = sa["mean"] - sb["mean"]
    spread = None if sa["std"] is None or sb["std"] is None else sa["std"] + sb["std"]
    if min(sa["n"], sb["n"]) < MIN_SEEDS_FOR_CLAIM:
        verdict = f"no claim: {min(sa['n'], sb['n'])} seed(s); a claim needs >= {MIN_SEEDS_FOR_CLAIM} seeds per entry"
    elif (sa["max"] < sb["min"] or sb["max"] < sa["min"]) and abs(delta) > spread:
        side = "lower" if delta < 0 else "higher"
        verdict = f"{a['label']} {side} BPB than {b['label']} (seed ranges apart, |difference| > std sum)"
    else:
        verdict = "within the spread: no claim"
    return {"a": a["label"], "b": b["label"], "metric": metric, "delta_bpb": delta, "sum_of_stds": spread, "verdict": verdict}


def comparisons(rows: list[dict[str, Any]], reference: str | None = None, metric: str = "val_bpb") -> list[dict[str, Any]]:
    """Every entry against the reference (``mha`` if present, else the first entry) on ``metric``."""
    labels = [r["label"] for r in rows]
    ref_label = reference if reference in labels else (REFERENCE if REFERENCE in labels else labels[0])
    ref = rows[labels.index(ref_label)]
    return [compare_pair(r, ref, metric) for r in rows if r["label"] != ref_label and r.get(metric) and ref.get(metric)]
