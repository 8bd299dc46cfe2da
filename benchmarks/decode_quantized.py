"""The native kernel's quantized-cache and one-row linear entries against the torch paths, interleaved in one run.

Attention: one decode step of one SmolLM2-shaped layer (``--kv-heads`` 3 key/value heads under 9
query heads of 64, batch 1) over ``--context`` cached tokens, in float32 and bfloat16: the cache
stored as int4 and int8 codes read in place (``stored_decode_attention``: the native kernel's
quantized entry), the same buffers dequantized then attended (the torch path a quantized cache
took before), and the same rows in full precision through the plain native kernel. Reported per
variant: median ms, ns per cached key (keys and values of one head), the bytes the step reads and
its read rate.

Linear: one row through SmolLM2's projection shapes (576 -> 576, 192, 1536; 1536 -> 576; the tied
576 -> 49152 output layer), each with ``--copies`` distinct weight matrices visited in turn so the
weights are read from memory, not from the CPU's caches: the native loop (``slimkv.ops.linear``)
against ``F.linear``, with GB/s of weights read.

``--isas avx2,portable``: the attention variants read in place and the full rows are also timed
through the kernel built for each named instruction-set path this CPU can run (the path a user's
CPU without AVX-512 takes), in the same interleaved rounds, each row naming its path.

Before timing, every variant's output is checked against its reference. The JSON records the
CPU model, the kernel's path, threads and load (``roofline``'s context and rates).

    .venv/bin/python benchmarks/decode_quantized.py --threads 1 [--isas avx2]

Writes benchmarks/results/decode/decode_quantized_<threads>thread.json and .md (``--name``: another name
starting ``decode_quantized``, e.g. a second CPU's results beside the first's). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from slimkv.bench.roofline import bound_context, machine_rates
from slimkv.common.files import write_text
from slimkv.common.markdown import markdown_table
from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.ops import native
from slimkv.ops.attention import buffer_segments, decode_attention, stored_decode_attention
from slimkv.ops.linear import linear
from slimkv.ops.quantize import parse_storage

RESULTS = Path(__file__).resolve().parent / "results"
LINEAR_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median of each variant's per-round best")
    p.add_argument("--copies", type=int, default=0, help="distinct weight matrices per linear shape (default: enough for 256 MB)")
    p.add_argument("--isas", default="", help="also time the attention on the kernels built for these paths (comma-separated, among "
                   f"{', '.join(native.ISAS)}; each must run on this CPU)")
    p.add_argument("--name", default=None, help="results name (default decode_quantized_<threads>thread); must start with decode_quantized, "
                   "letters, digits, _ and - only: e.g. decode_quantized_xeon_1thread for a second CPU's results")
    p.add_argument("--out-dir", default=None, help="results folder (default: the experiment folder of the results' name, benchmarks/results/decode)")
    args = p.parse_args()
    args.isas = [isa for isa in args.isas.split(",") if isa]
    if args.name is not None and not re.fullmatch(r"decode_quantized[A-Za-z0-9_-]*", args.name):
        p.error(f"--name {args.name!r}: must start with decode_quantized and hold only letters, digits, _ and -")
    args.name = args.name or f"decode_quantized_{args.threads}thread"
    runnable = native.runnable_isas()
    for isa in args.isas:
        if isa not in native.ISAS:
            p.error(f"--isas {isa!r}: not a kernel path; allowed: {', '.join(native.ISAS)}")
        if isa not in runnable:
            p.error(f"--isas {isa!r}: this CPU cannot run it; it runs {', '.join(runnable)}")
    return args


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def attention_rows(dtype: torch.dtype, context: int, kv_heads: int, rounds: int, isas: Sequence[str] = ()) -> list[dict]:
    """The variants' step times, interleaved over ``rounds``; ``isas``: also the in-place and full-row
    variants through the kernel built for each named path (bfloat16-only paths skipped for float32)."""
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, kv_heads, context, 64, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(1, 3 * kv_heads, 1, 64, generator=gen).to(dtype)
    scale = 1 / math.sqrt(q.shape[-1])
    kernels = {isa: native.isa_kernel(dtype, isa) for isa in isas if dtype == torch.bfloat16 or not isa.endswith("-bf16")}
    variants = {}
    for spec in ("int4", "int8"):
        storage = parse_storage(spec)
        kb, vb = (storage.buffer(1, kv_heads, 64, dtype=dtype, device="cpu") for _ in range(2))
        kb.store(k)
        vb.store(v)
        segments = buffer_segments(kb, vb)
        read = kb.nbytes() + vb.nbytes()
        got, expected = stored_decode_attention(q, segments), decode_attention(q, kb.view(), vb.view())
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2e-3)
        variants[f"{spec} codes in place"] = (lambda s=segments: stored_decode_attention(q, s), read, 10)
        variants[f"{spec} dequantized (torch path)"] = (lambda a=kb, b=vb: decode_attention(q, a.view(), b.view()), read, 2)
        for isa, library in kernels.items():
            torch.testing.assert_close(native.native_stored_attention(q, segments, scale, library).float(), expected.float(), rtol=2**-7, atol=2e-3)
            variants[f"{spec} codes in place, {isa} path"] = (lambda s=segments, lib=library: native.native_stored_attention(q, s, scale, lib), read, 10)
    variants["full rows (plain kernel)"] = (lambda: decode_attention(q, k, v), 2 * k.numel() * k.element_size(), 10)
    for isa, library in kernels.items():
        variants[f"full rows (plain kernel), {isa} path"] = (lambda lib=library: native.native_decode_attention([q], [(k, v)], scale, lib),
                                                             2 * k.numel() * k.element_size(), 10)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (fn, _, repeats) in variants.items():
            times[name].append(best_of(fn, repeats))
    rows = []
    for name, (_, read, _) in variants.items():
        seconds = statistics.median(times[name])
        rows.append({"dtype": str(dtype).removeprefix("torch."), "variant": name, "ms": seconds * 1e3, "ns_per_key": seconds * 1e9 / (kv_heads * context),
                     "bytes_read": read, "read_gb_per_s": read / seconds / 1e9})
    return rows


def linear_rows(dtype: torch.dtype, rounds: int, copies: int) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(1)
    for out_f, in_f in LINEAR_SHAPES:
        count = copies or max(2, (256 << 20) // (out_f * in_f * torch.empty((), dtype=dtype).element_size()))
        weights = [torch.randn(out_f, in_f, generator=gen).to(dtype) for _ in range(count)]
        x = torch.randn(1, 1, in_f, generator=gen).to(dtype)
        torch.testing.assert_close(linear(x, weights[0]).float(), F.linear(x, weights[0]).float(), rtol=2**-7, atol=1e-2)
        paths = {"native": linear, "torch": F.linear}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(rounds):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                for w in weights:
                    fn(x, w)
                times[name].append((time.perf_counter() - t0) / count)
        size = out_f * in_f * weights[0].element_size()
        row = {"dtype": str(dtype).removeprefix("torch."), "shape": f"{out_f} x {in_f}", "weights": count}
        for name in paths:
            seconds = statistics.median(times[name])
            row[f"{name}_us"], row[f"{name}_gb_per_s"] = seconds * 1e6, size / seconds / 1e9
        row["torch_over_native"] = row["torch_us"] / row["native_us"]
        rows.append(row)
    return rows


def render(payload: dict) -> str:
    ctx, rates = payload["roofline"]["context"], payload["roofline"]["rates"]
    lines = [f"# The native kernel's quantized-cache and linear entries ({payload['settings']['threads']} thread(s))", "",
             f"Generated by `benchmarks/decode_quantized.py` into `{payload['benchmark']}.json`. CPU {ctx['cpu_model']}, kernel path "
             f"{ctx['kernel_isa']}, load {ctx['load_average'][0]:.2f} at the start; read bandwidth {rates['read_bytes_per_s'] / 1e9:.1f} GB/s "
             "(a read-only sum over 512 MiB, same threads).", "",
             f"## One decode step, {payload['settings']['kv_heads']} KV heads x {3 * payload['settings']['kv_heads']} query heads of 64, "
             f"{payload['settings']['context']} tokens", ""]
    lines.append(markdown_table(["dtype", "variant", "ms", "ns / key", "MB read", "GB/s"],
                   [[r["dtype"], r["variant"], f"{r['ms']:.3f}", f"{r['ns_per_key']:.1f}", f"{r['bytes_read'] / 1e6:.1f}", f"{r['read_gb_per_s']:.1f}"]
                    for r in payload["attention"]]))
    lines += ["", "## One row through a linear layer (weights read from memory)", ""]
    lines.append(markdown_table(["dtype", "weights", "native us", "native GB/s", "torch us", "torch GB/s", "torch / native"],
                   [[r["dtype"], r["shape"], f"{r['native_us']:.0f}", f"{r['native_gb_per_s']:.1f}", f"{r['torch_us']:.0f}",
                     f"{r['torch_gb_per_s']:.1f}", f"{r['torch_over_native']:.2f}x"] for r in payload["linear"]]))
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    if native.decode_kernel() is None:
        raise SystemExit("no native kernel on this machine (no C compiler, or SLIMKV_NATIVE=0): nothing to compare")
    context = bound_context()
    rates = machine_rates()
    attention = [row for dtype in DTYPES.values() for row in attention_rows(dtype, args.context, args.kv_heads, args.rounds, args.isas)]
    linear_results = [row for dtype in DTYPES.values() for row in linear_rows(dtype, args.rounds, args.copies)]
    payload = {"settings": {"threads": args.threads, "context": args.context, "kv_heads": args.kv_heads, "rounds": args.rounds, "isas": args.isas,
                            "kernel_isa": {name: native.kernel_isa(dtype) for name, dtype in DTYPES.items()}},
               "roofline": {"context": context, "rates": rates, "load_after": bound_context()["load_average"]},
               "attention": attention, "linear": linear_results}
    name = args.name
    out_dir = Path(args.out_dir) if args.out_dir else results_dir(RESULTS, name)
    path = write_results(name, payload, out_dir)
    payload["benchmark"] = name
    write_text(out_dir / f"{name}.md", render(payload))
    print(render(payload))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
