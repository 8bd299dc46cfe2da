"""``slimkv eval ruler``: lm-evaluation-harness's offline RULER tasks on a slimkv-loadable model under
a named KV-cache option (docs/ruler.md)."""

from __future__ import annotations

import argparse

import torch

from slimkv.common.checks import check_int
from slimkv.eval import ruler, ruler_offline
from slimkv.eval.ruler_cache import CACHE_OPTIONS, parse_caches
from slimkv.eval.ruler_press import PRESSES
from slimkv.eval.ruler_report import format_markdown
from slimkv.retrieval.models import parse_lengths

DESCRIPTION = ("RULER (lm-eval's offline tasks) on a pretrained, converted or compressed model under a KV-cache option: lm-eval's score per "
               "(cache, task, length) with a 95% Wilson interval, live cache bytes per token and the ratio to the bfloat16 original's")


def ruler_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``slimkv eval ruler``."""
    parser.add_argument("--model", required=True, help="`smollm2`, a local transformers folder, or a `slimkv convert` / `slimkv compress` output folder")
    parser.add_argument("--tasks", default="niah_single_1,niah_multikey_2", help=f"comma-separated offline RULER tasks among {', '.join(ruler_offline.OFFLINE_TASKS)} "
                        "(default niah_single_1,niah_multikey_2); the essay and QA tasks download from the hub and are refused")
    parser.add_argument("--lengths", default="2k", help="comma-separated lengths in tokens (prompt plus answer; 2048 or 2k), "
                        f"{ruler.MIN_LENGTH} up to the model's max_position_embeddings (default 2k)")
    parser.add_argument("--caches", default="none", help=f"comma-separated KV-cache options among {', '.join(CACHE_OPTIONS)} (default none: the model's own), "
                        f"or press:NAME@BUDGET, a kvpress press run in .venv-kvpress (make bench-kvpress-env) at BUDGET of the bfloat16 original's bytes, "
                        f"NAME among {', '.join(PRESSES)}")
    parser.add_argument("--limit", type=int, default=20, help="prompts per (cache, task, length) cell: the first N lm-eval generates (default 20)")
    parser.add_argument("--max-gen-toks", type=int, default=None, help="new tokens at most per prompt, for every task (default per task: "
                        + ", ".join(f"{t} {v[2]}" for t, v in ruler_offline.OFFLINE_TASKS.items()) + ")")
    parser.add_argument("--seed", type=int, default=0, help="lm-eval's random seed, which draws the prompts (default 0)")
    parser.add_argument("--budget-minutes", type=float, default=None, help="run only the cells that the timed prompt says fit in this many minutes (in grid order)")
    parser.add_argument("--plan-only", action="store_true", help="time one prompt per (cache, length), print the plan and stop")
    parser.add_argument("--dtype", default="float32", help=f"the dtype the model runs in, among {', '.join(ruler.MODEL_DTYPES)} (default float32); "
                        "a slimkv model's cache holds its rows in it, so bfloat16 measures the bytes a bfloat16 deployment keeps")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", required=True, metavar="DIR", help=f"folder for {ruler.RESULT_NAME}.json, {ruler.TABLE_FILE} and cells/ (a repeated run skips finished cells)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_ruler(args: argparse.Namespace) -> int:
    """Check the options, then run or resume the grid and print its table."""
    tasks = ruler_offline.parse_tasks(args.tasks)
    lengths = parse_lengths(args.lengths)
    caches = parse_caches(args.caches)
    if args.threads is not None:
        check_int("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    try:
        report = ruler.evaluate(args.model, tasks=tasks, lengths=lengths, caches=caches, limit=args.limit, max_gen_toks=args.max_gen_toks, seed=args.seed,
                                out_dir=args.out, budget_minutes=args.budget_minutes, plan_only=args.plan_only, progress=not args.no_progress,
                                dtype=args.dtype)
    except ImportError as err:  # a package this environment lacks: a user error with its remedy, not a traceback
        raise ValueError(str(err)) from None
    if not args.plan_only:
        print(format_markdown(report))
        print(f"wrote {args.out}/{ruler.RESULT_NAME}.json, {ruler.TABLE_FILE} and cells/")
    return 0


def add_ruler_command(eval_subparsers) -> None:
    """Register ``ruler`` on ``slimkv eval``'s subparsers (an ``add_subparsers()`` result, or the
    ``EVAL_TASKS`` table of slimkv/cli/eval.py when given a dict)."""
    if isinstance(eval_subparsers, dict):
        eval_subparsers["ruler"] = (DESCRIPTION, ruler_arguments, run_ruler)
        return
    parser = eval_subparsers.add_parser("ruler", help=DESCRIPTION, description=DESCRIPTION[0].upper() + DESCRIPTION[1:] + ".")
    ruler_arguments(parser)
    parser.set_defaults(task_run=run_ruler)
