"""Which heads a hybrid conversion keeps exact: copy accuracy of SmolLM2's --cache-budget conversions, one per role score.

For each ``--scores`` entry, ``slimkv convert --cache-budget B --to hybrid:score=S`` (a folder per score under ``--runs``,
reused when finished): the same budget, so the same number of exact KV heads, chosen by that score. Each conversion and
the original read held-out copy contexts (``slimkv.convert.roles.copy_contexts`` built from Austen, which no conversion
calibrates on: a span shown once and repeated thousands of tokens later, as a list of random words and as JSON records)
at each length, and ``roles.copy_accuracy`` scores the repeat token by token (teacher-forced). The exact heads' rows are
read in full precision unless ``--through-cache`` (then through each conversion's own quantized cache). This is how the
default score was chosen (docs/conversion.md, hybrid): never on an evaluation's prompts.

    .venv/bin/python benchmarks/hybrid_heads.py --runs /tmp/heads [--budget 0.125] [--lengths 2048,4096,8192] [--threads 2]
    .venv/bin/python benchmarks/hybrid_heads.py --runs /tmp/heads --budget 0.25 --scores combined --storages full,int8,int4 --through-cache

Writes ``results/convert/convert_hybrid_heads_smollm2.json`` and ``.md``; a repeated run skips the (model, length) cells
already there with the same settings.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from slimkv.common.files import write_text
from slimkv.common.markdown import markdown_table
from slimkv.common.results import results_dir, results_path
from slimkv.common.timing import write_results
from slimkv.convert.hybrid import COMBINED
from slimkv.convert.manifest import finished_conversion
from slimkv.convert.pipeline import ConvertOptions, convert_pretrained
from slimkv.convert.roles import SCORES, copy_accuracy, copy_contexts
from slimkv.data.texts import evaluation_text
from slimkv.eval.models import load_language_model
from slimkv.pretrained import SMOLLM2, fetch_smollm2
from slimkv.retrieval.grid import parse_lengths

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "convert_hybrid_heads_smollm2"
TEXT = "austen"
FORMATS = ("word-list", "json-records")
SEED = 777
ORIGINAL = "original"


@functools.lru_cache(maxsize=1)
def held_out_documents() -> tuple[str, ...]:
    """The held-out text the copy contexts are built from, in 5,000-character documents (read once)."""
    text = evaluation_text(TEXT)
    return tuple(text[i:i + 5000] for i in range(0, min(len(text), 2_000_000), 5000))


def held_out_contexts(tokenizer, length: int, per_format: int) -> list:
    """``per_format`` held-out copy contexts of ``length`` tokens in each of ``FORMATS`` (the same for every script that uses them)."""
    return [c for c in copy_contexts(tokenizer, list(held_out_documents()), length, per_format, SEED) if c.format in FORMATS]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, required=True, help="where the converted folders go (not git)")
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--scores", default=",".join((*SCORES, COMBINED)))
    p.add_argument("--storages", default="", help="comma list of --cache-storage values, each converted with every score "
                   "(default: the planner's choice)")
    p.add_argument("--lengths", default="2k,4k,8k", help="token counts, the grammar of every --lengths (docs/evaluation.md)")
    p.add_argument("--contexts", type=int, default=2, help="contexts per format and length")
    p.add_argument("--through-cache", action="store_true", help="read the repeat through each conversion's own (quantized) cache")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default=NAME, help="the results files' stem (under results/convert/)")
    p.add_argument("--report", action="store_true", help="render the markdown from the JSON and measure nothing")
    return p.parse_args()


def render(payload: dict, name: str = NAME) -> str:
    """The markdown page: copy accuracy per model and length, and as a fraction of the original's."""
    s = payload["settings"]
    lengths = sorted({r["length"] for r in payload["rows"]})
    cell = {(r["model"], r["length"]): r for r in payload["rows"]}
    models = list(dict.fromkeys(r["model"] for r in payload["rows"]))
    table = []
    for model in models:
        row = [model, str(cell.get((model, lengths[0]), {}).get("exact_heads", ""))]
        for n in lengths:
            r, base = cell.get((model, n)), cell.get((ORIGINAL, n))
            row.append("" if r is None else f"{r['mean']:.3f}" + ("" if base is None or model == ORIGINAL else f" ({r['mean'] / base['mean']:.2f})"))
        table.append(row)
    what = "by role score and storage" if s.get("storages") else "by role score"
    lines = [f"# Which heads to keep exact: copy accuracy of SmolLM2's `--cache-budget {s['budget']}` conversions {what}", "",
             f"Generated by `benchmarks/hybrid_heads.py` from `{name}.json`. Held-out copy contexts built from {s['text']} "
             f"({', '.join(s['formats'])}; {s['contexts']} per format and length, seed {s['seed']}): the repeat's tokens predicted "
             "teacher-forced, the fraction right; in brackets, as a fraction of the original's. Exact heads read "
             + ("through each conversion's own quantized cache." if s["through_cache"] else "in full precision (which heads, not their storage)."),
             "", markdown_table(["model", "exact KV heads", *(f"{n} tokens" for n in lengths)], table,
                                align=["left", "right", *["right"] * len(lengths)]), ""]
    return "\n".join(lines)


