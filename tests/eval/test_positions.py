"""Position-wise loss: buckets cover every position, means match a hand computation, and the
command writes JSON + PNG for sequences longer than the training length."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from slimkv.cli import main
from slimkv.eval.positions import bucket_edges, bucket_means, parse_length, position_nll
from slimkv.train import train
from tests.train.tiny import one_thread, tiny_cache, tiny_config, tiny_env  # noqa: F401  (fixtures)


def test_buckets_cover_the_sequence_and_average_by_hand():
    nll = torch.arange(20, dtype=torch.float64).view(2, 10)  # row 0: 0..9, row 1: 10..19
    assert bucket_edges(10, 3) == [0, 3, 7, 10]
    buckets = bucket_means(nll, 3)
    assert [(b["start"], b["end"], b["tokens"]) for b in buckets] == [(0, 3, 6), (3, 7, 8), (7, 10, 6)]
    by_hand = [(0 + 1 + 2 + 10 + 11 + 12) / 6, (3 + 4 + 5 + 6 + 13 + 14 + 15 + 16) / 8, (7 + 8 + 9 + 17 + 18 + 19) / 6]
    assert [b["mean_nll"] for b in buckets] == pytest.approx(by_hand)
    for length, k in [(128, 16), (100, 7), (5, 5), (1, 1)]:
        edges = bucket_edges(length, k)
        assert edges[0] == 0 and edges[-1] == length and all(a < b for a, b in zip(edges, edges[1:]))
    with pytest.raises(ValueError, match="--buckets=6 is more than the 5 positions"):
        bucket_edges(5, 6)


def test_length_parses_multiples():
    assert parse_length("4x", 128) == 512 and parse_length("300", 128) == 300
    with pytest.raises(ValueError, match="--length"):
        parse_length("four", 128)


def test_position_nll_is_the_per_token_cross_entropy():
    from slimkv.model import ModelConfig, SlimKVForCausalLM

    torch.manual_seed(0)
    model = SlimKVForCausalLM(ModelConfig(vocab_size=13, d_model=16, n_layers=1, n_heads=2)).eval()
    windows = torch.randint(0, 13, (3, 9))
    nll = position_nll(model, windows, batch_size=2)
    with torch.no_grad():
        logp = model(windows[:, :-1]).logits.log_softmax(-1)
    assert nll.shape == (3, 8) and nll.dtype == torch.float64
    assert torch.allclose(nll, -logp.gather(-1, windows[:, 1:, None])[..., 0].double(), atol=1e-5)
    assert nll.mean().item() == pytest.approx(F.cross_entropy(logp.flatten(0, 1), windows[:, 1:].flatten()).item(), rel=1e-5)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_cache):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("positions") / "swa"
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setenv("SLIMKV_CACHE", str(tiny_cache))
        train(tiny_config(attention="swa", attention_options={"window": 16}, steps=3), run_dir, progress=False)
    return run_dir


def test_positions_cli_writes_json_and_png_beyond_the_training_length(run, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["eval", "positions", str(run), "--length", "4x", "--buckets", "8", "--max-sequences", "6", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "positions.json").read_text())
    assert report["length"] == 128 and report["train_seq_len"] == 32 and report["sequences"] == 6
    buckets = report["buckets"]
    assert [b["start"] for b in buckets] == list(range(0, 128, 16)) and buckets[-1]["end"] == 128
    assert sum(b["tokens"] for b in buckets) == 6 * 128
    weighted = sum(b["mean_nll"] * b["tokens"] for b in buckets) / (6 * 128)
    assert weighted == pytest.approx(report["mean_nll"])
    inside = sum(b["mean_nll"] for b in buckets[:2]) / 2  # positions 0..31 = the training length
    assert report["mean_nll_within_train_len"] == pytest.approx(inside)
    assert (out / "positions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "beyond the training length" in capsys.readouterr().out
