"""One row through SmolLM2's projections on every kernel path this CPU runs, against its read bandwidth.

A decode step's linears read every weight once: their bound is the weights' bytes over the read
bandwidth. For float32 and bfloat16 weights, this times, in interleaved rounds on ``--threads``:

- ``model pass``: one row through ``--layers`` layers of SmolLM2-135M's projections the way the model
  calls them (``native_project``: q, k and v in one call, the output projection, gate and up in one
  call, the down projection; 14.2 MB a layer in float32), each kernel path (``runnable_isas``: the
  AVX-512, AVX2 and portable builds of the same source), and ``torch`` (``F.linear`` per weight);
- ``one call``: the same bytes as one matrix of 576 columns in one kernel call (the loop alone, with
  no per-call Python cost).

Reported per row: the median ms, GB/s of weights read, and that rate as a fraction of a read-only sum's
(``roofline.measure_read_bandwidth``, before and after the rounds, the best kept). Every path's output is
checked against ``F.linear`` first.

    .venv/bin/python benchmarks/decode_linear.py --threads 1

Writes benchmarks/results/decode/decode_linear_<threads>thread.json and .md. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from slimkv.bench.roofline import bound_context, measure_read_bandwidth
from slimkv.common.checks import check_int
from slimkv.common.files import write_text
from slimkv.common.markdown import markdown_table, provenance_line
from slimkv.common.results import results_dir
from slimkv.common.timing import time_fn, write_results
from slimkv.ops import native, native_rows
from slimkv.ops.native_build import library_isa, runnable_isas

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYER_CALLS = [[(576, 576), (192, 576), (192, 576)], [(576, 576)], [(1536, 576), (1536, 576)], [(576, 1536)]]
"""(out, in) features of the weights of each call in one layer: q, k and v; o; gate and up; down."""


def layer_weights(dtype: torch.dtype, layers: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
    """SmolLM2's projections as the model calls them, ``layers`` times: a list of calls, each a list of weights sharing one input row."""
    calls = []
    for _ in range(layers):
        calls += [[torch.randn(o, i, generator=gen).to(dtype) for o, i in shapes] for shapes in LAYER_CALLS]
    return calls


