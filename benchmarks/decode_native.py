"""The native decode kernel against the torch path, interleaved in one run.

One decode step of attention alone (no projections): 8 query heads x 64, batch 1, float32, with
key/value heads 8 (MHA), 2 (GQA) and 1 (MQA), at each context. Per call: the native kernel
(``slimkv.ops.native``), the torch path (``matmul_decode_attention``: two matmuls around a softmax)
and a large copy, in rounds, so that background load hits them alike. Reported: median ms,
the cache's GB/s and its fraction of the copy bandwidth measured in the same rounds, and
native / torch. The kernel's output is checked against the torch path's before timing.

    .venv/bin/python benchmarks/decode_native.py --threads 1
    .venv/bin/python benchmarks/decode_native.py --threads 1,2 --contexts 4096,32768

Writes benchmarks/results/decode_native_<threads>thread.json and .png. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from decode_all import int_list  # this folder's decode benchmark: one parser for comma-separated counts

from slimkv.common.plotting import new_figure
from slimkv.common.timing import write_results
from slimkv.ops import native
from slimkv.ops.attention import matmul_decode_attention

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
            call()
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in samples.items()}
    cache_bytes = 2 * kv_heads * context * head_dim * 4
    copy_bandwidth = 2 * COPY_BYTES / median["copy"]
    row = {"kv_heads": kv_heads, "context": context, "cache_bytes": cache_bytes, "copy_bandwidth": copy_bandwidth, "samples_s": samples,
           "native_over_torch": median["native"] / median["torch"]}
    for name in ("native", "torch"):
        row[f"{name}_ms"] = median[name] * 1e3
        row[f"{name}_of_copy"] = cache_bytes / median[name] / copy_bandwidth
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384, 32768], help="cached tokens (default 1024,4096,16384,32768)")
    p.add_argument("--kv-heads", type=int_list, default=[8, 2, 1], help="key/value heads per row (default 8,2,1: MHA, GQA, MQA)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int_list, default=[1])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args()
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
