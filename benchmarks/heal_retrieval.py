"""Healing that teaches retrieval back: copy accuracy and perplexity of conversions against how long they were healed.

Each ``--models LABEL=DIR`` is a conversion folder (one-shot or healed; its manifest says with how many tokens, on which
windows and with which ``--heal-copy-fraction``). Each model and the original read held-out copy contexts
(``slimkv.convert.roles.copy_contexts`` from Austen, which no conversion calibrates or heals on: a list of random words or
JSON records shown once and repeated thousands of tokens later; the same contexts as ``benchmarks/hybrid_heads.py``) at
each length, scored token by token on the repeat (teacher-forced, ``roles.copy_accuracy``, through the model's own cache
storage), and ``slimkv eval ppl`` scores 4K windows of the held-out plays and Austen beside the original.

    .venv/bin/python benchmarks/heal_retrieval.py --models one-shot=/tmp/budget0.125,healed=/tmp/heal0.125 \\
        [--lengths 2k,8k] [--threads 1]

Writes ``results/heal/heal_retrieval_smollm2.json``, ``.md`` and ``.png``; a repeated run keeps the cells already
measured for the same folder and conversion (its weights' sha256).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hybrid_heads import (  # benchmarks/hybrid_heads.py, beside this script: the same contexts
    FORMATS,
    SEED,
    TEXT,
    held_out_contexts,
)

from slimkv.common.files import save_figure, write_text
from slimkv.common.markdown import markdown_table
from slimkv.common.plotting import new_figure
from slimkv.common.results import results_dir, results_path
from slimkv.common.timing import write_results
from slimkv.convert.roles import copy_accuracy
from slimkv.eval.models import load_language_model
from slimkv.eval.ppl import perplexity_report
from slimkv.pretrained import SMOLLM2, fetch_smollm2
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from slimkv.retrieval.grid import parse_lengths

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "heal_retrieval_smollm2"
PPL_TEXTS = ("shakespeare-val", "austen")
SEQ_LEN, MAX_TOKENS = 4096, 8192
ORIGINAL = "original"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="LABEL=DIR,... conversion folders (one-shot or healed)")
    p.add_argument("--lengths", default="2k,8k", help="token counts, the grammar of every --lengths (docs/evaluation.md)")
    p.add_argument("--contexts", type=int, default=2, help="contexts per format and length")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--report", action="store_true", help="render the page and plot from the JSON and measure nothing")
    return p.parse_args()


def healing_of(folder: str) -> dict:
    """What the folder's manifest says of its healing: tokens (0 when one-shot), window length, copy fraction."""
    manifest = json.loads((Path(folder) / CONVERTED_MANIFEST).read_text())
    config = (manifest.get("healing") or {}).get("config") or {}
    return {"tokens": int(config.get("tokens", 0)), "seq_len": config.get("seq_len"), "copy_fraction": config.get("copy_fraction", 0.0),
            "params": config.get("params"), "conversion_sha256": manifest.get("conversion_sha256"),
            "weights_sha256": (manifest.get("file_sha256") or {}).get("model.safetensors"), "method": manifest.get("method"),
            "budget": (manifest.get("budget_plan") or {}).get("budget"),
            "cache_ratio_8k": next((c["ratio"] for c in manifest.get("cache_bytes") or [] if c["context"] == 8192), None)}


def conversion_of(heal: dict) -> str:
    """A model row's conversion as its manifest recorded it: the method, and the planner's budget or the cache ratio at 8K."""
    if not heal.get("method"):
        return ""
    size = f"--cache-budget {heal['budget']:g}" if heal.get("budget") else f"cache {heal['cache_ratio_8k']:.3g} at 8K" if heal.get("cache_ratio_8k") else ""
    return f"{heal['method']} {size}".strip()


def render(payload: dict) -> str:
    """The page: per model its healing, copy accuracy per length (and as a fraction of the original's), perplexity ratios."""
    s = payload["settings"]
    lengths = s["lengths"]
    copy = {(r["model"], r["length"]): r["mean"] for r in payload["copy"]}
    ppl = {(r["model"], r["text"]): r for r in payload["ppl"]}
    table = []
    for model in [ORIGINAL, *payload["models"]]:
        heal = payload["models"].get(model, {}).get("healing", {})
        cells = [f"{copy[(model, n)]:.3f}" + ("" if model == ORIGINAL else f" ({copy[(model, n)] / copy[(ORIGINAL, n)]:.2f})")
                 if (model, n) in copy else "" for n in lengths]
        ratios = [f"{ppl[(model, t)]['ppl']:.2f} ({ppl[(model, t)]['ratio']:.3f}x)" if (model, t) in ppl else "" for t in s["ppl_texts"]]
        healed = "" if model == ORIGINAL else (f"{heal['tokens']:,} tokens, {heal['seq_len']}-token windows, copy fraction {heal['copy_fraction']:g}"
                                               if heal.get("tokens") else "none (one-shot)")
        table.append([model, conversion_of(heal), healed, *cells, *ratios])
    return "\n".join([
        "# Healing that teaches retrieval back (SmolLM2-135M)", "",
        f"Generated by `benchmarks/heal_retrieval.py` from `{NAME}.json`. Copy accuracy: held-out contexts built from {s['text']} "
        f"({', '.join(s['formats'])}; {s['contexts']} per format and length, seed {s['seed']}), the repeat's tokens predicted "
        "teacher-forced through each model's own cache storage, the fraction right; in brackets, as a fraction of the original's. "
        f"Perplexity: `slimkv eval ppl` on {s['seq_len']}-token windows ({s['max_tokens']} tokens) beside the original. "
        "The copy contexts share their formats with healing's copy mix (word lists, JSON records) but are built from a text "
        "healing never reads (`--heal-text` is the calibration mix): in format, out of text. RULER (`results/ruler/`) is the "
        "check out of both.", "",
        markdown_table(["model", "conversion", "healing", *(f"copy {n}" for n in lengths), *(f"ppl {t} (vs original)" for t in s["ppl_texts"])], table,
                       align=["left", "left", "left", *["right"] * (len(lengths) + len(s["ppl_texts"]))]), ""])


