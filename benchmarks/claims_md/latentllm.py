"""The LatentLLM section: perplexity against the baselines at equal ratio, and prefill speed."""

from __future__ import annotations

from typing import Any

from .rules import ppl_verdict, word
from .text import f2, join_words, link, ppl, table, times, when


def latentllm_section(sweep: dict[str, Any], prefill: dict[str, Any]) -> str:
    """LatentLLM against SVD, ASVD and RootCov at each ratio, then the measured prefill speed-up against the ideal."""
    texts = list(sweep["dense"]["ppl_by_text"])
    methods = [m for m in ("svd", "asvd", "rootcov", "latentllm")]
    ratios = sorted({r["ratio"] for r in sweep["rows"]})
    ppl_of = {(r["method"], r["ratio"]): r["ppl_by_text"] for r in sweep["rows"]}
    rows, supported, partial = [], [], []
    for ratio in ratios:
        cells = [f"{ratio:.1f}"]
        best_base = {t: min(ppl_of[(m, ratio)][t] for m in methods[:-1]) for t in texts}
        ours = ppl_of[("latentllm", ratio)]
        for t in texts:
            cells += [ppl(ppl_of[(m, ratio)][t]) if m != "latentllm" else f"**{ppl(ours[t])}**" if ours[t] < best_base[t] else ppl(ours[t]) for m in methods]
        v = ppl_verdict(ours, best_base)
        gaps = ", ".join(f"{ours[t] / best_base[t] - 1:+.0%}" for t in texts)
        cells.append(f"{word(-v, 'beats', 'loses', 'not separated')} ({gaps})")
        rows.append(cells)
        (supported if v < 0 else partial).append(ratio)
    header = ["ratio"] + [f"{m} ({'plays' if t == 'shakespeare-val' else t})" for t in texts for m in methods] + ["latentllm vs the best baseline"]
    dense = sweep["dense"]["ppl_by_text"]
    calib = sweep["calibration"]
    worst = min(ppl_of[(m, r)][t] / dense[t] for m in ("svd", "asvd") for r in ratios for t in texts)
    destroyed = (f" Plain SVD and ASVD destroy this model at every ratio (at least {worst:,.0f}x the dense perplexity): its RMSNorm gains "
                 "make a few input channels huge, and an unweighted factorisation spends its rank on them." if worst > 100 else "")
    p_dense, p_row = prefill["dense"], prefill["rows"][0]
    ideal = p_dense["flops_per_token"] / p_row["flops_per_token"]
    measured = p_row["speedup"]
    apart = max(p_row["latency"]["samples_s"]) < min(p_row["dense_latency"]["samples_s"])
    return f"""## LatentLLM (activation-aware joint compression)

**Claim (the LatentLLM paper): at equal compression ratio, LatentLLM's joint, activation-aware
factorisation beats plain SVD, ASVD and local RootCov in perplexity.** SmolLM2-135M ({link('compress_sweep_smollm2.json')}:
perplexity on {sweep['eval']['texts']['shakespeare-val']['tokens']:,} tokens of the held-out plays and of Austen's novels; dense {ppl(dense['shakespeare-val'])} and
{ppl(dense['austen'])}; calibration {calib['tokens']:,} tokens of `{calib['source']}`; the last column gives latentllm's perplexity
against the best of the three baselines on each text):

{table(header, rows, right=set(range(1, len(header) - 1)))}

**{'Supported' if supported else 'Not supported'}{' at ratios ' + join_words([f'{r:.1f}' for r in supported]) if supported and partial else ''}**{(' (at ' + join_words([f'{r:.1f}' for r in partial]) + ' the gap is inside the margin on at least one text)') if supported and partial else ''}.{destroyed} The runs are deterministic for a given calibration sample; other samples were not run.

**Claim: compressed models are faster.** At ratio {p_row['ratio']:.1f} the FLOPs per token fall to {p_row['flops_per_token'] / p_dense['flops_per_token']:.3f} of
dense's, so the ideal prefill speed-up is {times(ideal)}. A {p_row['latency']['prefill_len']}-token prefill ({link('compress_prefill_latentllm03.json')}, {when(prefill)})
ran {times(measured)} faster than dense (dense time over compressed time, dense timed right before it): {f2(measured / ideal)} of the ideal, with every timed
sample of the compressed model {'below' if apart else 'not below'} every sample of the dense one. **{'Supported' if apart and measured > 1 else 'Inconclusive'}.**"""
