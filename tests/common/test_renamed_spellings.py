"""Old spellings (slimkv.common.vocabulary): typed, they are refused naming the new one; written
earlier (a conversion manifest, a results file), they read as today's words."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from slimkv.common.files import write_json
from slimkv.common.vocabulary import VOCABULARY, current_method, is_legacy
from slimkv.convert.manifest import finished_conversion, same_method
from slimkv.convert.methods import parse_method
from slimkv.convert.pipeline import ConvertOptions
from slimkv.pretrained.loading import CONVERTED_MANIFEST


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
