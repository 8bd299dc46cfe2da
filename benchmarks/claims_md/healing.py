"""How much healing a ``latent`` conversion needs: perplexity against healing tokens, per cache ratio."""

from __future__ import annotations

from typing import Any

from .text import join_words, link, pct, ppl, table, times

METHOD = "latent"


def curve_points(runs: list[dict[str, Any]]) -> dict[float, dict[int, tuple[dict[str, Any], dict[str, Any]]]]:
    """Per cache ratio, per healing tokens seen (0: one-shot): the ``latent`` row (uniform
    allocation, the default parameter set) and the file it comes from. Two files with the same
    point are refused (the curve would depend on their order)."""
    points: dict[float, dict[int, tuple[dict[str, Any], dict[str, Any]]]] = {}
    for d in runs:
        for r in d["rows"]:
            healing = r.get("healing") or {}
            if r["method"] != METHOD or (healing and healing["config"]["params"] != "changed"):
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


def healing_curve_section(runs: list[dict[str, Any]], figure: str) -> str:
    """The table of every (ratio, tokens) point of ``runs`` and, per ratio, what the smallest and
    the largest healing budget remove of the one-shot excess; ``figure`` is the plot of the same
    points (``convert_oneshot.py --curve-from``)."""
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
    files = list({d["benchmark"]: d for ratio in points for _, d in points[ratio].values()}.values())
    loads = [d["machine"]["load_average"][0] for d in files]
    threads = join_words(sorted({str(d["threads"]) for d in files}))
    header = ["R", "healing tokens", "minutes", "file"] + [f"{t} (x original)" for t in texts]
    summary = "; ".join(clauses)
    return f"""## How much healing a latent conversion needs

`latent` at two cache ratios, healed by distillation (the parameters the conversion changed, on
the calibration mix, 512-token windows, batch 4, learning rate 1e-4 with cosine decay) for
different budgets; each budget is its own run with its own schedule, from the same one-shot
conversion, calibrated on `{runs[0]['calib']}`. Perplexity on {runs[0]['eval_tokens']:,} tokens per text, {runs[0]['seq_len']}-token
windows ({len(files)} files, {threads} thread, load {min(loads):.2f} to {max(loads):.2f} when written; minutes: healing alone):

{table(header, rows, right={0, 1, 2, *range(4, len(header))})}

{(summary[0].upper() + summary[1:] + ".") if summary else "No ratio has both a one-shot and a healed point."}

![perplexity against healing tokens]({figure})"""
