"""SmolLM2 under ``convert --cache-budget``: the planner's conversions and their perplexity.

``run`` converts SmolLM2-135M with ``slimkv convert --cache-budget B`` for each budget (a folder
per budget under ``--runs``, reused when finished), then scores each conversion and the original on
4K windows of the held-out plays and of Austen with ``slimkv eval ppl`` (a quantized cache is
scored through itself, ``slimkv.eval.ppl.cache_chunk``). ``report`` renders the JSON as markdown.
Retrieval of the same folders runs through RULER (``slimkv eval ruler --model DIR``, docs/ruler.md).

    .venv/bin/python benchmarks/budget_smollm2.py run --budgets 0.125,0.25 --runs /tmp/budget [--threads 1]
    .venv/bin/python benchmarks/budget_smollm2.py report
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from slimkv.common.files import write_text
from slimkv.common.markdown import markdown_table
from slimkv.common.timing import write_results
from slimkv.convert.pipeline import ConvertOptions, convert_pretrained, finished_conversion
from slimkv.eval.ppl import perplexity_report
from slimkv.pretrained import SMOLLM2, fetch_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "budget_smollm2"
TEXTS = ("shakespeare-val", "austen")
SEQ_LEN, MAX_TOKENS = 4096, 8192


def run(budgets: list[float], runs: Path) -> Path:
    """Convert at each budget (reusing finished folders), score perplexity, write the JSON."""
    fetch_smollm2()
    rows = []
    for budget in budgets:
        out = runs / f"budget{budget:g}"
        options = ConvertOptions("hybrid", cache_budget=budget)
        manifest = finished_conversion(out, options)
        if manifest is None:
            _, manifest = convert_pretrained(SMOLLM2, options, out)
        scores = {}
        for text in TEXTS:
            report = perplexity_report(str(out), text, SEQ_LEN, MAX_TOKENS)
            original, converted = report["results"]
            scores[text] = {"original_ppl": original["ppl"], "ppl": converted["ppl"], "ratio": converted["ppl"] / original["ppl"],
                            "tokens_predicted": converted["tokens_predicted"], "through_cache_in_calls_of": converted.get("through_cache_in_calls_of")}
        rows.append({"budget": budget, "folder": str(out), "plan": manifest["budget_plan"], "allocation": manifest["allocation"],
                     "cache_storage": manifest["cache_storage"], "cache_bytes": manifest["cache_bytes"], "seconds": manifest["seconds"], "ppl": scores})
    payload = {"model": SMOLLM2, "seq_len": SEQ_LEN, "max_tokens": MAX_TOKENS,
               "protocol": f"slimkv convert --cache-budget B; slimkv eval ppl --seq-len {SEQ_LEN} --max-tokens {MAX_TOKENS} on {', '.join(TEXTS)}",
               "rows": rows}
    return write_results(NAME, payload, RESULTS)


def render(payload: dict) -> str:
    """The markdown page of the JSON."""
    lines = [f"# SmolLM2 under `convert --cache-budget` ({payload['protocol']})", "",
             f"Machine: {payload['machine']['cpu_model']} ({payload['machine']['instruction_set']}), {payload['machine']['threads']} threads, "
             f"load {payload['machine']['load_average'][0]:.2f}; commit {payload['machine']['git_commit'][:10]}.", ""]
    table = []
    for row in payload["rows"]:
        at = {r["context"]: r["ratio"] for r in row["cache_bytes"]}
        table.append([f"{row['budget']:g}", row["plan"]["storage"], f"{row['plan']['exact_heads']} / {row['plan']['total_heads']}",
                      *(f"{at[n]:.4f}" if n in at else "" for n in (2048, 4096, 8192)),
                      *(f"{row['ppl'][t]['ppl']:.2f} ({row['ppl'][t]['ratio']:.3f}x)" for t in TEXTS), f"{row['seconds']['total']:.0f}"])
    lines.append(markdown_table(["budget", "storage", "exact KV heads", "bytes 2K", "bytes 4K", "bytes 8K", *(f"ppl {t} (vs original)" for t in TEXTS),
                                 "convert s"], table, align=["left"] * 3 + ["right"] * 6))
    lines += ["", "Bytes: the live bfloat16 cache against the bfloat16 original's at that context (measured at conversion). "
                  "Perplexity: 4K windows, the original beside each conversion in the same run; a quantized cache scored through itself."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run")
    run_p.add_argument("--budgets", default="0.125,0.25")
    run_p.add_argument("--runs", type=Path, required=True, help="where the converted folders go (not git)")
    run_p.add_argument("--threads", type=int, default=None)
    sub.add_parser("report")
    args = parser.parse_args()
    if args.command == "run":
        if args.threads:
            torch.set_num_threads(args.threads)
        run([float(b) for b in args.budgets.split(",")], args.runs)
    payload = json.loads((RESULTS / f"{NAME}.json").read_text())
    write_text(RESULTS / f"{NAME}.md", render(payload))
    print(render(payload))


if __name__ == "__main__":
    main()
