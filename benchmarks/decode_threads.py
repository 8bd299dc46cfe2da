"""When a second thread pays for one decode kernel call: one thread against ``--threads`` over contexts.

A call gains from a second thread only when its work outweighs handing half of it over (the
kernel's threads are torch's OpenMP team, csrc/threads.h). ``slimkv.ops.native`` decides by the
call's work (``attention_threads``, ``linear_threads``); this benchmark measures what that rule should be. For SmolLM2's layer
layouts, batch 1: ``gqa3x64`` (the exact copy: 3 KV heads of 64, 3 query heads each; float32 and
bfloat16 rows, int8 and int4 codes), ``mla192`` (the MLA conversion's shared rows of 192 with the
values inside, 9 query heads; float32 and bfloat16), the kernel call alone, with threads forced on
(``ATTENTION_PARALLEL_MIN_FLOPS`` 0) against one thread, in interleaved rounds; and one row through
SmolLM2's projections (``linear``: q/k/v fused 576 -> 960, gate and up fused 576 -> 3072, down
1536 -> 576, the tied output layer 576 -> 49152) by the native loop on one thread and forced onto
the threads (``PARALLEL_MIN_BYTES`` 0), beside torch's ``F.linear`` on the threads (what a call the
rule keeps from the native loop runs). Reported per row: bytes read, FLOPs, the medians, their
ratio, and whether the library's rule starts the threads for that call.

    .venv/bin/python benchmarks/decode_threads.py --threads 2

writes benchmarks/results/decode/decode_threads_<threads>thread.json and .md. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from decode_all import int_list  # this folder's decode benchmark: its list parser
from decode_native import call_cost  # the bytes and FLOPs of one kernel call

from slimkv.common.markdown import provenance_line
from slimkv.common.results import results_dir
from slimkv.common.timing import time_fn, write_results
from slimkv.ops import native, native_rows
from slimkv.ops.attention import buffer_segments
from slimkv.ops.codes import QuantizedRows
from slimkv.ops.quantize import parse_storage

RESULTS = Path(__file__).resolve().parent / "results"
STORAGES = {"float32": None, "bfloat16": None, "int8": "int8", "int4": "int4"}
LAYOUTS = {"gqa3x64": ("float32", "bfloat16", "int8", "int4"), "mla192": ("float32", "bfloat16")}
PROJECTIONS = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}  # (in, out) features


def kernel_call(layout: str, storage: str, context: int) -> tuple[Callable[[], torch.Tensor], int, int, bool]:
    """A kernel call of ``layout`` over ``context`` keys in ``storage``: the call, its bytes read and
    FLOPs, and whether ``slimkv.ops.native``'s rule gives it several threads."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if storage == "bfloat16" else torch.float32
    library = native.decode_kernel(dtype)
    if layout == "mla192":
        q = torch.randn(1, 9, 1, 192, generator=gen).to(dtype)
        k = torch.randn(1, 1, context, 192, generator=gen).to(dtype)
        v = k[..., :160]
        nbytes, flops = call_cost([q], [(k, v)])
        return (lambda: native.native_decode_attention([q], [(k, v)], 0.07, library)), nbytes, flops, native.attention_threads(flops) > 1
    q = torch.randn(1, 9, 1, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, 3, context, 64, generator=gen).to(dtype) for _ in range(2))
    if STORAGES[storage] is None:
        nbytes, flops = call_cost([q], [(k, v)])
        return (lambda: native.native_decode_attention([q], [(k, v)], 0.125, library)), nbytes, flops, native.attention_threads(flops) > 1
    kb, vb = (parse_storage(STORAGES[storage]).buffer(1, 3, 64, dtype=dtype, device="cpu") for _ in range(2))
    kb.store(k)
    vb.store(v)
    segments = buffer_segments(kb, vb)
    nbytes = sum(part.nbytes() if isinstance(part, QuantizedRows) else part.numel() * part.element_size() for pair in segments for part in pair)
    flops = 2 * 9 * context * 128
    return (lambda: native.native_stored_attention(q, segments, 0.125, library)), nbytes, flops, native.attention_threads(flops) > 1


