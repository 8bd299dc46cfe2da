"""``slimkv demo`` (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from slimkv.demo import DEMO_PARTS, DEMO_WORKERS, run_demo


def add_commands(subparsers) -> None:
    """Register ``demo`` on the top-level ``slimkv`` parser."""
    d = subparsers.add_parser(
        "demo",
        help="train and compare small models with each attention kind on Shakespeare",
        description=(
            "A small `slimkv compare`: prepare Shakespeare, train one small model per attention entry (mha, gqa, mqa, swa, "
            "mla, lrkv at half of MHA's cache, kvm fixed and sqrt, the swa/kvm hybrid) with one short recipe and one seed, "
            "print the table and write report.json, report.md and PNGs into --out; then convert SmolLM2 to a smaller KV cache "
            "(perplexity and live cache bytes before/after, into --out/conversion) and compress it at ratio 0.2 with rootcov and "
            "latentllm beside the dense model (into --out/compression); last, MQAR recall against cache size for a few kinds (into --out/recall). With --workers 2 or more (the default) the small "
            "models of the comparison and the recall part train in the background beside the SmolLM2 parts, so those print first. "
            "Finished runs are reused."
        ),
    )
    d.add_argument("--out", default="demo_runs", metavar="DIR", help="folder for the runs and the report (default demo_runs)")
    d.add_argument("--steps", type=int, help="optimizer steps per kind (default: the recipe's)")
    d.add_argument("--kinds", nargs="+", metavar="ENTRY", help="entries to compare (default: every entry of the demo)")
    d.add_argument("--parts", default=",".join(DEMO_PARTS), help=f"comma-separated parts to run (default: all of {', '.join(DEMO_PARTS)}; they run in the demo's order)")
    d.add_argument("--no-compression", action="store_true", help="skip the SmolLM2 compression part (same as leaving compress out of --parts)")
    d.add_argument("--eval-tokens", type=int, default=None, help="val tokens to evaluate per kind (default: the demo's)")
    d.add_argument("--workers", type=int, default=DEMO_WORKERS, help=f"runs the compare and recall parts train at once, each in its own process "
                   f"on one torch thread (default {DEMO_WORKERS}: with 2 or more, workers - 1 of them start ahead, beside the SmolLM2 parts; "
                   "1 = one at a time with progress bars, the same numbers)")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip() and not (args.no_compression and p.strip() == "compress"))
    run_demo(Path(args.out), steps=args.steps, kinds=args.kinds, eval_tokens=args.eval_tokens, progress=not args.no_progress, parts=parts,
             workers=args.workers)
    return 0
