"""Per-token decode latency of one attention layer with a filled cache, and sweeps of it over
attention kinds and contexts (``decode_sweep``, used by ``slimkv compare`` and benchmarks/decode_all.py)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from slimkv.attention import Attention, AttentionCache, LayerShape, build_attention, kind_spec
from slimkv.bench.roofline import add_bounds, bound_context, flop_counter, machine_rates, merge_rates, rates_line
from slimkv.common.checks import check_int
from slimkv.common.plotting import new_figure
from slimkv.common.timing import measure_copy_bandwidth, time_fn, write_results
from slimkv.ops.native import kernel_path


@torch.no_grad()
def decode_latency(attn: Attention, cache: AttentionCache, *, warmup: int = 3, repeats: int = 15) -> dict[str, Any]:
    """Median seconds of one single-token call at the cache's current context, and the bytes of
    live cache state that call reads (``cache.nbytes()`` before the step). The context grows by
    one token per timed call, negligible against the contexts benchmarked."""
    device = next(attn.parameters()).device
    x = torch.randn(cache.batch_size, 1, attn.d_model, dtype=cache.dtype, device=device)
    bytes_read = cache.nbytes()
    stats = time_fn(lambda: attn(x, cache=cache), warmup=warmup, repeats=repeats, device=device)
    stats["cache_bytes"] = bytes_read
    stats["gb_per_s"] = bytes_read / stats["median_s"] / 1e9
    return stats


@torch.no_grad()
def step_flops(attn: Attention, cache: AttentionCache) -> int:
    """FLOPs of one single-token call (projections included), as ``torch.utils.flop_counter``
    counts them (``roofline.flop_counter``: matmul-type ops and torch's CPU fused attention). The
    counted call appends one token to the cache, like a timed one."""
    x = torch.randn(cache.batch_size, 1, attn.d_model, dtype=cache.dtype, device=next(attn.parameters()).device)
    with flop_counter() as counter:
        attn(x, cache=cache)
    return counter.get_total_flops()


# ---------------------------------------------------------------- decode sweeps over kinds and contexts


@dataclass
class DecodeVariant:
    """One row of a decode benchmark: a label, a kind and its options (a second decode path is an
    option too, e.g. ``{"decode_path": "expanded"}``), and where the options came from."""

    label: str
    kind: str
    options: dict[str, Any]
    source: str = "the kind's decode preset"


def matched_width_variants(kinds: list[str], n_heads: int, head_dim: int, overrides: dict[str, dict] | None = None) -> list[DecodeVariant]:
    """Decode-benchmark variants of ``kinds`` at the width of an n_heads x head_dim MHA layer, from
    each kind's ``decode`` preset (its own file); ``overrides`` maps a kind to options that
    replace the preset's in every variant (a variant's own decode path is kept)."""
    shape = LayerShape(n_heads * head_dim, n_heads, head_dim)
    variants = []
    for kind in kinds:
        for label, options in kind_spec(kind).decode_variants(shape, kind):
            if overrides and kind in overrides:
                path = {k: v for k, v in options.items() if k == "decode_path"}
                variants.append(DecodeVariant(label, kind, {**overrides[kind], **path}, source="command line"))
            else:
                variants.append(DecodeVariant(label, kind, dict(options)))
    return variants


@torch.no_grad()
def fill_cache(attn: Attention, cache: AttentionCache, context: int, *, generator: torch.Generator, chunk: int = 2048) -> None:
    """Feed random inputs through ``attn`` until ``cache`` has seen ``context`` tokens (chunked prefill)."""
    device = next(attn.parameters()).device
    while cache.seq_len < context:
        n = min(chunk, context - cache.seq_len)
        x = torch.randn(cache.batch_size, n, attn.d_model, generator=generator, dtype=cache.dtype)
        attn(x.to(device), cache=cache)


def _split_runtime(kind: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options that build the layer, runtime options) of a variant: variants differing only in
    runtime options (a decode path) share one module and one cache."""
    runtime = kind_spec(kind).cls.RUNTIME_OPTIONS
    return {k: v for k, v in options.items() if k not in runtime}, {k: v for k, v in options.items() if k in runtime}


