"""The long-context retrieval comparison: slimkv's models (``slimkv eval niah --model`` reports)
and other tools' generations on the same prompts (``benchmarks/kvpress_niah.py``), scored alike,
set against the live cache bytes per token (docs/evaluation.md, "Long-context retrieval on
pretrained models"; ``benchmarks/niah_smollm2.py`` runs it).

Every figure of the markdown is rendered from the comparison JSON by ``render_markdown``, so the
committed table can be checked against its data (tests/retrieval/test_comparison.py).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

from slimkv.common.files import save_figure
from slimkv.common.markdown import markdown_table
from slimkv.common.plotting import new_figure
from slimkv.eval.models import kept_cache_ratio
from slimkv.retrieval.models import score_output, wilson

COMPARISON_FORMAT = "slimkv-niah-comparison/1"


def _stats(scores: list[float]) -> dict[str, Any]:
    full = sum(s == 1.0 for s in scores)
    low, high = wilson(full, len(scores))
    return {"score": float(np.mean(scores)), "full": full, "prompts": len(scores), "wilson95": [round(low, 4), round(high, 4)]}


def aggregate(items: list[tuple[str, int, float]]) -> dict[str, Any]:
    """(task, length, prompt score) -> per length (all tasks pooled) and per task and length."""
    by_length: dict[int, list[float]] = defaultdict(list)
    by_task: dict[tuple[str, int], list[float]] = defaultdict(list)
    for task, length, score in items:
        by_length[length].append(score)
        by_task[task, length].append(score)
    return {"per_length": {str(n): _stats(s) for n, s in sorted(by_length.items())},
            "per_task": {f"{t}/{n}": _stats(s) for (t, n), s in sorted(by_task.items())}}


def slimkv_row(report: dict[str, Any], label: str, source: str) -> dict[str, Any]:
    """A row from a ``slimkv eval niah --model`` report (``niah.json``)."""
    identity = report["settings"]["identity"]
    converted = identity.get("converted") or {}
    compressed = identity.get("compressed") or {}
    kept = kept_cache_ratio(converted) if converted and not compressed else 1.0
    # the fraction asked (the budget class); a bounded cache's kept fraction (kvm; mla-kvm, whose ratio sizes its rows)
    bounded = converted.get("achieved_cache_ratio") is None
    budget = (kept if bounded else converted["cache_ratio"]) if converted and not compressed else 1.0
    plan = converted.get("budget_plan")
    if plan and not compressed:  # convert --cache-budget: the bytes asked, and those measured, at the length it was planned for
        budget = plan["budget"]
        kept = next((row["ratio"] for row in converted.get("cache_bytes") or [] if row["context"] == plan["at"]), kept)
    items = [(c["task"], c["length"], s) for c in report["cells"].values() for s in c["scores"]]
    return {"label": label, "tool": "slimkv", "source": source, "cache_budget": round(float(budget), 4), "cache_kept": round(float(kept), 4),
            "bytes_per_token": {n: round(c["bytes_per_token"], 1) for n, c in report.get("cache", {}).items()},
            "healed": bool(converted.get("healing")), "seconds": round(sum(c["seconds"] for c in report["cells"].values()), 1), **aggregate(items)}


def generations_row(generations: dict[str, Any], prompts: dict[str, dict[str, Any]], source: str) -> dict[str, Any]:
    """A row from another tool's generations on exported prompts (``niah_prompts.json``), scored
    here with slimkv's own rule."""
    items, cache = [], defaultdict(list)
    for g in generations["generations"]:
        prompt = prompts[g["id"]]
        items.append((prompt["task"], prompt["length"], score_output(prompt["answers"], g["output_text"])))
        if g.get("cache_tokens"):
            cache[str(prompt["length"])].append(g["cache_bytes"] / g["cache_tokens"])
    return {"label": generations["label"], "tool": generations.get("method", "external"), "source": source,
            "cache_budget": float(generations.get("cache_budget", 1.0)), "cache_kept": float(generations.get("cache_budget", 1.0)), "bytes_per_token": {n: round(float(np.mean(v)), 1) for n, v in sorted(cache.items())},
            "healed": False, "seconds": round(float(generations.get("seconds", 0.0)), 1), "budget_note": generations.get("budget_note"), **aggregate(items)}


