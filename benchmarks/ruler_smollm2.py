"""RULER on SmolLM2-135M-Instruct: the original's own cache against transformers' quantized caches and kvpress's presses.

One model (slimkv's ``smollm2``: the 4-bit GGUF release dequantized to float32), lm-eval's offline
RULER tasks ``niah_single_1`` and ``niah_multikey_2``, the cache options ``none`` (the original's
float32 ``DynamicCache``: the ceiling), ``quanto-int4`` and ``quanto-int2`` (transformers'
``QuantizedCache``) and any ``press:NAME@BUDGET`` given to ``--caches`` (a kvpress press, run in
``.venv-kvpress`` at that fraction of the bfloat16 original's bytes), 40 prompts per cell, one torch thread; 2K first, then 4K while time allows
(``--stop-at`` turns a wall-clock deadline into ``--budget-minutes`` for each length). Every cell
goes through ``slimkv eval ruler``'s runner (``slimkv.eval.ruler``), so a repeated run skips the
finished cells. Each length has its folder, ``benchmarks/results/ruler/smollm2/<length>/``: the
runner's ``ruler.json``, ``ruler.md`` and ``cells/`` (lm-eval's own files), and ``comparison.md``
(each option beside the original, with intervals, then every option ranked per task and budget tier).

    .venv-ruler/bin/python benchmarks/ruler_smollm2.py [--lengths 2k,4k] [--limit 40] [--stop-at 16:55]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from slimkv.common.files import write_text
from slimkv.eval import ruler, ruler_offline
from slimkv.eval.ruler_cache import parse_caches
from slimkv.eval.ruler_report import BUDGET_TIERS, budget_tier
from slimkv.retrieval.models import parse_lengths

OUT = Path(__file__).resolve().parent / "results" / "ruler" / "smollm2"


def minutes_until(stop_at: str | None) -> float | None:
    """Minutes from now to ``HH:MM`` today (local time); None without a deadline."""
    if stop_at is None:
        return None
    now = datetime.datetime.now()
    hour, minute = (int(p) for p in stop_at.split(":"))
    return (now.replace(hour=hour, minute=minute, second=0, microsecond=0) - now).total_seconds() / 60


def apart(a: dict, b: dict) -> bool:
    """Whether two cells' 95% Wilson intervals do not overlap."""
    return a["wilson95"][1] < b["wilson95"][0] or a["wilson95"][0] > b["wilson95"][1]


def bytes_text(r: dict) -> str:
    """Bytes per token and the ratio to the bfloat16 original's; a press that only masks shows its live ratio too."""
    live = r.get("bytes_ratio_live")
    masked = f", live {live:.3f}" if live is not None and abs(live - r["bytes_ratio_to_bf16_original"]) > 1e-3 else ""
    return f"{r['bytes_per_token']:,.0f} ({r['bytes_ratio_to_bf16_original']:.3f}{masked})"


def comparison(report: dict) -> str:
    """Per (task, length): the original's score (the ceiling) and each option's, its difference and
    whether the two 95% Wilson intervals are apart; then, per task and budget tier, the options
    ranked by score, each marked where its interval is apart from the tier's best."""
    rows = ["| task | length | cache | score | full / n (95% CI) | minus the original | intervals apart | bytes/token (ratio to bf16) | s/sample |",
            "| --- | ---: | --- | ---: | --- | ---: | --- | ---: | ---: |"]
    cells = report["cells"]
    for r in cells.values():
        top = cells.get(ruler.cell_id("none", r["task"], r["length"]))
        delta = "" if top is None or r["option"] == "none" else f"{r['score'] - top['score']:+.3f}"
        sep = "" if top is None or r["option"] == "none" else ("yes" if apart(r, top) else "no")
        rows.append(f"| {r['task']} | {r['length']} | {r['option']} | {r['score']:.3f} | {r['full']}/{r['n']} ({r['wilson95'][0]:.2f}-{r['wilson95'][1]:.2f}) | "
                    f"{delta} | {sep} | {bytes_text(r)} | {r['seconds_per_sample']:.1f} |")
    rows += ["", "## Ranking per task and budget", "",
             f"Each cell in the budget tier nearest its measured ratio to the bfloat16 original's bytes (tiers {', '.join(map(str, BUDGET_TIERS))}; "
             "a press's ratio counts the entries attention still sees, its question tail included). `below the best`: the cell's 95% interval "
             "lies below the tier's best cell's (a winner is named only where intervals separate). A task whose original scores low measures the "
             "model more than its cache.", "",
             "| task | length | tier | rank | cache | score | full / n (95% CI) | ratio | below the best |", "| --- | ---: | ---: | ---: | --- | ---: | --- | ---: | --- |"]
    groups: dict[tuple, list[dict]] = {}
    for r in cells.values():
        if r["option"] != "none":
            groups.setdefault((r["task"], r["length"], budget_tier(r["bytes_ratio_to_bf16_original"])), []).append(r)
    task_order = list(dict.fromkeys(r["task"] for r in cells.values()))
    for (task, length, budget), members in sorted(groups.items(), key=lambda kv: (kv[0][1], task_order.index(kv[0][0]), kv[0][2])):
        members.sort(key=lambda r: -r["score"])
        for rank, r in enumerate(members, 1):
            rows.append(f"| {task} | {length} | {budget} | {rank} | {r['option']} | {r['score']:.3f} | {r['full']}/{r['n']} "
                        f"({r['wilson95'][0]:.2f}-{r['wilson95'][1]:.2f}) | {r['bytes_ratio_to_bf16_original']:.3f} | "
                        f"{'yes' if r['wilson95'][1] < members[0]['wilson95'][0] else 'no'} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2k,4k")
    parser.add_argument("--tasks", default="niah_single_1,niah_multikey_2")
    parser.add_argument("--caches", default="none,quanto-int4,quanto-int2")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop-at", default=None, help="HH:MM local time: start no cell that the planner says would end past it")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tasks, caches = ruler_offline.parse_tasks(args.tasks), parse_caches(args.caches)
    report = None
    for length in parse_lengths(args.lengths):  # one length at a time: 2K is complete before 4K starts
        budget = minutes_until(args.stop_at)
        if budget is not None and budget <= 0:
            print(f"past --stop-at {args.stop_at}: {length} not started")
            break
        report = ruler.evaluate("smollm2", tasks=tasks, lengths=[length], caches=caches, limit=args.limit, seed=0, out_dir=args.out / str(length),
                                budget_minutes=budget)
        write_text(args.out / str(length) / "comparison.md", comparison(report) + "\n")
        print(comparison(report))


if __name__ == "__main__":
    main()