def interleaved(calls: dict[str, tuple[Callable[[], object], int]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each named call on its thread count (forced on: both thresholds 0), the calls interleaved in rounds."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (call, threads) in calls.items():
            torch.set_num_threads(threads)
            with mock.patch.object(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0), mock.patch.object(native_rows, "PARALLEL_MIN_BYTES", 0):
                samples[name] += time_fn(call, warmup=1, repeats=5)["samples_s"]
    return samples


def measure(layout: str, storage: str, context: int, threads: int, rounds: int) -> dict:
    """Interleaved medians of the call on one thread and on ``threads`` (started whatever its size)."""
    call, nbytes, flops, rule_threads = kernel_call(layout, storage, context)
    samples = interleaved({"one": (call, 1), "many": (call, threads)}, rounds)
    one, many = statistics.median(samples["one"]), statistics.median(samples["many"])
    return {"layout": layout, "storage": storage, "context": context, "bytes": nbytes, "flops": flops, "one_thread_s": one, "threads_s": many,
            "speedup": one / many, "rule_starts_threads": rule_threads, "samples_s": samples}


def measure_projection(name: str, dtype: torch.dtype, threads: int, rounds: int) -> dict:
    """One row through a projection of SmolLM2's shape: the native loop on one thread and on ``threads``, torch's on ``threads``."""
    in_f, out_f = PROJECTIONS[name]
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(out_f, in_f, generator=gen).to(dtype), torch.randn(1, 1, in_f, generator=gen).to(dtype)
    library = native.decode_kernel(dtype)
    calls = {"one": (lambda: native_rows.native_linear(x, w, None, library), 1), "many": (lambda: native_rows.native_linear(x, w, None, library), threads),
             "torch": (lambda: torch.nn.functional.linear(x, w), threads)}
    samples = interleaved(calls, rounds)
    one, many, by_torch = (statistics.median(samples[k]) for k in ("one", "many", "torch"))
    torch.set_num_threads(threads)
    rule = native_rows.supports_linear(x, w, None) and native_rows.linear_threads(w.numel() * w.element_size()) > 1
    return {"layout": f"linear {name}", "storage": str(dtype).removeprefix("torch."), "context": 0, "bytes": w.numel() * w.element_size(),
            "flops": 2 * in_f * out_f, "one_thread_s": one, "threads_s": many, "torch_threads_s": by_torch, "speedup": one / many,
            "rule_starts_threads": rule, "samples_s": samples}


def render(results: dict) -> str:
    """The markdown table of a results file: per layout and storage, each context's speedup and the rule's choice."""
    s = results["settings"]
    lines = [f"# One decode kernel call on {s['threads']} threads against one (SmolLM2's layer layouts, batch 1)", "",
             f"{provenance_line('benchmarks/decode_threads.py', results, s['load_average_before'])}; kernel path {s['kernel_isa']}; "
             f"{s['rounds']} interleaved rounds of 5 calls each. Threads forced on for the second column; `rule`: whether "
             "`slimkv.ops.native.attention_threads` starts them for that call.", "",
             "| layout | storage | context | MB read | MFLOP | 1 thread ms | threads ms | speedup | torch on the threads ms | rule |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results["rows"]:
        by_torch = f"{r['torch_threads_s'] * 1e3:.3f}" if "torch_threads_s" in r else ""
        lines.append(f"| {r['layout']} | {r['storage']} | {r['context'] or ''} | {r['bytes'] / 1e6:.2f} | {r['flops'] / 1e6:.0f} | {r['one_thread_s'] * 1e3:.3f} | "
                     f"{r['threads_s'] * 1e3:.3f} | {r['speedup']:.2f} | {by_torch} | {'threads' if r['rule_starts_threads'] else 'one'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="the thread count set against one (default 2)")
    p.add_argument("--contexts", type=int_list, default=[1024, 2048, 4096, 8192, 16384, 32768], help="cached tokens (default 1024..32768)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--render", metavar="JSON", help="write the markdown table of a results file beside it, and measure nothing")
    args = p.parse_args()
    if args.render:
        path = Path(args.render)
        path.with_suffix(".md").write_text(render(json.loads(path.read_text(encoding="utf-8"))), encoding="utf-8")
        return
    if native.decode_kernel() is None:
        raise SystemExit("error: the native kernel is not available here (no C compiler, or SLIMKV_NATIVE=0): nothing to time")
    load_before = list(os.getloadavg())
    rows = []
    for layout, storages in LAYOUTS.items():
        for storage in storages:
            for context in args.contexts:
                row = measure(layout, storage, context, args.threads, args.rounds)
                rows.append(row)
                print(f"{layout:<8}{storage:>9}{context:>7}  {row['bytes'] / 1e6:7.2f} MB  1t {row['one_thread_s'] * 1e3:7.3f} ms  "
                      f"{args.threads}t {row['threads_s'] * 1e3:7.3f} ms  x{row['speedup']:.2f}  rule: {'threads' if row['rule_starts_threads'] else 'one'}")
    for projection in PROJECTIONS:
        for dtype in (torch.float32, torch.bfloat16):
            row = measure_projection(projection, dtype, args.threads, args.rounds)
            rows.append(row)
            print(f"{row['layout']:<16}{row['storage']:>9}  {row['bytes'] / 1e6:7.2f} MB  1t {row['one_thread_s'] * 1e3:7.3f} ms  "
                  f"{args.threads}t {row['threads_s'] * 1e3:7.3f} ms  x{row['speedup']:.2f}  torch {args.threads}t {row['torch_threads_s'] * 1e3:7.3f} ms")
    name = f"decode_threads_{args.threads}thread"
    settings = {"threads": args.threads, "rounds": args.rounds, "contexts": args.contexts, "kernel_isa": native.kernel_isa(torch.float32),
                "load_average_before": load_before, "attention_parallel_min_flops": native.ATTENTION_PARALLEL_MIN_FLOPS,
                "parallel_min_bytes": native_rows.PARALLEL_MIN_BYTES}
    path = write_results(name, {"settings": settings, "rows": rows}, results_dir(RESULTS, name))
    path.with_suffix(".md").write_text(render(json.loads(path.read_text(encoding="utf-8"))), encoding="utf-8")
    print(f"wrote {path} and {path.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
