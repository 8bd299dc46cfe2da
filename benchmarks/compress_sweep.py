"""LatentLLM and its baselines on SmolLM2-135M-Instruct (issue 7 targets).

Writes under benchmarks/results/:
- compress_sweep_smollm2.{json,md,png}: svd/asvd/rootcov/latentllm x ratios 0.1..0.5 on held-out
  Shakespeare (perplexity, parameters, analytic FLOPs/token, measured CPU prefill latency,
  calibration + factorization seconds), the dense model measured in the same run;
- compress_ablation_smollm2.{json,md}: latentllm with one component switched off at ratio 0.2
  (what joint QK, joint MLP and identity blocks each buy);
- compress_dense_check_smollm2.json: the dense model on the first 16,368 predicted tokens of all
  plays joined (assets.md quotes about 42).

Usage: .venv/bin/python benchmarks/compress_sweep.py [--threads 2] [--calib-tokens 8192] [--max-tokens 16384] [--quick]
(``--quick``: ratios 0.2,0.3 and 4096 eval tokens, to check the script in a few minutes.)
"""

from __future__ import annotations

import argparse
import sys

import torch

from slimkv.bench.timing import write_results
from slimkv.compress.models import fetch_smollm2, load_pretrained
from slimkv.compress.sweep import markdown_table, run_sweep, write_sweep
from slimkv.eval.ppl import perplexity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--ratios", default="0.1,0.2,0.3,0.4,0.5")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: dense,sweep,ablation")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ratios = [0.2, 0.3] if args.quick else [float(r) for r in args.ratios.split(",")]
    max_tokens = 4096 if args.quick else args.max_tokens
    skip = set(filter(None, args.skip.split(",")))
    fetch_smollm2()
    base = load_pretrained("smollm2")

    if "dense" not in skip:
        from slimkv.data import shakespeare_plays

        text = "\n\n".join(shakespeare_plays().values())
        check = perplexity(base.model, base.tokenizer, text, seq_len=1024, max_tokens=16384, progress=True)
        print(f"dense SmolLM2 on the first {check['tokens_predicted']} predicted tokens of all plays: ppl {check['ppl']:.2f} (assets.md: about 42)")
        write_results("compress_dense_check_smollm2", {"text": "all 38 plays joined, first 16384 tokens", "threads": torch.get_num_threads(), **check})

    common = {"calib_tokens": args.calib_tokens, "max_tokens": max_tokens}
    if "sweep" not in skip:
        result = run_sweep(base, ["svd", "asvd", "rootcov", "latentllm"], ratios, **common)
        write_sweep(result, "compress_sweep_smollm2")
        print(markdown_table(result))
    if "ablation" not in skip:
        labels = ["rootcov", "latentllm", "latentllm-no-joint-qk", "latentllm-no-joint-mlp", "latentllm-no-identity-block"]
        result = run_sweep(base, labels, [0.2], repeats=0, **common)
        path = write_results("compress_ablation_smollm2", result)
        path.with_suffix(".md").write_text(markdown_table(result))
        print(markdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
