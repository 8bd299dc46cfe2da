"""The native decode kernel against the torch path, interleaved in one run.

One decode step of attention alone (no projections): 8 query heads x 64, batch 1, float32, with
key/value heads 8 (MHA), 2 (GQA) and 1 (MQA), at each context. Per call: the native kernel
(``slimkv.ops.native``), the torch path (``matmul_decode_attention``: two matmuls around a softmax)
and a large copy, in rounds, so that background load hits them alike. Reported: median ms,
the cache's GB/s and its fraction of the copy bandwidth measured in the same rounds, and
native / torch. The kernel's output is checked against the torch path's before timing.

    .venv/bin/python benchmarks/decode_native.py --threads 1
    .venv/bin/python benchmarks/decode_native.py --threads 1,2 --contexts 4096,32768

Writes benchmarks/results/decode/decode_native_<threads>thread.json and .png. Run it on a quiet machine.

With ``--layers``, the kernel's instruction-set paths side by side instead (docs/evaluation.md,
"Roofline and kernel paths"): one layer of every kind at matched width (decode_all.py's variants,
less the ``expanded`` reference decode paths, whose step is the rebuilding of keys and values, not
the kernel), its cache filled to the last of ``--contexts``, in each of ``--dtypes``; each step is timed with the kernel
call routed to each path in turn, interleaved in rounds, and so is the kernel call alone on the
arguments the layer passed. Paths: ``generic`` (the portable C built for this CPU without AVX-512:
what a CPU with AVX2 and no AVX-512 ran before the AVX2 path), ``avx2``, ``avx512`` (where the CPU
has it), ``avx512-bf16`` (bfloat16 caches, where the CPU has AVX512-BF16), ``amx-bf16`` (bfloat16 caches, where the
CPU has AMX and the OS hands it out) and ``portable`` (no -march). Each row has its roofline (bytes read and FLOPs of the layer
step and of the kernel call; a read-only bandwidth and a small-GEMM rate measured before and after
each dtype) and its time against the generic path's.

    .venv/bin/python benchmarks/decode_native.py --layers --contexts 32768 --dtypes float32,bfloat16 --rounds 5

writes benchmarks/results/decode/decode_roofline_layer.json (``--name``) and the markdown table beside it
(``.md``; ``--render FILE.json`` writes it again from a results file, measuring nothing). The kernel
call repeats on one layer's arguments, whose tens of MB may stay in a large last-level cache from
one call to the next; ``--distinct-mb 1024`` times it once on each of enough distinct copies of
them to read 1 GiB a round instead, as a model's decode reads its layers (``distinct_copy``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from decode_all import DTYPES, dtype_list, int_list  # this folder's decode benchmark: its parsers and dtype names

from slimkv.attention import ATTENTION_KINDS, build_attention
from slimkv.bench.decode import fill_cache, matched_width_variants, step_flops
from slimkv.bench.roofline import add_bounds, bound_context, machine_rates, merge_rates, rates_line
from slimkv.common.plotting import new_figure
from slimkv.common.results import results_dir
from slimkv.common.timing import time_fn, write_results
from slimkv.ops import attention as attention_ops
from slimkv.ops import native
from slimkv.ops.attention import matmul_decode_attention
from slimkv.ops.kvm import core as kvm_core

RESULTS = Path(__file__).resolve().parent / "results"
COPY_BYTES = 256 << 20


def measure(kv_heads: int, context: int, *, heads: int, head_dim: int, rounds: int, library) -> dict:
    """Interleaved medians of the native kernel, the torch path and a copy, for one shape."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, head_dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, context, head_dim, generator=gen) for _ in range(2))
    scale = head_dim**-0.5
    torch.testing.assert_close(native.native_decode_attention([q], [(k, v)], scale, library), matmul_decode_attention(q, k, v, scale=scale),
                               rtol=1e-4, atol=1e-5)
    source = torch.ones(COPY_BYTES // 4)
    target = torch.empty_like(source)
    calls = {
        "native": lambda: native.native_decode_attention([q], [(k, v)], scale, library),
        "torch": lambda: matmul_decode_attention(q, k, v, scale=scale),
        "copy": lambda: target.copy_(source),
    }
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name] += _seconds(call, 1)
    median = {name: statistics.median(values) for name, values in samples.items()}
    cache_bytes = 2 * kv_heads * context * head_dim * 4
    copy_bandwidth = 2 * COPY_BYTES / median["copy"]
    row = {"kv_heads": kv_heads, "context": context, "cache_bytes": cache_bytes, "copy_bandwidth": copy_bandwidth, "samples_s": samples,
           "native_over_torch": median["native"] / median["torch"]}
    for name in ("native", "torch"):
        row[f"{name}_ms"] = median[name] * 1e3
        row[f"{name}_of_copy"] = cache_bytes / median[name] / copy_bandwidth
    return row


