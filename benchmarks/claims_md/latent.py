"""The RoPE price of a latent cache: ``mla`` against ``latent`` (exact RoPE) at the same cache ratio."""

from __future__ import annotations

from typing import Any

from .rules import ppl_verdict, word
from .text import join_words, link, pct1, ppl, table, times, when

ONE_SHOT_TARGET = 1.15  # the conversion target at R = 0.5 one-shot: perplexity / the original's on every text
HEALED_TARGETS = (1.03, 1.08)  # R = 0.5 healed (<= 30 minutes): in domain (the first text), out of domain (the others)


def _healing(row: dict[str, Any]) -> str:
    """``one-shot``, or the healing's tokens, minutes and parameter set."""
    h = row.get("healing")
    if not h:
        return "one-shot"
    return f"healed: {h['tokens_seen']:,} tokens, {h['train_seconds'] / 60:.0f} min, `{h['heal_config']['params']}`"


def _rows(runs: list[dict[str, Any]], texts: list[str]) -> list[list[str]]:
    rows = []
    for d in runs:
        for r in d["rows"]:
            rows.append([f"`{r['method']}`", f"{r['cache_ratio']}", f"{len(d['calib'].split(','))} texts", _healing(r)]
                        + [f"{ppl(r['ppl'][t])} ({times(r['ppl_over_original'][t])})" for t in texts])
    return rows


def _healed_target(healed: list[dict[str, Any]], texts: list[str]) -> str:
    """The healed target at R = 0.5 for every healed ``latent`` row: met or missed, per text."""
    inside, outside = HEALED_TARGETS
    out = []
    for d in healed:
        for r in d["rows"]:
            if r["method"] != "latent" or r["cache_ratio"] != 0.5 or not r.get("healing"):
                continue
            limits = {t: inside if i == 0 else outside for i, t in enumerate(texts)}
            missed = [t for t in texts if r["ppl_over_original"][t] > limits[t]]
            out.append(f" The healed target at R = 0.5 (at most {inside}x in domain and {outside}x out of domain, within 30 minutes of "
                       f"healing) is " + (f"**missed** on {join_words(missed)}" if missed else "**met** on every text")
                       + f" by `latent` healed on {r['healing']['tokens_seen']:,} tokens ({r['healing']['train_seconds'] / 60:.0f} minutes, "
                       f"{r['healing']['threads']} thread).")
    return "".join(out)


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
    header = ["method", "R", "calibration", "healing"] + [f"{t} (x original)" for t in texts]
    mixes = sorted({d["calib"] for d in [oneshot, *healed]}, key=len)
    originals = ", ".join(f"{t} {ppl(p)}" for t, p in oneshot["original_ppl"].items())
    return f"""## The RoPE price of a latent cache

`mla` caches a decoupled rotary key and lets the other key channels lose their rotation;
`latent` caches a latent of the same size and rebuilds every key before rotating it, so positions
are exact and its decode rebuilds every cached key per step. At the same cache ratio, the gap
between them is what `mla`'s treatment of RoPE costs. SmolLM2-135M, calibrated (and healed) on
{join_words([f"`{m}`" for m in mixes])} (the calibration column counts the texts), perplexity on {oneshot['eval_tokens']:,} tokens per text in
{oneshot['seq_len']}-token windows (the original: {originals}; {sources}):

{table(header, _rows([oneshot, *healed], texts), right={1, *range(4, len(header))})}

{_sentence(changes)}.{target}{_healed_target(list(healed), texts)}"""
