"""One recall run: the loss, the measurements, reuse, exact resume and refusals."""

import json

import pytest
import torch
import torch.nn.functional as F

from slimkv.cli import main
from slimkv.common.spec import AttentionSpec
from slimkv.model import SlimKVForCausalLM
from slimkv.recall.mqar import MQARTask
from slimkv.recall.recipe import RecallRecipe, model_config
from slimkv.recall.run import RUN_FILE, evaluate_recall, recall_loss, train_recall
from slimkv.recall.task import IGNORE, RecallBatches, unpack

TINY = RecallRecipe(task=MQARTask(vocab_size=40, seq_len=32, n_pairs=4), d_model=32, n_heads=2, train_pairs=(2, 4), steps=12, batch_size=8,
                    eval_sequences=32, eval_every=6, checkpoint_every=6, log_every=3, warmup_steps=2)


def test_loss_is_the_cross_entropy_of_the_queried_values_only():
    torch.manual_seed(0)
    model = SlimKVForCausalLM(model_config(AttentionSpec.parse("mha"), TINY))
    packed = RecallBatches(TINY.task, 0).sample(0, 4)
    inputs, targets = unpack(packed)
    logits = model(inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    assert torch.allclose(recall_loss(model, packed), expected, atol=1e-6)


@pytest.mark.parametrize("entry", ["mha", "lrkv:rank=1", "kvm:chunk_size=4,min_rows=4", "swa+kvm:swa.window=4,kvm.chunk_size=4"])
def test_measured_cache_is_the_live_cache(entry):
    recipe = RecallRecipe(task=TINY.task, d_model=32, n_heads=2, eval_sequences=32)
    spec = AttentionSpec.parse(entry)
    torch.manual_seed(0)
    model = SlimKVForCausalLM(model_config(spec, recipe))
    assert model.config.attention_options["qk_norm"] is True, "the recipe's base options reach every layer"
    result = evaluate_recall(model, recipe)
    for measured in result.values():
        assert measured["cache"]["bytes"] == measured["cache"]["analytic_bytes"] > 0
        assert 0.0 <= measured["accuracy"] <= 1.0 and measured["queries"] == measured["sequences"] * measured["n_pairs"]
        assert sum(b["count"] for b in measured["by_gap"].values()) == measured["queries"]
    if entry == "mha":
        assert result["4x"]["cache"]["bytes_per_token"] == result["1x"]["cache"]["bytes_per_token"]
    if entry.startswith("kvm"):
        assert result["4x"]["cache"]["bytes_per_token"] < result["1x"]["cache"]["bytes_per_token"], "a bounded state spreads over more tokens"


def test_a_finished_run_is_reused_and_a_resumed_run_continues_exactly(tmp_path):
    spec = AttentionSpec.parse("gqa:n_kv_heads=1")
    whole, reused = train_recall(spec, TINY, 3, tmp_path / "whole", progress=False)
    assert not reused and [point["step"] for point in whole["curve"]] == [6, 12]
    again, reused = train_recall(spec, TINY, 3, tmp_path / "whole", progress=False)
    assert reused and again == whole

    stopped, _ = train_recall(spec, TINY, 3, tmp_path / "split", progress=False, stop_after=7)
    assert stopped["status"] == "stopped" and not (tmp_path / "split" / RUN_FILE).exists()
    resumed, reused = train_recall(spec, TINY, 3, tmp_path / "split", progress=False)
    assert not reused
    assert resumed["lengths"] == whole["lengths"] and resumed["final_loss"] == whole["final_loss"]
    a = SlimKVForCausalLM.from_pretrained(tmp_path / "whole" / "model")
    b = SlimKVForCausalLM.from_pretrained(tmp_path / "split" / "model")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_foreign_folders_are_refused_and_kept(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes\.txt"):
        train_recall(AttentionSpec.parse("mha"), TINY, 0, folder, progress=False)
    assert (folder / "notes.txt").read_text() == "mine"

    train_recall(AttentionSpec.parse("mha"), TINY, 0, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="another configuration"):
        train_recall(AttentionSpec.parse("mqa"), TINY, 0, tmp_path / "run", progress=False)
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["request"]["attention"]["attention"] == "mha"


@pytest.mark.parametrize(
    ("change", "message"),
    [({"lengths": (2, 4)}, "including 1"), ({"lengths": (1, 8)}, "n_pairs=32 needs"), ({"train_pairs": (2, 30)}, "n_pairs=30"), ({"steps": 0}, "steps"),
     ({"mlp": "gelu"}, "allowed values: swiglu")],
)
def test_invalid_recipes_name_the_option(change, message):
    with pytest.raises(ValueError, match=message):
        RecallRecipe(**{**TINY.__dict__, **change}).validate()


def test_the_model_has_room_for_a_diverse_haystack():
    recipe = RecallRecipe(task=MQARTask(haystack_tokens=70))
    assert model_config(AttentionSpec.parse("mha"), recipe).vocab_size == MQARTask().vocab_size + 70


@pytest.mark.parametrize(("argv", "message"), [
    (["--haystack-tokens", "100000000"], "vocab_size=130 + haystack_tokens=100000000 (--vocab-size, --haystack-tokens) make 100000130 token ids, "
                                         "more than the 65536"),
    (["--seq-len", "1000000"], "= 4,000,000 tokens in one test sequence, more than the 65,536"),
    (["--batch-size", "100000000"], "tokens in one training step, more than the 1,048,576"),
    (["--kinds", "mha", "--d-model", "100000"], "(--d-model, --n-layers) give a model of 240,026,400,000 parameters, more than the 100,000,000"),
    (["--n-layers", "100000"], "n_layers=100000 (--n-layers) is more than the 256"),
    (["--kinds", "mha", "--seeds", "1000000000000"], "--seeds 1000000000000: at most 1000 seeds"),
    (["--kinds", "mha", "--seeds", "0,99999999999999999999"], "each below 2**63"),
])
def test_sizes_that_would_exhaust_memory_are_refused_before_any_work(tmp_path, capsys, argv, message):
    assert main(["eval", "recall", *argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
