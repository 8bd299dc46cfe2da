"""``slimkv eval`` (a training run, or a named evaluation task) and ``slimkv generate``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from slimkv.bench.entries import parse_entries, parse_kind_overrides, parse_seeds, split_entries
from slimkv.cli.ruler import add_ruler_command
from slimkv.common.checks import check_int
from slimkv.common.files import check_json_target, write_json
from slimkv.common.workers import check_workers
from slimkv.data import prepare_shakespeare
from slimkv.data.texts import evaluation_text
from slimkv.eval import cache, positions, ppl
from slimkv.eval.lm import MAX_NEW_TOKENS, evaluate_run, generate_ids
from slimkv.recall.frontier import check_entries, frontier_entries, run_recall
from slimkv.recall.mqar import GAP_KINDS
from slimkv.recall.recipe import RecallRecipe, default_recall_recipe
from slimkv.recall.registry import TASKS as RECALL_TASKS
from slimkv.retrieval import grid
from slimkv.retrieval import models as retrieval
from slimkv.retrieval import prompts as retrieval_tasks
from slimkv.retrieval import runs as niah
from slimkv.train.checkpoint import load_run


def _ppl_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="`smollm2`, a local transformers folder, a `slimkv compress` or `slimkv convert` output folder")
    parser.add_argument("--text", default="shakespeare-val", help="`shakespeare-val` (held-out plays) or a local text file/folder (default: shakespeare-val)")
    parser.add_argument("--seq-len", type=int, default=1024, help="window length in tokens (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def _ppl(args: argparse.Namespace) -> int:
    if args.json:
        check_json_target(args.json, "--json")
    report = ppl.perplexity_report(args.model, args.text, args.seq_len, args.max_tokens)
    print(ppl.format_table(report))
    if args.json:
        write_json(Path(args.json), report)
    return 0


def _niah_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None, help="a training run (slimkv train --out RUN_DIR); or give --model")
    parser.add_argument("--model", default=None, help="instead of RUN_DIR: `smollm2`, a local transformers folder, or a `slimkv convert` / `slimkv compress` "
                        f"output; runs the pretrained-model tasks ({', '.join(retrieval_tasks.TASKS)})")
    parser.add_argument("--tasks", default=None, help=f"comma-separated tasks; for RUN_DIR among {', '.join(niah.TASKS)} (default: all); "
                        "for --model among the pretrained-model tasks or `all` (default passkey,needle-number)")
    parser.add_argument("--lengths", default=None, help=f"prompt lengths: {grid.lengths_syntax('the training length (RUN_DIR only)')} "
                        "(default: 1x,2x,4x for RUN_DIR; for --model 1k,2k,4k,8k where prompt and answer fit the model's max_position_embeddings, "
                        "else the longest prompt that does, e.g. 8128 for 8192 positions)")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help=f"needle depths: {grid.DEPTHS_SYNTAX} (default 0,0.25,0.5,0.75,1)")
    parser.add_argument("--samples", type=int, default=None, help="prompts per (length, depth) cell (default 10 for RUN_DIR, 2 for --model)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="RUN_DIR only: greedy new tokens per prompt (default 48); --model generates what each answer needs")
    parser.add_argument("--haystack", default="shakespeare-val", help="--model only: the prose haystack (default shakespeare-val, the held-out plays; also austen, kjv-val, devil-val, pydoc-val, handbook-val (held out of calibration), kjv, devil, pydoc, handbook or a PATH)")
    parser.add_argument("--seed", type=int, default=0, help="seed of keys, values and haystack positions (default 0)")
    parser.add_argument("--batch-size", type=int, default=None, help="prompts generated together (default 8 for RUN_DIR, 1 for --model)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--export-prompts", action="store_true", help=f"--model only: also write OUT/{retrieval.PROMPTS_FILE} (the prompts as token ids, "
                        "for benchmarks/kvpress_niah.py)")
    parser.add_argument("--out", default=None, metavar="DIR", help=f"folder for {niah.RESULT_FILE}, the table and the heatmap (default RUN_DIR; required with --model; "
                        "an interrupted --model run resumes there)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _niah(args: argparse.Namespace) -> int:
    if (args.run_dir is None) == (args.model is None):
        raise ValueError("give either RUN_DIR (a training run) or --model (a pretrained, converted or compressed model), not both")
    if args.threads is not None:
        check_int("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    if args.model is not None:
        return _niah_pretrained(args)
    for option in ("haystack", "export_prompts"):
        if getattr(args, option) not in (None, False, "shakespeare-val"):
            raise ValueError(f"--{option.replace('_', '-')} applies to --model, not to a training run")
    tasks = niah.parse_tasks(args.tasks or "s1,s2,s3")
    grid.parse_depths(args.depths)
    args.samples = 10 if args.samples is None else args.samples
    args.batch_size = 8 if args.batch_size is None else args.batch_size
    for name in ("samples", "max_new_tokens", "batch_size"):
        check_int(f"--{name.replace('_', '-')}", getattr(args, name), 1)
    report = niah.niah_report(args.run_dir, tasks=tasks, lengths=args.lengths or "1x,2x,4x", depths=args.depths, samples=args.samples,
                              max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size, out_dir=args.out, progress=not args.no_progress)
    print(niah.format_table(report))
    out_dir = Path(args.out) if args.out else Path(args.run_dir)
    print(f"wrote {out_dir / niah.RESULT_FILE} and {out_dir / niah.PLOT_FILE}")
    return 0


def _niah_pretrained(args: argparse.Namespace) -> int:
    if args.out is None:
        raise ValueError("--out DIR is required with --model (results, table and heatmap go there)")
    if args.max_new_tokens != 48:
        raise ValueError("--max-new-tokens applies to RUN_DIR; with --model each prompt generates what its answer needs")
    tasks = retrieval_tasks.parse_tasks(args.tasks or "passkey,needle-number")
    lengths = grid.parse_lengths(args.lengths) if args.lengths else None
    depths = grid.parse_depths(args.depths)
    try:
        evaluation_text(args.haystack)  # a bad haystack fails before the model loads
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"--haystack: {err}") from None
    report = retrieval.evaluate(args.model, tasks=tasks, lengths=lengths, depths=depths, samples=2 if args.samples is None else args.samples, seed=args.seed,
                                haystack=args.haystack, batch_size=1 if args.batch_size is None else args.batch_size, out_dir=args.out,
                                progress=not args.no_progress, export_prompts=args.export_prompts)
    print(retrieval.format_markdown(report))
    print(f"wrote {Path(args.out) / retrieval.RESULT_FILE}, {retrieval.TABLE_FILE} and {retrieval.PLOT_FILE}")
    return 0


def _positions_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run (slimkv train --out RUN_DIR)")
    parser.add_argument("--length", default="4x", help="tokens per sequence, or a multiple of the training length like 4x (default 4x)")
    parser.add_argument("--buckets", type=int, default=16, help="position buckets (default 16)")
    parser.add_argument("--max-sequences", type=int, default=64, help="val sequences, spread over the split (default 64)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    parser.add_argument("--out", default=None, metavar="DIR", help=f"folder for {positions.RESULT_FILE} and {positions.PLOT_FILE} (default RUN_DIR)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _positions(args: argparse.Namespace) -> int:
    check_int("--buckets", args.buckets, 1)
    report = positions.positions_report(args.run_dir, length=args.length, buckets=args.buckets, max_sequences=args.max_sequences, batch_size=args.batch_size,
                                        out_dir=args.out, progress=not args.no_progress)
    print(positions.format_table(report))
    out_dir = Path(args.out) if args.out else Path(args.run_dir)
    print(f"wrote {out_dir / positions.RESULT_FILE} and {out_dir / positions.PLOT_FILE}")
    return 0


def _cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a converted or compressed folder, `smollm2`, or a local transformers folder")
    parser.add_argument("--context", type=int, required=True, help="tokens in the context when the cache is measured")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated after the prompt (default 16; the prompt fills the rest)")
    parser.add_argument("--text", default="shakespeare-val", help="prompt text (repeated if shorter than the context; default shakespeare-val)")
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")


def _cache(args: argparse.Namespace) -> int:
    if args.json:
        check_json_target(args.json, "--json")
    report = cache.cache_report(args.model, args.context, new_tokens=args.new_tokens, text=args.text)
    print(cache.format_report(report))
    if args.json:
        write_json(Path(args.json), report)
    return 0


# recall options: flag name (dashes for underscores) -> type; the task's fields, then the recipe's
RECALL_TASK_FLAGS = {"seq_len": int, "n_pairs": int, "vocab_size": int, "n_queries": int, "query_start": int, "gap": str, "power_a": float,
                     "haystack_tokens": int, "dataset": str, "values": str, "keys": int, "value_words": int, "digits": int, "needle_prefix": str}
RECALL_RECIPE_FLAGS = {"d_model": int, "n_layers": int, "n_heads": int, "steps": int, "batch_size": int, "lr": float, "weight_decay": float,
                       "warmup_steps": int, "eval_sequences": int}


def _recall_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="mqar", help=f"the recall task: {', '.join(RECALL_TASKS)} (default mqar; docs/recall.md)")
    parser.add_argument("--kinds", default=None, help="entries in compare's grammar (mha,lrkv:rank=2,swa+kvm:swa.window=8); default: every kind at the cache "
                        "sizes of its preset plus the swa+kvm hybrid (`--kinds list` prints them)")
    parser.add_argument("--kind-option", dest="kind_options", action="append", default=[], metavar="KIND.NAME=VALUE",
                        help="change a kind's default options for entries that do not set them (e.g. lrkv.rank=2)")
    parser.add_argument("--seeds", default="3", help="a count (3 = seeds 0,1,2) or a list (0,1,2); default 3")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder: runs/, report.json, report.md, recall_frontier.png (finished runs are reused)")
    described = {task: default_recall_recipe(task) for task in RECALL_TASKS}
    group = parser.add_argument_group("task (defaults per task: " + "; ".join(f"{name}: {dataclasses.asdict(r.task)}" for name, r in described.items()) + ")")
    for name, kind in RECALL_TASK_FLAGS.items():
        owners = [task for task, r in described.items() if name in _fields(r.task)]
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"{name} ({', '.join(owners)})" + (f"; one of {', '.join(GAP_KINDS)}" if name == "gap" else ""))
    group = parser.add_argument_group("recipe (defaults: docs/recall.md)")
    for name, kind in RECALL_RECIPE_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"default {' / '.join(str(getattr(r, name)) for r in described.values())}")
    group.add_argument("--train-pairs", default=None, help="pairs (needles) per training sequence, cycled over steps (default "
                       + " / ".join(",".join(map(str, r.train_pairs)) for r in described.values()) + ")")
    group.add_argument("--lengths", default=None, help=f"test lengths, whole multiples of --seq-len with 1x among them (default 1x,2x,4x): {grid.lengths_syntax('--seq-len')}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 when running one process per core)")
    parser.add_argument("--workers", type=int, default=1, help="runs trained at once, each in its own process on one torch thread (default 1; "
                        "2 on a 2-core machine trains faster, with the same numbers); not with --threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _fields(task) -> set[str]:
    """The settable options of a recall task (its dataclass fields; derived values are not options)."""
    return {f.name for f in dataclasses.fields(task)}


def _int_list(option: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None


def recall_recipe_from_args(args: argparse.Namespace) -> RecallRecipe:
    """The recall recipe of the command line: the task's default recipe, then the options; validated."""
    base = default_recall_recipe(args.task)
    task_values = {name: getattr(args, name) for name in RECALL_TASK_FLAGS if getattr(args, name) is not None}
    for name in task_values:
        if name not in _fields(base.task):
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --task {args.task}; its options: "
                             + ", ".join(f"--{f.replace('_', '-')}" for f in RECALL_TASK_FLAGS if f in _fields(base.task)))
    recipe_values = {name: getattr(args, name) for name in RECALL_RECIPE_FLAGS if getattr(args, name) is not None}
    if args.train_pairs is not None:
        recipe_values["train_pairs"] = _int_list("--train-pairs", args.train_pairs)
    if args.lengths is not None:
        recipe_values["lengths"] = grid.length_factors(args.lengths, task_values.get("seq_len", base.task.seq_len))
    return dataclasses.replace(base, task=dataclasses.replace(base.task, **task_values), **recipe_values).validate()


