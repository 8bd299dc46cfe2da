"""KVM's core against full attention, prefill and backward: KVM (fixed 256 rows, sqrt 16 sqrt(N)
rows) against full causal attention (``slimkv.ops.attention.attend``, i.e.
``scaled_dot_product_attention``), at the post-projection boundary, as in the paper's speed figure.

For every context N (default 1K .. 32K) it times, on q, k, v, gate tensors of shape
(batch, heads, N, head_dim) (kernel layout; the projections are not timed):

* prefill: N tokens from empty, forward only, no autograd;
* backward: the backward pass of that forward (gradients to q, k, v, gate, LN_s, temperatures),
  timed alone after an untimed forward.

Decode is not timed here: benchmarks/decode_all.py times every kind's decode step, KVM's
included, through the layers and the native decode kernel. (The decode rows of the committed
``kvm_speed.json`` come from an earlier version of this script, before that kernel and KVM's
fused decode step; git history keeps it.)

Variants run interleaved (round robin inside each repeat) so background load hits them alike;
ratios are full / KVM medians from the same run.

    python benchmarks/kvm_speed.py                 # CPU default: 8 heads x 64, batch 1, float32
    python benchmarks/kvm_speed.py --quick         # smoke test (1K and 2K, few repeats)
    python benchmarks/kvm_speed.py --ops backward --contexts 1024,4096,16384 --name kvm_speed_backward
    python benchmarks/kvm_speed.py --heads 32 --head-dim 128 --batch 8 --dtype bfloat16 --device cuda  # paper's shape

Writes ``benchmarks/results/kvm/<name>.json`` and ``.png`` (default name ``kvm_speed``, ``kvm_speed_quick``
with --quick).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import slimkv  # noqa: F401  (registers everything; keeps import order canonical)
from slimkv.common.plotting import new_figure
from slimkv.common.results import results_dir
from slimkv.common.timing import time_fn, write_results
from slimkv.ops.attention import attend
from slimkv.ops.kvm import KVMParams, KVMSettings, kvm_attention

VARIANTS = ("full", "kvm-fixed", "kvm-sqrt")
OPS = ("prefill", "backward")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default=None, help="comma-separated context lengths (default 1024,...,32768; --quick: 1024,2048)")
    p.add_argument("--heads", type=int, default=8, help="query = kv heads (default 8)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of prefill/backward (default 5; --quick: 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's current setting)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: smaller defaults for contexts and repeats")
    p.add_argument("--name", default=None, help="results name (default kvm_speed, or kvm_speed_quick with --quick)")
    args = p.parse_args(argv)
    quick, full = ("1024,2048", 3), ("1024,2048,4096,8192,16384,32768", 5)
    for name, default in zip(("contexts", "repeats"), quick if args.quick else full):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.ops = [o for o in args.ops.split(",") if o]
    for op in args.ops:
        if op not in OPS:
            p.error(f"--ops: {op!r} is not one of {', '.join(OPS)}")
    if any(c < 1 for c in args.contexts) or min(args.heads, args.head_dim, args.batch, args.repeats, args.chunk_size) < 1:
        p.error("contexts, heads, head-dim, batch, repeats and chunk-size must be positive")
    args.name = args.name or ("kvm_speed_quick" if args.quick else "kvm_speed")
    return args


def kvm_settings(variant: str, args: argparse.Namespace) -> KVMSettings:
    """The paper's two speed configurations: fixed 256 rows, and 16 sqrt(N) rows (min 256)."""
    schedule = "fixed" if variant == "kvm-fixed" else "sqrt"
    return KVMSettings(chunk_size=args.chunk_size, schedule=schedule, rot_dim=args.head_dim // 2)


def kvm_params(args: argparse.Namespace, device, dtype, requires_grad: bool = False) -> KVMParams:
    d, h = args.head_dim, args.heads

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    return KVMParams(leaf(torch.ones(d)), leaf(torch.zeros(d)), leaf(torch.ones(h)), leaf(torch.ones(h)))


def make_inputs(n: int, args: argparse.Namespace, device, dtype) -> dict[str, torch.Tensor]:
    """q, k, v (batch, heads, n, head_dim) and positive merge gates (batch, heads, n), seeded."""
    gen = torch.Generator().manual_seed(args.seed + n)
    shape = (args.batch, args.heads, n, args.head_dim)
    t = {name: torch.randn(shape, generator=gen) for name in ("q", "k", "v")}
    t["gate"] = 1.0 + F.elu(torch.randn(shape[:3], generator=gen))
    return {name: x.to(device=device, dtype=dtype) for name, x in t.items()}


def one_sample(fn: Callable[[], object], device) -> float:
    return time_fn(fn, warmup=0, repeats=1, device=device)["samples_s"][0]


def summarise(samples: list[float]) -> dict:
    return {
        "median_s": statistics.median(samples),
        "mean_s": statistics.fmean(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples_s": samples,
    }


def interleaved(fns: dict[str, Callable[[], object]], warmup: int, repeats: int, device) -> dict[str, dict]:
    """Round-robin timing: each repeat runs every variant once."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup + repeats):
        for name, fn in fns.items():
            s = one_sample(fn, device)
            if r >= warmup:
                samples[name].append(s)
    return {name: summarise(s) for name, s in samples.items()}


def forward_fn(variant: str, x: dict, params: KVMParams, args) -> Callable[[], torch.Tensor]:
    if variant == "full":
        return lambda: attend(x["q"], x["k"], x["v"])
    settings = kvm_settings(variant, args)
    return lambda: kvm_attention(x["q"], x["k"], x["v"], x["gate"], params, settings)


def time_prefill(x: dict, args, device, dtype) -> dict[str, dict]:
    params = kvm_params(args, device, dtype)
    fns = {v: forward_fn(v, x, params, args) for v in VARIANTS}
    with torch.no_grad():
        return interleaved(fns, args.warmup, args.repeats, device)


def time_backward(x: dict, args, device, dtype) -> dict[str, dict]:
    """Backward pass alone: an untimed forward, then a timed ``backward`` of a fixed output gradient."""
    leaves = {name: t.detach().requires_grad_(True) for name, t in x.items()}
    params = kvm_params(args, device, dtype, requires_grad=True)
    grad_out = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(args.seed)).to(device=device, dtype=dtype)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.warmup + args.repeats):
        for variant in VARIANTS:
            out = forward_fn(variant, leaves, params, args)()
            s = one_sample(lambda out=out: out.backward(grad_out), device)
            if r >= args.warmup:
                samples[variant].append(s)
    return {v: summarise(s) for v, s in samples.items()}


def ratios(stats: dict[str, dict]) -> dict[str, float]:
    """Full-attention median over each KVM variant's median (> 1: KVM is faster)."""
    return {v: stats["full"]["median_s"] / stats[v]["median_s"] for v in VARIANTS[1:]}


def plot(results: list[dict], args) -> object:
    fig, axes = new_figure(1, len(args.ops), figsize=(4.6 * len(args.ops), 4.0), squeeze=False)
    axes = list(axes[0])
    ctx = [r["context"] for r in results]
    for ax, op in zip(axes, args.ops):
        for variant in VARIANTS:
            med = [r[op][variant]["median_s"] * 1e3 for r in results]
            lo = [r[op][variant]["min_s"] * 1e3 for r in results]
            hi = [r[op][variant]["max_s"] * 1e3 for r in results]
            ax.plot(ctx, med, marker="o", label=variant)
            ax.fill_between(ctx, lo, hi, alpha=0.2)
        last = results[-1]
        note = ", ".join(f"{v.split('-')[1]} {last[op + '_speedup'][v]:.1f}x" for v in VARIANTS[1:])
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms", title=f"{op} ({note} at {ctx[-1]})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"KVM vs full attention, {args.heads} heads x {args.head_dim}, batch {args.batch}, {args.dtype}, {args.device}, {torch.get_num_threads()} threads")
    fig.tight_layout()
    return fig


def print_table(results: list[dict], args) -> None:
    print(f"\n{'context':>8} {'op':>9} {'full ms':>11} {'fixed ms':>11} {'x':>7} {'sqrt ms':>11} {'x':>7}")
    for r in results:
        for op in args.ops:
            s, x = r[op], r[op + "_speedup"]
            print(
                f"{r['context']:>8} {op:>9} {s['full']['median_s'] * 1e3:>11.3f} {s['kvm-fixed']['median_s'] * 1e3:>11.3f} "
                f"{x['kvm-fixed']:>6.1f}x {s['kvm-sqrt']['median_s'] * 1e3:>11.3f} {x['kvm-sqrt']:>6.1f}x"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    results = []
    progress = tqdm(total=len(args.contexts) * len(args.ops), desc="kvm_speed")
    for n in args.contexts:
        x = make_inputs(n, args, device, dtype)
        row: dict = {"context": n}
        for op in args.ops:
            progress.set_postfix(context=n, op=op)
            if op == "prefill":
                row["prefill"] = time_prefill(x, args, device, dtype)
            else:
                row["backward"] = time_backward(x, args, device, dtype)
            row[op + "_speedup"] = ratios(row[op])
            progress.update()
        results.append(row)
    progress.close()
    print_table(results, args)
    settings = {k: v for k, v in vars(args).items() if k != "quick"}
    payload = {
        "settings": {**settings, "quick": args.quick, "threads_used": torch.get_num_threads()},
        "variants": {"full": "slimkv.ops.attention.attend: causal scaled_dot_product_attention", **{v: repr(kvm_settings(v, args)) for v in VARIANTS[1:]}},
        "results": results,
    }
    path = write_results(args.name, payload, results_dir(Path(__file__).resolve().parent / "results", args.name), figure=plot(results, args))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