def plot(payload: dict):
    """Copy accuracy (each length) and perplexity ratio (each text) against healing tokens."""
    fig, (left, right) = new_figure(1, 2, figsize=(10, 4), layout="constrained")
    models = payload["models"]
    order = sorted(models, key=lambda m: models[m]["healing"]["tokens"])
    tokens = [models[m]["healing"]["tokens"] for m in order]
    for n in payload["settings"]["lengths"]:
        values = {r["model"]: r["mean"] for r in payload["copy"] if r["length"] == n}
        left.plot(tokens, [values.get(m) for m in order], marker="o", label=f"{n} tokens")
        if ORIGINAL in values:
            left.axhline(values[ORIGINAL], linestyle=":", color=left.lines[-1].get_color())
    left.set(xlabel="healing tokens", ylabel="copy accuracy (dotted: the original)", title="retrieval")
    for text in payload["settings"]["ppl_texts"]:
        values = {r["model"]: r["ratio"] for r in payload["ppl"] if r["text"] == text}
        right.plot(tokens, [values.get(m) for m in order], marker="o", label=text)
    right.set(xlabel="healing tokens", ylabel="perplexity / original's", title="perplexity")
    left.legend()
    right.legend()
    return fig


def write(payload: dict) -> None:
    write_results(NAME, payload, results_dir(RESULTS, NAME))
    path = results_path(RESULTS, f"{NAME}.md")
    write_text(path, render(payload))
    if payload["models"]:
        save_figure(plot(payload), path.with_suffix(".png"))


def main() -> None:
    args = parse()
    path = results_path(RESULTS, f"{NAME}.json")
    if args.report:
        payload = json.loads(path.read_text())
        write_text(path.with_suffix(".md"), render(payload))
        save_figure(plot(payload), path.with_suffix(".png"))
        return
    if not args.models:
        raise SystemExit("--models LABEL=DIR,... is required (or --report)")
    models = dict(item.split("=", 1) for item in args.models.split(","))
    for label, folder in models.items():
        if not (Path(folder) / CONVERTED_MANIFEST).is_file():
            raise SystemExit(f"--models {label}={folder}: not a conversion folder ({CONVERTED_MANIFEST} is missing)")
    if args.threads:
        torch.set_num_threads(args.threads)
    fetch_smollm2()
    settings = {"text": TEXT, "formats": list(FORMATS), "contexts": args.contexts, "seed": SEED, "lengths": parse_lengths(args.lengths),
                "ppl_texts": list(PPL_TEXTS), "seq_len": SEQ_LEN, "max_tokens": MAX_TOKENS}
    empty = {"models": {}, "copy": [], "ppl": []}
    previous = json.loads(path.read_text()) if path.is_file() else empty
    if {k: v for k, v in previous.get("settings", settings).items() if k != "lengths"} != {k: v for k, v in settings.items() if k != "lengths"}:
        previous = empty  # measured with other contexts or windows: nothing carries over
    info = {label: {"folder": folder, "healing": healing_of(folder)} for label, folder in models.items()}
    stale = {label for label in info if previous["models"].get(label) != info[label]}  # a label now naming another folder or weights
    payload = {"settings": settings, "models": {**previous["models"], **info},
               "copy": [r for r in previous["copy"] if r["model"] not in stale],
               "ppl": [r for r in previous["ppl"] if r["model"] not in stale]}
    for label, folder in {ORIGINAL: SMOLLM2, **models}.items():
        loaded = None
        for length in settings["lengths"]:
            if any(r["model"] == label and r["length"] == length for r in payload["copy"]):
                continue
            loaded = loaded or load_language_model(str(folder))
            contexts = held_out_contexts(loaded.tokenizer, length, args.contexts)
            storage = getattr(loaded.model.config, "cache_storage", None) if label != ORIGINAL else None
            measured = copy_accuracy(loaded.model, contexts, storage=storage)
            payload["copy"].append({"model": label, "length": length, **measured})
            print(f"{label:<16} {length:>6} copy accuracy {measured['mean']:.3f}", flush=True)
            write(payload)
        if label == ORIGINAL:
            continue
        for name in PPL_TEXTS:
            if any(r["model"] == label and r["text"] == name for r in payload["ppl"]):
                continue
            original, converted = perplexity_report(str(folder), name, SEQ_LEN, MAX_TOKENS)["results"]
            payload["ppl"].append({"model": label, "text": name, "ppl": converted["ppl"], "original_ppl": original["ppl"],
                                   "ratio": converted["ppl"] / original["ppl"], "tokens_predicted": converted["tokens_predicted"]})
            print(f"{label:<16} ppl {name} {converted['ppl']:.2f} ({converted['ppl'] / original['ppl']:.3f}x)", flush=True)
            write(payload)


if __name__ == "__main__":
    main()
