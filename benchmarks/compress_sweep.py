"""LatentLLM and its baselines on SmolLM2-135M-Instruct (targets in docs/compression.md).

Writes under benchmarks/results/compress/:
- compress_sweep_smollm2.{json,md,png}: svd/asvd/rootcov/latentllm x ratios 0.1..0.5 on the held-out
  plays (in domain) and Austen's novels (out of domain), with the default calibration (perplexity,
  parameters, analytic FLOPs/token, measured CPU prefill latency, calibration + factorization
  seconds), the dense model measured in the same run;
- compress_ablation_smollm2.{json,md}: latentllm with one component switched off at ratio 0.2
  (what joint QK, joint MLP and identity blocks each buy);
- compress_dense_check_smollm2.json: the dense model on the first 16,368 predicted tokens of all
  plays joined (assets.md quotes about 42);
- compress_rope_smollm2.{json,md}: what RoPE does to joint QK. The joint objective preserves the
  scores x^T W_q^T W_k x without the rotation; this measures, on held-out training-play windows,
  the relative attention-score error of joint QK and of separate RootCov q/k (same ranks) with and
  without RoPE applied, for a few layers.

Usage: .venv/bin/python benchmarks/compress_sweep.py [--threads 2] [--calib-tokens 8192] [--max-tokens 16384] [--quick]
       .venv/bin/python benchmarks/compress_sweep.py --skip dense,rope,ablation --methods latentllm --ratios 0.3 --name compress_prefill_latentllm03
(``--quick``: ratios 0.2,0.3 and 4096 eval tokens, to check the script in a few minutes.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.compress.sweep import markdown_table, parse_methods, run_sweep, write_sweep
from slimkv.eval.ppl import perplexity
from slimkv.pretrained import fetch_smollm2, load_pretrained

RESULTS = Path(__file__).resolve().parent / "results"  # where this repository keeps benchmark results


@torch.no_grad()
def rope_diagnostic(base, ratio: float = 0.2, layers: tuple[int, ...] = (0, 7, 15, 22, 29), calib_tokens: int = 4096, eval_len: int = 512) -> dict:
    """Relative score error sum_i ||S_i - S^_i||^2 / sum_i ||S_i||^2 over causal (query, key) pairs."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from slimkv.compress.cost import rank_for_budget
    from slimkv.compress.joint_qk import RopeAverage, joint_qk
    from slimkv.compress.latentllm import spend_leftover
    from slimkv.compress.linalg import StatsAccumulator, rootcov_factors
    from slimkv.compress.workflow import calibration_set

    model, config = base.model, base.model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    calib, _ = calibration_set(base, "shakespeare", calib_tokens, 1024, seed=0)
    held, _ = calibration_set(base, "shakespeare", eval_len, eval_len, seed=1)  # other training-play windows, never val

    def inputs_of(layer: int, ids: torch.Tensor) -> list[torch.Tensor]:
        grabbed = []
        leaf = model.model.layers[layer].self_attn.q_proj
        handle = leaf.register_forward_pre_hook(lambda m, a: grabbed.append(a[0][0]))
        for row in ids:
            model(row[None], use_cache=False, logits_to_keep=1)
        handle.remove()
        return grabbed

    positions = torch.arange(eval_len)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, eval_len, 1), positions)
    causal = torch.tril(torch.ones(eval_len, eval_len, dtype=torch.bool))

    def score_error(X, Wq, Wk, q_hat, k_hat, rope: bool) -> float:
        def heads_of(W, n):
            return (X @ W.T).reshape(1, eval_len, n, head_dim).transpose(1, 2)
        q, k, qh, kh = heads_of(Wq, heads), heads_of(Wk, kv_heads), heads_of(q_hat, heads), heads_of(k_hat, kv_heads)
        if rope:
            q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
            qh, kh = apply_rotary_pos_emb(qh, kh, cos.double(), sin.double())
        k, kh = k.repeat_interleave(heads // kv_heads, 1), kh.repeat_interleave(heads // kv_heads, 1)
        exact, approx = (q @ k.transpose(-1, -2))[..., causal], (qh @ kh.transpose(-1, -2))[..., causal]
        return float(((exact - approx) ** 2).sum() / (exact**2).sum())

    rows = []
    for layer in layers:
        acc = StatsAccumulator(config.hidden_size)
        for x in inputs_of(layer, calib):
            acc.add(x)
        cov = acc.finish().cov
        attn = model.model.layers[layer].self_attn
        Wq, Wk = attn.q_proj.weight.double(), attn.k_proj.weight.double()
        keep_q, keep_k = (1 - ratio) * Wq.numel(), (1 - ratio) * Wk.numel()
        ranks = spend_leftover([rank_for_budget(Wq.shape[1], Wq.shape[0], keep_q, True), rank_for_budget(Wk.shape[1], Wk.shape[0], keep_k, True)],
                               [Wq.shape, Wk.shape], keep_q + keep_k, True)
        candidates = {
            "joint": joint_qk(Wq, Wk, cov, heads, kv_heads, ranks[0], ranks[1]),
            "joint_rope_aware": joint_qk(Wq, Wk, cov, heads, kv_heads, ranks[0], ranks[1], rope=RopeAverage(model.model.rotary_emb.inv_freq, 1024)),
        }
        products = {name: (r.q.product(), r.k.product()) for name, r in candidates.items()}
        products["separate"] = (rootcov_factors(Wq, cov, ranks[0]).product(), rootcov_factors(Wk, cov, ranks[1]).product())
        X = inputs_of(layer, held)[0].double()
        row = {"layer": layer, "rank_q": ranks[0], "rank_k": ranks[1]}
        for rope in (False, True):
            for name, (q_hat, k_hat) in products.items():
                row[f"{name}_{'rope' if rope else 'no_rope'}"] = score_error(X, Wq, Wk, q_hat, k_hat, rope)
        rows.append(row)
        print(row, flush=True)
    names = ("joint", "joint_rope_aware", "separate")
    table = ["Relative attention-score error on held-out training-play windows (SmolLM2, identity-block ranks at ratio "
             f"{ratio}; joint = the paper's rotation-blind Tucker, joint_rope_aware = averaged over RoPE offsets, separate = RootCov q and k); "
             "lower is better.", "",
             "| layer | r_q | r_k | " + " | ".join(f"{n}, no RoPE" for n in names) + " | " + " | ".join(f"{n}, with RoPE" for n in names) + " |",
             "| ---: | ---: | ---: |" + " ---: |" * 6]
    table += [f"| {r['layer']} | {r['rank_q']} | {r['rank_k']} | " + " | ".join(f"{r[f'{n}_no_rope']:.2e}" for n in names) + " | "
              + " | ".join(f"{r[f'{n}_rope']:.2e}" for n in names) + " |" for r in rows]
    return {"ratio": ratio, "calib_tokens": calib_tokens, "eval_len": eval_len, "rows": rows, "table": "\n".join(table) + "\n"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--ratios", default="0.1,0.2,0.3,0.4,0.5")
    parser.add_argument("--methods", default="svd,asvd,rootcov,latentllm", help="methods of the sweep (default svd,asvd,rootcov,latentllm)")
    parser.add_argument("--name", default="compress_sweep_smollm2", help="results file name of the sweep (default compress_sweep_smollm2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed prefill repeats per row (0: no latency; time only on a quiet machine)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: dense,rope,sweep,ablation")
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
        write_results("compress_dense_check_smollm2", {"text": "all 38 plays joined, first 16384 tokens", "threads": torch.get_num_threads(), **check}, results_dir(RESULTS, "compress_"))

    if "rope" not in skip:
        result = rope_diagnostic(base)
        path = write_results("compress_rope_smollm2", result, results_dir(RESULTS, "compress_"))
        path.with_suffix(".md").write_text(result["table"])
        print(result["table"])

    common = {"calib_tokens": args.calib_tokens, "max_tokens": max_tokens}
    if "sweep" not in skip:
        result = run_sweep(base, parse_methods(args.methods), ratios, repeats=args.repeats, **common)
        write_sweep(result, args.name, results_dir(RESULTS, args.name))
        print(markdown_table(result))
    if "ablation" not in skip:
        labels = ["rootcov", "latentllm", "latentllm-rope-blind-qk", "latentllm-no-joint-qk", "latentllm-no-joint-mlp", "latentllm-no-identity-block"]
        result = run_sweep(base, labels, [0.2], repeats=0, **common)
        path = write_results("compress_ablation_smollm2", result, results_dir(RESULTS, "compress_"))
        path.with_suffix(".md").write_text(markdown_table(result))
        print(markdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
