"""``convert --to hybrid`` and the head-role measurement (``convert.roles``): a head that attends to
the first copy scores as a retrieval head and a local one does not, the contexts use no evaluation
template, the plan meets the budget with the best-scoring heads, a window covering the sequence is
the original, and bad options fail before any work."""

from __future__ import annotations

import json
import math

import pytest
import torch

from slimkv.convert import hybrid
from slimkv.convert.context import LayerContext
from slimkv.convert.pipeline import HEAD_ROLES_PLOT, check_before_work, convert_pretrained
from slimkv.convert.roles import FORMATS, CopyContext, copy_contexts, layer_scores
from slimkv.eval.cache import cache_report
from slimkv.eval.models import load_language_model
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.compress.conftest import char_tokenizer
from tests.convert.conftest import CALIB
from tests.convert.test_kvm import kvm_options


def test_a_copying_head_scores_high_and_a_local_head_low():
    length, d, heads = 64, 4, 2
    context = CopyContext("word-list", torch.zeros(length, dtype=torch.long), slice(8, 16), slice(56, 64))
    weights = torch.zeros(heads, length, length)
    for q in range(length):
        weights[1, q, q] = 1.0  # head 1 (KV head 1): attends to itself, a local head
        source = q - 48 if 56 <= q < 64 else q
        weights[0, q, source] = 1.0  # head 0 (KV head 0): reads the first copy while reading the repeat
    values = torch.randn(heads, length, d, generator=torch.Generator().manual_seed(0))
    copy_mass, window_loss = layer_scores(weights, values, torch.eye(heads * d), context, sink_len=1, window=4)
    assert copy_mass.tolist() == pytest.approx([1.0, 0.0])
    assert window_loss[0] > 0.5 and window_loss[1] == pytest.approx(0.0)


def test_copy_contexts_repeat_their_source_far_back_in_every_format():
    tokenizer = char_tokenizer()
    contexts = copy_contexts(tokenizer, [CALIB], 400, 2, seed=0)
    assert [c.format for c in contexts] == [f for f in FORMATS for _ in range(2)]
    for c in contexts:
        assert c.ids.numel() == 400 and torch.equal(c.ids[c.source], c.ids[c.copy])
        assert c.copy.start - c.source.stop >= 200
    text = "".join(tokenizer.decode(c.ids.tolist()) for c in contexts).lower()
    assert "pass key" not in text and "passkey" not in text and "magic number" not in text and "needle" not in text


def layers_with_scores(scores: list[list[float]], shape) -> list[LayerContext]:
    return [LayerContext(i, shape, None, None, None, roles={"window_loss": row, "copy_mass": row}) for i, row in enumerate(scores)]


def test_the_plan_keeps_the_best_heads_the_budget_allows(tiny_folder, tmp_path):
    from tests.compress.conftest import tiny_model
    from tests.convert.test_methods import contexts

    source, _ = contexts(tiny_model("llama"))
    shape = source.shape  # 2 layers x 2 KV heads, 128 positions
    options = {**hybrid.METHOD_OPTIONS, "window": 8, "sink_len": 2}
    layers = layers_with_scores([[0.1, 0.9], [0.5, 0.2]], shape)
    kept = hybrid.streaming_tokens(128, options)  # 2 sinks + 7 window tokens
    for ratio in (0.2, 0.5, 0.8):
        plans, text = hybrid.plan(layers, ratio, **options)
        exact = sum(len(p["full_heads"]) for p in plans)
        assert (exact * 128 + (4 - exact) * kept) / (4 * 128) <= ratio < ((exact + 1) * 128 + (3 - exact) * kept) / (4 * 128)
        best = sorted(((s, i, g) for i, row in enumerate([[0.1, 0.9], [0.5, 0.2]]) for g, s in enumerate(row)), reverse=True)[:exact]
        assert {(i, g) for _s, i, g in best} == {(i, g) for i, p in enumerate(plans) for g in p["full_heads"]}
    assert math.isclose(hybrid.ratio_floor(shape, options), kept / 128)


