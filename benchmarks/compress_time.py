"""Calibration + factorization time of SmolLM2-135M per method (target: 60 s at the defaults on 2 CPU cores, quiet machine).

Times ``compress_loaded`` (tokenizing the calibration text, the layer-by-layer calibration passes,
the float64 statistics, every factorization and the module swaps; not loading the model, not
saving) for each method at each calibration size, in one process, one after another. The
1-minute load average before and after each run is recorded: other processes' load slows these
numbers.

    .venv/bin/python benchmarks/compress_time.py [--methods rootcov latentllm] [--calib-tokens 4096 8192] [--threads 2]

Writes ``benchmarks/results/compress/compress_time_smollm2.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.compress import CompressOptions
from slimkv.compress.sweep import parse_methods, variant
from slimkv.compress.workflow import DEFAULT_CALIB, compress_loaded
from slimkv.pretrained import fetch_smollm2, load_pretrained

RESULTS = Path(__file__).resolve().parent / "results"  # where this repository keeps benchmark results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["rootcov", "latentllm"], help="sweep labels (method[+field=value...]), e.g. latentllm+rank_allocation=uniform")
    parser.add_argument("--calib", default=DEFAULT_CALIB, help=f"calibration text (default {DEFAULT_CALIB})")
    parser.add_argument("--calib-tokens", nargs="+", type=int, default=[8192])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="compress_time_smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fetch_smollm2()
    rows = []
    parse_methods(",".join(args.methods))
    for tokens in args.calib_tokens:
        for label in args.methods:
            method, overrides = variant(label)
            loaded = load_pretrained("smollm2")
            load_before = os.getloadavg()[0]
            started = time.perf_counter()
            manifest = compress_loaded(loaded, CompressOptions(method=method, ratio=args.ratio, **overrides), args.calib, tokens, progress=False)
            seconds = time.perf_counter() - started
            row = {"method": label, "calib": args.calib, "calib_tokens": tokens, "ratio": args.ratio, "achieved_ratio": manifest["achieved_ratio"], "seconds": seconds,
                   "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}}
            rows.append(row)
            print(f"{label:<10} calib {tokens:>6} tokens, ratio {args.ratio}: {seconds:6.1f} s "
                  f"(load {load_before:.2f} -> {row['load_average_1min']['after']:.2f})", flush=True)
            del loaded
    path = write_results(args.name, {"model": "smollm2", "threads": args.threads, "cpu_count": os.cpu_count(), "rows": rows}, results_dir(RESULTS, args.name))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
