"""kvpress baseline for slimkv's long-context retrieval (``slimkv eval niah --model``).

Runs NVIDIA's kvpress (KV-cache compression by pruning the prefilled cache) on the prompts that
slimkv exported (``niah_prompts.json``, format ``slimkv-niah-prompts/1``) and writes the greedy
continuations, one JSON per (press, cache budget), format ``slimkv-niah-generations/1``, for
slimkv to score beside its own models. It runs in its own virtualenv (kvpress 0.5.5 needs
transformers < 5.3; slimkv needs 5.24), so it never imports slimkv::

    make bench-kvpress-env
    make bench-kvpress PROMPTS=runs/niah/niah_prompts.json OUT=runs/niah/kvpress
    .venv-kvpress/bin/python benchmarks/kvpress_niah.py --prompts P.json --out DIR \\
        [--model-dir DIR] [--presses streaming_llm,snapkv,expected_attention,knorm] [--budgets 0.5,0.25] [--lengths 1024,8128]

``--lengths`` runs only the prompts of those token lengths (the prompts file keeps them all).

Per prompt, not kvpress's pipeline (it applies the chat template): the context is prefilled with
the press active (``with press(model): model(context, past_key_values=cache)``), which prunes
every layer's cache to ``budget`` of the context's tokens; then, without the press, the question
is fed at its true positions (``position_ids`` = context length onwards) on the pruned cache and
up to ``max_new_tokens`` tokens are decoded greedily (stopping at eos). The ``none`` row is the
same loop without a press. The live cache is measured from the cache tensors after generation.

What kvpress does (0.5.5, read from its source): the press is a forward hook on each attention
layer that, during the prefill only, replaces the layer's cached keys/values by a subset
(``ScorerPress``: top-k of a score per kv head; every head keeps the same count). The keys are
cached after RoPE, so kept tokens keep their original positions; nothing is re-rotated. Later
tokens attend to all kept entries. StreamingLLM keeps ``n_sink`` first tokens + the most recent
ones; SnapKV scores by the attention of the context's last ``window_size`` tokens (kept) - the
question is NOT in that window unless ``--compress-question``; ExpectedAttention scores with
statistics of the context's queries extrapolated ``n_future_positions`` ahead (keeps ``n_sink``);
Knorm keeps the keys of smallest norm; TOVA scores by the last context token's attention; random
is a control.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_niah_options import (  # noqa: E402  (beside this script: standard library only)
    DEFAULT_BUDGETS,
    DEFAULT_PRESSES,
    ENV_HINT,
    GENERATIONS_FORMAT,
    PRESSES,
    PROMPTS_FORMAT,
    atomic_write_json,
    budget_note,
    check_model_dir,
    compression_ratio,
    default_model_dir,
    label,
    min_context_tokens,
    parse_budgets,
    parse_press_options,
    parse_presses,
    previous_generations,
    prompts_digest,
    read_prompts,
    result_name,
    select_lengths,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="kvpress presses on slimkv's retrieval prompts (runs in .venv-kvpress)",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--prompts", required=True, help=f"prompts file written by slimkv (format {PROMPTS_FORMAT})")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for one JSON per (press, budget)")
    parser.add_argument("--model-dir", default=str(default_model_dir()), help="local transformers model folder (config.json + safetensors + tokenizer)")
    parser.add_argument("--presses", default=DEFAULT_PRESSES, help=f"comma-separated, among {', '.join(PRESSES)}; 'none' (uncompressed) always runs")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help="fractions of the context's KV cache kept, in (0, 1]")
    parser.add_argument("--press-option", action="append", metavar="PRESS.KEY=VALUE", help="override a press option, e.g. snapkv.window_size=32 (repeatable)")
    parser.add_argument("--compress-question", action="store_true",
                        help="prefill context+question under the press (query-aware SnapKV); default: only the context is compressed")
    parser.add_argument("--lengths", default=None, help="only the prompts of these token lengths, comma-separated (e.g. 1024,8128; default: all in the file)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts, after --lengths (for quick checks)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--attn-implementation", choices=("sdpa", "eager"), default="sdpa",
                        help="attention of the model; kvpress's presses here work with both (sdpa: SnapKV/TOVA recompute the window's attention)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return parser


@dataclass
class Plan:
    prompts_file: Path
    prompts: list[dict[str, Any]]
    model_dir: Path
    out: Path
    runs: list[tuple[str, float | None]]
    options: dict[str, dict[str, Any]]
    compress_question: bool


def make_plan(args: argparse.Namespace) -> Plan:
    """Every option checked (each error names its option) before anything heavy is imported."""
    presses = parse_presses(args.presses)
    budgets = parse_budgets(args.budgets)
    options = parse_press_options(args.press_option, presses)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    data = read_prompts(args.prompts)
    prompts = select_lengths(data["prompts"], args.lengths, args.prompts)
    prompts = prompts[: args.limit] if args.limit else prompts
    model_dir = check_model_dir(args.model_dir)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a folder")
    for name in presses:
        need = min_context_tokens(name, options.get(name, {}))
        short = [p["id"] for p in prompts if len(p["context_ids"]) + (len(p["question_ids"]) if args.compress_question else 0) < need]
        if short:
            raise ValueError(f"--presses {name}: needs prompts of at least {need} prefilled tokens; too short: {', '.join(short[:3])}")
    runs = [("none", None)] + [(name, b) for name in presses if name != "none" for b in budgets]
    return Plan(Path(args.prompts), prompts, model_dir, out, runs, options, args.compress_question)


# ---------------------------------------------------------------- the runs (need torch, transformers, kvpress)


def import_kvpress():
    try:
        import kvpress
    except ImportError as error:
        raise SystemExit(f"kvpress is not importable in {sys.executable} ({error}); {ENV_HINT}") from None
    if getattr(kvpress, "__file__", None) is None:  # benchmarks/kvpress/ (requirements.txt) seen as a namespace package
        raise SystemExit(f"kvpress is not installed in {sys.executable} (only the folder {list(kvpress.__path__)} was found); {ENV_HINT}")
    return kvpress


def load_model(model_dir: Path, attn_implementation: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the per-tensor "Loading weights" bar
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn_implementation, use_safetensors=True,
                                                 local_files_only=True, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    return model.eval(), tokenizer


def cache_layers(cache) -> list[tuple[Any, Any]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def greedy_after_press(model, press, context_ids: list[int], question_ids: list[int], max_new_tokens: int, eos: set[int],
                       compress_question: bool = False) -> dict[str, Any]:
    """Prefill under ``press`` (or none), the question at its true positions, greedy decoding.
    Returns the tokens and the live cache measured from its tensors."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    prefill = context_ids + (question_ids if compress_question else [])
    started = time.perf_counter()
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(input_ids=torch.tensor([prefill]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        kept = [k.shape[-2] for k, _ in cache_layers(cache)]
        prefill_seconds = time.perf_counter() - started
        position = len(prefill)
        if not compress_question:
            # position_ids at the true positions; cache_position is left to the model (it counts the
            # entries cached, so the causal mask sees every kept entry), as kvpress's pipeline does.
            ids = torch.tensor([question_ids])
            out = model(input_ids=ids, past_key_values=cache, position_ids=torch.arange(position, position + ids.shape[1]).unsqueeze(0),
                        use_cache=True, logits_to_keep=1)
            position += ids.shape[1]
        output_ids = [int(out.logits[0, -1].argmax())]
        while output_ids[-1] not in eos and len(output_ids) < max_new_tokens:
            out = model(input_ids=torch.tensor([[output_ids[-1]]]), past_key_values=cache, position_ids=torch.tensor([[position]]),
                        use_cache=True, logits_to_keep=1)
            position += 1
            output_ids.append(int(out.logits[0, -1].argmax()))
    layers = cache_layers(cache)
    cache_bytes = sum(t.numel() * t.element_size() for pair in layers for t in pair)
    entries = [k.shape[-2] for k, _ in layers]
    return {
        "output_ids": output_ids,
        "stopped_at_eos": output_ids[-1] in eos,
        "cache_bytes": int(cache_bytes),
        "cache_tokens": int(position),  # tokens processed: context + question + generated tokens fed back (the last is never fed)
        "bytes_per_token": cache_bytes / position,
        "cache_entries_per_layer_mean": sum(entries) / len(entries),
        "prefill_tokens_kept_per_layer_mean": sum(kept) / len(kept),
        # with --compress-question the kept entries mix context and question tokens: not split
        "context_tokens_kept_per_layer_mean": None if compress_question else sum(kept) / len(kept),
        "context_tokens": len(context_ids),
        "prefill_seconds": prefill_seconds,
        "seconds": time.perf_counter() - started,
    }


def make_press(kvpress, name: str, budget: float | None, options: dict[str, Any]):
    spec = PRESSES[name]
    if spec is None:
        return None
    return getattr(kvpress, spec.class_name)(compression_ratio=compression_ratio(budget), **options)


def run(plan: Plan, threads: int | None, attn_implementation: str, progress: bool) -> list[Path]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kvpress = import_kvpress()
    import importlib.metadata

    import torch
    import transformers
    from tqdm import tqdm

    if threads is not None:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(plan.model_dir, attn_implementation)
    vocab = model.config.vocab_size
    bad = [p["id"] for p in plan.prompts if max(p["context_ids"] + p["question_ids"]) >= vocab]
    if bad:
        raise SystemExit(f"--prompts: token ids beyond this model's vocabulary ({vocab}) in {', '.join(bad[:3])}: the prompts were made with another tokenizer than {plan.model_dir}'s")
    limit = getattr(model.config, "max_position_embeddings", None)
    long = [p["id"] for p in plan.prompts if limit and len(p["context_ids"]) + len(p["question_ids"]) + p["max_new_tokens"] > limit]
    if long:
        raise SystemExit(f"--prompts: {', '.join(long[:3])} run past the model's {limit} positions")
    eos_config = model.generation_config.eos_token_id
    eos = set(eos_config if isinstance(eos_config, list) else [eos_config] if eos_config is not None else [])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    config_digest = hashlib.sha256((plan.model_dir / "config.json").read_bytes()).hexdigest()[:16]
    digest = prompts_digest(plan.prompts)
    written = []
    for name, budget in plan.runs:
        spec = PRESSES[name]
        path = plan.out / result_name(name, budget, plan.compress_question)
        header = {
            "format": GENERATIONS_FORMAT, "label": label(name, budget, plan.compress_question), "method": "kvpress", "press": name,
            "press_class": spec.class_name if spec else None, "press_options": plan.options.get(name, {}),
            "cache_budget": 1.0 if budget is None else budget, "compression_ratio": 0.0 if budget is None else compression_ratio(budget),
            "compress_question": plan.compress_question and name != "none", "budget_note": budget_note(name, plan.compress_question),
            "kvpress_version": importlib.metadata.version("kvpress"), "transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "model_dir": str(plan.model_dir), "model_config_digest": config_digest, "dtype": "float32", "attn_implementation": attn_implementation,
            "prompts_file": str(plan.prompts_file), "prompts_digest": digest, "eos_token_ids": sorted(eos),
        }
        done, seconds, complete = previous_generations(path, header)
        if complete:
            print(f"{path}: complete, skipped")
            written.append(path)
            continue
        done_ids = {g["id"] for g in done}
        todo = [p for p in plan.prompts if p["id"] not in done_ids]
        press = make_press(kvpress, name, budget, plan.options.get(name, {}))
        header.update(torch_threads=torch.get_num_threads(), load_avg_start=list(os.getloadavg()))
        bar = tqdm(total=len(plan.prompts), initial=len(plan.prompts) - len(todo), desc=header["label"], unit="prompt", disable=not progress)
        for prompt in todo:
            result = greedy_after_press(model, press, prompt["context_ids"], prompt["question_ids"], prompt["max_new_tokens"], eos,
                                        header["compress_question"])
            seconds += result["seconds"]
            done.append({"id": prompt["id"], "output_text": tokenizer.decode(result["output_ids"], skip_special_tokens=True),
                         "answers": prompt.get("answers"), **result})
            atomic_write_json(path, {**header, "seconds": seconds, "complete": False, "generations": done})
            bar.update()
        bar.close()
        order = {p["id"]: i for i, p in enumerate(plan.prompts)}
        done.sort(key=lambda g: order.get(g["id"], len(order)))
        atomic_write_json(path, {**header, "seconds": seconds, "complete": True, "generations": done})
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        written = run(plan, args.threads, args.attn_implementation, progress=not args.no_progress)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files into {plan.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
