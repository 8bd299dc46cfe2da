"""The command line end to end on a tiny local Llama folder (no downloads)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from slimkv.cli import main
from slimkv.compress import load
from slimkv.compress.persist import MANIFEST_NAME
from slimkv.pretrained import load_pretrained

from .conftest import CALIB_LINES, HELD_OUT_LINES, write_tiny_llama_folder

CALIB = CALIB_LINES * 8
HELD_OUT = HELD_OUT_LINES * 6


@pytest.fixture
def tiny_folder(tmp_path):
    return write_tiny_llama_folder(tmp_path, CALIB, HELD_OUT)


def test_compress_then_eval_ppl_prints_dense_beside_compressed(tiny_folder, tmp_path, capsys):
    out = tmp_path / "compressed"
    code = main(["compress", "--model", str(tiny_folder), "--method", "latentllm", "--ratio", "0.3", "--calib", str(tmp_path / "calib.txt"),
                 "--calib-tokens", "128", "--calib-seq-len", "32", "--out", str(out)])
    assert code == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["method"] == "latentllm" and manifest["ratio"] == 0.3 and manifest["achieved_ratio"] >= 0.3
    assert manifest["calibration"]["tokens"] == 128 and len(manifest["calibration"]["tokens_sha256"]) == 64
    assert manifest["base_model"]["name"] == str(tiny_folder.resolve()) and len(manifest["base_model"]["weights_sha256"]) == 64
    assert manifest["library_version"]
    capsys.readouterr()

    json_path = tmp_path / "ppl.json"
    code = main(["eval", "ppl", "--model", str(out), "--text", str(tmp_path / "held.txt"), "--seq-len", "32", "--json", str(json_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "dense (" in printed and "latentllm ratio 0.3" in printed
    results = json.loads(json_path.read_text())["results"]
    assert [r["model"].split(" ")[0] for r in results] == ["dense", "latentllm"]
    # the compressed folder loads as a transformers model whose perplexity matches the printed one
    model, tokenizer = load(out)
    from slimkv.eval.ppl import perplexity

    assert abs(perplexity(model, tokenizer, HELD_OUT, 32)["ppl"] - results[1]["ppl"]) < 1e-9


def test_eval_refuses_the_calibration_text(tiny_folder, tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["compress", "--model", str(tiny_folder), "--method", "rootcov", "--ratio", "0.2", "--calib", str(tmp_path / "calib.txt"),
                 "--calib-tokens", "64", "--calib-seq-len", "32", "--out", str(out)]) == 0
    assert main(["eval", "ppl", "--model", str(out), "--text", str(tmp_path / "calib.txt"), "--seq-len", "32"]) == 2
    assert "calibrated on" in capsys.readouterr().err


def test_sweep_writes_table_json_and_png(tiny_folder, tmp_path, capsys):
    code = main(["compress-sweep", "--model", str(tiny_folder), "--methods", "rootcov,latentllm", "--ratios", "0.2,0.4", "--calib", str(tmp_path / "calib.txt"),
                 "--calib-tokens", "64", "--calib-seq-len", "32", "--text", str(tmp_path / "held.txt"), "--seq-len", "32", "--prefill-len", "16",
                 "--repeats", "1", "--out-dir", str(tmp_path / "results"), "--name", "sweep"])
    assert code == 0
    data = json.loads((tmp_path / "results" / "sweep.json").read_text())
    assert [(r["method"], r["ratio"]) for r in data["rows"]] == [("rootcov", 0.2), ("rootcov", 0.4), ("latentllm", 0.2), ("latentllm", 0.4)]
    assert data["dense"]["latency"]["median_s"] > 0 and all(r["flops_per_token"] < data["dense"]["flops_per_token"] for r in data["rows"])
    assert all(r["speedup"] == r["dense_latency"]["median_s"] / r["latency"]["median_s"] for r in data["rows"])
    assert (tmp_path / "results" / "sweep.png").stat().st_size > 0
    table = (tmp_path / "results" / "sweep.md").read_text()
    assert sum(line.startswith("| ") for line in table.splitlines()) == 7  # header, rule, dense, 4 rows


def test_eval_refuses_a_text_named_among_the_calibration_sources(tiny_folder, tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["compress", "--model", str(tiny_folder), "--method", "rootcov", "--ratio", "0.2", "--calib", str(tmp_path / "calib.txt"),
                 "--calib-tokens", "64", "--calib-seq-len", "32", "--out", str(out)]) == 0
    manifest_path = out / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    assert manifest["calibration"]["sources"] == [str(tmp_path / "calib.txt")]
    manifest["calibration"]["sources"].append(str(tmp_path / "held.txt"))  # as a mix naming it would record
    manifest_path.write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", str(out), "--text", str(tmp_path / "held.txt"), "--seq-len", "32"]) == 2
    assert "one of the calibration sources" in capsys.readouterr().err


def test_sweep_measures_every_text_and_refuses_its_calibration_text_as_one(tiny_folder, tmp_path, capsys):
    (tmp_path / "other.txt").write_text("Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail about.\n" * 3)
    texts = f"{tmp_path / 'held.txt'},{tmp_path / 'other.txt'}"
    common = ["--model", str(tiny_folder), "--ratios", "0.3", "--calib-tokens", "64", "--calib-seq-len", "32", "--seq-len", "32", "--repeats", "0",
              "--out-dir", str(tmp_path / "results"), "--name", "two"]
    code = main(["compress-sweep", *common, "--methods", "rootcov,latentllm+rank_allocation=spectrum", "--calib", str(tmp_path / "calib.txt"),
                 "--texts", texts])
    assert code == 0
    data = json.loads((tmp_path / "results" / "two.json").read_text())
    names = [str(tmp_path / "held.txt"), str(tmp_path / "other.txt")]
    assert list(data["dense"]["ppl_by_text"]) == names and data["eval"]["in_domain"] == names[0]
    for row in data["rows"]:
        assert list(row["ppl_by_text"]) == names and row["ppl"] == row["ppl_by_text"][names[0]]
    assert data["rows"][1]["allocation"]["rule"] == "spectrum"
    header = (tmp_path / "results" / "two.md").read_text().splitlines()[2]
    assert header.count("| vs dense |") == 2 and "(out of domain)" in (tmp_path / "results" / "two.md").read_text()
    capsys.readouterr()
    assert main(["compress-sweep", *common, "--calib", str(tmp_path / "calib.txt"), "--texts", f"{tmp_path / 'held.txt'},{tmp_path / 'calib.txt'}"]) == 2
    assert "never evaluated on its calibration text" in capsys.readouterr().err


def test_missing_smollm2_names_the_fetch_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLIMKV_CACHE", str(tmp_path / "empty-cache"))
    assert main(["compress", "--model", "smollm2", "--method", "rootcov", "--ratio", "0.2", "--out", str(tmp_path / "o")]) == 2
    assert "slimkv models fetch smollm2" in capsys.readouterr().err


def test_unsupported_architecture_folder_lists_supported_ones(tmp_path, capsys):
    folder = tmp_path / "neox"
    AutoModelForCausalLM.from_config(GPTNeoXConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)).save_pretrained(folder)
    with pytest.raises(ValueError, match="Llama, Mistral, Qwen2"):
        load_pretrained(str(folder))
    assert main(["eval", "ppl", "--model", str(folder), "--text", str(folder / "config.json")]) == 2
    assert "GPT-2" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["compress", "--model", "smollm2", "--method", "rootcov", "--ratio", "1.5", "--out", "x"],
    ["compress", "--model", "smollm2", "--method", "rootcov", "--ratio", "0.2", "--calib-tokens", "0", "--out", "x"],
    ["compress-sweep", "--model", "smollm2", "--methods", "rootcov,magic"],
    ["compress-sweep", "--model", "smollm2", "--ratios", "0.2,2"],
])
def test_bad_options_are_rejected_before_any_work(argv, capsys):
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_compressed_model_generates(tiny_folder, tmp_path):
    out = tmp_path / "g"
    assert main(["compress", "--model", str(tiny_folder), "--method", "asvd", "--ratio", "0.3", "--calib", str(tmp_path / "calib.txt"),
                 "--calib-tokens", "64", "--calib-seq-len", "32", "--out", str(out)]) == 0
    model, tokenizer = load(out)
    ids = tokenizer("To be", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape == (1, ids.shape[1] + 5) and torch.equal(generated[:, :ids.shape[1]], ids)
