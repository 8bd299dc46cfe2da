"""The RoPE price of a latent cache: ``mla`` against ``latent`` (exact RoPE) at the same cache ratio."""

from __future__ import annotations

from typing import Any

from .rules import ppl_verdict, word
from .text import join_words, link, pct1, ppl, table, times, when

ONE_SHOT_TARGET = 1.15  # the conversion target at R = 0.5 one-shot: perplexity / the original's on every text


def _rows(runs: list[dict[str, Any]], texts: list[str]) -> list[list[str]]:
    rows = []
    for d in runs:
        healed = f"healed, {d['heal_tokens']:,} tokens" if d.get("heal_tokens") else "one-shot"
        for r in d["rows"]:
            rows.append([f"`{r['method']}`", f"{r['cache_ratio']}", healed]
                        + [f"{ppl(r['ppl'][t])} ({times(r['ppl_over_original'][t])})" for t in texts])
    return rows


def _sentence(parts: list[str]) -> str:
    """Clauses joined by semicolons, the first letter capitalised (nothing else)."""
    text = "; ".join(parts) or "no cache ratio has both methods"
    return text[0].upper() + text[1:]


def latent_section(oneshot: dict[str, Any], healed: list[dict[str, Any]] = ()) -> str:
    """The table of every run (one-shot, then healed), the change from ``mla`` to ``latent`` at each
    cache ratio both were run at, and the one-shot target at R = 0.5."""
    texts = list(oneshot["original_ppl"])
    found = {(r["method"], r["cache_ratio"]): r for r in oneshot["rows"]}
    changes = []
    for (method, ratio), row in found.items():
        if method != "latent" or ("mla", ratio) not in found:
            continue
        other = found[("mla", ratio)]
        gaps = ", ".join(f"{pct1(row['ppl'][t] / other['ppl'][t] - 1)} on {t}" for t in texts)
        verdict = word(ppl_verdict(row["ppl"], other["ppl"]), "worse than", "better than", "level with")
        changes.append(f"at R = {ratio}, `latent` is {verdict} `mla` ({gaps})")
    at_half = found.get(("latent", 0.5))
    target = ""
    if at_half is not None:
        missed = [t for t in texts if at_half["ppl_over_original"][t] > ONE_SHOT_TARGET]
        target = (f" The one-shot target at R = 0.5 (at most {ONE_SHOT_TARGET}x the original on every text) is "
                  + (f"**missed** by `latent` on {join_words(missed)}." if missed else "**met** by `latent` on every text."))
    sources = ", ".join(f"{link(d['benchmark'] + '.json')}: {when(d)}" for d in [oneshot, *healed])
    header = ["method", "R", "healing"] + [f"{t} (x original)" for t in texts]
    originals = ", ".join(f"{t} {ppl(p)}" for t, p in oneshot["original_ppl"].items())
    return f"""## The RoPE price of a latent cache

`mla` caches a decoupled rotary key and lets the other key channels lose their rotation;
`latent` caches a latent of the same size and rebuilds every key before rotating it, so positions
are exact and its decode rebuilds every cached key per step. At the same cache ratio, the gap
between them is what `mla`'s treatment of RoPE costs. SmolLM2-135M, calibrated on
`{oneshot['calib']}`, perplexity on {oneshot['eval_tokens']:,} tokens per text in
{oneshot['seq_len']}-token windows (the original: {originals}; {sources}):

{table(header, _rows([oneshot, *healed], texts), right={1, *range(3, len(header))})}

{_sentence(changes)}.{target}"""
