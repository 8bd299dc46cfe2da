"""The calibration section: one-shot conversions calibrated on different texts."""

from __future__ import annotations

from typing import Any

from .text import link, table, times, when


def calibration_table(runs: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """One-shot conversions calibrated on different texts (``convert_oneshot.py --calib``), matched
    by method and cache ratio: the table (perplexity / the original's per text and calibration) and
    a sentence with the last calibration's change against the first, per text."""
    names = list(runs)
    calib = {name: d.get("calib", "shakespeare") for name, d in runs.items()}  # files older than --calib: the then default, the plays
    texts = list(runs[names[0]]["original_ppl"])
    keys = [(r["method"], r["cache_ratio"]) for r in runs[names[-1]]["rows"]]
    found = {name: {(r["method"], r["cache_ratio"]): r for r in d["rows"]} for name, d in runs.items()}
    rows, changes = [], {t: [] for t in texts}
    for key in keys:
        if not all(key in found[name] for name in names):
            continue
        rows.append([f"`{key[0]}`", f"{key[1]}"] + [times(found[name][key]["ppl_over_original"][t]) for t in texts for name in names])
        for t in texts:
            changes[t].append(found[names[-1]][key]["ppl"][t] / found[names[0]][key]["ppl"][t] - 1)
    header_cells = ["method", "R"] + [f"{t}, {calib[name]}" for t in texts for name in names]
    summary = "; ".join(f"on {t}, {', '.join(f'{c:+.1%}' for c in changes[t])}" for t in texts)
    sources = ", ".join(f"{link(name)}: {when(d)}" for name, d in runs.items())
    return (f"perplexity / the original's on {runs[names[-1]]['eval_tokens']:,} tokens per text ({sources}):\n\n"
            f"{table(header_cells, rows, right=set(range(1, len(header_cells))))}\n\n"
            f"Perplexity with `{calib[names[-1]]}` against `{calib[names[0]]}` (the rows in order): {summary}."), calib[names[-1]]


def calibration_section(default_runs: dict[str, dict[str, Any]], held_out_runs: dict[str, dict[str, Any]],
                        modern_runs: dict[str, dict[str, Any]]) -> str:
    """The default calibration mix against the plays alone, then the same question on a source that
    neither calibration saw (pydoc held out of the mix), then what adding modern English (the
    Debian handbook, and every source's held-out split) to the mix does."""
    default_table, mix = calibration_table(default_runs)
    held_out_table, _ = calibration_table(held_out_runs)
    modern_table, modern_mix = calibration_table(modern_runs)
    return f"""## Calibration text of a conversion

`slimkv convert` calibrates on `{mix}` by default (as `compress`); it calibrated on
the plays alone before. One-shot conversions of SmolLM2-135M, {default_table}

Every text above is outside both calibrations except the plays, which the plays-only calibration
was fitted to. On a source that neither calibration saw, the Python documentation, held out of a
three-source mix: {held_out_table}

The default mix is now `{modern_mix}`: the four texts above (each with every fifth document held
out as `NAME-val`) and the Debian handbook, modern English, whose held-out pages (`handbook-val`)
are the evaluation text of its kind. What that buys one-shot conversions, {modern_table}"""
