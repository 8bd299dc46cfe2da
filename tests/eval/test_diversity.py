"""The head-diversity metric (slimkv.eval.diversity) and ``slimkv analyze diversity``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from slimkv import ModelConfig, SlimKVForCausalLM
from slimkv.attention import build_attention
from slimkv.cli import main
from slimkv.convert.lrkv import lrkv_from_mha
from slimkv.eval.diversity import cosine_gram, effective_rank, head_diversity, layer_diversity, operator_gram
from tests.helpers import D_MODEL, HEAD_DIM, N_HEADS, attention_cases, case_id


def explicit_gram(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """<A_i, A_j> with every A_h = W^Q_h W^K_h^T formed explicitly (small shapes only)."""
    ops = torch.einsum("hda,hea->hde", wq.double(), wk.double()).flatten(1)
    return ops @ ops.t()


def test_trace_identity_matches_explicit_operators():
    torch.manual_seed(0)
    wq, wk = torch.randn(5, 12, 3), torch.randn(5, 12, 3)
    assert torch.allclose(operator_gram(wq, wk), explicit_gram(wq, wk), rtol=1e-12, atol=1e-10)


def test_orthogonal_operators_reach_the_ceiling():
    """Heads reading disjoint input coordinates have mutually orthogonal operators: r_eff = H - 1
    centred (the ceiling), H uncentred."""
    heads, d = 6, 12
    eye = torch.eye(d)
    wq = torch.stack([eye[:, 2 * h : 2 * h + 2] * (h + 1) for h in range(heads)])  # different norms on purpose
    wk = torch.stack([eye[:, 2 * h : 2 * h + 2] for h in range(heads)]) @ torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    result = head_diversity(wq, wk)
    assert result["r_eff"] == pytest.approx(heads - 1, abs=1e-9)
    assert result["r_eff_over_heads"] == pytest.approx(result["ceiling"]) and result["ceiling"] == pytest.approx(5 / 6)
    assert result["r_eff_uncentred"] == pytest.approx(heads, abs=1e-9)


def test_identical_heads_have_zero_centred_rank():
    torch.manual_seed(0)
    wq, wk = torch.randn(1, 10, 4), torch.randn(1, 10, 4)
    scales = torch.tensor([1.0, 2.0, 0.5, 3.0])[:, None, None]  # same direction, different norms
    result = head_diversity(wq.repeat(4, 1, 1) * scales, wk.repeat(4, 1, 1))
    assert result["r_eff"] == 0.0
    assert result["r_eff_uncentred"] == pytest.approx(1.0, abs=1e-9)


def test_two_equal_pairs_give_one_direction():
    """Heads {a, a, b, b} with a orthogonal to b: the centred Gram has one direction (a - b)."""
    eye = torch.eye(8)
    a, b = eye[:, :2], eye[:, 2:4]
    w = torch.stack([a, a, b, b])
    assert head_diversity(w, w)["r_eff"] == pytest.approx(1.0, abs=1e-9)
    assert head_diversity(w, w)["r_eff_uncentred"] == pytest.approx(2.0, abs=1e-9)


def test_effective_rank_of_known_spectrum():
    gram = torch.diag(torch.tensor([2.0, 1.0, 1.0, 0.0]))
    p = torch.tensor([0.5, 0.25, 0.25])
    assert effective_rank(gram) == pytest.approx(math.exp(-float((p * p.log()).sum())))


def test_zero_operator_is_an_error():
    wq = torch.randn(3, 6, 2)
    wq[1] = 0
    with pytest.raises(ValueError, match=r"heads \[1\]"):
        cosine_gram(operator_gram(wq, torch.randn(3, 6, 2)))


@pytest.mark.parametrize(
    "kind, options",
    [("mha", {}), ("gqa", {"n_kv_heads": 2}), ("mqa", {}), ("lrkv", {"rank": 2}), ("lrkv", {"rank": 2, "rope_placement": "full", "qk_norm": True})],
)
def test_every_kind_gives_the_explicit_operator_metric(kind, options):
    """head_qk_maps of each kind, checked against the projection weights; the metric against
    explicitly formed operators."""
    torch.manual_seed(0)
    attn = build_attention(kind, 16, 4, 4, **options)
    wq, wk = attn.head_qk_maps()
    assert wq.shape == wk.shape == (4, 16, 4)
    assert torch.allclose(operator_gram(wq, wk), explicit_gram(wq, wk), rtol=1e-10, atol=1e-12)
    if kind != "lrkv":
        n_kv = attn.n_kv_heads
        keys = attn.k_proj.weight.view(n_kv, 4, 16).transpose(1, 2)
        for h in range(4):
            assert torch.equal(wk[h], keys[h // (4 // n_kv)])
    result = layer_diversity(attn)
    assert result["kind"] == kind and 0 < result["r_eff"] <= 3 + 1e-9


@pytest.mark.parametrize("case", attention_cases(), ids=case_id)
def test_every_registered_kind_exposes_its_maps(case):
    """The spec asks the metric of every kind: each registered configuration gives per-head maps
    of the layer's shape, and a centred rank within [0, H - 1]."""
    kind, options = case
    torch.manual_seed(0)
    attn = build_attention(kind, D_MODEL, N_HEADS, HEAD_DIM, **options)
    wq, wk = attn.head_qk_maps()
    assert wq.shape[:2] == wk.shape[:2] == (N_HEADS, D_MODEL) and wq.shape[2] == wk.shape[2]
    assert torch.allclose(operator_gram(wq, wk), explicit_gram(wq, wk), rtol=1e-9, atol=1e-12)
    assert 0 < layer_diversity(attn)["r_eff"] <= N_HEADS - 1 + 1e-9


