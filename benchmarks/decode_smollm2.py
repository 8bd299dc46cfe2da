"""End-to-end decode speed of SmolLM2-135M: transformers' own decode (SDPA, its default
DynamicCache) against slimkv's decode of the same model (the exact slimkv copy: gqa layers) and
of converted compact-cache models (``slimkv convert`` output folders).

For every context (default 1K, 4K, 16K) each model's cache is filled by one prefill of that many
tokens of held-out text, then single-token greedy decode steps are timed, the models interleaved
step by step (``--rounds`` rounds of ``--steps`` steps per model). Reported: median ms/token,
tokens/s, the live cache bytes each step reads and the parameter bytes, and the ratio of each
model's time to what its memory traffic predicts at the bandwidth the original achieves in the
same run ((weights + cache bytes) / original's bytes per second), and each step's roofline
(docs/evaluation.md, "Roofline and kernel paths"): bytes read (weights + cache) and FLOPs per step
(counted by torch's FLOP counter on one extra step; transformers' fused CPU attention is invisible
to it, so its rows take the FLOPs of slimkv's exact copy, the same arithmetic), against a read-only
bandwidth and a small-GEMM FMA rate measured before and after the run on the same threads; the
bound max(bytes / bandwidth, FLOPs / rate) and the time as a multiple of it, with the CPU model,
the kernel's instruction-set path per dtype, the threads and the load.

    .venv/bin/python benchmarks/decode_smollm2.py --threads 1
    .venv/bin/python benchmarks/decode_smollm2.py --threads 2 --converted runs/smollm2-mla50 runs/smollm2-lrkv50
    .venv/bin/python benchmarks/decode_smollm2.py --dtypes float32,bfloat16 --converted runs/smollm2-mla50
    .venv/bin/python benchmarks/decode_smollm2.py --quick

With ``--dtypes float32,bfloat16`` every model runs in both (weights and caches in that dtype;
transformers' own bfloat16 run is the baseline of the bfloat16 rows), interleaved in one run. With
``--threads 1,2`` every model is timed at each thread count on the same caches, the counts
interleaved within each round, and each row has its speed against the first count's
(``speedup_over_first_threads``); the rates are measured at each count.

    .venv/bin/python benchmarks/decode_smollm2.py --threads 1,2 --contexts 16384 --converted runs/smollm2-mla50

With ``--parts`` each slimkv model also runs ``--steps`` instrumented steps per thread count after the
timed ones (``slimkv.bench.step_parts``): the time of its native linear calls, of its native
attention calls and of the rest, each beside its bound (weights over the read rate; cache bytes over
it or the attention's FLOPs over the FMA rate; zero for the rest), and the run's page ``<name>.md``
tabulates them (``--render JSON`` writes that page again from a results file, measuring nothing).

    .venv/bin/python benchmarks/decode_smollm2.py --contexts 1024,16384 --parts --converted runs/smollm2-mla50

With ``--module-path`` every slimkv model whose blocks take native block steps (``slimkv.model.block_step``:
the whole block in one call, or two around a hybrid or quantized attention) also runs as a copy of
itself on the module path (``Block.native_step`` False), interleaved with it; every slimkv row
records how its blocks stepped (``block_steps``).

    .venv/bin/python benchmarks/decode_smollm2.py --contexts 16384 --dtypes bfloat16 --parts --module-path --converted runs/smollm2-gqa50

Writes benchmarks/results/decode/<name>.json and .png (the name's experiment folder).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
from decode_all import DTYPES, int_list  # this folder's decode benchmark: one map of dtype names, its list parser

from slimkv.bench.roofline import add_bounds, bound_context, flop_counter, machine_rates, merge_rates, rates_line
from slimkv.bench.step_parts import split_step, timed_parts
from slimkv.common.markdown import markdown_table, provenance_line
from slimkv.common.plotting import new_figure
from slimkv.common.results import results_dir
from slimkv.common.timing import write_results
from slimkv.convert.source import Source, exact_copy
from slimkv.data.texts import evaluation_text, tokenize
from slimkv.eval.cache import layer_bytes
from slimkv.eval.models import load_language_model
from slimkv.model.block_step import block_step_counts
from slimkv.ops.native import kernel_isa, kernel_path
from slimkv.pretrained import SMOLLM2, fetch_smollm2, load_pretrained

RESULTS = Path(__file__).resolve().parent / "results"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,16384", help="cached tokens (comma-separated; default 1024,4096,16384)")
    p.add_argument("--converted", nargs="*", default=[], help="converted model folders to time beside the original")
    p.add_argument("--threads", type=int_list, default=[1], help="torch thread counts, comma-separated, interleaved in one run (default 1)")
    p.add_argument("--dtypes", default="float32", help=f"comma-separated, among {', '.join(DTYPES)} (default float32)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--parts", action="store_true", help="also time each slimkv model's linears, attention and the rest in instrumented steps")
    p.add_argument("--module-path", action="store_true", help="also time each slimkv model whose blocks take native block steps on the module path "
                   "(slimkv.model.block_step: Block.native_step False), interleaved with it")
    p.add_argument("--render", metavar="JSON", help="write the parts page of a --parts results file beside it, and measure nothing")
    p.add_argument("--quick", action="store_true", help="contexts 256,1024; 1 round of 3 steps")
    p.add_argument("--name", default=None, help="results file name (default decode_smollm2_<threads>thread, threads joined by '-')")
    p.add_argument("--out-dir", default=None, help="results folder (default: the name's experiment folder, benchmarks/results/decode)")
    return p.parse_args()


@torch.no_grad()
def prefill(model, ids: torch.Tensor, slimkv: bool):
    """The cache after ``ids`` (1, T) and the last token's logits."""
    if slimkv:
        cache = model.new_cache(1)
        logits = model(ids, cache=cache, logits_to_keep=1).logits
    else:
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, logits = out.cache, out.logits
    return cache, logits[:, -1:].argmax(-1)