def _recall(args: argparse.Namespace) -> int:
    check_workers(args.workers, "--workers")
    if args.threads is not None:
        check_int("--threads", args.threads, 1)
        if args.workers > 1:
            raise ValueError(f"--threads {args.threads} with --workers {args.workers}: each worker runs on one torch thread; give one of the two")
    if args.task == "needles" and (args.dataset or "shakespeare") == "shakespeare":
        prepare_shakespeare(progress=not args.no_progress)
    recipe = recall_recipe_from_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.kinds is None or args.kinds.strip() == "list":
        entries = frontier_entries(recipe)
        if args.kinds is not None:
            print("\n".join(e.label for e in entries))
            return 0
    else:
        entries = parse_entries(split_entries(args.kinds), recipe, parse_kind_overrides(args.kind_options), check=lambda e: check_entries([e], recipe))
    run_recall(entries, recipe, parse_seeds(args.seeds), Path(args.out), progress=not args.no_progress, workers=args.workers)
    return 0


# Evaluation tasks: name -> (description, add the task's arguments, run it).
EVAL_TASKS = {
    "ppl": ("perplexity of a pretrained, compressed or converted model on held-out text (its original beside it)", _ppl_arguments, _ppl),
    "niah": ("long-context retrieval (passkey, needles) over a length x depth grid: a pretrained, converted or compressed model (--model) or a training run",
             _niah_arguments, _niah),
    "positions": ("val loss by position out to several times a training run's length", _positions_arguments, _positions),
    "recall": ("the recall frontier: MQAR (or needles-in-prose) accuracy against measured cache bytes per token, every kind at several sizes, several seeds", _recall_arguments, _recall),
    "cache": ("live KV-cache bytes of a real generate() (per token, per layer, total), beside the original model's", _cache_arguments, _cache),
}
add_ruler_command(EVAL_TASKS)


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
    """The parser of ``slimkv eval TASK``."""
    description, add_arguments, run = EVAL_TASKS[task]
    p = argparse.ArgumentParser(prog=f"slimkv eval {task}", description=description[0].upper() + description[1:] + ".")
    add_arguments(p)
    p.set_defaults(task_run=run)
    return p


