"""LatentLLM away from its calibration text (docs/compression.md, "Away from the calibration text").

Every row is SmolLM2-135M-Instruct compressed and measured on the first ``--max-tokens`` tokens of
the held-out plays (in domain) and of Austen's novels (out of domain, never calibration text),
1024-token windows, the dense model measured in the same run. Parts (``--parts``):

- ``curve``: latentllm at ratio 0.2 against calibration tokens and calibration mix
  (``compress_calibration_curve.{json,md}``);
- ``ablation``: each method change alone and combined, at ``--ratios`` (``compress_robustness_ablation.{json,md}``);
- ``asvd``: the ASVD audit: slimkv's asvd, its scaling exponent, calibration on the dense model
  (as the paper does) and the paper's sensitivity-based rank search (``compress_asvd_audit.{json,md}``).

Usage: .venv/bin/python benchmarks/compress_robustness.py --threads 2 --parts curve,ablation,asvd
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from slimkv.common.timing import write_results
from slimkv.compress.sweep import markdown_table, parse_methods, run_sweep
from slimkv.data.texts import MIXED_CALIBRATION
from slimkv.pretrained import fetch_smollm2, load_pretrained

RESULTS = Path(__file__).resolve().parent / "results"

ABLATION = [
    "latentllm+cov_shrinkage=0",
    "latentllm+cov_shrinkage=0.05",
    "latentllm+cov_shrinkage=0.2",
    "latentllm+correct_upstream=true",
    "latentllm+refit=true",
    "latentllm+rank_allocation=spectrum",
    "latentllm+sequential=false",
    "latentllm-no-joint-mlp",
]
ASVD = [
    "asvd",
    "asvd+asvd_alpha=0.25",
    "asvd+asvd_alpha=1.0",
    "asvd+sequential=false",
    "asvd+sequential=false+rank_allocation=sensitivity",
    "rootcov+sequential=false+rank_allocation=sensitivity",
]


def run(base, name: str, labels: list[str], ratios: list[float], calibs: list[tuple[str, int]], args, dense=None) -> dict:
    """Every (calibration, tokens) x label x ratio; one JSON + markdown table per part."""
    results = []
    for calib, tokens in calibs:
        result = run_sweep(base, parse_methods(",".join(labels)), ratios, calib=calib, calib_tokens=tokens, max_tokens=args.max_tokens, repeats=0,
                           options=args.options, dense=dense)
        dense = result["dense"]
        print(markdown_table(result), flush=True)
        results.append(result)
    payload = {"part": name, "threads": torch.get_num_threads(), "load_average_1min_end": os.getloadavg()[0], "runs": results}
    path = write_results(name, payload, RESULTS)
    path.with_suffix(".md").write_text("\n".join(f"Calibration: {r['calibration']['tokens']} tokens of {r['calibration']['source']!r}.\n\n"
                                                 + markdown_table(r) for r in results))
    return dense


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--parts", default="curve,ablation,asvd")
    parser.add_argument("--ratios", default="0.2,0.3", help="ratios of the ablation and the ASVD audit (default 0.2,0.3)")
    parser.add_argument("--calib", default=None, help="calibration of the ablation and the audit (default: the library default)")
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--curve-tokens", default="2048,8192,32768")
    parser.add_argument("--max-tokens", type=int, default=8192, help="evaluation tokens per text (default 8192)")
    args = parser.parse_args(argv)
    args.options = None
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    ratios = [float(r) for r in args.ratios.split(",")]
    fetch_smollm2()
    base = load_pretrained("smollm2")
    calib = args.calib or MIXED_CALIBRATION
    dense = None
    if "curve" in parts:
        calibs = [(source, int(tokens)) for source in ("shakespeare", MIXED_CALIBRATION) for tokens in args.curve_tokens.split(",")]
        dense = run(base, "compress_calibration_curve", ["latentllm"], [0.2], calibs, args, dense)
    if "ablation" in parts:
        dense = run(base, "compress_robustness_ablation", ABLATION, ratios, [(calib, args.calib_tokens)], args, dense)
    if "asvd" in parts:
        dense = run(base, "compress_asvd_audit", ASVD, ratios, [(calib, args.calib_tokens)], args, dense)
    return 0


if __name__ == "__main__":
    sys.exit(main())
