"""KVM speed at the post-projection boundary: KVM (fixed 256 rows, sqrt 16 sqrt(N) rows) against
full causal attention (``slimkv.ops.attention.attend``, i.e. ``scaled_dot_product_attention``), as
in the paper's speed figure.

For every context N (default 1K .. 32K) it times, on q, k, v, gate tensors of shape
(batch, heads, N, head_dim) (kernel layout; the projections are not timed):

* decode: latency of one more token with a filled state/cache (full: K/V cache append + SDPA;
  KVM: ``kvm_step``, which folds a chunk into the state every ``chunk_size`` tokens). ``median``
  is the typical token, ``mean`` the cost amortised over ``--decode-tokens`` consecutive tokens
  (one fold per chunk included);
* prefill: N tokens from empty, forward only, no autograd;
* backward: the backward pass of that forward (gradients to q, k, v, gate, LN_s, temperatures),
  timed alone after an untimed forward.

Variants run interleaved (round robin inside each repeat, token by token for decode) so background
load hits them alike; ratios are full / KVM medians from the same run. Also recorded per context:
the state bytes (``nbytes`` of the decode state: flat in N for fixed, ~16 sqrt(N) rows for sqrt),
the bytes one decode token reads, and the machine's copy bandwidth as a yardstick.

    python benchmarks/kvm_speed.py                 # CPU default: 8 heads x 64, batch 1, float32
    python benchmarks/kvm_speed.py --quick         # smoke test (1K and 2K, few repeats)
    python benchmarks/kvm_speed.py --heads 32 --head-dim 128 --batch 8 --dtype bfloat16 --device cuda  # paper's shape

Writes ``benchmarks/results/kvm_speed.json`` and ``.png`` (``kvm_speed_quick.*`` with --quick).
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
from slimkv.common.buffer import GrowableBuffer
from slimkv.common.plotting import new_figure
from slimkv.common.timing import measure_copy_bandwidth, time_fn, write_results
from slimkv.ops.attention import attend
from slimkv.ops.kvm import KVMParams, KVMSettings, KVMState, kvm_attention, kvm_step

VARIANTS = ("full", "kvm-fixed", "kvm-sqrt")
OPS = ("decode", "prefill", "backward")
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
    p.add_argument("--decode-tokens", type=int, default=None, help="timed decode tokens per context (default 256 = one chunk, one fold; --quick: 32)")
    p.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's current setting)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: smaller defaults for contexts, repeats and decode tokens")
    p.add_argument("--name", default=None, help="results name (default kvm_speed, or kvm_speed_quick with --quick)")
    args = p.parse_args(argv)
    quick, full = ("1024,2048", 3, 32), ("1024,2048,4096,8192,16384,32768", 5, 256)
    for name, default in zip(("contexts", "repeats", "decode_tokens"), quick if args.quick else full):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.ops = [o for o in args.ops.split(",") if o]
    for op in args.ops:
        if op not in OPS:
            p.error(f"--ops: {op!r} is not one of {', '.join(OPS)}")
    if any(c < 1 for c in args.contexts) or min(args.heads, args.head_dim, args.batch, args.repeats, args.decode_tokens, args.chunk_size) < 1:
        p.error("contexts, heads, head-dim, batch, repeats, decode-tokens and chunk-size must be positive")
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


class FullDecoder:
    """Full attention decode: append to a K/V cache (growable buffer, as the ``mha`` layer does) and attend."""

    def __init__(self, x: dict, args, device, dtype) -> None:
        self.k = GrowableBuffer(args.batch, args.heads, args.head_dim, dtype=dtype, device=device, capacity=x["k"].shape[2] + args.decode_tokens + 64)
        self.v = GrowableBuffer(args.batch, args.heads, args.head_dim, dtype=dtype, device=device, capacity=x["k"].shape[2] + args.decode_tokens + 64)
        self.k.append(x["k"])
        self.v.append(x["v"])

    def step(self, t: dict) -> torch.Tensor:
        return attend(t["q"], self.k.append(t["k"]), self.v.append(t["v"]))

    def bytes_read(self) -> int:
        return self.k.nbytes() + self.v.nbytes()

    def state_bytes(self) -> int:
        return self.bytes_read()


class KVMDecoder:
    """KVM decode: a ``KVMState`` filled by ``kvm_step`` over the context, then one token per call."""

    def __init__(self, variant: str, x: dict, args, device, dtype) -> None:
        self.settings = kvm_settings(variant, args)
        self.params = kvm_params(args, device, dtype)
        self.state = KVMState(args.batch, args.heads, args.head_dim, dtype=dtype, device=device, gated=True)
        kvm_step(x["q"], x["k"], x["v"], x["gate"], self.params, self.settings, self.state)

    def step(self, t: dict) -> torch.Tensor:
        return kvm_step(t["q"], t["k"], t["v"], t["gate"], self.params, self.settings, self.state)

    def bytes_read(self) -> int:
        """What a decode token reads: the cached row readouts and the window keys/values."""
        rows = self.state.rows
        return sum(t.numel() * t.element_size() for t in (rows.read_k, rows.read_v)) + self.state.window_k.nbytes() + self.state.window_v.nbytes()

    def state_bytes(self) -> int:
        return self.state.nbytes()


def time_decode(x: dict, args, device, dtype) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per-token latency, token by token round robin; also the state/bytes-read of each variant."""
    with torch.no_grad():
        decoders = {"full": FullDecoder(x, args, device, dtype)}
        for variant in VARIANTS[1:]:
            decoders[variant] = KVMDecoder(variant, x, args, device, dtype)
        memory = {
            v: {"state_bytes": d.state_bytes(), "decode_bytes_read": d.bytes_read(), "state_rows": getattr(getattr(d, "state", None), "state_rows", None)}
            for v, d in decoders.items()
        }
        tokens = [make_inputs(1, args, device, dtype) for _ in range(4)]
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        warmup = max(args.warmup, 2)
        for i in range(warmup + args.decode_tokens):
            t = tokens[i % len(tokens)]
            for variant, dec in decoders.items():
                s = one_sample(lambda dec=dec, t=t: dec.step(t), device)
                if i >= warmup:
                    samples[variant].append(s)
    return {v: summarise(s) for v, s in samples.items()}, memory


