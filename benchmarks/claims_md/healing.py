"""How much healing a ``latent`` conversion needs: perplexity against healing tokens, per cache ratio."""

from __future__ import annotations

from typing import Any

from .text import join_words, link, pct, ppl, table, times

METHOD = "latent"
CURVE_LR = 1e-4  # the peak learning rate of the curve's runs (convert's default when they ran); other rates are the sweep's


def curve_points(runs: list[dict[str, Any]]) -> dict[float, dict[int, tuple[dict[str, Any], dict[str, Any]]]]:
    """Per cache ratio, per healing tokens seen (0: one-shot): the ``latent`` row (uniform
    allocation, the default parameter set, peak learning rate ``CURVE_LR``) and the file it comes from. Two files with the same
    point are refused (the curve would depend on their order)."""
    points: dict[float, dict[int, tuple[dict[str, Any], dict[str, Any]]]] = {}
    for d in runs:
        for r in d["rows"]:
            healing = r.get("healing") or {}
            if r["method"] != METHOD or (healing and (healing["config"]["params"] != "changed" or healing["config"]["lr"] != CURVE_LR)):
                continue
            tokens = healing.get("tokens_seen", 0)
            if tokens in points.setdefault(r["cache_ratio"], {}):
                raise ValueError(f"two results for R = {r['cache_ratio']} healed on {tokens} tokens: {d['benchmark']} and "
                                 f"{points[r['cache_ratio']][tokens][1]['benchmark']}")
            points[r["cache_ratio"]][tokens] = (r, d)
    return points


def _recovered(one_shot: dict[str, Any], row: dict[str, Any], texts: list[str]) -> str:
    """The share of the one-shot excess (ppl / original - 1) the healing removed, per text."""
    shares = [1 - (row["ppl_over_original"][t] - 1) / (one_shot["ppl_over_original"][t] - 1) for t in texts]
    return ", ".join(f"{pct(s)} on {t}" for s, t in zip(shares, texts))


def learning_rate_rows(runs: list[dict[str, Any]], sweep: list[dict[str, Any]], texts: list[str]) -> tuple[list[list[str]], list[str]]:
    """The sweep's healed ``latent`` rows beside the curve's point at the same ratio and tokens,
    and per (ratio, tokens) the rate with the lowest perplexity on every text (or none)."""
    points = curve_points(runs)
    by_point: dict[tuple[float, int], list[tuple[float, dict[str, Any], dict[str, Any]]]] = {}
    for d in sweep:
        for r in d["rows"]:
            if r["method"] == METHOD and r.get("healing"):
                by_point.setdefault((r["cache_ratio"], r["healing"]["tokens_seen"]), []).append((r["healing"]["config"]["lr"], r, d))
    rows, best = [], []
    for (ratio, tokens), entries in sorted(by_point.items(), reverse=True):
        if tokens in points.get(ratio, {}):
            entries.append((CURVE_LR, *points[ratio][tokens]))
        entries.sort(key=lambda e: e[0])
        for lr, r, d in entries:
            rows.append([str(ratio), f"{tokens:,}", f"{lr:g}", link(d["benchmark"] + ".json")]
                        + [f"{ppl(r['ppl'][t])} ({times(r['ppl_over_original'][t])})" for t in texts])
        winners = {t: min(entries, key=lambda e: e[1]["ppl"][t])[0] for t in texts}
        lrs = set(winners.values())
        best.append(f"at R = {ratio} and {tokens:,} tokens, " + (f"{lrs.pop():g} is best on every text" if len(lrs) == 1 else
                    "the best rate differs by text (" + ", ".join(f"{lr:g} on {t}" for t, lr in winners.items()) + ")"))
    return rows, best