PATHS = {"generic": ("avx2", ("-DSLIMKV_PORTABLE",)), "avx2": ("avx2", ()), "avx512": ("avx512", ()), "avx512-bf16": ("avx512-bf16", ()),
         "amx-bf16": ("amx-bf16", ()), "portable": ("portable", ())}
PATH_GEMM = {"generic": "avx2", "avx2": "avx2"}
"""The instruction set a path's FMA rate is measured under (``roofline.machine_rates(isa=...)``): a
path held to AVX2 cannot reach an AVX-512 machine's peak, so its bound uses an AVX2 GEMM's; the
others use the machine's best (for ``portable``, built for any x86-64, an optimistic bound)."""
"""--layers' paths -> (native.ISAS name, extra flags): ``generic`` is the portable C built for this CPU without AVX-512;
``avx512-bf16`` (AVX512-BF16) and ``amx-bf16`` (AMX logits for rows that several query rows share) run for bfloat16 caches only, their float32
builds being the avx512 path."""


def path_libraries(dtype: torch.dtype) -> dict[str, Any]:
    """The kernel library (``native.isa_kernel``) of every path in ``PATHS`` this CPU can run, for caches of ``dtype``."""
    if native.compiler() is None:
        raise SystemExit("error: no C compiler: there are no kernel paths to compare")
    runnable = native.runnable_isas()
    return {name: native.isa_kernel(dtype, isa, flags) for name, (isa, flags) in PATHS.items()
            if isa in runnable and not (isa.endswith("-bf16") and dtype != torch.bfloat16)}


@contextlib.contextmanager
def routed_kernel(library: Any = None, calls: list | None = None) -> Iterator[None]:
    """Within: every native decode call of a layer goes to ``library`` (None: the default build),
    and its arguments are appended to ``calls``."""
    real = native.native_decode_attention

    def route(queries, segments, scale, default):
        if calls is not None:
            calls.append((queries, segments, scale))
        return real(queries, segments, scale, library if library is not None else default)

    with mock.patch.object(attention_ops, "native_decode_attention", route), mock.patch.object(kvm_core, "native_decode_attention", route):
        yield


def call_cost(queries, segments) -> tuple[int, int]:
    """(bytes read, FLOPs) of one kernel call: each segment's key and value rows (values inside
    the key rows, as MLA's, counted once; values every head shares, value head stride 0 as the
    latent kind's, counted once per batch row, as the kernel reads them) and 2 FLOPs per query
    head, key and channel."""
    nbytes = flops = 0
    for q, (k, v) in zip(queries, segments):
        rows = k.shape[0] * k.shape[1] * k.shape[2]
        offset = (v.data_ptr() - k.data_ptr()) // k.element_size()
        inside = v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() and 0 <= offset < k.stride(2) and v.stride() == k.stride()
        if inside:
            nbytes += rows * k.element_size() * max(k.shape[3], offset + v.shape[3])
        else:
            value_rows = v.shape[0] * v.shape[2] if v.shape[1] > 1 and v.stride(1) == 0 else rows
            nbytes += k.element_size() * (rows * k.shape[3] + value_rows * v.shape[3])
        flops += 2 * q.shape[0] * q.shape[1] * k.shape[2] * (k.shape[3] + v.shape[3])
    return nbytes, flops