def ratios(stats: dict[str, dict]) -> dict[str, float]:
    """Full-attention median over each KVM variant's median (> 1: KVM is faster)."""
    return {v: stats["full"]["median_s"] / stats[v]["median_s"] for v in VARIANTS[1:]}


def plot(results: list[dict], args) -> object:
    fig, axes = new_figure(1, len(args.ops) + 1, figsize=(4.6 * (len(args.ops) + 1), 4.0))
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
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms" + (" per token" if op == "decode" else ""), title=f"{op} ({note} at {ctx[-1]})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax = axes[-1]
    if all("memory" in r for r in results):
        for variant in VARIANTS:
            ax.plot(ctx, [r["memory"][variant]["state_bytes"] / 2**20 for r in results], marker="o", label=variant)
        ax.legend()
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="MiB", title="decode state bytes (measured)")
    ax.grid(True, which="both", alpha=0.3)
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
        if "decode_amortised_speedup" in r:
            s, x = r["decode"], r["decode_amortised_speedup"]
            print(
                f"{'':>8} {'mean/tok':>9} {s['full']['mean_s'] * 1e3:>11.3f} {s['kvm-fixed']['mean_s'] * 1e3:>11.3f} "
                f"{x['kvm-fixed']:>6.1f}x {s['kvm-sqrt']['mean_s'] * 1e3:>11.3f} {x['kvm-sqrt']:>6.1f}x   (decode amortised over folds)"
            )
        if "memory" in r:
            m = r["memory"]
            print(
                f"{'':>8} {'state':>9} {m['full']['state_bytes'] / 2**20:>9.2f}MB {m['kvm-fixed']['state_bytes'] / 2**20:>9.2f}MB "
                f"{m['kvm-fixed']['state_rows']:>5}r  {m['kvm-sqrt']['state_bytes'] / 2**20:>9.2f}MB {m['kvm-sqrt']['state_rows']:>5}r"
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
            if op == "decode":
                row["decode"], row["memory"] = time_decode(x, args, device, dtype)
                row["decode_amortised_speedup"] = {v: row["decode"]["full"]["mean_s"] / row["decode"][v]["mean_s"] for v in VARIANTS[1:]}
            elif op == "prefill":
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
        "variants": {"full": "slimkv.ops.attention.attend: causal scaled_dot_product_attention (decode: growable K/V cache, one query)", **{v: repr(kvm_settings(v, args)) for v in VARIANTS[1:]}},
        "copy_bandwidth_bytes_per_s": measure_copy_bandwidth(device=device),
        "results": results,
    }
    path = write_results(args.name, payload, Path(__file__).resolve().parent / "results", figure=plot(results, args))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