@torch.no_grad()
def step(model, cache, token: torch.Tensor, slimkv: bool) -> torch.Tensor:
    """One greedy decode step through the model's cache; the next token."""
    if slimkv:
        logits = model(token, cache=cache).logits
    else:
        logits = model(token, cache=cache, use_cache=True).logits
    return logits[:, -1:].argmax(-1)


def _exact_copy_label(label: str) -> str:
    """The label of slimkv's exact copy beside transformers' ``label`` (same dtype suffix)."""
    return label.replace("transformers (SDPA, DynamicCache)", "slimkv exact copy (gqa)")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_parts(results: dict) -> str:
    """The page of a ``--parts`` run: per slimkv model and context, the timed step against its roofline
    bound, then one instrumented step cut into linears, attention (and blocks that ran as one call,
    when any did) and the rest, each beside its bound; ``-`` in those columns for a row that took no
    instrumented step (a run without ``--parts``, rendered by ``--render``)."""
    with_blocks = any(r.get("parts", {}).get("block_calls") for r in results["rows"])
    instrumented = any("parts" in r for r in results["rows"])
    headers = ["model", "context", "dtype", "step ms", "tokens/s", "bound ms", "x bound", "instrumented ms", "linears ms (x bound)",
               "attention ms (x bound, bound)", *(["one-call blocks ms (x bound)"] if with_blocks else []), "rest ms (share)", "bound by parts ms",
               "step x bound by parts"]
    cells = []
    for r in results["rows"]:
        if not r["model"].startswith("slimkv"):  # transformers' own rows: timed, never instrumented
            continue
        timed = [r["model"], r["context"], r["dtype"], f"{r['median_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.1f}", f"{r['bound_s'] * 1e3:.1f} ({r['bound']})",
                 f"{r['time_over_bound']:.2f}"]
        if "parts" not in r:
            cells.append(timed + ["-"] * (len(headers) - len(timed)))
            continue
        part = r["parts"]
        parts_bound = part["linear_bound_s"] + part["attention_bound_s"] + part.get("block_bound_s", 0.0)
        blocks = [f"{part['block_s'] * 1e3:.1f} ({_ratio(part['block_over_bound'])})"] if with_blocks else []
        cells.append([*timed, f"{part['step_s'] * 1e3:.1f}", f"{part['linear_s'] * 1e3:.1f} ({_ratio(part['linear_over_bound'])})",
                      f"{part['attention_s'] * 1e3:.1f} ({_ratio(part['attention_over_bound'])}, {part['attention_bound']})", *blocks,
                      f"{part['rest_s'] * 1e3:.1f} ({part['rest_s'] / part['step_s']:.2f})", f"{parts_bound * 1e3:.1f}",
                      f"{r['median_s'] / parts_bound:.2f}"])
    s, rates = results["settings"], results["roofline"]["rates"]
    rate_text = "; ".join(f"{name}: read {rate['read_bytes_per_s'] / 1e9:.1f} GB/s, FMA {rate['fma_flop_per_s'] / 1e9:.0f} GFLOP/s" for name, rate in rates.items())
    threads = s["threads"] if isinstance(s["threads"], list) else [s["threads"]]
    return "\n".join([
        f"# SmolLM2-135M decode step, where the time goes ({'/'.join(map(str, threads))} thread(s), batch 1)", "",
        f"{provenance_line('benchmarks/decode_smollm2.py --parts', results, results['load_average']['before'])}; kernel paths "
        f"{', '.join(f'{k}: {v}' for k, v in s['kernel_isa'].items())}; {s['rounds']} interleaved rounds of {s['steps']} timed steps per model, "
        + (f"then {s['steps']} instrumented steps per model." if instrumented else "and no instrumented step (a run without `--parts`: "
           "the columns of the instrumented step are `-`).") + f" Rates (best of before and after the run): {rate_text}.", "",
        "Step: the median timed step; bound: max((weights + cache bytes) / read rate, FLOPs / FMA rate). The instrumented step "
        "(`slimkv.bench.step_parts`) times every native linear call (bound: its weights over the read rate), every native attention "
        "call (bound: the cache bytes over the read rate or the attention's FLOPs over the FMA rate, whichever is larger)"
        + (", every block that ran as one native call (`slimkv.model.block_step`: its projections, MLP and attention; bound: its "
           "weights over the read rate plus its layer's share of the attention's bound)" if with_blocks else "") + " and "
        "leaves the rest (norms, RoPE, cache appends, MLA's absorbed products, the logits' argmax, Python between calls; bound 0). "
        "The parts run one after the other, so the sum of their bounds (bound by parts) is the tighter bound where one part is "
        "compute-bound and another memory-bound; the last column is the timed step over it. Attention work outside the native "
        "call (`latent` rebuilds every cached key at every step in torch matmuls) counts in the attention's FLOPs and bound but in "
        "the rest's time: there the attention's ratio is low and the rest large.", "",
        markdown_table(headers, cells, ["left", "right", "left"] + ["right"] * (len(headers) - 3)), ""])