def variants(dtype: torch.dtype, layers: int) -> tuple[dict[str, tuple[Callable[[], object], int]], dict[str, str]]:
    """Name -> (one timed call, bytes it reads), and name -> the path it ran; outputs checked against ``F.linear`` here."""
    gen = torch.Generator().manual_seed(0)
    calls = layer_weights(dtype, layers, gen)
    rows = {576: torch.randn(1, 1, 576, generator=gen).to(dtype), 1536: torch.randn(1, 1, 1536, generator=gen).to(dtype)}
    nbytes = sum(w.numel() * w.element_size() for call in calls for w in call)
    big = torch.randn(nbytes // (576 * calls[0][0].element_size()), 576, generator=gen).to(dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2e-2}
    found: dict[str, tuple[Callable[[], object], int]] = {}
    ran: dict[str, str] = {}
    for isa in runnable_isas():
        library = native.isa_kernel(dtype, isa)
        if library_isa(library) in ran.values():  # a float32 build of avx512-bf16 is the avx512 path
            continue
        for call in calls[:4]:
            x = rows[call[0].shape[1]]
            for got, w in zip(native_rows.native_project(x, call, [None] * len(call), library), call, strict=True):
                torch.testing.assert_close(got.float(), F.linear(x, w).float(), **tolerance)
        found[f"model pass, {isa}"] = (lambda lib=library: [native_rows.native_project(rows[c[0].shape[1]], c, [None] * len(c), lib) for c in calls], nbytes)
        found[f"one call, {isa}"] = (lambda lib=library: native_rows.native_linear(rows[576], big, None, lib), big.numel() * big.element_size())
        ran[f"model pass, {isa}"] = ran[f"one call, {isa}"] = library_isa(library)
    found["model pass, torch"] = (lambda: [F.linear(rows[w.shape[1]], w) for c in calls for w in c], nbytes)
    ran["model pass, torch"] = f"torch ({torch.backends.cpu.get_cpu_capability()})"
    return found, ran


def measure(dtype: torch.dtype, layers: int, rounds: int) -> list[dict]:
    """Interleaved rounds of every variant (best of 3 per round); rows with the median."""
    found, ran = variants(dtype, layers)
    samples: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(rounds):
        for name, (fn, _) in found.items():
            samples[name].append(time_fn(fn, warmup=1, repeats=3)["min_s"])
    return [{"dtype": str(dtype).removeprefix("torch."), "variant": name, "path": ran[name], "bytes_read": nbytes,
             "median_s": statistics.median(samples[name]), "samples_s": samples[name]} for name, (_, nbytes) in found.items()]


def render(payload: dict) -> str:
    """The page of a results file: per dtype and variant, ms, GB/s and the fraction of the read rate."""
    s = payload["settings"]
    read = payload["read_bytes_per_s"]
    lines = [f"# One row through SmolLM2's projections, every kernel path ({s['threads']} thread(s))", "",
             f"{provenance_line('benchmarks/decode_linear.py', payload, s['load_average_before'])}. {s['layers']} layers of projections "
             f"({s['rounds']} interleaved rounds, best of 3 each, median shown). Read bandwidth {read / 1e9:.1f} GB/s (a read-only sum over "
             "512 MiB of float32 on the same threads, the best of before and after the rounds); the bound of each row is its bytes over it.", ""]
    table = [[r["dtype"], r["variant"], r["path"], f"{r['bytes_read'] / 1e6:.0f}", f"{r['median_s'] * 1e3:.2f}",
              f"{r['bytes_read'] / r['median_s'] / 1e9:.1f}", f"{r['bytes_read'] / r['median_s'] / read:.2f}"] for r in payload["rows"]]
    lines.append(markdown_table(["dtype", "variant", "path", "MB", "ms", "GB/s", "of read rate"], table, align=["left"] * 3 + ["right"] * 4))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch's and the kernel's threads (default 1)")
    p.add_argument("--layers", type=int, default=30, help="SmolLM2 layers of projections (default 30: the whole model, 425 MB in float32)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--render", metavar="JSON", help="write the page of a results file beside it, and measure nothing")
    args = p.parse_args()
    if args.render:
        path = Path(args.render)
        write_text(path.with_suffix(".md"), render(json.loads(path.read_text(encoding="utf-8"))))
        return
    try:
        for option in ("threads", "layers", "rounds"):
            check_int(f"--{option}", getattr(args, option), 1)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    if native.decode_kernel() is None:
        raise SystemExit("error: the native kernel is not available here (no C compiler, or SLIMKV_NATIVE=0): nothing to time")
    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    before = measure_read_bandwidth()
    rows = [row for dtype in DTYPES.values() for row in measure(dtype, args.layers, args.rounds)]
    after = measure_read_bandwidth()
    read = max(before["bytes_per_s"], after["bytes_per_s"])
    for row in rows:
        print(f"{row['dtype']:<9} {row['variant']:<28} {row['median_s'] * 1e3:8.2f} ms  {row['bytes_read'] / row['median_s'] / read:.2f} of read rate")
    name = f"decode_linear_{args.threads}thread"
    settings = {"threads": args.threads, "layers": args.layers, "rounds": args.rounds, "load_average_before": load_before,
                "runnable_isas": runnable_isas(), "context": bound_context()}
    path = write_results(name, {"settings": settings, "read_bytes_per_s": read, "read": {"before": before, "after": after}, "rows": rows},
                         results_dir(RESULTS, name))
    write_text(path.with_suffix(".md"), render(json.loads(path.read_text(encoding="utf-8"))))
    print(f"wrote {path} and {path.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
