"""Training throughput (tokens/s of forward + backward + AdamW step) of the default small model per kind.

Uses the trainer's own pieces (``accumulate_gradients``, ``make_optimizer``, clipping) on random
token ids of the dataset's vocabulary size (the content does not change the cost). The kinds are
timed interleaved in one process (round robin), after warm-up; median, min and max per kind.

    .venv/bin/python benchmarks/train_throughput.py [--kinds mha gqa mqa swa] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from slimkv.attention import ATTENTION_KINDS, kind_spec
from slimkv.bench.entries import recipe_shape
from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.demo import demo_recipe
from slimkv.model import SlimKVForCausalLM
from slimkv.train.config import TrainConfig
from slimkv.train.trainer import accumulate_gradients, make_optimizer


def build_step(kind: str, recipe: TrainConfig, vocab_size: int):
    cfg = TrainConfig.from_dict({**recipe.to_dict(), "attention": kind, "attention_options": kind_spec(kind).comparable(recipe_shape(recipe))[0]})
    torch.manual_seed(0)
    model = SlimKVForCausalLM(cfg.model_config(vocab_size)).train()
    optimizer = make_optimizer(model, cfg)
    batch = torch.randint(0, vocab_size, (cfg.grad_accum, cfg.batch_size, cfg.seq_len + 1))

    def step() -> None:
        accumulate_gradients(model, batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["mha", "gqa", "mqa", "swa"], choices=ATTENTION_KINDS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--vocab-size", type=int, default=4096, help="the default Shakespeare vocabulary")
    parser.add_argument("--name", default="train_throughput")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]  # other processes' load makes the numbers meaningless: record it
    recipe = demo_recipe()
    steps = {kind: build_step(kind, recipe, args.vocab_size) for kind in args.kinds}
    for step, _ in steps.values():
        for _ in range(args.warmup):
            step()
    samples: dict[str, list[float]] = {kind: [] for kind in args.kinds}
    for _ in range(args.repeats):  # interleaved: every kind sees the same machine conditions
        for kind, (step, _) in steps.items():
            t0 = time.perf_counter()
            step()
            samples[kind].append(time.perf_counter() - t0)
    tokens = recipe.tokens_per_step
    results = {}
    print(f"default model: d_model {recipe.d_model}, {recipe.n_layers} layers, {recipe.n_heads} heads, seq_len {recipe.seq_len}, "
          f"batch {recipe.batch_size}x{recipe.grad_accum} = {tokens} tokens/step, vocab {args.vocab_size}, {args.threads} threads")
    print(f"{'kind':<6} {'params':>10} {'median s/step':>14} {'tokens/s (median)':>18} {'min..max tokens/s':>20}")
    for kind, times in samples.items():
        median = statistics.median(times)
        results[kind] = {
            "options": kind_spec(kind).comparable(recipe_shape(recipe))[0],
            "parameters": steps[kind][1],
            "median_s": median,
            "min_s": min(times),
            "max_s": max(times),
            "samples_s": times,
            "tokens_per_s": tokens / median,
        }
        print(f"{kind:<6} {steps[kind][1]:>10,} {median:>14.3f} {tokens / median:>18,.0f} {tokens / max(times):>9,.0f}..{tokens / min(times):<9,.0f}")
    path = write_results(args.name, {"settings": {**recipe.to_dict(), "vocab_size": args.vocab_size, "threads": args.threads, "repeats": args.repeats, "warmup": args.warmup, "tokens_per_step": tokens},
                                         "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}, "results": results}, results_dir(Path(__file__).resolve().parent / "results", args.name))
    print(f"1-minute load average before/after: {load_before:.2f}/{os.getloadavg()[0]:.2f} (other processes' load slows these numbers: rerun on a quiet machine)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
