"""``slimkv demo`` / ``make demo``: a small ``slimkv compare``, a conversion of SmolLM2 to a smaller
KV cache, the LatentLLM compression demo and a small recall frontier (``DEMO_PARTS``).

1. Prepares Shakespeare (reused when already there) and compares ``DEMO_ENTRIES`` with one seed
   and a short recipe (``demo_recipe``): mha, gqa, mqa, swa, mla, lrkv (at about half of MHA's
   cache), kvm with the fixed and the sqrt schedule, and the swa/kvm hybrid. Prints the table and
   writes ``report.json``, ``report.md`` and the PNGs into the output folder (default
   ``demo_runs/``, git-ignored). One seed cannot support "A beats B": the report says so.
2. Converts SmolLM2 to a quarter of its bfloat16 cache bytes at 8K with ``convert --cache-budget``
   (``DEMO_CONVERSION``: the planner picks the storage and the exact retrieval heads, one-shot) and
   prints perplexity and the live cache bytes of a real generate() beside the original's, into
   ``OUT/conversion``.
3. Compresses SmolLM2 at ratio 0.2 with rootcov and latentllm and prints the perplexities beside
   the dense model's (``slimkv.compress.demo_compression``), into ``OUT/compression``.
4. Asks the original SmolLM2 and the demo's conversion for a pass key hidden in 1K and 2K tokens
   of filler (``DEMO_RETRIEVAL``; ``slimkv eval niah --model`` runs the full grid), into
   ``OUT/retrieval``.
5. Maps recall against cache size for a few kinds (``DEMO_RECALL_ENTRIES``, one seed, a short
   MQAR recipe; ``slimkv eval recall`` runs the full sweep), into ``OUT/recall``.

With two or more workers (the default) the parts run in the order convert, retrieval, compress,
compare, recall: the compare and recall runs train ahead in a background process while SmolLM2
works here on the other thread (``TrainingAhead``), and their reports follow. Finished runs in the
output folder are reused; interrupted ones resume from their checkpoint.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from slimkv.attention import ATTENTION_KINDS, kind_spec
from slimkv.bench.compare import compare_calls, compare_configs, compare_run, run_compare
from slimkv.bench.entries import parse_entries
from slimkv.common.files import check_folder_target, write_json
from slimkv.common.workers import check_workers, worker_pool
from slimkv.compress import demo_compression
from slimkv.convert.manifest import finished_conversion
from slimkv.convert.pipeline import ConvertOptions, convert_pretrained
from slimkv.data import prepare_shakespeare
from slimkv.eval.cache import cache_report
from slimkv.eval.cache import format_report as format_cache
from slimkv.eval.ppl import format_table as format_ppl
from slimkv.eval.ppl import perplexity_report
from slimkv.pretrained import SMOLLM2, fetch_smollm2
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from slimkv.recall.frontier import check_entries, recall_calls, recall_run, run_recall
from slimkv.recall.recipe import RecallRecipe
from slimkv.retrieval import models as retrieval
from slimkv.retrieval.prompts import TASKS
from slimkv.train.config import TrainConfig

DEMO_PARTS = ("compare", "convert", "retrieval", "compress", "recall")
SMOLLM2_PARTS = ("convert", "retrieval", "compress")  # one process, torch's threads
TRAINING_PARTS = ("compare", "recall")  # small runs in worker processes of one thread each
# the conversion demo: the planner's hybrid at a quarter of the bfloat16 bytes at 8K (slimkv.convert.budget); one copy context per format keeps it short
DEMO_CONVERSION = ("hybrid:roles_contexts=1", 0.25)
DEMO_CONVERSION_CALIB_TOKENS = 2560
DEMO_CONVERSION_CALIB_SEQ_LEN = 512  # 5 windows: one from each source of the default calibration mix
DEMO_CONVERSION_EVAL_TOKENS = 2048
DEMO_COMPRESSION_EVAL_TOKENS = 2048  # per evaluation text
DEMO_STEPS = 100  # per entry: the default recipe, shortened so the whole demo fits 10 minutes on 2 cores (docs/timings.md)
DEMO_EVAL_TOKENS = 8192  # val tokens scored per entry (windows spread over the held-out plays)
DEMO_DECODE_CONTEXTS = (128, 512, 2048)
DEMO_SEED = 0
DEMO_RETRIEVAL = {"tasks": ("passkey",), "lengths": (1024, 2048), "depths": (0.5,), "samples": 1}  # 2 prompts per model
# at a few hundred B/token: full attention with one KV head recalls, a sliding window forgets, the SWA/KVM hybrid recalls.
# The hybrid trains longest (about 1.5x the others), so it goes first: with two workers it runs beside the other two.
DEMO_RECALL_ENTRIES = ("swa+kvm:swa.window=8,kvm.chunk_size=4,kvm.schedule=fixed,kvm.min_rows=16", "mqa", "swa:window=16")
DEMO_TIMINGS = "demo_timings.json"  # seconds per part by the wall clock and by perf_counter (one session saw them disagree; docs/timings.md)
DEMO_RECALL_STEPS = 800  # with a schedule this short, 500 steps left MHA at 18%; 800 reach 100% (seed 0)
DEMO_WORKERS = 2  # compare and recall train their runs two at a time, one process of one torch thread each (docs/timings.md)


def demo_entries() -> tuple[str, ...]:
    """The demo's entries: every registered kind's ``demo`` presets (its own file), in registration
    order; options not given come from each kind's comparable preset (tunable kinds at about half
    of MHA's cache)."""
    return tuple(entry for kind in ATTENTION_KINDS for entry in kind_spec(kind).presets.demo)


