"""Old spellings (slimkv.common.vocabulary): typed, they are refused naming the new one; written
earlier (a conversion manifest, a results file, a saved model's config.json, a run's train_config.json),
they read as today's words."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import slimkv  # noqa: F401  (registers the slimkv model with AutoConfig)
from slimkv.attention import build_attention
from slimkv.bench.entries import parse_entries, parse_kind_overrides
from slimkv.cli import main
from slimkv.common.files import write_json
from slimkv.common.spec import AttentionSpec
from slimkv.common.vocabulary import VOCABULARY, current_attention_fields, current_layer_options, current_method, is_legacy
from slimkv.convert.manifest import finished_conversion, same_method
from slimkv.convert.methods import parse_method
from slimkv.convert.pipeline import ConvertOptions
from slimkv.model import ModelConfig, SlimKVForCausalLM, load_model_folder
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from slimkv.recall.run import stored_request
from slimkv.train import TrainConfig
from slimkv.train.checkpoint import read_run_config
from slimkv.train.config import attention_overrides, load_config


@pytest.mark.parametrize("old, new", [
    ("mla+kvm@0.5", "mla-kvm:chunk_size=128,sink_len=4@0.5"),
    ("mla+kvm:rows=192@0.75", "mla-kvm:chunk_size=128,sink_len=4,min_rows=192@0.75"),
    ("kvm", "kvm:chunk_size=128,sink_len=4"),
    ("kvm:chunk_size=256,rows=128,transfer_steps=0", "kvm:sink_len=4,chunk_size=256,min_rows=128,transfer_steps=0"),
    ("lrkv:rope=decoupled,rope_pairs=12", "lrkv:rope_placement=decoupled,rope_pairs=12"),
    ("mla:pairs=measured", "mla:pairs=measured"),
    ("hybrid", "hybrid:score=copy_mass"),
    ("hybrid:window=128,score=window_loss", "hybrid:window=128,score=window_loss"),
    (None, None),
])
def test_an_old_text_reads_in_todays_words(old, new):
    assert current_method(old) == new
    if new is not None:
        parse_method(new.rpartition("@")[0] if "@" in new else new)  # today's parser takes it


def test_a_text_of_today_is_left_as_it_is():
    assert current_method("kvm:transfer_steps=0", written_in=VOCABULARY) == "kvm:transfer_steps=0"
    assert current_method("hybrid@0.25", written_in=VOCABULARY) == "hybrid@0.25"
    assert is_legacy({}) and is_legacy({"vocabulary": 1}) and not is_legacy({"vocabulary": VOCABULARY})


@pytest.mark.parametrize("old, new", [("mla+kvm", "mla-kvm"), ("kvm:rows=256", "kvm:min_rows=256"), ("lrkv:rope=decoupled", "lrkv:rope_placement=decoupled")])
def test_old_spellings_typed_are_refused_naming_the_new_one(old, new):
    with pytest.raises(ValueError, match="now spelled") as err:
        parse_method(old)
    assert new.partition(":")[0] in str(err.value) and (":" not in new or new.partition(":")[2].partition("=")[0] in str(err.value))


def test_a_folder_converted_before_the_renames_is_still_found(tmp_path):
    """A manifest of vocabulary 1 (``--to mla+kvm``, the old kvm defaults) matches the options that
    make the same conversion today; one of today matches its own text and equivalent spellings."""
    old = ConvertOptions(method="mla+kvm:rows=512", cache_ratio=0.5)
    write_json(tmp_path / CONVERTED_MANIFEST, {"method": "mla+kvm", "options": asdict(old)})
    assert finished_conversion(tmp_path, ConvertOptions(method="mla-kvm:min_rows=512,chunk_size=128,sink_len=4", cache_ratio=0.5)) is not None
    assert finished_conversion(tmp_path, ConvertOptions(method="mla-kvm:min_rows=512", cache_ratio=0.5)) is None  # today's defaults differ
    new = ConvertOptions(method="kvm:transfer_steps=0,chunk_size=128")
    write_json(tmp_path / CONVERTED_MANIFEST, {"vocabulary": VOCABULARY, "method": "kvm", "options": asdict(new)})
    assert finished_conversion(tmp_path, ConvertOptions(method="kvm:chunk_size=128,transfer_steps=0")) is not None
    assert finished_conversion(tmp_path, ConvertOptions(method="kvm:chunk_size=128")) is None
    assert same_method("kvm:chunk_size=256", "kvm") and not same_method("kvm:sink_len=4", "kvm") and not same_method("kvm:rows=4", "kvm")


def test_a_hybrid_folder_of_vocabulary_2_reads_with_the_score_it_was_made_with(tmp_path):
    """Before vocabulary 3 ``--to hybrid`` (and ``--cache-budget``) chose heads by copy_mass: such a folder is not
    today's default conversion (a demo or benchmark reusing it would relabel it), it is the copy_mass one."""
    options = ConvertOptions(method="hybrid", cache_budget=0.25)
    write_json(tmp_path / CONVERTED_MANIFEST, {"vocabulary": 2, "method": "hybrid", "options": asdict(options)})
    assert finished_conversion(tmp_path, options) is None
    assert finished_conversion(tmp_path, ConvertOptions(method="hybrid:score=copy_mass", cache_budget=0.25)) is not None
    assert current_method("kvm", written_in=2) == "kvm" and current_method("hybrid", written_in=2) == "hybrid:score=copy_mass"


# ---------------------------------------------------------------- layer options (RENAMED_LAYER_OPTIONS)

OLD_OPTION = r"the option 'rope_mode' of attention kind 'lrkv' is now spelled 'rope_placement' \(lrkv:rope_placement=\.\.\.\)"
SMALL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4}


