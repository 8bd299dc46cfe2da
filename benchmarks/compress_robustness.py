"""LatentLLM away from its calibration text (docs/compression.md, "Away from the calibration text").

Every row is SmolLM2-135M-Instruct compressed and measured on the first ``--max-tokens`` tokens of
the held-out plays (in domain) and of Austen's novels (out of domain, never calibration text),
1024-token windows, the dense model measured in the same run. Parts (``--parts``):

- ``curve``: latentllm at ratio 0.2 against calibration tokens and calibration mix
  (``compress_calibration_curve.{json,md}``);
- ``ablation``: each method change switched against the defaults (``compress_robustness_ablation.{json,md}``);
- ``sources``: latentllm at 0.2 and 0.3 calibrated on the four-text mix and on the library's mix
  (the four plus the Debian handbook, modern English), measured also on the handbook's held-out
  pages: what the added source buys (``compress_calibration_sources.{json,md}``);
- ``asvd``: the ASVD audit: slimkv's asvd, its scaling exponent, calibration on the dense model
  (as the paper does) and the paper's sensitivity-based rank search (``compress_asvd_audit.{json,md}``).

Usage: .venv/bin/python benchmarks/compress_robustness.py --threads 2 --parts curve,ablation,asvd,sources
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from slimkv.common.files import save_figure
from slimkv.common.plotting import new_figure
from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.compress.sweep import DEFAULT_TEXTS, markdown_table, parse_methods, run_sweep
from slimkv.compress.workflow import DEFAULT_CALIB
from slimkv.data.texts import MIXED_CALIBRATION
from slimkv.pretrained import fetch_smollm2, load_pretrained

RESULTS = Path(__file__).resolve().parent / "results"

# (label, ratios): each change alone against the defaults (whose rows are compress_sweep_smollm2's,
# same calibration and evaluation tokens), at 0.2; the MLP choice also where it mattered (0.4)
ABLATION = [
    ("latentllm+rank_allocation=spectrum", (0.2, 0.4)),
    ("latentllm+correct_upstream=true", (0.2,)),
    ("latentllm+sequential=false", (0.2,)),
    ("latentllm+joint_mlp_check=false", (0.2, 0.4)),
    ("latentllm-no-joint-mlp", (0.4,)),
]
FOUR_TEXT_MIX = "shakespeare,kjv,devil,pydoc"  # the mix before the handbook joined it
SOURCES_TEXTS = ("shakespeare-val", "austen", "handbook-val")
# the ASVD audit at ratio 0.2: slimkv's asvd, the scaling exponent, the paper's calibration on the
# dense model, and the paper's sensitivity-based rank search (probes cost ~1,900 forwards)
ASVD = [
    ("asvd+rank_allocation=sensitivity+sequential=false", (0.2,)),
    ("asvd+rank_allocation=uniform", (0.2,)),
    ("asvd+rank_allocation=uniform+asvd_alpha=0.25", (0.2,)),
    ("asvd+rank_allocation=uniform+asvd_alpha=1.0", (0.2,)),
    ("asvd+rank_allocation=uniform+sequential=false", (0.2,)),
]


def plot_curve(merged: dict):
    """Perplexity against calibration tokens (log x), one line per calibration and text; returns the figure."""
    fig, ax = new_figure(figsize=(6.4, 4.4))
    texts = list(merged["eval"]["texts"])
    for calib in dict.fromkeys(row["calib"] for row in merged["rows"]):
        rows = sorted((r for r in merged["rows"] if r["calib"] == calib), key=lambda r: r["calib_tokens"])
        for text, style in zip(texts, ("-", "--")):
            ax.plot([r["calib_tokens"] for r in rows], [r["ppl_by_text"][text] / merged["dense"]["ppl_by_text"][text] for r in rows],
                    style, marker="o", label=f"{calib}: {text}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration tokens")
    ax.set_ylabel("perplexity / dense perplexity")
    ax.set_title("latentllm at ratio 0.2: calibration size and mix")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_part(name: str, results: list[dict], several: bool) -> None:
    """The part's JSON and markdown so far (rewritten after every run, so an interrupted part keeps its rows)."""
    merged = {**results[0], "rows": [row | {"calib": r["calibration"]["source"], "calib_tokens": r["calibration"]["tokens"],
                                            "method": f"{row['method']} ({r['calibration']['source']}, {r['calibration']['tokens']} tokens)" if several
                                            else row["method"]} for r in results for row in r["rows"]]}
    if several:
        merged["calibration"] = {"source": "each row's (in its label)", "tokens": "each row's"}
    payload = {"part": name, "threads": torch.get_num_threads(), "load_average_1min_end": os.getloadavg()[0], "result": merged}
    path = write_results(name, payload, results_dir(RESULTS, name), figure=plot_curve(merged) if name == "compress_calibration_curve" else None)
    path.with_suffix(".md").write_text(markdown_table(merged))