def demo_recipe(steps: int | None = None) -> TrainConfig:
    """The shared recipe: the default TrainConfig (Shakespeare, 4 layers, d_model 128) for
    ``DEMO_STEPS`` steps (or ``steps``)."""
    values = TrainConfig().to_dict()
    values.update(steps=DEMO_STEPS if steps is None else steps, seed=DEMO_SEED)
    values["warmup_steps"] = min(values["warmup_steps"], max(1, values["steps"] // 10))
    return TrainConfig.from_dict(values)


def run_demo(
    out_dir: Path,
    *,
    steps: int | None = None,
    kinds: list[str] | None = None,
    eval_tokens: int | None = None,
    progress: bool = True,
    parts: tuple[str, ...] = DEMO_PARTS,
    workers: int = DEMO_WORKERS,
) -> dict[str, Any]:
    """Run the demo's ``parts`` in order (``DEMO_PARTS``; with ``workers`` > 1 the SmolLM2 parts
    first, the small runs training ahead beside them); returns the comparison's report.

    ``kinds``: a subset of ``demo_entries()`` (default all of them). ``workers``: runs the
    compare and recall parts train at once (``slimkv.common.workers``)."""
    check_workers(workers, "--workers")
    for part in parts:
        if part not in DEMO_PARTS:
            raise ValueError(f"--parts: {part!r} is not a demo part; allowed values: {', '.join(DEMO_PARTS)}")
    entries_allowed = demo_entries()
    specs = list(entries_allowed) if kinds is None else list(kinds)
    for spec in specs:
        if spec not in entries_allowed:
            raise ValueError(f"--kinds: {spec!r} is not a demo entry; allowed values: {', '.join(entries_allowed)} (use `slimkv compare` for others)")
    check_folder_target(out_dir)
    recipe = demo_recipe(steps)
    entries = parse_entries(specs, recipe)
    out_dir = Path(out_dir)
    run_part = {
        "compare": lambda: run_compare_demo(entries, recipe, out_dir, eval_tokens, progress, part_workers["compare"]),
        "convert": lambda: run_conversion_demo(out_dir / "conversion", progress),
        "retrieval": lambda: run_retrieval_demo(out_dir / "retrieval", out_dir / "conversion", progress),
        "compress": lambda: run_compression_demo(out_dir / "compression", progress),
        "recall": lambda: run_recall_demo(out_dir / "recall", progress, part_workers["recall"]),
    }
    order = [part for part in DEMO_PARTS if part in parts]
    part_workers = dict.fromkeys(TRAINING_PARTS, workers)
    ahead = None
    if workers > 1 and set(order) & set(SMOLLM2_PARTS) and set(order) & set(TRAINING_PARTS):
        order = [p for p in order if p in SMOLLM2_PARTS] + [p for p in order if p in TRAINING_PARTS]
        ahead = TrainingAhead(workers)
    report: dict[str, Any] = {}
    timings: dict[str, dict[str, float]] = {}
    trained_ahead: dict[str, Any] = {}
    try:
        if ahead is not None:
            if "recall" in order:
                ahead.submit("recall", recall_run, recall_demo_calls(out_dir / "recall"))
            if "compare" in order:
                ahead.submit("compare", compare_run, compare_demo_calls(entries, recipe, out_dir, eval_tokens, progress))
        for part in order:
            if part in TRAINING_PARTS and ahead is not None:
                settling, ahead = ahead, None
                trained_ahead = settling.settle()
                for name, left in trained_ahead["left"].items():  # no worker processes to start for runs all trained
                    part_workers[name] = workers if left else 1
            wall, monotonic = time.time(), time.perf_counter()
            result = run_part[part]()
            if part == "compare":
                report = result
            timings[part] = {"wall_clock_s": time.time() - wall, "perf_counter_s": time.perf_counter() - monotonic}
    finally:
        if ahead is not None:  # a SmolLM2 part failed or was interrupted: its error is not kept waiting
            ahead.close(wait=False)
    total = {clock: sum(t[clock] for t in timings.values()) for clock in ("wall_clock_s", "perf_counter_s")}
    write_json(out_dir / DEMO_TIMINGS, {"parts": timings, "total": total, **({"ahead": trained_ahead} if trained_ahead else {})})
    print("\ndemo time by part (wall clock; perf_counter in brackets): "
          + ", ".join(f"{part} {t['wall_clock_s']:.0f} s ({t['perf_counter_s']:.0f})" for part, t in timings.items())
          + f"; total {total['wall_clock_s']:.0f} s ({total['perf_counter_s']:.0f}); reports in {out_dir.resolve()}", flush=True)
    return report


class TrainingAhead:
    """The compare and recall parts' small trainings, started before the SmolLM2 parts in
    ``workers - 1`` background processes of one torch thread each while this process works on
    SmolLM2 on the threads left (a SmolLM2 part gains 1.2-1.5x from a second thread, a small training
    run little: on 2 cores the parts took 365-405 s this way against 479-599 s one after another;
    docs/timings.md).

    ``settle`` cancels the runs not yet started, waits for those running and gives this process its
    threads back; the compare and recall parts then reuse every finished run (their run folders'
    markers, as on any rerun) and train the rest on all workers. Results are those of the serial
    demo: a run depends only on its arguments."""

    def __init__(self, workers: int) -> None:
        self.threads = torch.get_num_threads()
        self.pool = worker_pool(workers - 1)
        self.futures: dict[str, list[Future]] = {}
        self.started = time.perf_counter()
        torch.set_num_threads(max(1, self.threads - (workers - 1)))
        print(f"training the compare and recall runs ahead in {workers - 1} background process(es) of one torch thread while SmolLM2 "
              f"runs here on {torch.get_num_threads()} thread(s); their reports follow the SmolLM2 parts (whose seconds "
              "are taken beside them)", flush=True)

    def submit(self, part: str, function: Any, calls: list[tuple[Any, ...]]) -> None:
        """Queue ``function(*call)`` for every call of ``part``."""
        self.futures[part] = [self.pool.submit(function, *call) for call in calls]

    def settle(self) -> dict[str, Any]:
        """Cancel what has not started, wait for what has (a run's error is raised here), restore
        the threads; what happened."""
        futures = [future for part in self.futures.values() for future in part]
        for future in futures:
            future.cancel()
        try:
            for future in futures:
                if not future.cancelled():
                    future.result()
        finally:
            self.close()
        left = {part: sum(future.cancelled() for future in part_futures) for part, part_futures in self.futures.items()}
        finished = len(futures) - sum(left.values())
        print(f"\n{finished} of {len(futures)} small runs trained ahead, beside the SmolLM2 parts "
              f"({time.perf_counter() - self.started:.0f} s); the parts below reuse them", flush=True)
        return {"runs": len(futures), "trained_ahead": finished, "left": left, "wall_s": time.perf_counter() - self.started}

    def close(self, wait: bool = True) -> None:
        """Drop the runs not started and restore the threads; ``wait``: until the running ones end
        (else they end in the background and the process exits after them; their folders are
        reused or resumed by the next demo)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)
        torch.set_num_threads(self.threads)


def compare_demo_calls(entries: list, recipe: TrainConfig, out_dir: Path, eval_tokens: int | None, progress: bool) -> list[tuple[Any, ...]]:
    """The compare part's runs as ``run_compare`` will look for them (the dataset prepared first)."""
    prepare_shakespeare(progress=progress)
    return compare_calls(compare_configs(entries, recipe, [recipe.seed]), out_dir, eval_tokens=DEMO_EVAL_TOKENS if eval_tokens is None else eval_tokens, other_text=None, progress=False)[2]


def recall_demo_setup() -> tuple[list, RecallRecipe]:
    """The recall part's entries and recipe."""
    recipe = RecallRecipe(steps=DEMO_RECALL_STEPS, eval_every=DEMO_RECALL_STEPS, checkpoint_every=0)
    return parse_entries(list(DEMO_RECALL_ENTRIES), recipe, check=lambda e: check_entries([e], recipe)), recipe


def recall_demo_calls(out_dir: Path) -> list[tuple[Any, ...]]:
    """The recall part's runs as ``run_recall`` will look for them."""
    entries, recipe = recall_demo_setup()
    check_folder_target(out_dir)
    return recall_calls(entries, recipe, [DEMO_SEED], out_dir, progress=False)[2]


def run_compare_demo(entries: list, recipe: TrainConfig, out_dir: Path, eval_tokens: int | None, progress: bool, workers: int = 1) -> dict[str, Any]:
    """The comparison: one small model per entry, one seed, the shared recipe."""
    print(f"slimkv demo: {len(entries)} attention entries x 1 seed, {recipe.steps} steps each; output in {out_dir.resolve()}", flush=True)
    report = run_compare(
        entries,
        recipe,
        [recipe.seed],
        out_dir,
        eval_tokens=DEMO_EVAL_TOKENS if eval_tokens is None else eval_tokens,
        decode_contexts=DEMO_DECODE_CONTEXTS,
        title="slimkv demo: one recipe, one seed per attention entry",
        progress=progress,
        prepare=lambda: prepare_shakespeare(progress=progress),
        workers=workers,
    )
    print("(one seed per entry: differences between entries are not evidence that one beats another; "
          "`slimkv compare --seeds 3` measures the spread)", flush=True)
    return report


def run_conversion_demo(out_dir: Path, progress: bool, *, method: str = DEMO_CONVERSION[0], budget: float = DEMO_CONVERSION[1]) -> dict[str, Any]:
    """SmolLM2 converted to ``budget`` of its bfloat16 cache bytes (``convert --cache-budget``, one-shot):
    the plan, perplexity and the live cache before/after."""
    print(f"\n== conversion demo (SmolLM2 -> `convert --cache-budget {budget}`: {budget:.0%} of its bfloat16 KV cache at 8K, one-shot) into {out_dir}",
          flush=True)
    fetch_smollm2()
    options = ConvertOptions(method, cache_budget=budget, calib_tokens=DEMO_CONVERSION_CALIB_TOKENS, calib_seq_len=DEMO_CONVERSION_CALIB_SEQ_LEN)
    manifest = finished_conversion(out_dir, options)
    if manifest is not None:
        print(f"reusing the conversion in {out_dir}", flush=True)
    else:
        _, manifest = convert_pretrained(SMOLLM2, options, out_dir, progress=progress)
    print(f"plan: {manifest['budget_plan']['why']}; {manifest['allocation']}", flush=True)
    quality = perplexity_report(str(out_dir), "shakespeare-val", 1024, DEMO_CONVERSION_EVAL_TOKENS, progress=progress)
    print(format_ppl(quality))
    cache = cache_report(str(out_dir), 1024, new_tokens=16)
    print(format_cache(cache))
    write_json(out_dir.parent / "conversion_demo.json", {"perplexity": quality, "cache": cache})
    return {"perplexity": quality, "cache": cache}


def run_retrieval_demo(out_dir: Path, conversion: Path, progress: bool) -> dict[str, Any]:
    """A pass key in 1K and 2K tokens of filler: the original SmolLM2 and the demo's conversion
    (when ``conversion`` holds it) on the same prompts."""
    print(f"\n== retrieval demo (a pass key in {' and '.join(map(str, DEMO_RETRIEVAL['lengths']))} tokens; the original and the conversion) into {out_dir}", flush=True)
    fetch_smollm2()
    models = {"original": SMOLLM2, **({"conversion": str(conversion)} if (conversion / CONVERTED_MANIFEST).is_file() else {})}
    reports = {}
    for name, model in models.items():
        reports[name] = retrieval.evaluate(model, tasks=[TASKS[t] for t in DEMO_RETRIEVAL["tasks"]], lengths=list(DEMO_RETRIEVAL["lengths"]),
                                           depths=list(DEMO_RETRIEVAL["depths"]), samples=DEMO_RETRIEVAL["samples"], out_dir=out_dir / name, progress=progress)
        means = ", ".join(f"{n} tokens: {m:.2f}" for n, m in reports[name]["mean_per_length"].items())
        print(f"{name}: pass key found (mean over depths) at {means}; live cache {reports[name]['cache'][str(DEMO_RETRIEVAL['lengths'][-1])]['bytes_per_token']:.0f} B/token", flush=True)
    print("(4 prompts per model: a glimpse; `slimkv eval niah --model ...` runs the grid, benchmarks/niah_smollm2.py the comparison)", flush=True)
    return reports


def run_compression_demo(out_dir: Path, progress: bool = True) -> None:
    """The LatentLLM step: SmolLM2 at ratio 0.2 with rootcov and latentllm beside the dense model."""
    print(f"\n== compression demo (SmolLM2, ratio 0.2, rootcov and latentllm) into {out_dir}", flush=True)
    demo_compression(out_dir, ratio=0.2, methods=("rootcov", "latentllm"), eval_tokens=DEMO_COMPRESSION_EVAL_TOKENS, progress=progress)


def run_recall_demo(out_dir: Path, progress: bool, workers: int = 1) -> dict[str, Any]:
    """A few kinds on the MQAR recall task, one seed, a short recipe: accuracy against live cache bytes."""
    entries, recipe = recall_demo_setup()
    print(f"\n== recall demo (MQAR, {len(DEMO_RECALL_ENTRIES)} entries x 1 seed, {recipe.steps} steps) into {out_dir}", flush=True)
    report = run_recall(entries, recipe, [DEMO_SEED], out_dir, title="slimkv demo: recall against cache size (one seed, short recipe)", progress=progress,
                        workers=workers)
    print("(one seed and a short recipe: `slimkv eval recall` trains every kind at several cache sizes over 3 seeds)", flush=True)
    return report
