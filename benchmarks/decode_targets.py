"""The decode benchmark's acceptance targets (docs/evaluation.md, "Speed benchmarks"): what
``benchmarks/decode_all.py`` checks its measurements against. They live with the benchmark, not
in the installed package; ``slimkv.bench.decode.run_decode_benchmark`` takes them as a callable."""

from __future__ import annotations

from typing import Any

TARGET_CONTEXT = 32768  # the decode targets are stated for 32K cached tokens
READ_BOUND = ("mha", "gqa", "mqa", "swa")  # kinds whose decode should stream their cache at near copy bandwidth
COMPUTE_BOUND = ("mla", "lrkv")  # kinds whose decode does extra arithmetic per cached byte
KVM_SPEEDUP = {"kvm-fixed": 30.0, "kvm-sqrt": 8.0}  # times faster than MHA at 32K



def decode_targets(payload: dict[str, Any], copy_bandwidth: float) -> list[dict[str, Any]]:
    """The targets of docs/evaluation.md ("Speed benchmarks") at the largest context, if >= 32K:

    * MHA, GQA, MQA, SWA read their live cache at >= 0.8 x the measured copy bandwidth (bytes/s
      of a large copy, read + write counted, as ``measure_copy_bandwidth`` reports it);
    * MLA and LRKV (their default decode path): time / MHA's time <= 1.2 x cache bytes / MHA's
      (``reachable`` says whether their roofline, from ``add_roofline``, allows it on this machine);
    * KVM: fixed >= 30x and sqrt >= 8x faster than MHA.
    Where the rows allow it, each target says whether this machine can reach it (``reachable``):
    the read-bound kinds also read their weights each step, so at most cache / (cache + parameter
    bytes) of the copy bandwidth goes to the cache (``ceiling``); MLA and LRKV compare their
    roofline with the bound. KVM gets no such flag: its byte count is its whole state, more than
    a step reads, so its roofline is overstated.
    Rows are matched by label: the kind's name (or ``kvm-fixed`` / ``kvm-sqrt``).
    """
    top = max(payload["settings"]["contexts"])
    if top < TARGET_CONTEXT:
        return []
    at_top = {r["label"]: r for r in payload["rows"] if r["context"] == top}
    targets = []
    for label in READ_BOUND:
        if label in at_top:
            row = at_top[label]
            fraction = row["gb_per_s"] * 1e9 / copy_bandwidth
            target = {"target": "cache read >= 0.8 x copy bandwidth", "label": label, "context": top, "value": fraction, "met": fraction >= 0.8}
            if "parameter_bytes" in row:  # the step reads its weights too: at copy bandwidth the cache gets this share of it
                target["ceiling"] = row["cache_bytes"] / (row["cache_bytes"] + row["parameter_bytes"])
                target["reachable"] = target["ceiling"] >= 0.8
            targets.append(target)
    mha = at_top.get("mha")
    if mha is None:
        return targets
    for label in COMPUTE_BOUND:
        if label in at_top:
            time_ratio = at_top[label]["median_s"] / mha["median_s"]
            bytes_ratio = at_top[label]["cache_bytes"] / mha["cache_bytes"]
            target = {"target": "time vs mha <= 1.2 x cache-bytes ratio", "label": label, "context": top, "value": time_ratio / bytes_ratio,
                      "time_ratio": time_ratio, "bytes_ratio": bytes_ratio, "met": time_ratio <= 1.2 * bytes_ratio}
            if "roofline_s" in at_top[label]:
                target["roofline_time_ratio"] = at_top[label]["roofline_s"] / mha["median_s"]
                target["reachable"] = target["roofline_time_ratio"] <= 1.2 * bytes_ratio
            targets.append(target)
    for label, wanted in KVM_SPEEDUP.items():
        if label in at_top:
            speedup = mha["median_s"] / at_top[label]["median_s"]
            targets.append({"target": f"speedup over mha >= {wanted:g}x", "label": label, "context": top, "value": speedup, "met": speedup >= wanted})
    return targets


def reach_basis(target: dict[str, Any]) -> str:
    """What a target's ``reachable`` was decided on, in words."""
    if "ceiling" in target:
        return f"cache share of the bytes read {target['ceiling']:.3f}"
    return f"roofline time vs mha {target['roofline_time_ratio']:.3f}"


def overhead_targets(payload: dict[str, Any], *, from_context: int = 2048, tolerance: float = 0.05) -> list[dict[str, Any]]:
    """Per-step overhead checks (the demo width): at every context >= ``from_context`` no kind is
    slower than MHA (the primary label of each kind), and no label's time falls by more than
    ``tolerance`` as the context grows (a thread-overhead floor would make small contexts slow)."""
    rows = payload["rows"]
    mha = {r["context"]: r["median_s"] for r in rows if r["label"] == "mha"}
    primary = sorted({r["label"] for r in rows if r["label"] == r["kind"] or r["label"] in KVM_SPEEDUP} - {"mha"})
    targets = []
    for label in primary:
        mine = {r["context"]: r["median_s"] for r in rows if r["label"] == label}
        slower = [c for c in sorted(mine) if c >= from_context and c in mha and mine[c] > mha[c]]
        worst = max((mine[c] / mha[c] for c in mine if c >= from_context and c in mha), default=None)
        if worst is not None:
            targets.append({"target": f"not slower than mha at >= {from_context} tokens", "label": label, "value": worst, "slower_at": slower, "met": not slower})
    for label in sorted({r["label"] for r in rows}):
        times = [t for _, t in sorted((r["context"], r["median_s"]) for r in rows if r["label"] == label)]
        drops = [round(b / a, 3) for a, b in zip(times, times[1:]) if b < a * (1 - tolerance)]
        targets.append({"target": "time never falls as context grows", "label": label, "value": min((b / a for a, b in zip(times, times[1:])), default=1.0),
                        "drops": drops, "met": not drops})
    return targets



def all_targets(payload: dict[str, Any], copy_bandwidth: float, *, check_overhead: bool = False) -> list[dict[str, Any]]:
    """The bandwidth targets (at >= 32K cached tokens) and, with ``check_overhead``, the per-step
    overhead ones; every target that says whether it is reachable also says on what basis."""
    top = max(payload["settings"]["contexts"])
    if top < TARGET_CONTEXT:
        print(f"bandwidth targets: stated for >= {TARGET_CONTEXT} cached tokens; not evaluated (largest context {top})")
    found = decode_targets(payload, copy_bandwidth) + (overhead_targets(payload) if check_overhead else [])
    for t in found:
        if "reachable" in t:
            t["basis"] = reach_basis(t)
    return found
