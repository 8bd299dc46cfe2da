"""Which software prefetch the AVX-512 row tiles should use on this CPU: the kernel built with each rule, side by side.

The 32/64/128-wide row tiles (MHA, GQA, MQA, sliding window, KVM regions, hybrid) prefetch the rows
``PREFETCH_BLOCKS`` blocks ahead by a rule chosen at build time (``ROW_PREFETCH_ALWAYS`` in
``slimkv/ops/csrc/decode_avx512.h``): ``always`` (every tile, into L1: measured on an Intel Xeon),
``several-tiles`` (only items whose rows take several tiles per block, into L2: measured on an AMD
Zen 4), and ``none`` (``PREFETCH_BLOCKS`` 0: the hardware prefetcher alone). This benchmark builds
the avx512 path (avx512-bf16 for bfloat16 where the CPU has it) with each, times one kernel call per
layout at ``--context`` keys, batch 1, 64-wide heads, the three builds interleaved in rounds, and
evicts the caches before every call (a read of ``--evict-mib``, as a model's other layers would), so
a cache that fits the last-level cache is read from memory as in a real step. Reported: each build's
median, its read rate as a fraction of a plain sum's in the same run, and which rule this CPU's
default build takes.

    .venv/bin/python benchmarks/decode_prefetch.py [--context 32768] [--rounds 11]

writes benchmarks/results/decode/decode_prefetch_1thread.json and .md. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from slimkv.bench.roofline import measure_read_bandwidth
from slimkv.common.markdown import provenance_line
from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.ops import native

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "decode_prefetch_1thread"
LAYOUTS = {"mha": (8, 1), "gqa": (2, 4), "smollm2": (3, 3), "mqa": (1, 8)}  # name -> (key/value heads, query rows per head), 64 wide
RULES = {"always": ("-DROW_PREFETCH_ALWAYS=1",), "several-tiles": ("-DROW_PREFETCH_ALWAYS=0",), "none": ("-DPREFETCH_BLOCKS=0",)}
HEAD_DIM = 64


def measure(layout: str, dtype: torch.dtype, isa: str, context: int, rounds: int, evict: torch.Tensor) -> dict:
    """Interleaved medians of one kernel call per rule's build, the caches evicted before each call."""
    kv_heads, groups = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, kv_heads * groups, 1, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, context, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    scale = HEAD_DIM**-0.5
    libraries = {rule: native.isa_kernel(dtype, isa, flags) for rule, flags in RULES.items()}
    first = None
    for library in libraries.values():  # every build gives the same answer (the tests compare each with the reference)
        out = native.native_decode_attention([q], [(k, v)], scale, library)
        first = out if first is None else first
        torch.testing.assert_close(out.float(), first.float(), rtol=1e-3, atol=1e-4)
    samples: dict[str, list[float]] = {rule: [] for rule in libraries}
    for _ in range(rounds):
        for rule, library in libraries.items():
            for _ in range(3):
                evict.sum()
                start = time.perf_counter()
                native.native_decode_attention([q], [(k, v)], scale, library)
                samples[rule].append(time.perf_counter() - start)
    nbytes = (k.numel() + v.numel()) * k.element_size()
    return {"layout": layout, "kv_heads": kv_heads, "groups": groups, "dtype": str(dtype).removeprefix("torch."), "isa": isa, "context": context,
            "bytes": nbytes, "median_s": {rule: statistics.median(s) for rule, s in samples.items()}, "samples_s": samples}


def render(results: dict) -> str:
    """The markdown table of a results file: per layout and dtype, each rule's time and read rate, and the ratio to the best."""
    s = results["settings"]
    lines = [f"# Row-tile prefetch rules side by side ({s['context']} keys, batch 1, 64-wide heads, 1 thread)", "",
             f"{provenance_line('benchmarks/decode_prefetch.py', results, s['load_average_before'])}; {s['rounds']} interleaved rounds of 3 calls per build, {s['evict_mib']} MiB read before every call; plain sum "
             f"{s['read_bytes_per_s'] / 1e9:.1f} GB/s. This CPU's default build takes `{s['default_rule']}`. Cell: median ms "
             "(fraction of the sum's read rate; time over the fastest rule's).", "",
             "| layout | kv heads x rows | dtype | path | " + " | ".join(RULES) + " |", "| --- | --- | --- | --- |" + " ---: |" * len(RULES)]
    for r in results["rows"]:
        best = min(r["median_s"].values())
        cells = [f"{r['median_s'][rule] * 1e3:.3f} ({r['bytes'] / r['median_s'][rule] / s['read_bytes_per_s']:.2f}; "
                 f"{r['median_s'][rule] / best:.2f}x)" for rule in RULES]
        lines.append(f"| {r['layout']} | {r['kv_heads']} x {r['groups']} | {r['dtype']} | {r['isa']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768, help="cached tokens (default 32768)")
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default 11)")
    p.add_argument("--evict-mib", type=int, default=96, help="MiB read before every call to evict the caches (default 96)")
    p.add_argument("--render", metavar="JSON", help="write the markdown table of a results file beside it, and measure nothing")
    args = p.parse_args()
    if args.render:
        path = Path(args.render)
        path.with_suffix(".md").write_text(render(json.loads(path.read_text(encoding="utf-8"))), encoding="utf-8")
        return
    if native.compiler() is None or "avx512" not in native.runnable_isas():
        raise SystemExit("error: this benchmark builds the AVX-512 path: it needs a C compiler and a CPU with AVX-512F and AVX-512BW")
    torch.set_num_threads(1)
    load_before = list(os.getloadavg())
    evict = torch.ones(args.evict_mib << 18)
    rate = measure_read_bandwidth()["bytes_per_s"]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        isa = "avx512-bf16" if dtype == torch.bfloat16 and "avx512-bf16" in native.runnable_isas() else "avx512"
        for layout in LAYOUTS:
            row = measure(layout, dtype, isa, args.context, args.rounds, evict)
            rows.append(row)
            print(f"{layout:<8}{row['dtype']:>9} {isa:<12}" + "  ".join(f"{rule} {t * 1e3:7.3f} ms" for rule, t in row["median_s"].items()))
    settings = {"context": args.context, "rounds": args.rounds, "evict_mib": args.evict_mib, "threads": 1, "read_bytes_per_s": rate,
                "load_average_before": load_before, "rules": {rule: list(flags) for rule, flags in RULES.items()},
                "default_rule": native.library_row_prefetch_rule(native.isa_kernel(torch.float32, "avx512"))}
    path = write_results(NAME, {"settings": settings, "rows": rows}, results_dir(RESULTS, NAME))
    path.with_suffix(".md").write_text(render(json.loads(path.read_text(encoding="utf-8"))), encoding="utf-8")
    print(f"wrote {path} and {path.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
