"""``slimkv demo`` / ``make demo``: a small ``slimkv compare`` and the LatentLLM compression demo.

1. Prepares Shakespeare (reused when already there) and compares ``DEMO_ENTRIES`` with one seed
   and a short recipe (``demo_recipe``): mha, gqa, mqa, swa, mla, lrkv (at about half of MHA's
   cache), kvm with the fixed and the sqrt schedule, and the swa/kvm hybrid. Prints the table and
   writes ``report.json``, ``report.md`` and the PNGs into the output folder (default
   ``demo_runs/``, git-ignored). One seed cannot support "A beats B": the report says so.
2. Compresses SmolLM2 at ratio 0.2 with rootcov and latentllm and prints the perplexities beside
   the dense model's (``slimkv.compress.demo_compression``), into ``OUT/compression``.

Finished runs in the output folder are reused; interrupted ones resume from their checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from slimkv.attention import ATTENTION_KINDS, kind_spec
from slimkv.bench.compare import run_compare
from slimkv.bench.entries import parse_entries
from slimkv.common.files import check_folder_target
from slimkv.compress import demo_compression
from slimkv.data import prepare_shakespeare
from slimkv.train.config import TrainConfig

DEMO_STEPS = 120  # per entry: the default recipe; about 40 s per entry with evaluation on 2 quiet CPU cores
DEMO_EVAL_TOKENS = 16384  # val tokens scored per entry (windows spread over the held-out plays)
DEMO_DECODE_CONTEXTS = (128, 512, 2048)
DEMO_SEED = 0


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
    compression: bool = True,
) -> dict[str, Any]:
    """Run the small comparison (and then the compression demo); returns the compare report.

    ``kinds``: a subset of ``demo_entries()`` (default all of them)."""
    entries_allowed = demo_entries()
    specs = list(entries_allowed) if kinds is None else list(kinds)
    for spec in specs:
        if spec not in entries_allowed:
            raise ValueError(f"--kinds: {spec!r} is not a demo entry; allowed values: {', '.join(entries_allowed)} (use `slimkv compare` for others)")
    check_folder_target(out_dir)
    recipe = demo_recipe(steps)
    entries = parse_entries(specs, recipe)
    out_dir = Path(out_dir)
    started = time.perf_counter()
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
    )
    print("(one seed per entry: differences between entries are not evidence that one beats another; "
          "`slimkv compare --seeds 3` measures the spread)", flush=True)
    if compression:
        run_compression_demo(out_dir / "compression")
    print(f"demo wall time {time.perf_counter() - started:.0f} s; reports in {out_dir.resolve()}", flush=True)
    return report


def run_compression_demo(out_dir: Path) -> None:
    """The LatentLLM step: SmolLM2 at ratio 0.2 with rootcov and latentllm beside the dense model."""
    print(f"\n== compression demo (SmolLM2, ratio 0.2, rootcov and latentllm) into {out_dir}", flush=True)
    demo_compression(out_dir, ratio=0.2, methods=("rootcov", "latentllm"))
