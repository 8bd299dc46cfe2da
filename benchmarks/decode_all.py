"""Decode speed of every registered attention kind at matched width.

One layer per kind (default 8 heads x 64, d_model 512, batch 1, float32), caches filled to each
context by the kind's own prefill, then per-token decode time, the live cache bytes a step reads,
the GB/s that implies and the machine's measured memory-copy bandwidth beside it, the counted
FLOPs per step, and each row's roofline (docs/evaluation.md, "Roofline and kernel paths"): the bytes
a step reads and its FLOPs against a read-only bandwidth and a small-GEMM FMA rate measured in the
same run, the bound max(bytes / bandwidth, FLOPs / rate) and the step time as a multiple of it, with
the CPU model, the kernel's instruction-set path, the threads and the load. Every kind in
``ATTENTION_KINDS`` runs, with the matched-width options of ``slimkv.bench.decode`` (kinds without
an entry fall back to their registered example options, and the output says so).

    .venv/bin/python benchmarks/decode_all.py --threads 1,2     # 1K..32K, every kind, 1 then 2 threads
    .venv/bin/python benchmarks/decode_all.py --width demo --threads 1,2   # the demo's 4 x 32 heads, 512..8K
    .venv/bin/python benchmarks/decode_all.py --quick           # smoke run (small contexts)
    .venv/bin/python benchmarks/decode_all.py --dtype float32,bfloat16 --threads 1   # one run per dtype
    .venv/bin/python benchmarks/decode_all.py --heads 32 --head-dim 128 --contexts 1024,8192
    .venv/bin/python benchmarks/decode_all.py --kinds mha,mla --kind-options '{"mla": {"kv_rank": 128, "rope_dim": 32}}'

Writes benchmarks/results/decode/<name>[_<dtype>]_<threads>thread.json (machine, settings, raw samples,
roofline, targets) and .png per dtype (float32 unnamed) and thread count. Targets
(docs/evaluation.md, "Speed benchmarks"): at 32K the read-bound kinds stream their cache at >= 0.8 x copy bandwidth, MLA/LRKV within 1.2x of their bytes ratio x
MHA's time, KVM fixed >= 30x and sqrt >= 8x MHA's speed; at the demo width no kind is slower than
MHA from 2K on and no time falls as the context grows. Run it on a quiet machine (load < 1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from decode_targets import all_targets  # benchmarks/decode_targets.py, beside this script

from slimkv.attention import ATTENTION_KINDS
from slimkv.bench.decode import matched_width_variants, run_decode_benchmark
from slimkv.common.results import results_dir

RESULTS = Path(__file__).resolve().parent / "results"  # where this repository keeps benchmark results

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CONTEXTS = "1024,2048,4096,8192,16384,32768"
DEMO_CONTEXTS = "512,1024,2048,4096,8192"
QUICK_CONTEXTS = "256,1024"
WIDTHS = {"paper": (8, 64), "demo": (4, 32)}  # heads x head_dim: the targets' layer and the demo model's


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def dtype_list(text: str) -> list[str]:
    names = [d.strip() for d in text.split(",") if d.strip()]
    for name in names:
        if name not in DTYPES:
            raise argparse.ArgumentTypeError(f"{name!r} is not allowed; allowed values: {', '.join(DTYPES)}")
    return names or ["float32"]


def kind_list(text: str) -> list[str]:
    return [k.strip() for k in text.split(",") if k.strip()]


def parser(description: str = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", type=kind_list, default=None, help="comma-separated kinds (default: every registered kind)")
    p.add_argument("--contexts", type=int_list, default=None, help=f"cached tokens (default {DEFAULT_CONTEXTS})")
    p.add_argument("--width", choices=sorted(WIDTHS), default="paper", help="paper: 8 heads x 64 (the targets' layer); demo: 4 x 32 with contexts 512..8K")
    p.add_argument("--heads", type=int, default=None, help="query heads (default: the --width's)")
    p.add_argument("--head-dim", type=int, default=None, help="head width (default: the --width's)")
    p.add_argument("--d-model", type=int, default=None, help="model width (default heads x head-dim)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", type=dtype_list, default=["float32"], help=f"comma-separated, among {', '.join(DTYPES)}: one run each (default float32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int_list, default=None, help="comma-separated torch thread counts, one run each (default: torch's choice)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per variant per round")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per variant per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants per context")
    p.add_argument("--kind-options", type=json.loads, default=None, help='JSON {kind: options} replacing the matched-width options')
    p.add_argument("--quick", action="store_true", help=f"smoke run: contexts {QUICK_CONTEXTS}, 1 round of 3 calls")
    p.add_argument("--name", default="decode_all", help="results file name (default decode_all)")
    p.add_argument("--out-dir", default=None, help="results folder (default: the name's experiment folder, benchmarks/results/decode)")
    p.add_argument("--seed", type=int, default=0)
    return p


def run(args: argparse.Namespace, kinds: list[str]) -> list[dict]:
    """One benchmark per dtype and thread count; the payloads."""
    heads, head_dim = args.heads or WIDTHS[args.width][0], args.head_dim or WIDTHS[args.width][1]
    contexts = args.contexts or int_list(QUICK_CONTEXTS if args.quick else DEMO_CONTEXTS if args.width == "demo" else DEFAULT_CONTEXTS)
    warmup, repeats, rounds = (1, 3, 1) if args.quick else (args.warmup, args.repeats, args.rounds)
    variants = matched_width_variants(kinds, heads, head_dim, args.kind_options)
    payloads = []
    for dtype, threads in ((d, t) for d in args.dtype for t in args.threads or [torch.get_num_threads()]):
        torch.set_num_threads(threads)
        name = f"{args.name}{'_demo_width' if args.width == 'demo' else ''}{'' if dtype == 'float32' else '_' + dtype}_{threads}thread"
        payloads.append(run_decode_benchmark(
            name, variants, contexts, out_dir=args.out_dir or results_dir(RESULTS, name), targets=lambda payload, bandwidth: all_targets(payload, bandwidth, check_overhead=args.width == "demo"),
            d_model=args.d_model or heads * head_dim, n_heads=heads, head_dim=head_dim,
            batch=args.batch, dtype=DTYPES[dtype], device=args.device,
            warmup=warmup, repeats=repeats, rounds=rounds, seed=args.seed,
        ))
    return payloads


def main() -> None:
    args = parser().parse_args()
    try:
        run(args, args.kinds or list(ATTENTION_KINDS))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
