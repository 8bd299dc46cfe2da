"""Issue 39, round 3, on the evaluation side: option values, bounded conversions in reports, the
original of a conversion, damaged source weights, resumed retrieval grids and damaged results
files. Tiny local models only (no downloads)."""

from __future__ import annotations

import pytest

from slimkv.bench.entries import parse_kind_overrides
from slimkv.common import spec as grammar
from slimkv.common.spec import AttentionSpec, split_entries
from slimkv.convert.methods import parse_method


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