def test_end_to_end_the_roles_are_recorded_and_a_long_window_is_the_original(tiny_folder, tmp_path):
    out = tmp_path / "out"
    method = "hybrid:window=30,sink_len=2,roles_contexts=1"
    model, manifest = convert_pretrained(str(tiny_folder), kvm_options(tmp_path, method, cache_ratio=0.9), out, progress=False)
    stored = json.loads((out / CONVERTED_MANIFEST).read_text())
    roles = stored["head_roles"]
    assert len(roles["window_loss"]) == 2 and len(roles["window_loss"][0]) == 2 and roles["contexts"] == dict.fromkeys(FORMATS, 1)
    assert (out / HEAD_ROLES_PLOT).stat().st_size > 1000 and HEAD_ROLES_PLOT in stored["files"]
    assert stored["changed_parameters"] == [] and stored["achieved_cache_ratio"] is None
    reloaded = load_language_model(str(out))
    original = load_language_model(str(tiny_folder))
    ids = torch.randint(3, 99, (1, 30))  # no longer than the window: nothing is forgotten
    with torch.no_grad():
        assert torch.allclose(reloaded.model(ids).logits, original.model(ids).logits, atol=1e-4)
    report = cache_report(str(out), 120, new_tokens=4, text=str(tmp_path / "held.txt"))
    assert report["model"]["bytes_per_token"] < report["original"]["bytes_per_token"]  # the streaming heads forget past their window
    layers = len(reloaded.model.model.layers)  # every hybrid block steps in one native call (slimkv.model.block_step)
    assert report["block_steps"] == {"one_call": layers, "two_calls": 0, "module_path": 0}


@pytest.mark.parametrize("method, ratio, message", [
    ("hybrid:window=8,score=bogus", 0.5, r"--to hybrid: score=.bogus. is not allowed"),
    ("hybrid:window=8,at=4", 0.5, r"--to hybrid: at must be an integer >= 13"),
    ("hybrid:window=64", 0.5, r"window=64 is too long to measure roles"),
    ("hybrid:window=8,sink_len=2", 0.01, r"--cache-ratio 0.01 is below what --to hybrid:window=8,sink_len=2 can represent"),
])
def test_bad_options_fail_before_any_work(tiny_folder, tmp_path, no_loading, method, ratio, message):
    with pytest.raises(ValueError, match=message):
        check_before_work(str(tiny_folder), kvm_options(tmp_path, method, cache_ratio=ratio), tmp_path / "out")


def test_quantized_storage_is_recorded_measured_and_served(tiny_folder, tmp_path):
    """``--cache-storage int8``: the config says it, the manifest's cache table is a live bfloat16
    cache, smaller than the same conversion's in full storage, and loading serves it by default."""
    method = "hybrid:window=30,sink_len=2,roles_contexts=1"
    _, full = convert_pretrained(str(tiny_folder), kvm_options(tmp_path, method, cache_ratio=0.9), tmp_path / "full", progress=False)
    _, manifest = convert_pretrained(str(tiny_folder), kvm_options(tmp_path, method, cache_ratio=0.9, cache_storage="int8:group=12,residual=16"),
                                     tmp_path / "int8", progress=False)
    assert manifest["cache_storage"] == "int8:group=12,residual=16,block=16" and full["cache_storage"] == "full"
    rows = manifest["cache_bytes"]
    assert rows and all(row["measured"] and row["dtype"] == "bfloat16" for row in rows)
    assert all(0 < row["ratio"] < full_row["ratio"] for row, full_row in zip(rows, full["cache_bytes"]))
    reloaded = load_language_model(str(tmp_path / "int8")).model
    assert reloaded.config.cache_storage == "int8:group=12,residual=16,block=16"
    assert reloaded.new_cache(1).layers[0].storage.bits == 8


@pytest.mark.parametrize("method, storage, message", [
    ("hybrid:window=8", "int3", r"--cache-storage 'int3': the storage must be one of full, int8, int4"),
    ("kvm", "int4", r"--cache-storage int4: --to kvm makes kvm layers, which update their memory in place"),
])
def test_bad_storage_fails_before_any_work(tiny_folder, tmp_path, no_loading, method, storage, message):
    with pytest.raises(ValueError, match=message):
        check_before_work(str(tiny_folder), kvm_options(tmp_path, method, cache_ratio=0.5 if method != "kvm" else None, cache_storage=storage),
                          tmp_path / "out")