def decode_sweep(
    variants: list[DecodeVariant],
    contexts: list[int],
    *,
    d_model: int,
    n_heads: int,
    head_dim: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    rounds: int = 3,
    chunk: int = 2048,
    seed: int = 0,
) -> dict[str, Any]:
    """Per-token decode latency of one layer of every variant at every context.

    Variants that differ only in runtime options (a decode path) share a module and a cache, which grows from context to
    context (prefill in chunks of random inputs, never restarted). At each context the variants
    are timed interleaved: ``rounds`` rounds, each running every variant for ``warmup`` untimed
    and ``repeats`` timed single-token calls; the samples of all rounds are pooled. Each timed
    call appends a token, so a row records the context its first call saw. Kinds that cannot be
    built at this width are listed under "skipped" with the reason, never dropped silently.
    """
    check_int("batch", batch, 1)
    check_int("repeats", repeats, 1)
    check_int("rounds", rounds, 1)
    check_int("warmup", warmup, 0)
    for c in contexts:
        check_int("contexts", c, 1)
    modules: dict[str, tuple[Attention, AttentionCache, dict[str, Any]]] = {}  # key -> (layer, cache, its default runtime options)
    names: dict[str, str] = {}  # module key -> label of its first variant (progress bar)
    runnable, skipped = [], []
    for variant in variants:
        try:
            build, runtime = _split_runtime(variant.kind, variant.options)
        except ValueError as err:
            skipped.append({"label": variant.label, "kind": variant.kind, "options": variant.options, "reason": str(err)})
            continue
        key = json.dumps([variant.kind, build], sort_keys=True, default=str)
        if key not in modules:
            try:
                torch.manual_seed(seed)
                attn = build_attention(variant.kind, d_model, n_heads, head_dim, **variant.options)
            except ValueError as err:
                skipped.append({"label": variant.label, "kind": variant.kind, "options": variant.options, "reason": str(err)})
                continue
            attn = attn.to(device=device, dtype=dtype).eval()
            modules[key] = (attn, attn.new_cache(batch, dtype=dtype, device=device), {name: getattr(attn, name) for name in attn.RUNTIME_OPTIONS})
            names[key] = variant.label
        runnable.append((variant, key, runtime))

    generator = torch.Generator().manual_seed(seed)
    rows = []
    steps = len(contexts) * (len(modules) + rounds * len(runnable))
    with tqdm(total=steps, desc="decode sweep", unit="step") as bar:
        for context in sorted(contexts):
            for key, (attn, cache, defaults) in modules.items():
                bar.set_postfix_str(f"prefill {names[key]} to {context}")
                attn.set_runtime_options(**defaults)
                fill_cache(attn, cache, context, generator=generator, chunk=chunk)
                bar.update()
            pooled: dict[str, dict[str, Any]] = {}
            for _ in range(rounds):
                for variant, key, runtime in runnable:
                    attn, cache, defaults = modules[key]
                    bar.set_postfix_str(f"decode {variant.label} at {context}")
                    attn.set_runtime_options(**{**defaults, **runtime})
                    seen = cache.seq_len
                    stats = decode_latency(attn, cache, warmup=warmup, repeats=repeats)
                    if variant.label not in pooled:  # FLOPs per step: counted once per variant and context
                        pooled[variant.label] = {"context_seen": seen, "cache_bytes": stats["cache_bytes"], "flops": step_flops(attn, cache), "samples_s": []}
                    pooled[variant.label]["samples_s"].extend(stats["samples_s"])
                    bar.update()
            for variant, key, _ in runnable:
                attn = modules[key][0]
                entry = pooled[variant.label]
                samples = entry["samples_s"]
                median = statistics.median(samples)
                rows.append(
                    {
                        "label": variant.label,
                        "kind": variant.kind,
                        "context": context,
                        "context_seen": entry["context_seen"],
                        "cache_bytes": entry["cache_bytes"],
                        "parameter_bytes": sum(p.numel() * p.element_size() for p in attn.parameters()),
                        "median_s": median,
                        "min_s": min(samples),
                        "max_s": max(samples),
                        "gb_per_s": entry["cache_bytes"] / median / 1e9,
                        "flops": entry["flops"],
                        "gflop_per_s": entry["flops"] / median / 1e9,
                        "samples_s": samples,
                    }
                )
    mha = build_attention("mha", d_model, n_heads, head_dim)
    for row in rows:
        row["cache_ratio_to_mha"] = row["cache_bytes"] / mha.cache_bytes(row["context_seen"], dtype, batch)
    return {
        "settings": {
            "d_model": d_model, "n_heads": n_heads, "head_dim": head_dim, "batch": batch, "dtype": str(dtype).replace("torch.", ""),
            "device": str(device), "contexts": sorted(contexts), "warmup": warmup, "repeats": repeats, "rounds": rounds,
            "prefill_chunk": chunk, "seed": seed,
        },
        "variants": [asdict(v) for v, _, _ in runnable],
        "skipped": skipped,
        "rows": rows,
    }