def run(base, name: str, plan: list[tuple[str, tuple[float, ...]]], calibs: list[tuple[str, int]], args, dense=None,
        texts: tuple[str, ...] = DEFAULT_TEXTS) -> dict:
    """Every (calibration, tokens) x (label, ratios); one JSON + markdown table per part."""
    results = []
    for calib, tokens in calibs:
        for label, ratios in plan:
            result = run_sweep(base, parse_methods(label), list(ratios), calib=calib, calib_tokens=tokens, max_tokens=args.max_tokens, repeats=0,
                               dense=dense, texts=texts)
            dense = result["dense"]
            print(markdown_table(result), flush=True)
            results.append(result)
            write_part(name, results, several=len(calibs) > 1)
    return dense


def replot_curve() -> None:
    """The curve with the default-calibration point of the main sweep (same evaluation tokens and seed)."""
    curve = json.loads((results_dir(RESULTS, "compress_") / "compress_calibration_curve.json").read_text())
    sweep = json.loads((results_dir(RESULTS, "compress_") / "compress_sweep_smollm2.json").read_text())
    merged = curve["result"]
    row = next(r for r in sweep["rows"] if r["method"] == "latentllm" and r["ratio"] == 0.2)
    source, tokens = sweep["calibration"]["source"], sweep["calibration"]["tokens"]
    if not any(r["calib"] == source and r["calib_tokens"] == tokens for r in merged["rows"]):
        merged["rows"].append(row | {"calib": source, "calib_tokens": tokens, "method": f"latentllm ({source}, {tokens} tokens; compress_sweep_smollm2)"})
    merged["rows"].sort(key=lambda r: (r["calib"], r["calib_tokens"]))
    merged["calibration"] = {"source": "each row's (in its label)", "tokens": "each row's"}
    curve["result"] = merged
    (results_dir(RESULTS, "compress_") / "compress_calibration_curve.json").write_text(json.dumps(curve, indent=1))
    save_figure(plot_curve(merged), results_dir(RESULTS, "compress_") / "compress_calibration_curve.png")
    (results_dir(RESULTS, "compress_") / "compress_calibration_curve.md").write_text(markdown_table(merged))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--parts", default="ablation,asvd,curve", help="parts to run, in this order: ablation, asvd, curve, sources")
    parser.add_argument("--calib", default=None, help="calibration of the ablation and the audit (default: the library default)")
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--curve", default="shakespeare:8192,MIX:2048,MIX:32768",
                        help="calibration:tokens points of the curve (MIX: the library's mixed calibration)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="evaluation tokens per text (default 8192)")
    parser.add_argument("--replot", action="store_true",
                        help="only rebuild the curve's table and plot from its JSON, adding latentllm 0.2 of compress_sweep_smollm2.json (same settings)")
    args = parser.parse_args(argv)
    if args.replot:
        replot_curve()
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    fetch_smollm2()
    base = load_pretrained("smollm2")
    calib = args.calib or DEFAULT_CALIB
    dense = None
    if "ablation" in parts:
        dense = run(base, "compress_robustness_ablation", ABLATION, [(calib, args.calib_tokens)], args, dense)
    if "asvd" in parts:
        dense = run(base, "compress_asvd_audit", ASVD, [(calib, args.calib_tokens)], args, dense)
    if "curve" in parts:
        calibs = [(MIXED_CALIBRATION if source == "MIX" else source, int(tokens)) for source, tokens in (p.rsplit(":", 1) for p in args.curve.split(","))]
        dense = run(base, "compress_calibration_curve", [("latentllm", (0.2,))], calibs, args, dense)
    if "sources" in parts:
        run(base, "compress_calibration_sources", [("latentllm", (0.2, 0.3))], [(FOUR_TEXT_MIX, args.calib_tokens), (MIXED_CALIBRATION, args.calib_tokens)],
            args, None, texts=SOURCES_TEXTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
