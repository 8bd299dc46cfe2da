"""RULER on SmolLM2-135M-Instruct: the original's own cache against transformers' quantized caches.

One model (slimkv's ``smollm2``: the 4-bit GGUF release dequantized to float32), lm-eval's offline
RULER tasks ``niah_single_1`` and ``niah_multikey_2``, the cache options ``none`` (the original's
float32 ``DynamicCache``: the ceiling), ``quanto-int4`` and ``quanto-int2`` (transformers'
``QuantizedCache``), 40 prompts per cell, one torch thread; 2K first, then 4K while time allows
(``--stop-at`` turns a wall-clock deadline into ``--budget-minutes`` for each length). Every cell
goes through ``slimkv eval ruler``'s runner (``slimkv.eval.ruler``), so a repeated run skips the
finished cells. Each length has its folder, ``benchmarks/results/ruler/smollm2/<length>/``: the
runner's ``ruler.json``, ``ruler.md`` and ``cells/`` (lm-eval's own files), and ``comparison.md``
(each option beside the original, with intervals).

    .venv-ruler/bin/python benchmarks/ruler_smollm2.py [--lengths 2k,4k] [--limit 40] [--stop-at 16:55]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from slimkv.common.files import write_text
from slimkv.eval import ruler
from slimkv.eval.ruler_cache import parse_caches
from slimkv.retrieval.models import parse_lengths

OUT = Path(__file__).resolve().parent / "results" / "ruler" / "smollm2"


def minutes_until(stop_at: str | None) -> float | None:
    """Minutes from now to ``HH:MM`` today (local time); None without a deadline."""
    if stop_at is None:
        return None
    now = datetime.datetime.now()
    hour, minute = (int(p) for p in stop_at.split(":"))
    return (now.replace(hour=hour, minute=minute, second=0, microsecond=0) - now).total_seconds() / 60


def comparison(report: dict) -> str:
    """Per (task, length): the original's score (the ceiling) and each option's, its difference and
    whether the two 95% Wilson intervals are apart."""
    rows = ["| task | length | cache | score | full / n (95% CI) | minus the original | intervals apart | bytes/token (ratio to bf16) | s/sample |",
            "| --- | ---: | --- | ---: | --- | ---: | --- | ---: | ---: |"]
    cells = report["cells"]
    for r in cells.values():
        top = cells.get(ruler.cell_id("none", r["task"], r["length"]))
        delta = "" if top is None or r["option"] == "none" else f"{r['score'] - top['score']:+.3f}"
        apart = "" if top is None or r["option"] == "none" else ("yes" if r["wilson95"][1] < top["wilson95"][0] or r["wilson95"][0] > top["wilson95"][1] else "no")
        rows.append(f"| {r['task']} | {r['length']} | {r['option']} | {r['score']:.3f} | {r['full']}/{r['n']} ({r['wilson95'][0]:.2f}-{r['wilson95'][1]:.2f}) | "
                    f"{delta} | {apart} | {r['bytes_per_token']:,.0f} ({r['bytes_ratio_to_bf16_original']:.3f}) | {r['seconds_per_sample']:.1f} |")
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
    tasks, caches = ruler.parse_tasks(args.tasks), parse_caches(args.caches)
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