def add_roofline(payload: dict[str, Any], read_bandwidth: float, fma_rate: float) -> None:
    """Give every row its roofline (``slimkv.bench.roofline``): the least time one step can take on
    this machine, the larger of (cache + parameter bytes) / read bandwidth and counted FLOPs / FMA
    rate (``roofline_s``, ``roofline_bound``), the step time as a multiple of it
    (``time_over_bound``) and its inverse ``of_roofline`` (1.0 = as fast as the machine allows)."""
    add_bounds(payload["rows"], {"read_bytes_per_s": read_bandwidth, "fma_flop_per_s": fma_rate},
               bytes_key=lambda row: row["cache_bytes"] + row["parameter_bytes"])
    for row in payload["rows"]:
        row["roofline_s"], row["roofline_bound"], row["of_roofline"] = row["bound_s"], row["bound"], row["bound_s"] / row["median_s"]


def decode_table(payload: dict[str, Any], copy_bandwidth: float) -> str:
    """Human-readable table of a ``decode_sweep`` payload (times per token, cache bytes read)."""
    rows = payload["rows"]
    mha_time = {r["context"]: r["median_s"] for r in rows if r["label"] == "mha"}
    header = (f"{'variant':<16}{'context':>8}{'cache MiB':>11}{'vs mha':>8}  {'ms/token median (min-max)':<30}{'GB/s':>8}{'of copy':>9}"
              f"{'read MiB':>10}{'MFLOP':>9}{'GFLOP/s':>9}{'bound ms':>10}{'x bound':>12}{'time vs mha':>13}")
    lines = [header, "-" * len(header)]
    for r in sorted(rows, key=lambda r: (r["label"], r["context"])):
        spread = f"{r['median_s'] * 1e3:.3f} ({r['min_s'] * 1e3:.3f}-{r['max_s'] * 1e3:.3f})"
        vs_time = f"{r['median_s'] / mha_time[r['context']]:.3f}" if r["context"] in mha_time else "-"
        lines.append(
            f"{r['label']:<16}{r['context']:>8}{r['cache_bytes'] / 2**20:>11.2f}{r['cache_ratio_to_mha']:>8.3f}  {spread:<30}"
            f"{r['gb_per_s']:>8.2f}{r['gb_per_s'] * 1e9 / copy_bandwidth:>9.2f}"
            f"{format(r['bytes_read'] / 2**20, '.2f') if 'bytes_read' in r else '-':>10}{r['flops'] / 1e6:>9.2f}{r['gflop_per_s']:>9.2f}"
            f"{format(r['roofline_s'] * 1e3, '.3f') if 'roofline_s' in r else '-':>10}"
            f"{(format(r['time_over_bound'], '.2f') + ' ' + r['roofline_bound'][:3]) if 'time_over_bound' in r else '-':>12}{vs_time:>13}"
        )
    return "\n".join(lines)