def winners(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At each (cache budget class, length): the best mean score, and whether the samples separate
    it from every other row of that budget (its Wilson interval of fully answered prompts lies
    above theirs). Budgets are classed by the nominal fraction kept, to 2 decimals."""
    out = []
    classes = sorted({round(r["cache_budget"], 2) for r in rows}, reverse=True)
    for budget in classes:
        group = [r for r in rows if round(r["cache_budget"], 2) == budget]
        if len(group) < 2:
            continue
        for length in sorted({int(n) for r in group for n in r["per_length"]}):
            present = [r for r in group if str(length) in r["per_length"]]
            if len(present) < 2:
                continue
            top = max(r["per_length"][str(length)]["score"] for r in present)
            best = [r for r in present if r["per_length"][str(length)]["score"] == top]  # every row that ties for the best
            low = min(r["per_length"][str(length)]["wilson95"][0] for r in best)
            others = [r for r in present if r not in best]
            separated = bool(others) and all(low > r["per_length"][str(length)]["wilson95"][1] for r in others)
            out.append({"cache_budget": budget, "length": length, "best": " = ".join(r["label"] for r in best), "score": top,
                        "separated": separated, "rows": len(present)})
    return out


def comparison(rows: list[dict[str, Any]], grid: dict[str, Any], notes: dict[str, Any]) -> dict[str, Any]:
    return {"format": COMPARISON_FORMAT, "grid": grid, "notes": notes, "rows": rows, "winners": winners(rows)}


def render_markdown(data: dict[str, Any]) -> str:
    """The comparison as markdown; every figure comes from ``data``."""
    grid, rows = data["grid"], data["rows"]
    lengths = sorted({int(n) for r in rows for n in r["per_length"]})
    tasks = grid["tasks"]
    title = data.get("title", "conversions and kvpress presses")
    lines = [f"# Long-context retrieval on SmolLM2-135M-Instruct: {title}", "",
             f"Generated by `benchmarks/niah_smollm2.py report` from `{data.get('source', 'niah_smollm2.json')}`; do not edit by hand.", "",
             f"Grid: tasks {', '.join(tasks)}; depths {', '.join(f'{d:g}' for d in grid['depths'])}; {grid['samples']} sample(s) per cell; "
             f"seed {grid['seed']}; greedy; plain completion prompts (no chat template). A cell of the table is the mean score over "
             "tasks and depths (1 = every asked value found); in brackets, prompts fully answered / prompts and the 95% Wilson interval.", ""]
    for key, value in data["notes"].items():
        lines.append(f"- {key}: {value}")
    main = []
    for r in rows:
        measured = r["bytes_per_token"].get(str(max(int(n) for n in r["bytes_per_token"])), None) if r["bytes_per_token"] else None
        cells = []
        for n in lengths:
            s = r["per_length"].get(str(n))
            cells.append("" if s is None else f"{s['score']:.2f} ({s['full']}/{s['prompts']}, {s['wilson95'][0]:.2f}-{s['wilson95'][1]:.2f})")
        main.append([r["label"], r["tool"], f"{r['cache_budget']:.2f}", f"{r.get('cache_kept', r['cache_budget']):.4f}", "" if measured is None else f"{measured:.0f}", *cells])
    lines += ["", markdown_table(["model", "tool", "budget", "cache kept", "bytes/token (at the longest length)", *lengths], main,
                                 align=["left", "left", "right", "right", "right"] + ["left"] * len(lengths))]
    with_ppl = [r for r in rows if r.get("ppl")]
    if with_ppl:
        texts = list(with_ppl[0]["ppl"])
        ppl = [[r["label"], *(f"{r['ppl'][t]['ppl']:.2f} ({r['ppl'][t]['ppl'] / r['ppl'][t]['original_ppl']:.2f}x)" for t in texts)] for r in with_ppl]
        lines += ["", "Perplexity (1024-token windows; in brackets, over the original's in the same run):", "",
                  markdown_table(["model", *texts], ppl, align=["left"] + ["right"] * len(texts))]
    columns = [(t, n) for t in tasks for n in lengths]
    per_task = [[r["label"], *(f"{r['per_task'][f'{t}/{n}']['score']:.2f}" if f"{t}/{n}" in r["per_task"] else "" for t, n in columns)] for r in rows]
    lines += ["", "Per task (mean score):", "", markdown_table(["model", *(f"{t} {n}" for t, n in columns)], per_task, align=["left"] + ["right"] * len(columns))]
    lines += ["", "Best at each cache budget (separated: its interval lies above every other's at that budget):", ""]
    if not data["winners"]:
        lines.append("- no budget has two rows to compare yet")
    for w in data["winners"]:
        verdict = "separated by the samples" if w["separated"] else f"not separated from the others at these sample counts ({w['rows']} rows)"
        if " = " in w["best"] and not w["separated"] and w["best"].count(" = ") + 1 == w["rows"]:
            verdict = "every row ties"
        lines.append(f"- budget {w['cache_budget']:.2f}, {w['length']} tokens: {w['best']} ({w['score']:.2f}), {verdict}")
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Score against measured cache bytes per token, one panel per length, the same axes in every
    panel; bars: the 95% Wilson interval of the prompts fully answered; atomic PNG."""
    rows = data["rows"]
    lengths = sorted({int(n) for r in rows for n in r["per_length"]})
    fig, axes = new_figure(1, len(lengths), figsize=(3.6 * len(lengths), 5.2), squeeze=False, layout="constrained", sharex=True, sharey=True)
    widest = max((b for r in rows for b in r["bytes_per_token"].values()), default=1.0)
    markers = {"slimkv": "o", "kvpress": "s"}
    labelled: set[str] = set()
    for ax, n in zip(axes[0], lengths):
        for index, r in enumerate(rows):
            if str(n) not in r["per_length"] or not r["bytes_per_token"]:
                continue
            x = r["bytes_per_token"].get(str(n)) or r["bytes_per_token"][max(r["bytes_per_token"], key=int)]
            x *= 1 + 0.0015 * (index - len(rows) / 2)  # at most ~1.5% apart, so rows at one cache size stay visible
            stats = r["per_length"][str(n)]
            y, (low, high) = stats["score"], stats["wilson95"]
            full = stats["full"] / stats["prompts"]
            ax.errorbar([x], [y], yerr=[[max(0.0, y - min(low, full))], [max(0.0, max(high, full) - y)]], fmt=markers.get(r["tool"], "^"), ms=5, capsize=2, alpha=0.8,
                        color=matplotlib.colormaps["tab20"](index % 20), label=None if r["label"] in labelled else r["label"])  # one colour per row in every panel
            labelled.add(r["label"])
        ax.set_title(f"{n} tokens", fontsize=9)
        ax.set_xlabel("live cache bytes per token", fontsize=8)
        ax.set_xlim(0, widest * 1.15)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, alpha=0.3)
    fig.legend(loc="outside lower center", ncol=4, fontsize=7)
    axes[0][0].set_ylabel("retrieval score")
    fig.suptitle("retrieval vs cache (o slimkv, s kvpress; points at one cache size offset by up to 1.5% to stay apart)", fontsize=9)
    save_figure(fig, path)
