"""benchmarks/decode_quantized.py: its variants check themselves against their references, and the
committed results render to the committed table."""

import json

import pytest

from slimkv.common.results import results_path
from slimkv.ops import native
from tests.helpers import load_benchmark

bench = load_benchmark("decode_quantized.py")


@pytest.mark.skipif(native.decode_kernel() is None, reason="no C compiler on this machine, so no native kernel to benchmark")
def test_a_tiny_run_checks_and_reports_every_variant():
    import torch

    attention = bench.attention_rows(torch.float32, 300, 2, rounds=1)
    assert [r["variant"] for r in attention] == ["int4 codes in place", "int4 dequantized (torch path)", "int8 codes in place",
                                                  "int8 dequantized (torch path)", "full rows (plain kernel)"]
    assert all(r["ms"] > 0 and r["bytes_read"] > 0 for r in attention)
    assert attention[0]["bytes_read"] < attention[2]["bytes_read"] < attention[4]["bytes_read"]  # int4 < int8 < float32 rows
    portable = bench.attention_rows(torch.float32, 300, 2, rounds=1, isas=["portable"])  # a named path, timed beside the build's own
    assert [r["variant"] for r in portable if "portable" in r["variant"]] == ["int4 codes in place, portable path", "int8 codes in place, portable path",
                                                                             "full rows (plain kernel), portable path"]
    bench.LINEAR_SHAPES = [(12, 8)]
    rows = bench.linear_rows(torch.float32, rounds=1, copies=2)
    assert rows[0]["shape"] == "12 x 8" and rows[0]["torch_over_native"] > 0


def test_the_committed_tables_are_what_their_json_renders():
    paths = sorted(results_path(bench.RESULTS, "decode_quantized_1thread.json").parent.glob("decode_quantized*.json"))
    assert results_path(bench.RESULTS, "decode_quantized_1thread.json") in paths  # the results docs/evaluation.md cites are committed
    for path in paths:
        payload = json.loads(path.read_text())
        assert path.with_suffix(".md").read_text() == bench.render(payload), path.name


@pytest.mark.parametrize("name", ["results_1thread", "decode_quantized/../x", "decode_quantized x"])
def test_a_results_name_outside_the_family_is_refused_naming_the_option(monkeypatch, capsys, name):
    monkeypatch.setattr("sys.argv", ["decode_quantized.py", "--name", name])
    with pytest.raises(SystemExit):
        bench.parse()
    assert f"--name {name!r}" in capsys.readouterr().err


def test_an_unknown_kernel_path_is_refused_naming_the_option(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["decode_quantized.py", "--isas", "neon"])
    with pytest.raises(SystemExit):
        bench.parse()
    err = capsys.readouterr().err
    assert "--isas 'neon'" in err and "allowed: amx-bf16, avx512-bf16, avx512, avx2, portable" in err