@pytest.mark.parametrize("typed", [
    lambda: build_attention("lrkv", 32, 4, rank=2, rope_mode="full"),
    lambda: ModelConfig(**SMALL, attention="lrkv", attention_options={"rank": 2, "rope_mode": "full"}),
    lambda: ModelConfig(**SMALL, attention=["mha", "lrkv"], kind_options={"lrkv": {"rank": 2, "rope_mode": "none"}}),
    lambda: ModelConfig(**SMALL, attention="lrkv", per_layer_options=[{"rank": 2}, {"rank": 2, "rope_mode": "none"}]),
    lambda: load_config(None, attention_overrides("lrkv:rank=2,rope_mode=full")),  # train --attention
    lambda: parse_entries(["lrkv:rope_mode=none"], TrainConfig()),  # compare --kinds
    lambda: parse_entries(["mha", "lrkv"], TrainConfig(), parse_kind_overrides(["lrkv.rope_mode=none"])),  # --kind-option
], ids=["build_attention", "attention_options", "kind_options", "per_layer_options", "--attention", "--kinds", "--kind-option"])
def test_an_old_layer_option_typed_is_refused_naming_the_new_one(typed):
    with pytest.raises(ValueError, match=OLD_OPTION):
        typed()


def test_the_command_line_refuses_an_old_layer_option(tmp_path, capsys):
    assert main(["train", "--attention", "lrkv:rank=2,rope_mode=none", "--out", str(tmp_path / "run")]) == 2
    assert re.search(OLD_OPTION, capsys.readouterr().err) and not (tmp_path / "run").exists()


def _old_spelling(fields: dict) -> dict:
    """``fields`` (a config's) with every ``rope_placement`` spelled ``rope_mode``, as it was written before the rename."""
    if isinstance(fields, dict):
        return {("rope_mode" if k == "rope_placement" else k): _old_spelling(v) for k, v in fields.items()}
    return [_old_spelling(v) for v in fields] if isinstance(fields, list) else fields


@pytest.mark.parametrize("attention", [
    {"attention": "lrkv", "attention_options": {"rank": 2, "rope_placement": "full"}},
    {"attention": ["mha", "lrkv"], "kind_options": {"lrkv": {"rank": 2, "rope_placement": "none"}}},
    {"attention": "lrkv", "per_layer_options": [{"rank": 2, "rope_placement": "full"}, {"rank_k": 1, "rank_v": 3, "rope_placement": "none"}]},
], ids=["attention_options", "kind_options", "per_layer_options"])
def test_a_saved_model_written_with_the_old_layer_option_loads_as_the_same_model(tmp_path, attention):
    """A config.json written before the rename (lrkv's ``rope_mode``) loads, in every place a config holds
    layer options, as today's ``rope_placement``: the same config and the same outputs as the folder written today."""
    torch.manual_seed(0)
    model = SlimKVForCausalLM(ModelConfig(**SMALL, **attention)).eval()
    today, before = tmp_path / "today", tmp_path / "before"
    model.save_pretrained(today)
    shutil.copytree(today, before)
    config = json.loads((before / "config.json").read_text())
    (before / "config.json").write_text(json.dumps(_old_spelling(config)))
    assert "rope_mode" in (before / "config.json").read_text() and "rope_placement" not in (before / "config.json").read_text()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = load_model_folder(today)(ids).logits
        for loaded in (load_model_folder(before), AutoModelForCausalLM.from_pretrained(before).eval()):
            assert loaded.config.to_dict() == {**model.config.to_dict(), **{k: loaded.config.to_dict()[k] for k in ("_name_or_path",)}}
            assert torch.equal(loaded(ids).logits, expected)
    assert AutoConfig.from_pretrained(before).attention_spec() == model.config.attention_spec()


def test_a_run_config_written_with_the_old_layer_option_reads_as_the_new(tmp_path):
    cfg = TrainConfig(attention=["swa", "lrkv"], attention_options={"qk_norm": True}, kind_options={"swa": {"window": 8}, "lrkv": {"rank": 2, "rope_placement": "none"}})
    write_json(tmp_path / "train_config.json", _old_spelling(cfg.to_dict()))
    assert read_run_config(tmp_path) == cfg


def test_stored_layer_options_read_in_todays_words():
    assert current_layer_options("lrkv", {"rank": 2, "rope_mode": "none"}) == {"rank": 2, "rope_placement": "none"}
    assert current_layer_options(["swa", "lrkv"], {"rope_mode": "full"}) == {"rope_placement": "full"}
    assert current_layer_options("swa", {"rope_mode": "full"}) == {"rope_mode": "full"}  # never an option of swa: refused when built
    assert current_layer_options("lrkv", {"rope_mode": "full", "rope_placement": "none"}) == {"rope_mode": "full", "rope_placement": "none"}
    fields = {"attention": ["mha", "lrkv"], "attention_options": {"rope": "none"}, "kind_options": {"lrkv": {"rope_mode": "none"}, "mha": {"rope_mode": "x"}},
              "per_layer_options": [{"rope_mode": "a"}, {"rope_mode": "b"}], "vocab_size": 64}
    assert current_attention_fields(fields) == {**fields, "kind_options": {"lrkv": {"rope_placement": "none"}, "mha": {"rope_mode": "x"}},
                                                "per_layer_options": [{"rope_mode": "a"}, {"rope_placement": "b"}]}
    assert current_attention_fields({"attention": 3, "attention_options": {"rope_mode": "full"}}) == {"attention": 3, "attention_options": {"rope_mode": "full"}}
    request = {"attention": AttentionSpec.parse("lrkv:rank=2,rope_placement=none").to_fields(), "seed": 0}
    assert stored_request(_old_spelling(request)) == request and stored_request(None) is None