def _eval(args: argparse.Namespace) -> int:
    if args.target in EVAL_TASKS:
        task_args = task_parser(args.target).parse_args(args.rest)
        return int(task_args.task_run(task_args) or 0)
    options = lm_eval_parser().parse_args(args.rest)
    for flag in ("max_tokens", "context", "batch_size"):
        if getattr(options, flag) is not None:
            check_int(f"--{flag.replace('_', '-')}", getattr(options, flag), 1)
    evaluate_run(args.target, max_tokens=options.max_tokens, context=options.context, batch_size=options.batch_size, seed=options.seed, progress=not options.no_progress)
    return 0


def _generate(args: argparse.Namespace) -> int:
    """Print the prompt, then each new token as it is generated (Ctrl-C stops and keeps what was printed)."""
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("--prompt is not valid UTF-8 text (the shell passed bytes that are not UTF-8)") from None
    check_int("--max-new-tokens", args.max_new_tokens, 1, MAX_NEW_TOKENS)
    model, _, dataset = load_run(args.run_dir)
    new_ids: list[int] = []
    printed = ""

    def show(token: int) -> None:
        nonlocal printed
        new_ids.append(token)
        text = dataset.decode(new_ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    try:
        generate_ids(model, dataset.encode(args.prompt), max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                     seed=args.seed, on_token=show)
    finally:
        sys.stdout.write(dataset.decode(new_ids)[len(printed):] + "\n")
        sys.stdout.flush()
    return 0


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
            "slimkv eval TASK ...: one of the evaluation tasks (see `slimkv eval TASK --help`):\n"
            + "\n".join(f"  {name:<10} {description}" for name, (description, _, _) in EVAL_TASKS.items())
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
    g.add_argument("--max-new-tokens", type=int, default=100, help=f"tokens to generate, 1..{MAX_NEW_TOKENS:,} (default 100); printed as they come, Ctrl-C stops")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens (0 = all)")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=_generate)
