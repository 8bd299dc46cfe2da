"""Bad input around pretrained and compressed models and the model API: clear errors before any
work, nothing a user wrote is deleted, nothing silently accepted."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from slimkv import ModelConfig, SlimKVForCausalLM
from slimkv.cli import main
from slimkv.compress.persist import MANIFEST_NAME
from tests.compress.conftest import CALIB_LINES, write_tiny_llama_folder

CALIB = CALIB_LINES * 8


@pytest.fixture
def tiny_folder(tmp_path):
    return write_tiny_llama_folder(tmp_path, CALIB, "")


def compress_argv(folder, tmp_path, out, *extra):
    return ["compress", "--model", str(folder), "--method", "rootcov", "--ratio", "0.3", "--calib", str(tmp_path / "calib.txt"),
            "--calib-tokens", "64", "--calib-seq-len", "32", "--out", str(out), *extra]


def test_compress_never_deletes_what_it_did_not_write(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    assert main(compress_argv(tiny_folder, tmp_path, out)) == 2  # a folder slimkv did not write: refused before any work
    assert "not empty and is not an earlier slimkv compression folder" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]

    (out / "notes.txt").unlink()
    assert main(compress_argv(tiny_folder, tmp_path, out)) == 0
    (out / "notes.txt").write_text("my notes")  # the user adds a file beside the output
    assert main(compress_argv(tiny_folder, tmp_path, out)) == 0  # replacing the earlier output keeps it
    assert (out / "notes.txt").read_text() == "my notes" and (out / MANIFEST_NAME).is_file()
    assert "notes.txt" not in json.loads((out / MANIFEST_NAME).read_text())["files"]


def test_compress_checks_before_work(tiny_folder, tmp_path, capsys):
    for extra, message in ((["--ratio", "0"], "ratio=0 removes nothing"), (["--ratio", "1.2"], "ratio must be a finite number")):
        assert main(compress_argv(tiny_folder, tmp_path, tmp_path / "x", *extra)) == 2
        assert message in capsys.readouterr().err
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary" * 100)
    argv = compress_argv(tiny_folder, tmp_path, tmp_path / "x")
    argv[argv.index("--calib") + 1] = str(tmp_path / "blob.bin")
    assert main(argv) == 2
    assert "looks like a binary file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    argv[argv.index("--calib") + 1] = str(tmp_path / "empty")
    assert main(argv) == 2
    assert "is a folder that holds no *.txt files" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_recompressing_a_compressed_folder_is_refused(tiny_folder, tmp_path, capsys):
    out = tmp_path / "c1"
    assert main(compress_argv(tiny_folder, tmp_path, out)) == 0
    assert main(compress_argv(out, tmp_path, tmp_path / "c2")) == 2
    assert "already compressed" in capsys.readouterr().err


def test_eval_ppl_refuses_binary_text_and_windows_past_the_position_limit(tiny_folder, tmp_path, capsys):
    (tmp_path / "blob.bin").write_bytes(b"\x00\xff" * 64)
    assert main(["eval", "ppl", "--model", str(tiny_folder), "--text", str(tmp_path / "blob.bin")]) == 2
    assert "looks like a binary file" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", str(tiny_folder), "--text", str(tmp_path / "calib.txt"), "--seq-len", "4096"]) == 2
    assert "past this model's position limit (max_position_embeddings=128)" in capsys.readouterr().err


def test_sweep_name_cannot_escape_the_output_folder(tiny_folder, tmp_path, capsys):
    argv = ["compress-sweep", "--model", str(tiny_folder), "--methods", "svd", "--ratios", "0.3", "--out-dir", str(tmp_path / "res"), "--name", "../escape"]
    assert main(argv) == 2
    assert "--name must start with a letter or digit" in capsys.readouterr().err
    assert not (tmp_path / "escape.json").exists()


def tiny_slimkv() -> SlimKVForCausalLM:
    torch.manual_seed(0)
    return SlimKVForCausalLM(ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2)).eval()


def test_past_key_values_is_honoured_as_the_deprecated_name_of_cache():
    model = tiny_slimkv()
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(1)
        model(ids[:, :8], cache=cache)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            step = model(ids[:, 8:], past_key_values=cache).logits
    assert cache.seq_len == 9 and torch.allclose(step[:, -1], full[:, -1], atol=1e-5)


def test_unknown_keywords_and_bad_arguments_are_refused():
    model = tiny_slimkv()
    ids = torch.randint(0, 50, (1, 4))
    with pytest.raises(TypeError, match="unexpected keyword argument.*past_key_value\\b"):
        model(ids, past_key_value=None)
    with pytest.raises(TypeError, match="cache must be a SlimKVCache"):
        model(ids, cache="notacache")
    with pytest.raises(ValueError, match=r"input_ids hold ids outside \[0, 50\)"):
        model(torch.tensor([[1, 2, 77]]))
    with pytest.raises(ValueError, match="position_ids must be 0..3"):
        model(ids, position_ids=torch.tensor([[0, 0, 1, 2]]))
    with pytest.raises(ValueError, match="output_attentions is not supported"):
        model(ids, output_attentions=True)
    out = model(ids, output_hidden_states=True, return_dict=False)
    assert isinstance(out, tuple)


def test_heads_errors_name_the_right_option():
    from slimkv.attention import build_attention

    with pytest.raises(ValueError, match="n_heads must be an integer >= 1, got 0"):
        build_attention("mha", 16, 0)
    with pytest.raises(ValueError, match="n_heads must be an integer >= 1, got 0"):
        ModelConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=0)


@pytest.mark.parametrize("seq_len, batch", [(-1, 1), (1.5, 1), (True, 1), (4, 0)])
def test_cache_bytes_refuses_lengths_that_are_not_token_counts(seq_len, batch):
    from slimkv.attention import build_attention

    attn = build_attention("mha", 16, 2)
    with pytest.raises(ValueError, match="must be an integer"):
        attn.cache_bytes(seq_len, batch_size=batch)
    with pytest.raises(ValueError, match="must be an integer"):
        tiny_slimkv().cache_bytes(seq_len, batch_size=batch)
