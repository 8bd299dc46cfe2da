"""A tiny prepared text dataset and a tiny training recipe, shared by the training/eval/CLI tests."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from slimkv.data import prepare_text
from slimkv.train import TrainConfig
from tests.helpers import share_kernel_builds

DATASET = "tiny"
NAMES = ["KING", "QUEEN", "FOOL", "DUKE"]
ADJECTIVES = ["good", "old", "young", "proud", "gentle"]
NOUNS = ["lord", "crown", "sword", "night", "heart"]
VERBS = ["loves", "fears", "calls", "seeks"]


def tiny_text(seed: int = 0, lines: int = 1200) -> str:
    """Lines of a tiny grammar: learnable structure, so the loss falls within a few steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
        out.append(f"{rng.choice(NAMES)}: the {a} {rng.choice(NOUNS)} {rng.choice(VERBS)} the {b} {rng.choice(NOUNS)}.")
    return "\n".join(out) + "\n"


def prepare_tiny(cache: Path) -> None:
    """Prepare dataset ``tiny`` (300-id byte BPE) under ``cache`` (used as $SLIMKV_CACHE)."""
    text = cache / "tiny.txt"
    text.write_text(tiny_text(), encoding="utf-8")
    prepare_text([text], name=DATASET, vocab_size=300, progress=False)


def tiny_config(**changes) -> TrainConfig:
    """A model and recipe small enough for a unit test (a few tenths of a second per step at most)."""
    values = dict(
        dataset=DATASET, d_model=32, n_layers=2, n_heads=4, seq_len=32, batch_size=4, steps=8, lr=1e-2, warmup_steps=2,
        eval_every=4, eval_batches=2, checkpoint_every=4, log_every=1,
    )
    values.update(changes)
    return TrainConfig.from_dict({**TrainConfig().to_dict(), **values})


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A cache folder with ``tiny`` prepared (once per test process)."""
    cache = tmp_path_factory.mktemp("slimkv_cache")
    share_kernel_builds(cache)
    with pytest.MonkeyPatch.context() as mp:  # session scope: no function-scoped monkeypatch here
        mp.setenv("SLIMKV_CACHE", str(cache))
        prepare_tiny(cache)
    return cache


@pytest.fixture(autouse=True)
def tiny_env(tiny_cache, monkeypatch) -> Iterator[Path]:
    """Point $SLIMKV_CACHE at the tiny cache (autouse wherever it is imported), on one thread:
    tiny matrices gain nothing from more, and on a shared machine extra threads cost 10x."""
    monkeypatch.setenv("SLIMKV_CACHE", str(tiny_cache))
    with one_thread():
        yield tiny_cache


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread meanwhile (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
