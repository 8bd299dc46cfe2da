"""The one grammar for "layer kinds + options": every spelling gives the same AttentionSpec, and
build_attention (through ModelConfig) is the one validator of kinds and options."""

from __future__ import annotations

import pytest

from slimkv import ModelConfig
from slimkv.common.spec import AttentionSpec, split_entries
from slimkv.train import TrainConfig
from slimkv.train.config import attention_overrides, load_config


def test_entry_text_fields_and_dotted_overrides_are_one_spec():
    text = AttentionSpec.parse("swa+kvm:qk_norm=true,swa.window=64,kvm.schedule=sqrt")
    fields = AttentionSpec.from_fields(["swa", "kvm"], {"qk_norm": True}, {"swa": {"window": 64}, "kvm": {"schedule": "sqrt"}})
    dotted = load_config(None, attention_overrides("swa+kvm:qk_norm=true,swa.window=64,kvm.schedule=sqrt")).attention_spec()
    assert text == fields == dotted
    assert text.layer_options(0) == {"qk_norm": True, "window": 64} and text.layer_options(1) == {"qk_norm": True, "schedule": "sqrt"}
    assert AttentionSpec.parse(text.text()) == text  # text() writes what parse() reads


def test_older_spellings_still_read():
    assert AttentionSpec.parse("swa,mha").kinds == ("swa", "mha")  # train --attention swa,mha
    assert AttentionSpec.from_fields("swa,mha").kinds == ("swa", "mha")  # attention: "swa,mha" in a YAML file
    assert TrainConfig.from_dict({"attention": "gqa", "attention_options": {"n_kv_heads": 2}}).attention_spec() == AttentionSpec.parse("gqa:n_kv_heads=2")
    values = load_config(None, {"attention": "swa", "attention_options.window": 16}).attention_spec()
    assert values == AttentionSpec.parse("swa:window=16")
    assert split_entries("mha,lrkv:rank=8,rope_placement=none,gqa") == ["mha", "lrkv:rank=8,rope_placement=none", "gqa"]
    assert split_entries("mla:kv_rank=8,swa+kvm:kvm.max_rows=[4]") == ["mla:kv_rank=8", "swa+kvm:kvm.max_rows=[4]"]


def test_values_are_yaml_and_null_means_the_kind_default():
    spec = AttentionSpec.parse("kvm:chunk_size=16,min_rows=null,rope_fraction=0.25,merge_gate=false")
    assert spec.layer_options(0) == {"chunk_size": 16, "rope_fraction": 0.25, "merge_gate": False}


def test_per_layer_options_override_for_single_layers():
    config = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, attention="gqa", attention_options={"n_kv_heads": 1},
                         per_layer_options=[{}, {"n_kv_heads": 2}])
    assert config.layer_options(0) == {"n_kv_heads": 1} and config.layer_options(1) == {"n_kv_heads": 2}
    with pytest.raises(ValueError, match=r"per_layer_options has 1 entries; it needs one per layer \(2\)"):
        ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, per_layer_options=[{}])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention": "lrkv", "attention_options": {"rnk": 2}}, r"unknown option 'rnk' for attention kind 'lrkv' \(did you mean rank"),
        ({"attention": "gqa"}, r"attention kind 'gqa' cannot be built .*n_kv_heads"),
        ({"attention": "mlaa"}, r"unknown attention kind 'mlaa' \(did you mean mla"),
        ({"attention": 5}, r"attention must be a kind name or a list of kind names, got 5"),
        ({"attention": ["swa", "mha"], "kind_options": {"kvm": {"window": 3}}}, r"kind_options names 'kvm', which no layer uses"),
        ({"attention": ["swa", "mha", "mha"]}, r"pattern swa\+mha\+mha of length 3 does not divide n_layers=4"),
        ({"norm_eps": -1.0}, r"norm_eps must be a finite number > 0"),
        ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be True or False"),
    ],
)
def test_model_config_refuses_what_cannot_build(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(vocab_size=32, d_model=16, n_layers=4, n_heads=2, **kwargs)


def test_entry_errors_name_the_bad_part():
    with pytest.raises(ValueError, match=r"option 'rank' needs a value"):
        AttentionSpec.parse("lrkv:rank")
    with pytest.raises(ValueError, match=r"names kind 'mla', which the entry does not use"):
        AttentionSpec.parse("swa+kvm:mla.kv_rank=2")
    with pytest.raises(ValueError, match=r"an empty kind in the pattern"):
        AttentionSpec.parse("swa++kvm")