def decode_figure(payload: dict[str, Any], copy_bandwidth: float):
    """Two panels: ms per token against context, and cache GB/s against context beside the copy
    bandwidth (and half of it)."""
    fig, (ax_time, ax_bw) = new_figure(1, 2, figsize=(12, 4.5))
    labels = list(dict.fromkeys(r["label"] for r in payload["rows"]))
    for label in labels:
        rows = sorted((r for r in payload["rows"] if r["label"] == label), key=lambda r: r["context"])
        ctx = [r["context"] for r in rows]
        ax_time.plot(ctx, [r["median_s"] * 1e3 for r in rows], marker="o", label=label)
        ax_bw.plot(ctx, [r["gb_per_s"] for r in rows], marker="o", label=label)
    ax_bw.axhline(copy_bandwidth / 1e9, color="k", linestyle="--", label="copy bandwidth")
    ax_bw.axhline(copy_bandwidth / 2e9, color="k", linestyle=":", label="half copy bandwidth")
    s = payload["settings"]
    title = f"{s['n_heads']}x{s['head_dim']} heads, d_model {s['d_model']}, batch {s['batch']}, {s['dtype']}"
    for ax, ylabel in ((ax_time, "ms per decoded token"), (ax_bw, "cache GB/s (live cache bytes / time)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_title(title, fontsize=9)
    ax_time.set_yscale("log")
    ax_bw.legend(fontsize=7)
    fig.tight_layout()
    return fig


def run_decode_benchmark(name: str, variants: list[DecodeVariant], contexts: list[int], *, out_dir: str | Path,
                         targets: Callable[[dict[str, Any], float], list[dict[str, Any]]] | None = None, **sweep_options: Any) -> dict[str, Any]:
    """Measure the copy bandwidth and the roofline's rates (before and after), run ``decode_sweep``,
    print the table, write ``<name>.json`` and ``<name>.png`` (``write_results``); returns the JSON payload. ``targets(payload, copy
    bandwidth)`` (the benchmark's acceptance targets, which live with the benchmark script, not in
    the package) gives dicts with ``target``, ``label``, ``value``, ``met`` and optionally
    ``context``, ``reachable`` and ``basis``; they are printed and stored in the payload."""
    device = sweep_options.get("device", "cpu")
    print(f"threads: {torch.get_num_threads()}; variants: " + ", ".join(f"{v.label} {v.options or ''}".strip() for v in variants))
    dtype = sweep_options.get("dtype", torch.float32)
    context_before, rates_before, copy_before = bound_context(dtype), machine_rates(dtype), measure_copy_bandwidth(device=device)
    payload = decode_sweep(variants, contexts, **sweep_options)
    context_after, rates_after, copy_after = bound_context(dtype), machine_rates(dtype), measure_copy_bandwidth(device=device)
    copy_bandwidth, rates = max(copy_before, copy_after), merge_rates(rates_before, rates_after)
    payload["copy_bandwidth"] = {
        "bytes_per_s": copy_bandwidth,
        "samples_bytes_per_s": [copy_before, copy_after],
        "definition": "2 x bytes / time of a 256 MiB tensor copy (read + write), best of before/after the sweep",
    }
    payload["roofline"] = {**rates, **{k: v for k, v in context_before.items() if k != "load_average"},
                           "load_average": {"before": context_before["load_average"], "after": context_after["load_average"]},
                           "definition": "bound = max((cache + parameter bytes) / read bandwidth, counted FLOPs / FMA rate); "
                                         "read and FMA rates: the best of before/after the sweep"}
    add_roofline(payload, rates["read_bytes_per_s"], rates["fma_flop_per_s"])
    payload["targets"] = targets(payload, copy_bandwidth) if targets is not None else []
    payload["threads"] = torch.get_num_threads()
    payload["native_kernel"] = kernel_path(dtype)
    payload["kernel_isa"] = context_before["kernel_isa"]
    print(decode_table(payload, copy_bandwidth))
    print(f"native decode kernel: {payload['native_kernel'] or 'not in use (the torch path)'} (path: {payload['kernel_isa']})")
    print(f"memory-copy bandwidth: {copy_bandwidth / 1e9:.2f} GB/s (read + write counted); "
          "'of copy' = cache bytes read per second / that")
    print(rates_line(rates, context_before) + "; 'x bound' = time / bound, with the side that sets it (mem or com)")
    ran = sorted({r["kind"] for r in payload["rows"]})
    print(f"kinds run: {', '.join(ran)}")
    for skip in payload["skipped"]:
        print(f"skipped {skip['label']} ({skip['kind']} {skip['options']}): {skip['reason']}")
    for t in payload["targets"]:
        where = f" at {t['context']}" if "context" in t else ""
        reach = "" if "reachable" not in t else f" ({t.get('basis', '')}: {'reachable' if t['reachable'] else 'not reachable on this machine'})"
        print(f"target [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['label']}{where}: {t['value']:.3f}{reach}")
    path = write_results(name, payload, out_dir, figure=decode_figure(payload, copy_bandwidth))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return payload
