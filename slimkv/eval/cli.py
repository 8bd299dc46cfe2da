"""``slimkv eval`` (a run directory, or a named evaluation task) and ``slimkv generate``."""

from __future__ import annotations

import argparse
import importlib

# Evaluation tasks: name -> module defining ``add_arguments(parser)`` and ``run(args) -> int``.
EVAL_TASKS = {
    "ppl": "slimkv.eval.ppl",
    "niah": "slimkv.eval.niah",
    "positions": "slimkv.eval.positions",
}


def add_commands(subparsers) -> None:
    """Register ``eval`` and ``generate`` on the top-level ``slimkv`` parser."""
    tasks = ", ".join(EVAL_TASKS)
    p = subparsers.add_parser(
        "eval",
        help="evaluate a trained run (CE, BPB, cache bytes, sample) or run an evaluation task",
        usage="slimkv eval RUN_DIR [--max-tokens N] [--context N] [--batch-size N] [--seed S]\n"
        f"       slimkv eval {{{','.join(EVAL_TASKS)}}} [task options]",
        description=(
            "slimkv eval RUN_DIR: val CE (nats), BPB (total NLL / (ln 2 x UTF-8 bytes)), measured cache bytes per token "
            "per layer after prefilling the eval context with the ratio to MHA of the same shape, and a sample; "
            "prints a table and writes RUN_DIR/eval.json. See `slimkv eval RUN_DIR --help`.\n\n"
            f"slimkv eval TASK ...: one of the evaluation tasks ({tasks}); see `slimkv eval TASK --help`."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="RUN_DIR|TASK", help=f"a run directory, or a task: {tasks}")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=_eval)

    g = subparsers.add_parser("generate", help="continue a prompt with a trained run's model",
                              description="Sample a continuation of --prompt from RUN_DIR/model (temperature 0 = greedy).")
    g.add_argument("run_dir", metavar="RUN_DIR")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens (0 = all)")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=_generate)


def lm_eval_parser() -> argparse.ArgumentParser:
    """Options of ``slimkv eval RUN_DIR``."""
    p = argparse.ArgumentParser(prog="slimkv eval RUN_DIR", description="Evaluate a training run on its dataset's val split; writes RUN_DIR/eval.json.")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate about N val tokens, in windows spread over the split (default: all)")
    p.add_argument("--context", type=int, default=None, help="tokens per eval window and prefilled for the cache measurement (default: training seq_len)")
    p.add_argument("--batch-size", type=int, default=None, help="windows per forward pass (default: training batch size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated sample")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def task_parser(task: str) -> argparse.ArgumentParser:
    """The parser of ``slimkv eval TASK``, filled by the task module; ValueError if it is not installed."""
    module_name = EVAL_TASKS[task]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        raise ValueError(f"the evaluation task {task!r} is not available in this installation ({module_name} is missing)") from None
    p = argparse.ArgumentParser(prog=f"slimkv eval {task}", description=(module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else None)
    module.add_arguments(p)
    p.set_defaults(task_run=module.run)
    return p


def _eval(args: argparse.Namespace) -> int:
    if args.target in EVAL_TASKS:
        task_args = task_parser(args.target).parse_args(args.rest)
        return int(task_args.task_run(task_args) or 0)
    options = lm_eval_parser().parse_args(args.rest)
    from slimkv.eval.lm import evaluate_run

    evaluate_run(args.target, max_tokens=options.max_tokens, context=options.context, batch_size=options.batch_size, seed=options.seed, progress=not options.no_progress)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from slimkv.eval.lm import generate_ids
    from slimkv.train.checkpoint import load_run

    model, _, dataset = load_run(args.run_dir)
    new_ids = generate_ids(model, dataset.encode(args.prompt), max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None, seed=args.seed)
    print(args.prompt + dataset.decode(new_ids))
    return 0