def main() -> None:
    args = parse()
    path = results_path(RESULTS, f"{args.name}.json")
    if args.report:
        write_text(path.with_suffix(".md"), render(json.loads(path.read_text()), args.name))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    fetch_smollm2()
    lengths = parse_lengths(args.lengths)
    scores = args.scores.split(",")
    settings = {"budget": args.budget, "text": TEXT, "formats": list(FORMATS), "contexts": args.contexts, "seed": SEED,
                "through_cache": args.through_cache, "scores": scores, "storages": args.storages.split(",") if args.storages else [],
                "lengths": lengths}
    previous = json.loads(path.read_text()) if path.is_file() else None
    kept = ("budget", "text", "formats", "contexts", "seed", "through_cache")  # what a finished cell was measured with
    same = previous is not None and all(previous["settings"].get(k) == settings[k] for k in kept)
    rows = {(r["model"], r["length"]): r for r in previous["rows"]} if same else {}
    folders = {}
    storages = args.storages.split(",") if args.storages else [None]
    for score in scores:
        for storage in storages:
            out = args.runs / (f"budget{args.budget:g}-{score}" + (f"-{storage}" if storage else ""))
            options = ConvertOptions(f"hybrid:score={score}", cache_budget=args.budget, cache_storage=storage)
            manifest = finished_conversion(out, options) or convert_pretrained(SMOLLM2, options, out)[1]
            heads = sum(len(layer["full_heads"]) for layer in manifest["layers"]) if "layers" in manifest else None
            folders[f"score={score}" + (f" storage={storage}" if storage else "")] = (out, heads)
    for name, (folder, heads) in {ORIGINAL: (SMOLLM2, None), **folders}.items():
        loaded = load_language_model(str(folder))
        for length in lengths:
            if (name, length) in rows:
                continue
            contexts = held_out_contexts(loaded.tokenizer, length, args.contexts)
            storage = loaded.model.config.cache_storage if args.through_cache and name != ORIGINAL else None
            measured = copy_accuracy(loaded.model, contexts, storage=storage)
            rows[(name, length)] = {"model": name, "length": length, "exact_heads": heads, **measured}
            print(f"{name:<24} {length:>6} copy accuracy {measured['mean']:.3f}", flush=True)
            payload = {"settings": settings, "rows": sorted(rows.values(), key=lambda r: (r["model"] != ORIGINAL, r["model"], r["length"]))}
            write_results(args.name, payload, results_dir(RESULTS, args.name))
            write_text(path.with_suffix(".md"), render(payload, args.name))


if __name__ == "__main__":
    main()
