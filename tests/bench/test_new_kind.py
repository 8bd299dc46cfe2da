"""A kind registered in this file alone runs through compare's entries and the decode benchmark:
adding a kind needs no per-kind code anywhere else (its presets live beside its class)."""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import ATTENTION_KINDS, LayerShape, Presets, register_attention, unregister_attention
from slimkv.attention.mha import MultiHeadAttention
from slimkv.bench.decode import decode_sweep, matched_width_variants
from slimkv.bench.entries import parse_entries
from slimkv.train import TrainConfig


class LastTokens(MultiHeadAttention):
    """A toy kind: attention over the newest ``keep`` tokens (a sliding window under another name)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, keep: int = 4, **common) -> None:
        super().__init__(d_model, n_heads, head_dim, window=keep, **common)


@pytest.fixture
def toy_kind():
    presets = Presets(
        comparable=lambda shape, explicit: ({"keep": max(1, shape.seq_len // 4)}, "a quarter of the context"),
        decode=lambda shape: [("last", {"keep": 8}), ("last-reference", {"keep": 8, "backend": "reference"})],
        sizes=lambda shape: [(f"last:keep={k}", {"keep": k}) for k in (2, 4)],
    )
    register_attention("last", LastTokens, example_options=[{"keep": 3}], description="toy", presets=presets)
    yield "last"
    unregister_attention("last")
    assert "last" not in ATTENTION_KINDS


def test_a_new_kind_gets_compare_defaults_from_its_presets(toy_kind):
    recipe = TrainConfig()
    entry, explicit = parse_entries(["last", "last:keep=5"], recipe)
    assert entry.options == {"last": {"keep": recipe.seq_len // 4}} and "a quarter of the context" in entry.defaults["last"]
    assert explicit.options == {"last": {"keep": 5}}
    with pytest.raises(ValueError, match="unknown option 'kep' for attention kind 'last'"):
        parse_entries(["last:kep=5"], recipe)


def test_a_new_kind_runs_in_the_decode_benchmark_on_both_paths(toy_kind):
    variants = matched_width_variants(["mha", toy_kind], n_heads=2, head_dim=8)
    assert [v.label for v in variants] == ["mha", "last", "last-reference"]
    payload = decode_sweep(variants, [16], d_model=16, n_heads=2, head_dim=8, dtype=torch.float64, warmup=0, repeats=1, rounds=1)
    rows = {r["label"]: r for r in payload["rows"]}
    assert set(rows) == {"mha", "last", "last-reference"} and not payload["skipped"]
    assert rows["last"]["cache_bytes"] == rows["last-reference"]["cache_bytes"] == 2 * 2 * 7 * 8 * 8  # keep - 1 = 7 tokens, k and v, 2 heads of 8, float64
    assert rows["mha"]["cache_bytes"] == 2 * 2 * 16 * 8 * 8


def test_size_variants_come_from_the_presets(toy_kind):
    from slimkv.attention import kind_spec

    shape = LayerShape(16, 2, 8, 32)
    assert kind_spec(toy_kind).size_variants(shape, toy_kind) == [("last:keep=2", {"keep": 2}), ("last:keep=4", {"keep": 4})]
    assert kind_spec("mha").size_variants(shape, "mha") == [("mha", {})]