def test_combined_score_takes_each_rankings_next_head_in_turn():
    from types import SimpleNamespace

    from slimkv.convert.hybrid import ranked_heads
    shape = SimpleNamespace(n_kv_heads=2)
    layers = [SimpleNamespace(index=0, shape=shape, roles={"copy_mass": [0.9, 0.1], "window_loss": [0.2, 0.3]}),
              SimpleNamespace(index=1, shape=shape, roles={"copy_mass": [0.5, 0.4], "window_loss": [0.9, 0.1]})]
    assert ranked_heads(layers, "copy_mass") == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert ranked_heads(layers, "window_loss") == [(1, 0), (0, 1), (0, 0), (1, 1)]
    # window_loss first in SCORES' order, then copy_mass: (1, 0), (0, 0); (0, 1), [(1, 0) taken]; (0, 0) taken, (1, 1)
    assert ranked_heads(layers, "combined") == [(1, 0), (0, 0), (0, 1), (1, 1)]


def test_copy_accuracy_of_the_original_and_of_a_hybrid_through_its_cache(tiny_folder, tmp_path):
    """``roles.copy_accuracy``: every repeat scored once, in [0, 1]; a hybrid whose window covers the context copies as
    the original does, and reading through a full-precision cache in chunks gives what one call gives."""
    from slimkv.convert.roles import copy_accuracy
    out = tmp_path / "out"
    convert_pretrained(str(tiny_folder), kvm_options(tmp_path, "hybrid:window=30,sink_len=2,roles_contexts=1", cache_ratio=0.9), out, progress=False)
    original, converted = load_language_model(str(tiny_folder)), load_language_model(str(out))
    contexts = copy_contexts(char_tokenizer(), [CALIB], 120, 1, seed=3)
    contexts = [CopyContext(c.format, c.ids[:28], slice(2, 6), slice(20, 28)) for c in contexts]  # 28 tokens: inside the window
    base = copy_accuracy(original.model, contexts, progress=False)
    assert len(base["contexts"]) == len(FORMATS) and set(base["by_format"]) == set(FORMATS) and 0.0 <= base["mean"] <= 1.0
    assert copy_accuracy(converted.model, contexts, progress=False)["mean"] == pytest.approx(base["mean"])
    chunked = copy_accuracy(converted.model, contexts, storage="full", chunk=3, progress=False)
    assert chunked["mean"] == pytest.approx(base["mean"]) and chunked["storage"] == "full"


class _Oracle(torch.nn.Module):
    """A stand-in LM that knows the whole sequence and predicts the token ``shift`` after each position (1: always right)."""

    def __init__(self, ids: torch.Tensor, shift: int) -> None:
        super().__init__()
        self.ids, self.shift, self.lm_head = ids, shift, torch.nn.Identity()

    def new_cache(self, batch_size, storage=None):
        return {"seen": 0}

    def model(self, input_ids, cache=None):
        start = 0 if cache is None else cache["seen"]
        if cache is not None:
            cache["seen"] += input_ids.shape[1]
        targets = torch.cat((self.ids, self.ids[-1:].repeat(self.shift)))[start + self.shift:start + self.shift + input_ids.shape[1]]
        return torch.nn.functional.one_hot(targets, 100).float()[None]


@pytest.mark.parametrize("storage", [None, "int4"])
def test_copy_accuracy_scores_the_next_token_of_every_repeated_position(storage):
    from slimkv.convert.roles import copy_accuracy
    contexts = copy_contexts(char_tokenizer(), [CALIB], 300, 1, seed=5)
    for shift, want in ((1, 1.0), (0, None)):
        scores = [copy_accuracy(_Oracle(c.ids, shift), [c], storage=storage, chunk=7, progress=False)["mean"] for c in contexts]
        if want is not None:
            assert scores == [want] * len(contexts)  # every position read once, in the right place, through the cache in chunks too
        else:
            assert max(scores) < 0.5  # off by one: the current token is no prediction of the next