def distinct_copy(call: tuple) -> tuple:
    """A kernel call's arguments over fresh memory: per storage, the byte range its tensors reach
    copied once, and each tensor re-made as the same view of the copy (sizes, strides, offsets
    within the range), so what the kernel sees is unchanged: MLA's values inside the key rows, a
    buffer's [k | v] rows, the latent kind's stride-0 shared values; a buffer's spare capacity past
    the rows is not copied."""
    queries, segments = call[0], call[1]
    tensors = [*queries, *(t for pair in segments for t in pair)]

    def span(t: torch.Tensor) -> tuple[int, int]:  # bytes [first, end) of the storage the view reaches
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
        return t.storage_offset() * t.element_size(), (t.storage_offset() + last + 1) * t.element_size()

    ranges: dict[int, list[int]] = {}
    for t in tensors:
        first, end = span(t)
        lo_hi = ranges.setdefault(t.untyped_storage().data_ptr(), [first, end])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], first), max(lo_hi[1], end)
    copies = {}
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in copies:
            lo, hi = ranges[key]
            whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            copies[key] = whole[lo:hi].clone().untyped_storage()

    def copy(t: torch.Tensor) -> torch.Tensor:
        lo = ranges[t.untyped_storage().data_ptr()][0]
        assert lo % t.element_size() == 0
        return torch.empty(0, dtype=t.dtype).set_(copies[t.untyped_storage().data_ptr()], t.storage_offset() - lo // t.element_size(), t.size(), t.stride())

    return [copy(q) for q in queries], [(copy(k), copy(v)) for k, v in segments], *call[2:]


def distinct_copies(calls: list[tuple], kernel_bytes: int, distinct_bytes: int) -> list[list[tuple]]:
    """Copies of a layer's kernel calls (``distinct_copy``) until they read ``distinct_bytes`` in all, or
    hold three times that much memory, whichever comes first (a buffer's keys and values, or a
    bounded cache's few rows, can lie far apart in it: their copies hold more than they read)."""
    copies: list[list[tuple]] = []
    held = 0
    while len(copies) * kernel_bytes < distinct_bytes and held < 3 * distinct_bytes:
        copies.append([distinct_copy(c) for c in calls])
        tensors = [t for q, segments, *_ in copies[-1] for t in (*q, *(x for pair in segments for x in pair))]
        held += sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    return copies


def _seconds(fn, repeats: int) -> list[float]:
    """Seconds of ``repeats`` timed calls after one untimed (``timing.time_fn``'s samples)."""
    return time_fn(fn, warmup=1, repeats=repeats)["samples_s"]


@torch.no_grad()
def layer_rows(label: str, kind: str, options: dict, context: int, dtype: torch.dtype, libraries: dict, *, heads: int, head_dim: int,
               rounds: int, distinct_bytes: int = 0) -> list[dict]:
    """One row per path: the layer step and its kernel call alone, interleaved medians (ms). The kernel
    call repeats on the layer's own arguments (3 calls a round), or with ``distinct_bytes`` runs once
    on each of enough distinct copies of them (``distinct_copy``) to read that many bytes a round, as a
    model's decode reads its layers, none of them left in the caches by the call before (its time:
    the round's over the copies)."""
    torch.manual_seed(0)
    attn = build_attention(kind, heads * head_dim, heads, head_dim, **options).to(dtype).eval()
    cache = attn.new_cache(1, dtype=dtype)
    fill_cache(attn, cache, context, generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, 1, attn.d_model, dtype=dtype)
    attn(x, cache=cache)  # a step at a multiple of KVM's chunk folds; the next ones are plain decode steps
    calls: list = []
    with routed_kernel(calls=calls):
        attn(x, cache=cache)
    layer_bytes = cache.nbytes() + sum(p.numel() * p.element_size() for p in attn.parameters())
    flops = step_flops(attn, cache)
    names = list(libraries) if calls else ["default"]
    kernel_bytes, kernel_flops = (sum(c) for c in zip(*(call_cost(q, s) for q, s, _ in calls))) if calls else (0, 0)
    copies = distinct_copies(calls, kernel_bytes, distinct_bytes) if distinct_bytes and kernel_bytes else []
    samples = {name: {"layer": [], "kernel": []} for name in names}
    for _ in range(rounds):
        for name in names:
            library = libraries.get(name)
            with routed_kernel(library):
                samples[name]["layer"] += _seconds(lambda: attn(x, cache=cache), 1)
            if copies:
                run = _seconds(lambda lib=library: [native.native_decode_attention(*c, lib) for copy in copies for c in copy], 1)
                samples[name]["kernel"] += [t / len(copies) for t in run]
            elif calls:
                samples[name]["kernel"] += _seconds(lambda lib=library: [native.native_decode_attention(*c, lib) for c in calls], 3)
    rows = []
    for name in names:
        row = {"label": label, "kind": kind, "options": options, "dtype": str(dtype).removeprefix("torch."), "context": context, "path": name,
               "path_isa": native.library_isa(libraries[name]) if name in libraries else native.kernel_isa(dtype), "kernel_calls": len(calls),
               "layer_s": statistics.median(samples[name]["layer"]), "layer_bytes": layer_bytes, "layer_flops": flops, "samples_s": samples[name],
               "kernel_copies": len(copies)}
        if calls:
            row.update(kernel_s=statistics.median(samples[name]["kernel"]), kernel_bytes=kernel_bytes, kernel_flops=kernel_flops)
        rows.append(row)
    return rows


def _bounds(rows: list[dict], rates: dict, held_rates: dict) -> None:
    """Each row's layer and kernel bounds and times as multiples of them (``slimkv.bench.roofline``), a
    path held to fewer instructions against the FMA rate of a GEMM held to the same (``PATH_GEMM``)."""
    for row in rows:
        gemm = PATH_GEMM.get(row["path"])
        row["fma_isa"] = gemm or "the machine's best"
        mine = held_rates[gemm] if gemm in held_rates else rates
        for part in ("layer", "kernel") if "kernel_s" in row else ("layer",):
            view = {"flops": row[f"{part}_flops"], "median_s": row[f"{part}_s"], "bytes": row[f"{part}_bytes"]}
            add_bounds([view], mine, bytes_key=lambda r: r["bytes"])
            row.update({f"{part}_{k}": view[k] for k in ("bound_s", "bound", "time_over_bound")})
    for row in rows:
        base = next((r for r in rows if r["label"] == row["label"] and r["dtype"] == row["dtype"] and r["path"] == "generic"), None)
        if base is not None:
            row["layer_speedup_over_generic"] = base["layer_s"] / row["layer_s"]
            if "kernel_s" in row:
                row["kernel_speedup_over_generic"] = base["kernel_s"] / row["kernel_s"]


def layer_benchmark(name: str, kinds: list[str] | None, context: int, dtypes: list[torch.dtype], *, rounds: int, heads: int, head_dim: int,
                    out_dir: str, distinct_bytes: int = 0) -> dict:
    """The --layers benchmark: every kind x dtype x path; prints the table, writes ``<name>.json``."""
    variants = [v for v in matched_width_variants(kinds or list(ATTENTION_KINDS), heads, head_dim) if v.options.get("decode_path") != "expanded"]
    rows, rates, held_rates, contexts = [], {}, {}, {}
    for dtype in dtypes:
        key = str(dtype).removeprefix("torch.")
        libraries, contexts[key] = path_libraries(dtype), bound_context(dtype)
        held = sorted({PATH_GEMM[name] for name in libraries if name in PATH_GEMM})
        before, before_held = machine_rates(dtype), {isa: machine_rates(dtype, isa=isa) for isa in held}
        mine = [r for v in variants for r in layer_rows(v.label, v.kind, v.options, context, dtype, libraries, heads=heads, head_dim=head_dim, rounds=rounds,
                                                        distinct_bytes=distinct_bytes)]
        rates[key] = merge_rates(before, machine_rates(dtype))
        held_rates[key] = {isa: merge_rates(before_held[isa], machine_rates(dtype, isa=isa)) for isa in held}
        contexts[key]["load_average_after"] = bound_context(dtype)["load_average"]
        _bounds(mine, rates[key], held_rates[key])
        rows += mine
        print(rates_line(rates[key], contexts[key]))
        print(f"{'variant':<16}{'dtype':>9}{'path':>13}  {'kernel ms':>10}{'x bound':>12}{'vs generic':>11}  {'layer ms':>10}{'x bound':>12}{'vs generic':>11}")
        for r in mine:
            kernel = (f"{r['kernel_s'] * 1e3:>10.3f}{format(r['kernel_time_over_bound'], '.2f') + ' ' + r['kernel_bound'][:3]:>12}"
                      f"{r.get('kernel_speedup_over_generic', float('nan')):>11.2f}") if "kernel_s" in r else f"{'no kernel call':>33}"
            print(f"{r['label']:<16}{key:>9}{r['path']:>13}  {kernel}  {r['layer_s'] * 1e3:>10.3f}"
                  f"{format(r['layer_time_over_bound'], '.2f') + ' ' + r['layer_bound'][:3]:>12}{r.get('layer_speedup_over_generic', float('nan')):>11.2f}")
    payload = {"settings": {"context": context, "heads": heads, "head_dim": head_dim, "rounds": rounds, "threads": torch.get_num_threads(),
                            "distinct_bytes": distinct_bytes,
                            "dtypes": list(rates), "paths": {k: list(v[1]) + [v[0]] for k, v in PATHS.items()}},
               "roofline": {"rates": rates, "held_rates": held_rates, "context": contexts,
                            "definition": "bound = max(bytes / read bandwidth, FLOPs / FMA rate); layer: cache + parameter bytes and counted FLOPs; "
                            "kernel: the rows its call reads and 2 FLOPs per head, key and channel; the FMA rate of a path held to fewer "
                            "instructions (PATH_GEMM) is a GEMM's held to the same (held_rates)"},
               "rows": rows}
    path = write_results(name, payload, out_dir)
    path.with_suffix(".md").write_text(render_layers(json.loads(path.read_text())), encoding="utf-8")
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    return payload


def _kernel_timing(settings: dict) -> str:
    """How the page's kernel calls were timed (``layer_rows``)."""
    if not settings.get("distinct_bytes"):
        return f"Kernel call alone on the layer's own arguments, {settings['rounds']} interleaved rounds of 3 calls per path"
    return (f"Kernel call alone, once on each of as many distinct copies of the layer's arguments as read "
            f"{settings['distinct_bytes'] / 2**20:.0f} MiB (`--distinct-mb`: none left in the caches by the call before, as in a model's "
            f"decode), {settings['rounds']} interleaved rounds of one pass per path, the call's time the pass's over the copies")


def render_layers(results: dict) -> str:
    """The markdown table of a --layers results file: each kind, dtype and path's kernel call as a
    multiple of its bound (median and fastest of its samples), with the rates, CPU, threads and load."""
    settings, roof = results["settings"], results["roofline"]
    lines = [f"# Decode kernel paths against the roofline: one layer of {settings['heads']} x {settings['head_dim']} heads, "
             f"{settings['context']} cached tokens, {settings['threads']} thread(s)", "",
             f"Generated by `benchmarks/decode_native.py --layers` (`--render {results['benchmark']}.json`) from "
             f"[`{results['benchmark']}.json`]({results['benchmark']}.json), written {results['time']} at commit "
             f"{results['machine'].get('git_commit')}. " + _kernel_timing(settings) + "; bound = max(bytes / read bandwidth, FLOPs / "
             "FMA rate), both measured before and after each dtype in the same run.", ""]
    for dtype, context in roof["context"].items():
        rates = roof["rates"][dtype]
        load = ", ".join(f"{x:.2f}" for x in context["load_average"])
        after = ", ".join(f"{x:.2f}" for x in context.get("load_average_after", []))
        held = "".join(f", {r['fma_flop_per_s'] / 1e9:.0f} GFLOP/s held to {isa} (its paths' bound)"
                       for isa, r in roof.get("held_rates", {}).get(dtype, {}).items())
        lines += [f"**{dtype}**: CPU {context['cpu_model']}, default kernel path {context['kernel_isa']}, {context['threads']} thread(s), "
                  f"load {load} before and {after} after; read {rates['read_bytes_per_s'] / 1e9:.1f} GB/s, FMA "
                  f"{rates['fma_flop_per_s'] / 1e9:.0f} GFLOP/s{held}.", ""]
    rows = [r for r in results["rows"] if "kernel_s" in r]
    ran = {r["path"] for r in rows}
    paths = [p for p in PATHS if p in ran] + sorted(ran - set(PATHS))
    distinct = bool(settings.get("distinct_bytes"))
    copies_head, copies_rule = ("copies (MiB a pass) | ", "---: | ") if distinct else ("", "")
    lines += ["| kind | dtype | bytes | FLOPs | bound | " + copies_head + " | ".join(f"{p} x bound (fastest)" for p in paths) + " |",
              "| --- | --- | ---: | ---: | --- | " + copies_rule + " | ".join("---:" for _ in paths) + " |"]
    for label, dtype in dict.fromkeys((r["label"], r["dtype"]) for r in rows):
        mine = {r["path"]: r for r in rows if r["label"] == label and r["dtype"] == dtype}
        first = next(iter(mine.values()))
        cells = [f"{mine[p]['kernel_time_over_bound']:.2f} ({min(mine[p]['samples_s']['kernel']) / mine[p]['kernel_bound_s']:.2f})"
                 if p in mine else "" for p in paths]
        copies = f"{first['kernel_copies']} ({first['kernel_copies'] * first['kernel_bytes'] / 2**20:.0f}) | " if distinct else ""
        lines.append(f"| {label} | {dtype} | {first['kernel_bytes'] / 1e6:.1f} MB | {first['kernel_flops'] / 1e6:.0f} M | "
                     f"{first['kernel_bound_s'] * 1e3:.3f} ms {first['kernel_bound']} | " + copies + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384, 32768], help="cached tokens (default 1024,4096,16384,32768)")
    p.add_argument("--kv-heads", type=int_list, default=[8, 2, 1], help="key/value heads per row (default 8,2,1: MHA, GQA, MQA)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int_list, default=[1])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument("--out-dir", default=None, help="results folder (default: the experiment folder of the results' name, benchmarks/results/decode)")
    p.add_argument("--layers", action="store_true", help="every kind's layer on each instruction-set path instead (see above)")
    p.add_argument("--dtypes", type=dtype_list, default=["float32", "bfloat16"], help="with --layers: comma-separated dtypes")
    p.add_argument("--kinds", default=None, help="with --layers: comma-separated kinds (default every registered kind)")
    p.add_argument("--name", default="decode_roofline_layer", help="with --layers: the results file name")
    p.add_argument("--distinct-mb", type=int, default=0, help="with --layers: time each kernel call once on each of enough distinct copies of "
                   "its arguments to read this many MiB a round (past the last-level cache, as a model's decode reads its layers; "
                   "default 0: 3 calls on the layer's own arguments, which may stay in the caches)")
    p.add_argument("--render", metavar="JSON", help="write the markdown table of a --layers results file beside it, and measure nothing")
    args = p.parse_args()
    if args.render:
        source = Path(args.render)
        source.with_suffix(".md").write_text(render_layers(json.loads(source.read_text())), encoding="utf-8")
        print(f"wrote {source.with_suffix('.md')}")
        return
    args.out_dir = args.out_dir or str(results_dir(RESULTS, args.name if args.layers else "decode_native_"))
    if args.distinct_mb < 0:
        raise SystemExit(f"error: --distinct-mb must be 0 or more, got {args.distinct_mb}")
    if args.layers:
        torch.set_num_threads(args.threads[0])
        kinds = [k.strip() for k in args.kinds.split(",")] if args.kinds else None
        layer_benchmark(args.name, kinds, args.contexts[-1], [DTYPES[d] for d in args.dtypes], rounds=args.rounds, heads=args.heads,
                        head_dim=args.head_dim, out_dir=args.out_dir, distinct_bytes=args.distinct_mb * 2**20)
        return
    library = native.decode_kernel()
    if library is None:
        raise SystemExit("error: the native kernel is not available here (no C compiler, or SLIMKV_NATIVE=0); nothing to compare")
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows = [measure(kv, context, heads=args.heads, head_dim=args.head_dim, rounds=args.rounds, library=library)
                for kv in args.kv_heads for context in args.contexts]
        print(f"threads {threads}: kv_heads context   native ms (of copy)   torch ms (of copy)   native/torch   copy GB/s")
        for r in rows:
            print(f"{r['kv_heads']:>18} {r['context']:>7} {r['native_ms']:>10.3f} ({r['native_of_copy']:.2f}) {r['torch_ms']:>12.3f} ({r['torch_of_copy']:.2f})"
                  f" {r['native_over_torch']:>13.2f} {r['copy_bandwidth'] / 1e9:>10.1f}")
        fig, ax = new_figure(figsize=(6, 4))
        for kv in args.kv_heads:
            mine = [r for r in rows if r["kv_heads"] == kv]
            for name, style in (("native", "-o"), ("torch", "--x")):
                ax.plot([r["context"] for r in mine], [r[f"{name}_of_copy"] for r in mine], style, label=f"{name}, {kv} kv heads")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached tokens")
        ax.set_ylabel("cache bytes/s / copy bandwidth")
        ax.set_title(f"decode attention, {args.heads} x {args.head_dim}, {threads} thread(s)")
        ax.legend(fontsize=7)
        payload = {"settings": {**vars(args), "threads": threads}, "native_kernel": native.kernel_path(), "rows": rows}
        path = write_results(f"decode_native_{threads}thread", payload, args.out_dir, figure=fig)
        print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
