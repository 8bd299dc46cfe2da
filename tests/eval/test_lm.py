"""LM evaluation: the BPB byte denominator, eval windows, cache accounting, seeded samples."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slimkv.eval.lm import evaluate_run, generate_ids
from slimkv.scoring import eval_windows, lm_metrics, score_windows
from slimkv.train import load_run, train
from tests.train.tiny import one_thread, tiny_cache, tiny_config, tiny_env  # noqa: F401  (fixtures)


class UniformLM(torch.nn.Module):
    """Logits all zero: every next token costs exactly ln(vocab) nats."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=torch.zeros(*ids.shape, self.vocab))


def test_bpb_divides_by_bytes_not_tokens():
    """8 predicted tokens at ln 8 nats each = 24 bits over the targets' bytes (worked by hand)."""
    token_bytes = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4])
    windows = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 0, 3]])  # targets 1,2,3,4 and 6,7,0,3
    nll, tokens, n_bytes = score_windows(UniformLM(8), windows, token_bytes, batch_size=1)
    assert (tokens, n_bytes) == (8, (2 + 3 + 4 + 1) + (3 + 4 + 1 + 4))
    assert nll == pytest.approx(8 * math.log(8))
    result = lm_metrics(nll, tokens, n_bytes)
    assert result["ce"] == pytest.approx(math.log(8))
    assert result["bpb"] == pytest.approx(24 / 22)  # total bits / bytes
    assert result["bpb"] != pytest.approx(result["ce"] / math.log(2))  # bits per token would be 3.0


def test_score_windows_matches_a_hand_written_loss():
    from slimkv.model import ModelConfig, SlimKVForCausalLM

    torch.manual_seed(0)
    model = SlimKVForCausalLM(ModelConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2)).eval()
    windows = torch.randint(0, 11, (3, 7))
    token_bytes = torch.randint(1, 5, (11,))
    nll, tokens, n_bytes = score_windows(model, windows, token_bytes, batch_size=2)
    with torch.no_grad():
        logp = model(windows[:, :-1]).logits.log_softmax(-1)
    by_hand = -logp.gather(-1, windows[:, 1:, None]).sum().item()
    assert nll == pytest.approx(by_hand, rel=1e-6)
    assert tokens == 18 and n_bytes == int(token_bytes[windows[:, 1:]].sum())


def test_eval_windows_predict_every_token_once_or_spread_a_subset():
    tokens = np.arange(23)
    windows = eval_windows(tokens, 5)
    assert windows.tolist() == [list(range(s, s + 6)) for s in (0, 5, 10, 15)]
    assert sorted(windows[:, 1:].flatten().tolist()) == list(range(1, 21))
    assert eval_windows(tokens, 5, max_windows=2)[:, 0].tolist() == [0, 15]
    with pytest.raises(ValueError, match="too few for a context of 30"):
        eval_windows(tokens, 30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_cache):  # noqa: F811
    """Two tiny trained runs: gqa (2 of 4 K/V heads) and swa (window 9)."""
    root = tmp_path_factory.mktemp("eval_runs")
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("SLIMKV_CACHE", str(tiny_cache))
        train(tiny_config(attention="gqa", attention_options={"n_kv_heads": 2}, steps=3), root / "gqa", progress=False)
        train(tiny_config(attention="swa", attention_options={"window": 9}, steps=3), root / "swa", progress=False)
    return root


@pytest.mark.parametrize(("kind", "ratio"), [("gqa", 0.5), ("swa", 8 / 32)])
def test_evaluate_run_reports_quality_and_measured_cache(runs, kind, ratio, capsys):
    run_dir = runs / kind
    result = evaluate_run(run_dir, max_tokens=320)
    assert json.loads((run_dir / "eval.json").read_text()) == json.loads(json.dumps(result))
    assert result["context"] == 32 and result["windows"] == 10 and result["val_tokens"] == 320
    assert result["val_bpb"] == pytest.approx(result["val_ce"] * result["val_tokens"] / (math.log(2) * result["val_bytes"]))
    model, _, dataset = load_run(run_dir)
    windows = eval_windows(dataset.val, 32, 10)
    assert result["val_bytes"] == int(dataset.token_bytes[windows[:, 1:].numpy()].sum())
    cache = result["cache"]
    assert cache["measured_equals_analytic"] and cache["seq_len"] == 32
    assert [layer["kind"] for layer in cache["layers"]] == [kind, kind]
    assert cache["mha_bytes_per_token_per_layer"] == 2 * 4 * 8 * 4  # K and V, 4 heads x 8 dims, float32
    assert cache["ratio_to_mha"] == pytest.approx(ratio)
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    assert result["sample"]["prompt"] == dataset.decode(dataset.val[:24]) and result["sample"]["continuation"]
    out = capsys.readouterr().out
    assert "val BPB" in out and f"ratio to MHA {ratio:.3f}" in out


def test_samples_are_seeded_and_leave_the_global_rng_alone(runs):
    model, _, dataset = load_run(runs / "gqa")
    prompt = dataset.encode("KING: the")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = generate_ids(model, prompt, max_new_tokens=12, seed=4)
    assert torch.equal(torch.get_rng_state(), before)
    assert a == generate_ids(model, prompt, max_new_tokens=12, seed=4) and len(a) == 12
    greedy = generate_ids(model, prompt, max_new_tokens=6, temperature=0.0)
    assert greedy == generate_ids(model, prompt, max_new_tokens=6, temperature=0.0, seed=99)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_ids(model, [], max_new_tokens=3)
