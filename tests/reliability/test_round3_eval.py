"""Issue 39, round 3, on the evaluation side: option values, bounded conversions in reports, the
original of a conversion, damaged source weights, resumed retrieval grids and damaged results
files. Tiny local models only (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimkv.bench.entries import parse_kind_overrides
from slimkv.cli import main
from slimkv.common import spec as grammar
from slimkv.common.spec import AttentionSpec, split_entries
from slimkv.compress.options import CompressOptions
from slimkv.compress.workflow import compress_pretrained
from slimkv.convert.methods import parse_method
from slimkv.convert.pipeline import ConvertOptions, convert_pretrained
from slimkv.eval import ppl
from slimkv.pretrained.loading import COMPRESSED_MANIFEST, CONVERTED_MANIFEST
from tests.compress.conftest import CALIB_LINES, HELD_OUT_LINES, tiny_model, write_tiny_llama_folder

MLA_KVM = "mla+kvm:chunk_size=4,window_chunks=2,rows=6,sink_len=1,transfer_steps=0,transfer_seq_len=32,transfer_windows=2"


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    return write_tiny_llama_folder(tmp_path, CALIB_LINES * 30, HELD_OUT_LINES * 10)


def convert(folder: Path, method: str, ratio: float | None, out: Path) -> dict:
    options = ConvertOptions(method, ratio, calib=str(folder.parent / "calib.txt"), calib_tokens=96, calib_seq_len=32)
    return convert_pretrained(str(folder), options, out, progress=False)[1]


def ppl_argv(model: Path, *extra: str) -> list[str]:
    return ["eval", "ppl", "--model", str(model), "--text", str(model.parent / "held.txt"), "--seq-len", "32", "--max-tokens", "200", *extra]


def test_plain_float_spellings_are_numbers_in_every_option_grammar():
    """YAML 1.1 reads 1e-3 as text; --to, --kinds and --kind-option read it as the number it spells."""
    assert parse_method("kvm:transfer_lr=1e-3")[1]["transfer_lr"] == 0.001
    spec = AttentionSpec.parse("swa+kvm:rope_fraction=2.5E-1,kvm.max_rows=[1e1, 12]")
    assert spec.shared == {"rope_fraction": 0.25} and spec.per_kind == {"kvm": {"max_rows": [10.0, 12]}}
    assert parse_kind_overrides(["lrkv.rank=1E+1", "swa.window=.5"]) == {"lrkv": {"rank": 10.0}, "swa": {"window": 0.5}}
    assert [grammar.read_value(t) for t in ("-.5", "1.0e5", "+2e0", "8", "012", "0x10", "1:30", "'1e-3'", "sqrt", "null")] == \
        [-0.5, 1e5, 2.0, 8, 12, 16, "1:30", "1e-3", "sqrt", None]  # 012 is twelve, 1:30 is text, a quoted value stays text
    assert isinstance(grammar.read_value("8"), int)


def test_an_option_given_twice_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"option 'rows' is given twice in 'rows=1,rows=2'"):
        parse_method("kvm:rows=1,rows=2")
    with pytest.raises(ValueError, match=r"option 'swa.window' is given twice"):
        AttentionSpec.parse("swa+kvm:swa.window=4,kvm.rows=2,swa.window=8")
    assert AttentionSpec.parse("swa+kvm:window=4,swa.window=8").layer_options(0) == {"window": 8}  # a kind's own option over the shared one
    assert split_entries("lrkv:rank=8,rope_mode=none,swa:window=4,rope_mode=none") == ["lrkv:rank=8,rope_mode=none", "swa:window=4,rope_mode=none"]


def test_ppl_of_a_bounded_conversion_describes_its_cache_in_bytes(tiny_folder, tmp_path, capsys):
    """mla+kvm records a ratio but no achieved ratio (its cache is bounded): the label gives its
    cache bytes at the longest context of its table, where it used to format None."""
    manifest = convert(tiny_folder, MLA_KVM, 0.5, tmp_path / "out")
    assert manifest["cache_ratio"] == 0.5 and manifest["achieved_cache_ratio"] is None
    assert main(ppl_argv(tmp_path / "out", "--json", str(tmp_path / "ppl.json"))) == 0
    last = manifest["cache_bytes"][-1]
    label = json.loads((tmp_path / "ppl.json").read_text())["results"][1]["model"]
    assert f"(mla-kvm layers) cache ratio 0.5, bounded cache: {last['bytes']:,} bytes at {last['context']} tokens ({last['ratio']:.4f} of the original's)" in label
    assert label in capsys.readouterr().out
    kvm = {"method": "kvm", "kind": "kvm", "cache_ratio": None, "achieved_cache_ratio": None, "cache_bytes": manifest["cache_bytes"], "healing": {"step": 1}}
    assert ppl.describe({"converted": kvm}, "x") == f"convert kvm (kvm layers) bounded cache: {last['bytes']:,} bytes at {last['context']} tokens ({last['ratio']:.4f} of the original's) healed"
    assert ppl.describe({"converted": {**kvm, "cache_bytes": None}}, "x") == "convert kvm (kvm layers) bounded cache healed"


@pytest.mark.parametrize("made", ["convert", "compress"])
def test_an_original_whose_weights_changed_is_refused_before_any_model_loads(made, tiny_folder, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    if made == "convert":
        manifest_path, recorded = out / CONVERTED_MANIFEST, convert(tiny_folder, "gqa", 0.5, out)["base_model"]["weights_sha256"]
    else:
        options = CompressOptions("svd", 0.3)
        manifest_path, recorded = out / COMPRESSED_MANIFEST, compress_pretrained(str(tiny_folder), options, "", 64, out, progress=False)[1]["base_model"]["weights_sha256"]
    tiny_model("llama", seed=1).save_pretrained(tiny_folder)  # other weights where the original was
    monkeypatch.setattr(ppl, "load_language_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(ppl_argv(out)) == 2
    err = capsys.readouterr().err
    assert f"the original model {tiny_folder} holds other weights than the ones {manifest_path} was made from (weights sha256 {recorded[:12]}... recorded" in err
    assert f"or run `slimkv {made}` again from the current ones" in err
    monkeypatch.undo()
    manifest = json.loads(manifest_path.read_text())
    del manifest["base_model"]["weights_sha256"]  # a manifest written before the fingerprint: accepted
    manifest_path.write_text(json.dumps(manifest))
    assert main(ppl_argv(out)) == 0


def test_the_healing_resume_checks_the_original_in_the_same_place(tiny_folder, tmp_path):
    from slimkv.pretrained.loading import resolve_original

    out = tmp_path / "out"
    manifest = convert(tiny_folder, "gqa", 0.5, out)
    assert resolve_original(manifest, out / CONVERTED_MANIFEST) == manifest["base_model"]["name"]
    tiny_model("llama", seed=1).save_pretrained(tiny_folder)
    with pytest.raises(ValueError, match=r"holds other weights than the ones .* was made from"):
        resolve_original(manifest, out / CONVERTED_MANIFEST)
    with pytest.raises(ValueError, match=r"base_model.weights_sha256 is 5, not a sha256"):
        resolve_original({"base_model": {**manifest["base_model"], "weights_sha256": 5}}, out / CONVERTED_MANIFEST)


def test_a_damaged_source_model_is_named_in_convert_ppl_and_niah(tiny_folder, tmp_path, capsys):
    weights = tiny_folder / "model.safetensors"
    whole = weights.read_bytes()
    commands = (ppl_argv(tiny_folder),
                ["convert", "--model", str(tiny_folder), "--to", "gqa", "--cache-ratio", "0.5", "--calib", str(tmp_path / "calib.txt"), "--calib-tokens", "96",
                 "--calib-seq-len", "32", "--out", str(tmp_path / "conv"), "--no-progress"],
                ["eval", "niah", "--model", str(tiny_folder), "--tasks", "passkey", "--lengths", "64", "--depths", "0.5", "--samples", "1",
                 "--out", str(tmp_path / "niah"), "--no-progress"])
    weights.write_bytes(whole[: len(whole) // 2])
    for argv in commands:
        assert main(argv) == 2, argv
        assert f"the weights in {tiny_folder} cannot be read (" in capsys.readouterr().err
    from safetensors.torch import load_file, save_file

    weights.write_bytes(whole)
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})  # a readable file that lacks a tensor: it used to be initialised at random
    assert main(commands[0]) == 2
    assert "the weights do not fit config.json (missing: ['model.layers.1.mlp.up_proj.weight'])" in capsys.readouterr().err
    weights.write_bytes(whole)
    config = json.loads((tiny_folder / "config.json").read_text())
    for damaged, message in (("{not json", "config.json is not valid JSON"), (json.dumps({**config, "hidden_size": "wide"}), "config.json cannot be read as a llama config"),
                             (json.dumps({**config, "intermediate_size": 81}), "the weights do not have the shapes config.json gives")):
        (tiny_folder / "config.json").write_text(damaged)
        assert main(commands[0]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "conv").exists() and not (tmp_path / "niah").exists()
