"""Per-token decode latency of one LRKV layer (factored and expanded decode) against MHA.

One layer per shape (default 8 heads x 64 and 32 heads x 128, d_model = heads x head_dim), batch 1,
float32, caches filled by each layer's own chunked prefill to 1K .. 32K tokens. LRKV uses the rank
that makes its cache half of MHA's: r = head_dim (1/2 - 1/heads) (24 for 8x64, 60 for 32x128),
rope_mode ``decoupled`` (the default). Variants:

* ``mha``: the mha layer (rotated K/V cache, fused SDPA);
* ``lrkv-factored``: the compact cache read by the exact factored path (``decode_path="factored"``);
* ``lrkv-expanded``: the same module and cache, but every step rebuilds all per-head K/V
  (``decode_path="expanded"``), which is what the factored path avoids.

The variants run interleaved in one process (``slimkv.bench.decode.decode_sweep``). Reported per
context: ms per token (median, min, max), the live cache bytes a step reads, the GB/s that implies,
the machine's memory-copy bandwidth, and lrkv/mha time ratio against the cache-bytes ratio (target:
factored time ratio at the largest context <= 1.2 x the bytes ratio).

    .venv/bin/python benchmarks/decode_lrkv.py                    # full sweep (minutes)
    .venv/bin/python benchmarks/decode_lrkv.py --quick            # smoke run
    .venv/bin/python benchmarks/decode_lrkv.py --shapes 8x64 --contexts 1024,8192 --threads 2

Writes benchmarks/results/decode_lrkv.json and .png (decode_lrkv_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from slimkv.bench.decode import DecodeVariant, decode_sweep, decode_table
from slimkv.common.plotting import new_figure
from slimkv.common.timing import measure_copy_bandwidth, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_all import int_list  # noqa: E402

DEFAULT_CONTEXTS = "1024,2048,4096,8192,16384,32768"
QUICK_CONTEXTS = "256,1024"
DEFAULT_SHAPES = "8x64,32x128"
TARGET_FACTOR = 1.2


def shape_list(text: str) -> list[tuple[int, int]]:
    """'8x64,32x128' -> [(8, 64), (32, 128)] (heads x head_dim)."""
    try:
        shapes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEADSxHEAD_DIM pairs such as 8x64,32x128, got {text!r}") from None
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected HEADSxHEAD_DIM pairs such as 8x64,32x128, got {text!r}")
    return shapes


def half_cache_rank(n_heads: int, head_dim: int) -> int:
    """The rank whose cache (2 d_h + 2 H r elements per token) is closest to half of MHA's (2 H d_h)."""
    return max(0, round(head_dim * (0.5 - 1 / n_heads)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int_list, default=None, help=f"cached tokens (default {DEFAULT_CONTEXTS})")
    p.add_argument("--shapes", type=shape_list, default=None, help=f"HEADSxHEAD_DIM list (default {DEFAULT_SHAPES})")
    p.add_argument("--repeats", type=int, default=5, help="timed single-token calls per variant per round (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants per context (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per variant per round (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help=f"smoke run: shape 8x64, contexts {QUICK_CONTEXTS}, 1 round of 3 calls")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"), help="results folder (default benchmarks/results)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("repeats", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0 or (args.threads is not None and args.threads < 1):
        p.error("--warmup must be >= 0 and --threads >= 1")
    return args


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per context and lrkv variant: time ratio to mha, cache-bytes ratio, and their quotient."""
    mha = {r["context"]: r for r in rows if r["label"] == "mha"}
    out = []
    for r in rows:
        if r["kind"] == "lrkv" and r["context"] in mha:
            time_ratio = r["median_s"] / mha[r["context"]]["median_s"]
            bytes_ratio = r["cache_bytes"] / mha[r["context"]]["cache_bytes"]
            out.append({"label": r["label"], "context": r["context"], "time_ratio": time_ratio, "bytes_ratio": bytes_ratio, "time_over_bytes": time_ratio / bytes_ratio})
    return out


def figure(results: list[dict[str, Any]]):
    """Per shape: ms/token against context, and lrkv/mha time ratio beside the cache-bytes ratio."""
    fig, axes = new_figure(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    for col, res in enumerate(results):
        s = res["settings"]
        title = f"{s['n_heads']}x{s['head_dim']} (lrkv rank {res['rank']}), batch {s['batch']}, {s['dtype']}, {res['threads']} threads"
        ax_time, ax_ratio = axes[0][col], axes[1][col]
        colors = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(r["label"] for r in res["rows"]))}
        for label, color in colors.items():
            rows = sorted((r for r in res["rows"] if r["label"] == label), key=lambda r: r["context"])
            ax_time.plot([r["context"] for r in rows], [r["median_s"] * 1e3 for r in rows], marker="o", color=color, label=label)
            rows = sorted((r for r in res["ratios"] if r["label"] == label), key=lambda r: r["context"])
            if rows:
                ax_ratio.plot([r["context"] for r in rows], [r["time_ratio"] for r in rows], marker="o", color=color, label=f"{label} time / mha time")
        rows = sorted((r for r in res["ratios"] if r["label"] == "lrkv-factored"), key=lambda r: r["context"])
        ctx = [r["context"] for r in rows]
        ax_ratio.plot(ctx, [r["bytes_ratio"] for r in rows], "k--", label="cache bytes ratio")
        ax_ratio.plot(ctx, [TARGET_FACTOR * r["bytes_ratio"] for r in rows], "k:", label=f"{TARGET_FACTOR} x bytes ratio (target)")
        ax_time.set_ylabel("ms per decoded token")
        ax_ratio.set_ylabel("lrkv / mha")
        for ax in (ax_time, ax_ratio):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("cached tokens")
            ax.grid(True, alpha=0.3)
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    contexts = args.contexts or int_list(QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS)
    shapes = args.shapes or shape_list("8x64" if args.quick else DEFAULT_SHAPES)
    warmup, repeats, rounds = (1, 3, 1) if args.quick else (args.warmup, args.repeats, args.rounds)
    copy_before = measure_copy_bandwidth(device=args.device)
    results = []
    for heads, head_dim in shapes:
        rank = half_cache_rank(heads, head_dim)
        print(f"shape {heads}x{head_dim}: lrkv rank {rank} (cache {1 / heads + rank / head_dim:.1%} of mha), threads {torch.get_num_threads()}")
        variants = [
            DecodeVariant("mha", "mha", {}),
            DecodeVariant("lrkv-factored", "lrkv", {"rank": rank, "decode_path": "factored"}),
            DecodeVariant("lrkv-expanded", "lrkv", {"rank": rank, "decode_path": "expanded"}),
        ]
        sweep = decode_sweep(
            variants, contexts, d_model=heads * head_dim, n_heads=heads, head_dim=head_dim, batch=1, dtype=torch.float32,
            device=args.device, warmup=warmup, repeats=repeats, rounds=rounds, seed=args.seed,
        )
        sweep.update(rank=rank, threads=torch.get_num_threads(), ratios=ratios(sweep["rows"]))
        results.append(sweep)
    copy_bandwidth = max(copy_before, measure_copy_bandwidth(device=args.device))

    targets = []
    for res in results:
        s = res["settings"]
        print(f"\n{s['n_heads']}x{s['head_dim']}, lrkv rank {res['rank']}")
        print(decode_table(res, copy_bandwidth))
        print(f"{'variant':<16}{'context':>8}{'time ratio':>12}{'bytes ratio':>13}{'time/bytes':>12}")
        for r in sorted(res["ratios"], key=lambda r: (r["label"], r["context"])):
            print(f"{r['label']:<16}{r['context']:>8}{r['time_ratio']:>12.3f}{r['bytes_ratio']:>13.3f}{r['time_over_bytes']:>12.3f}")
        top = max(r["context"] for r in res["ratios"])
        at_top = next(r for r in res["ratios"] if r["label"] == "lrkv-factored" and r["context"] == top)
        targets.append(
            {
                "target": f"lrkv-factored/mha time ratio <= {TARGET_FACTOR} x cache-bytes ratio", "shape": f"{s['n_heads']}x{s['head_dim']}",
                "context": top, "value": at_top["time_over_bytes"], "met": at_top["time_over_bytes"] <= TARGET_FACTOR,
            }
        )
    print(f"\nmemory-copy bandwidth: {copy_bandwidth / 1e9:.2f} GB/s (read + write counted)")
    for t in targets:
        print(f"target [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['shape']} at {t['context']}: {t['value']:.3f}")
    payload = {
        "settings": {"contexts": contexts, "shapes": [f"{h}x{d}" for h, d in shapes], "warmup": warmup, "repeats": repeats, "rounds": rounds,
                     "batch": 1, "dtype": "float32", "device": args.device, "quick": args.quick, "seed": args.seed,
                     "rank_rule": "round(head_dim * (1/2 - 1/heads)): cache = 1/heads + rank/head_dim of mha"},
        "copy_bandwidth": {"bytes_per_s": copy_bandwidth, "definition": "2 x bytes / time of a 256 MiB tensor copy, best of before/after"},
        "shapes": results,
        "targets": targets,
    }
    path = write_results("decode_lrkv_quick" if args.quick else "decode_lrkv", payload, args.out_dir, figure=figure(results))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return payload


if __name__ == "__main__":
    main()