def test_lrkv_loaded_from_mha_has_mha_diversity():
    torch.manual_seed(0)
    mha = build_attention("mha", 16, 4, 4, rope="none")
    with pytest.warns(UserWarning):
        lrkv = lrkv_from_mha(mha, rope_placement="none")
    assert layer_diversity(lrkv)["r_eff"] == pytest.approx(layer_diversity(mha)["r_eff"], rel=1e-9)


def test_qk_norm_gains_are_folded_in():
    torch.manual_seed(0)
    attn = build_attention("mha", 16, 4, 4, qk_norm=True)
    plain_q, plain_k = attn.head_qk_maps()
    with torch.no_grad():
        attn.k_norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    _, wk = attn.head_qk_maps()
    assert torch.allclose(wk, plain_k * torch.tensor([1.0, 2.0, 3.0, 4.0]))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run directory holding a tiny two-layer lrkv/mha model under model/."""
    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=4, attention=["lrkv", "mha"], kind_options={"lrkv": {"rank": 2}})
    model = SlimKVForCausalLM(cfg)
    model.save_pretrained(run / "model")
    return run, [layer_diversity(attn)["r_eff"] for attn in model.attention_layers]


def test_cli_on_a_run_directory(saved_run, capsys):
    saved_run, expected = saved_run
    assert main(["analyze", "diversity", str(saved_run)]) == 0
    printed = capsys.readouterr().out
    assert "r_eff" in printed and "lrkv" in printed and "mha" in printed
    report = json.loads((saved_run / "diversity.json").read_text())
    layers = report["layers"]
    assert [r["kind"] for r in layers] == ["lrkv", "mha"]
    for row, r_eff in zip(layers, expected):  # the saved weights, not a fresh initialisation
        assert row["r_eff"] == pytest.approx(r_eff, rel=1e-9)
        assert row["ceiling"] == 0.75 and 0 < row["r_eff"] <= 3 + 1e-9


def test_cli_on_a_model_folder_and_errors(saved_run, tmp_path, capsys):
    saved_run, _ = saved_run
    out = tmp_path / "div.json"
    assert main(["analyze", "diversity", str(saved_run / "model"), "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["layers"]) == 2
    assert main(["analyze", "diversity", str(tmp_path / "missing")]) == 2
    assert "slimkv train" in capsys.readouterr().err
