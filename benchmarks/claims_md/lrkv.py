"""The LRKV section: recall and LM frontier against GQA/MQA/MHA at equal cache, and the SmolLM2 conversion."""

from __future__ import annotations

from typing import Any

from .results import Frontier, Recall, describe_against
from .rules import ppl_verdict, word
from .text import acc, f3, join_words, link, pct, ppl, table, times


def lrkv_section(recall: Recall, frontier: Frontier, convert: dict[str, Any]) -> str:
    """LRKV against GQA, MQA and MHA at equal cache: recall, the LM frontier and the one-shot conversion of SmolLM2."""
    lrkv = recall.labels(("lrkv",))
    baselines = [recall.labels((k,))[0] for k in ("gqa", "mqa", "mha")]
    lines = []
    recall_support = []
    for label in lrkv:
        for other in baselines:
            if recall.cache(other) < recall.cache(label):
                lines.append(f"- `{label}` ({recall.cache(label):.0f} B) against `{other}` ({recall.cache(other):.0f} B): `{other}` caches less, no equal-cache comparison.")
                continue
            verdicts = recall.against(label, other)
            lines.append(f"- `{label}` ({recall.cache(label):.0f} B) against `{other}` ({recall.cache(other):.0f} B): {describe_against(verdicts)}.")
            if other != baselines[-1]:
                recall_support.append((label, other, verdicts))
    beats = sorted({(label, other) for label, other, v in recall_support if any(x > 0 for x in v.values()) and not any(x < 0 for x in v.values())})
    loses = sorted({(label, other) for label, other, v in recall_support if any(x < 0 for x in v.values())})
    mha = baselines[-1]
    below_mha = [label for label in lrkv if any(v < 0 for v in recall.against(label, mha).values())]
    unsolved = [label for label in lrkv if recall.solved(label) < recall.seeds(label)]
    beat_text = join_words([f"`{a}` beats `{b}`" for a, b in beats]) or "no LRKV entry beats a baseline"
    recall_verdict = (f"**{'supported' if beats and not loses else 'inconclusive'}** where the seeds resolve it: {beat_text}"
                      + (f"; {join_words([f'`{a}` is below `{b}`' for a, b in loses])}" if loses else "")
                      + f". Against MHA, {join_words([f'`{x}`' for x in below_mha]) + (' scores' if len(below_mha) == 1 else ' score') + ' lower by the seed rule' if below_mha else 'no LRKV entry scores lower by the seed rule'}.")
    full = [x for x in recall.rows if set(recall.entries[x]["kinds"]) <= {"mha", "gqa", "mqa", "mla", "lrkv"} and recall.cache(x) >= 256]
    short = [x for x in full if recall.stat(x, "1x")["mean"] < 1.0 - 5e-4]
    at_1x = (f"At the training length, {len(full) - len(short)} of the {len(full)} full-context entries (mha, gqa, mqa, mla, lrkv) with at least "
             f"256 B/token score 1.000 at 1x (mean over seeds)" + (": " + join_words([f"`{x}` {acc(recall.stat(x, '1x'))}" for x in short]) + " fall short" if short else "")
             + f" ({link('recall_frontier.json')}, every entry: [`recall_frontier.md`](recall_frontier.md)).")
    if unsolved:
        recall_verdict += (" Larger ranks were less reliable to train: " + join_words([
            f"`{x}` solved {recall.solved(x)} of {recall.seeds(x)} seeds (1x: {acc(recall.stat(x, '1x'))})" for x in unsolved]) + ".")

    f_lrkv = [label for label in frontier.rows if label.startswith("lrkv")]
    f_lines = []
    for label in f_lrkv:
        for other in ("gqa", "mqa", "mha"):
            if frontier.cache(other) < frontier.cache(label):
                continue
            v = frontier.against(label, other)
            f_lines.append(f"`{label}` ({frontier.cache(label):.0f} B) against `{other}` ({frontier.cache(other):.0f} B): "
                           f"val BPB {word(v['val_bpb'], 'higher', 'lower')}, Austen BPB {word(v['other_bpb'], 'higher', 'lower')}")
    f_any_gqa = [v for label in f_lrkv for v in frontier.against(label, "gqa").values()] if all(frontier.cache("gqa") >= frontier.cache(x) for x in f_lrkv) else []
    frontier_verdict = ("**supported**" if f_any_gqa and all(v < 0 for v in f_any_gqa) else
                        "**not supported**" if any(v > 0 for v in f_any_gqa) else "**inconclusive**")
    if not any(f_any_gqa):
        frontier_verdict += "; at this scale the LM frontier does not separate LRKV from GQA"

    rows = [r for r in convert["rows"] if r["cache_ratio"] == 0.5]
    texts = list(convert["original_ppl"])
    by_method = {r["method"]: r for r in rows}
    c_rows = [[f"`{r['method']}`", f"{r['cache_ratio']}", f3(r["live_cache_ratio"])] + [f"{ppl(r['ppl'][t])} ({times(r['ppl_over_original'][t])})" for t in texts] for r in rows]
    c_lrkv_gqa = ppl_verdict(by_method["lrkv"]["ppl"], by_method["gqa"]["ppl"])
    c_mla_lrkv = ppl_verdict(by_method["mla"]["ppl"], by_method["lrkv"]["ppl"])
    gaps = {t: by_method["mla"]["ppl"][t] / by_method["lrkv"]["ppl"][t] - 1 for t in texts}
    below_gqa = [f"{pct(abs(by_method['lrkv']['ppl'][t] / by_method['gqa']['ppl'][t] - 1))} {'below' if by_method['lrkv']['ppl'][t] < by_method['gqa']['ppl'][t] else 'above'} gqa's on {t}"
                 for t in texts]
    convert_verdict = (f"**{word(-c_lrkv_gqa, 'supported', 'not supported', 'inconclusive')}** for conversion: lrkv's perplexity is "
                       f"{join_words(below_gqa)}. MLA's perplexity against LRKV's: {', '.join(f'{gaps[t]:+.0%} on {t}' for t in texts)}, "
                       f"{word(-c_mla_lrkv, 'better beyond the margin on every text', 'worse beyond the margin on every text', 'not separated by the margin on every text')}.")
    return f"""## LRKV (low-rank key-value attention)

**Claim (the LRKV paper): at equal cache, LRKV beats GQA and MQA and approaches MHA.**

**Recall** (MQAR, 3 seeds, {link('recall_frontier.json')}; accuracy = exact recall at 1x, 2x and 4x the
training length, mean [min, max] over seeds):

{recall.table(lrkv + baselines)}

{chr(10).join(lines)}

Verdict on recall: {recall_verdict}

{at_1x}

**Language modelling** (the LM frontier, {link('lm_frontier.json')}: {frontier.d['recipe']['dataset']}, 3 seeds per entry; the
full table is under [KVM](#kvm-key-value-means)): {'; '.join(f_lines)}. Verdict: {frontier_verdict}.

**Converting SmolLM2-135M** to half its KV cache, one-shot ({link('convert_oneshot_smollm2.json')}; perplexity on
{convert['eval_tokens']:,} tokens per text, in brackets the original's multiple; the original is the 4-bit model
dequantized to float32):

{table(['method', 'cache ratio asked', 'live cache ratio'] + [f'{t} ppl' for t in texts], c_rows, right={1, 2, 3, 4})}

Verdict: {convert_verdict}"""