def main() -> None:
    args = parse()
    if args.render:
        path = Path(args.render)
        path.with_suffix(".md").write_text(render_parts(json.loads(path.read_text(encoding="utf-8"))), encoding="utf-8")
        print(f"wrote {path.with_suffix('.md')}")
        return
    dtypes = args.dtypes.split(",")
    for name in dtypes:
        if name not in DTYPES:
            raise SystemExit(f"--dtypes: {name!r} is not allowed; allowed values: {', '.join(DTYPES)}")
    for folder in args.converted:  # before any loading: a wrong folder is named at once
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"--converted: {folder!r} is not a folder with config.json (a `slimkv convert` output); "
                             "give the folders one after the other, separated by spaces")
    thread_counts = args.threads
    torch.set_num_threads(max(thread_counts))  # loading and prefill on the most threads
    contexts = [256, 1024] if args.quick else [int(c) for c in args.contexts.split(",")]
    steps, rounds = (3, 1) if args.quick else (args.steps, args.rounds)
    fetch_smollm2()
    original = load_pretrained(SMOLLM2)
    float32_models = {"transformers (SDPA, DynamicCache)": (original.model, False),
                      "slimkv exact copy (gqa)": (exact_copy(Source(original)), True)}
    for folder in args.converted:
        loaded = load_language_model(folder)
        float32_models[f"slimkv {Path(folder).name}"] = (loaded.model, True)
    for label, (model, slim) in list(float32_models.items()) if args.module_path else []:
        if slim and block_step_counts(model)["module_path"] < len(model.model.layers):
            module_path = copy.deepcopy(model)
            for block in module_path.model.layers:
                block.native_step = False
            float32_models[f"{label}, module path"] = (module_path, True)
    models = {}  # every model in every dtype, dtype by dtype (transformers' run first in each: the traffic baseline)
    for name in dtypes:
        for label, (model, slim) in float32_models.items():
            models[label if name == "float32" else f"{label} {name}"] = (model if name == "float32" else copy.deepcopy(model).to(DTYPES[name]), slim)
    text_ids = tokenize(original.tokenizer, evaluation_text("shakespeare-val"))
    load_before = os.getloadavg()

    def rates_now() -> dict[tuple[str, int], dict]:
        measured = {}
        for n in thread_counts:
            torch.set_num_threads(n)
            measured.update({(name, n): machine_rates(DTYPES[name]) for name in dtypes})
        torch.set_num_threads(max(thread_counts))
        return measured
    rates_before = rates_now()
    rows = []
    for context in contexts:
        ids = torch.tensor([(text_ids * (context // len(text_ids) + 1))[:context]])
        state = {}
        for label, (model, slim) in models.items():
            t0 = time.perf_counter()
            state[label] = list(prefill(model, ids, slim)) + [time.perf_counter() - t0]
        samples = {(label, n): [] for label in models for n in thread_counts}
        for _ in range(rounds):
            for n in thread_counts:
                torch.set_num_threads(n)
                for label, (model, slim) in models.items():
                    cache, token, _ = state[label]
                    step(model, cache, token, slim)  # warm-up step
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        token = step(model, cache, token, slim)
                        samples[label, n].append(time.perf_counter() - t0)
                    state[label][1] = token
        torch.set_num_threads(max(thread_counts))
        flops = {}
        for label, (model, slim) in models.items():  # one more step per model, counted (after the timed ones)
            with flop_counter() as counter:
                step(model, state[label][0], state[label][1], slim)
            flops[label] = counter.get_total_flops()
        instrumented = {}  # (label, threads) -> one instrumented step's seconds and parts (means over --steps steps)
        for n in thread_counts if args.parts else []:
            torch.set_num_threads(n)
            for label, (model, slim) in models.items():
                if not slim:
                    continue
                cache, token, _ = state[label]
                with timed_parts() as totals:
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        token = step(model, cache, token, slim)
                    elapsed = time.perf_counter() - t0
                state[label][1] = token
                instrumented[label, n] = (elapsed / steps, {key: value / steps for key, value in totals.items()})
        torch.set_num_threads(max(thread_counts))
        base_bytes = {}  # per dtype and thread count: the bytes per second of transformers' run in that dtype
        for n in thread_counts:
            for label, (model, slim) in models.items():
                median = statistics.median(samples[label, n])
                cache_bytes = sum(layer_bytes(state[label][0]))
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
                if not slim:  # transformers' own run
                    base_bytes[dtype, n] = (weights + cache_bytes) / median
                row = {"model": label, "dtype": dtype, "context": context, "threads": n, "median_s": median, "tokens_per_s": 1 / median,
                       "min_s": min(samples[label, n]), "max_s": max(samples[label, n]), "cache_bytes": cache_bytes, "parameter_bytes": weights,
                       "prefill_s": state[label][2], "time_over_traffic_prediction": median / ((weights + cache_bytes) / base_bytes[dtype, n]),
                       "samples_s": samples[label, n], "flops": flops[label] if slim else flops.get(_exact_copy_label(label), flops[label]),
                       "flops_source": "counted" if slim or _exact_copy_label(label) not in flops else "slimkv exact copy's count"}
                if slim:
                    row["block_steps"] = block_step_counts(model)
                if (label, n) in instrumented:
                    row["instrumented_step"] = {"step_s": instrumented[label, n][0], **instrumented[label, n][1]}
                if n != thread_counts[0]:
                    row["speedup_over_first_threads"] = statistics.median(samples[label, thread_counts[0]]) / median
                rows.append(row)
                speedup = f"  x{row['speedup_over_first_threads']:.2f} of {thread_counts[0]} thread(s)" if "speedup_over_first_threads" in row else ""
                print(f"{context:>6} {n}t {label:<40} {median * 1e3:8.2f} ms/token {1 / median:8.1f} tok/s  cache {cache_bytes / 2**20:8.1f} MiB  "
                      f"x{row['time_over_traffic_prediction']:.2f} of its traffic prediction{speedup}", flush=True)
        del state
        gc.collect()
    rates_after = rates_now()
    rates = {key: merge_rates(rates_before[key], rates_after[key]) for key in rates_before}
    print("roofline (bytes read = weights + cache; FLOPs counted):")
    for (name, n), rate in rates.items():
        torch.set_num_threads(n)
        print(f"  {name}, {n} thread(s): {rates_line(rate, bound_context(DTYPES[name]))}")
        mine = [r for r in rows if r["dtype"] == name and r["threads"] == n]
        add_bounds(mine, rate, bytes_key=lambda r: r["parameter_bytes"] + r["cache_bytes"])
        for r in mine:
            print(f"  {r['context']:>6} {r['model']:<40} read {r['bytes_read'] / 2**20:8.1f} MiB  {r['flops'] / 1e9:7.3f} GFLOP  "
                  f"bound {r['bound_s'] * 1e3:7.2f} ms ({r['bound']})  time {r['median_s'] * 1e3:7.2f} ms = x{r['time_over_bound']:.2f} of the bound")
            if "instrumented_step" in r:
                measured = r.pop("instrumented_step")
                r["parts"] = split_step(measured["step_s"], measured, cache_bytes=r["cache_bytes"], rates=rate,
                                        attention_flops=r["flops"] - 2 * (measured["linear_weight_elements"] + measured["block_weight_elements"]))
                part = r["parts"]
                print(f"         instrumented step {part['step_s'] * 1e3:7.2f} ms: linears {part['linear_s'] * 1e3:6.2f} ms (x{_ratio(part['linear_over_bound'])} "
                      f"of their bound), attention {part['attention_s'] * 1e3:6.2f} ms (x{_ratio(part['attention_over_bound'])}, "
                      f"{part['attention_bound']}), one-call blocks {part['block_s'] * 1e3:6.2f} ms ({part['block_calls']:.0f} calls, "
                      f"x{_ratio(part['block_over_bound'])}), rest {part['rest_s'] * 1e3:6.2f} ms")
    threads_key = thread_counts[0] if len(thread_counts) == 1 else thread_counts
    payload = {"settings": {"contexts": contexts, "threads": threads_key, "dtypes": dtypes, "native_kernel": {name: kernel_path(DTYPES[name]) for name in dtypes},
                            "kernel_isa": {name: kernel_isa(DTYPES[name]) for name in dtypes}, "steps": steps, "rounds": rounds, "models": list(models)},
               "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
               "roofline": {"rates": {name if len(thread_counts) == 1 else f"{name}/{n}thread": rate for (name, n), rate in rates.items()},
                            **{k: v for k, v in bound_context().items() if k not in ("kernel_isa", "load_average", "threads")},
                            "definition": "bound = max((weights + cache bytes) / read bandwidth, FLOPs / FMA rate); rates: best of before/after",
                            **({"parts": "rows' parts: means of --steps instrumented steps after the timed ones (slimkv.bench.step_parts)"} if args.parts else {})},
               "rows": rows}
    fig, ax = new_figure(figsize=(7, 4.5))
    for label in models:
        for n in thread_counts:
            mine = [r for r in rows if r["model"] == label and r["threads"] == n]
            ax.plot([r["context"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=label if len(thread_counts) == 1 else f"{label}, {n}t")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (cached tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"SmolLM2-135M decode, {'/'.join(map(str, thread_counts))} thread(s), {', '.join(dtypes)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    name = args.name or f"decode_smollm2_{'-'.join(map(str, thread_counts))}thread"
    path = write_results(name, payload, args.out_dir or results_dir(RESULTS, name), figure=fig)
    print(f"wrote {path}")
    if args.parts:
        path.with_suffix(".md").write_text(render_parts(json.loads(path.read_text(encoding="utf-8"))), encoding="utf-8")
        print(f"wrote {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