def healing_curve_section(runs: list[dict[str, Any]], figure: str, sweep: list[dict[str, Any]] = ()) -> str:
    """The table of every (ratio, tokens) point of ``runs`` and, per ratio, what the smallest and
    the largest healing budget remove of the one-shot excess; ``figure`` is the plot of the same
    points (``convert_oneshot.py --curve-from``); ``sweep``: runs at other peak learning rates,
    each beside the curve's point with the same ratio and tokens."""
    texts = list(runs[0]["original_ppl"])
    mixed = {(d["calib"], d.get("seed", 0), tuple(d["texts"])) for d in runs}
    if len(mixed) > 1:
        raise ValueError(f"the healing curve's files differ in calibration, seed or texts: {sorted(mixed)}")
    points = curve_points(runs)
    rows, clauses = [], []
    for ratio in sorted(points, reverse=True):
        for tokens, (r, d) in sorted(points[ratio].items()):
            h = r.get("healing")
            minutes = f"{h['train_seconds'] / 60:.0f}" if h else "-"
            rows.append([str(ratio), f"{tokens:,}", minutes, link(d["benchmark"] + ".json")]
                        + [f"{ppl(r['ppl'][t])} ({times(r['ppl_over_original'][t])})" for t in texts])
        healed = sorted(t for t in points[ratio] if t)
        if 0 in points[ratio] and healed:
            one_shot = points[ratio][0][0]
            first, last = points[ratio][healed[0]][0], points[ratio][healed[-1]][0]
            clause = f"at R = {ratio}, {healed[0]:,} tokens remove {_recovered(one_shot, first, texts)} of the one-shot excess"
            if len(healed) > 1:
                clause += f", and {healed[-1]:,} tokens {_recovered(one_shot, last, texts)}"
            clauses.append(clause)
    recipes = {(r["healing"]["config"]["seq_len"], r["healing"]["config"]["batch_size"]) for ratio in points
               for r, _ in points[ratio].values() if r.get("healing")}
    if len(recipes) != 1:
        raise ValueError(f"the healing curve's runs differ in window length or batch size: {sorted(recipes)}")
    [(seq_len, batch_size)] = recipes
    files = list({d["benchmark"]: d for ratio in points for _, d in points[ratio].values()}.values())
    loads = [d["machine"]["load_average"][0] for d in files]
    threads = join_words(sorted({str(d["threads"]) for d in files}))
    header = ["R", "healing tokens", "minutes", "file"] + [f"{t} (x original)" for t in texts]
    summary = "; ".join(clauses)
    return f"""## How much healing a latent conversion needs

`latent` at two cache ratios, healed by distillation (the parameters the conversion changed, on
the calibration mix, {seq_len}-token windows, batch {batch_size}, peak learning rate {CURVE_LR:g} with cosine decay) for
different budgets; each budget is its own run with its own schedule, from the same one-shot
conversion, calibrated on `{runs[0]['calib']}`. Perplexity on {runs[0]['eval_tokens']:,} tokens per text, {runs[0]['seq_len']}-token
windows ({len(files)} files, {threads} thread, load {min(loads):.2f} to {max(loads):.2f} when written; minutes: healing alone):

{table(header, rows, right={0, 1, 2, *range(4, len(header))})}

{(summary[0].upper() + summary[1:] + ".") if summary else "No ratio has both a one-shot and a healed point."}

![perplexity against healing tokens]({figure}){_learning_rate_part(runs, list(sweep), texts)}"""


def _learning_rate_part(runs: list[dict[str, Any]], sweep: list[dict[str, Any]], texts: list[str]) -> str:
    """The learning-rate table and its verdicts (nothing without a sweep)."""
    if not sweep:
        return ""
    rows, best = learning_rate_rows(runs, sweep, texts)
    header = ["R", "healing tokens", "peak learning rate", "file"] + [f"{t} (x original)" for t in texts]
    summary = "; ".join(best)
    return f"""

The peak learning rate (the curve above used {CURVE_LR:g}), the same healing otherwise:

{table(header, rows, right={0, 1, 2, *range(4, len(header))})}

{summary[0].upper() + summary[1:]}."""
