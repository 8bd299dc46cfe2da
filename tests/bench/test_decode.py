"""The decode benchmark's accounting: counted FLOPs per step, the roofline, and the targets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from slimkv.attention import build_attention
from slimkv.bench.decode import add_roofline, fill_cache, matched_width_variants, run_decode_benchmark, step_flops
from slimkv.bench.roofline import machine_rates
from slimkv.ops.native import kernel_isa

_spec = importlib.util.spec_from_file_location("decode_targets", Path(__file__).resolve().parents[2] / "benchmarks" / "decode_targets.py")
decode_targets_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_targets_module)
decode_targets = decode_targets_module.decode_targets  # the acceptance targets live with the benchmark script


def test_step_flops_of_mha_are_the_projections_and_two_products_per_key():
    """One decode step of MHA: four d_model x d_model projections and, per head, q.k and p.v over
    every key (the new one included): 2 * 4 * d^2 + 4 * heads * head_dim * keys."""
    d_model, heads, head_dim, context = 16, 2, 8, 12
    attn = build_attention("mha", d_model, heads, head_dim).double().eval()
    cache = attn.new_cache(1, dtype=torch.float64)
    fill_cache(attn, cache, context, generator=torch.Generator().manual_seed(0))
    assert step_flops(attn, cache) == 2 * 4 * d_model**2 + 4 * heads * head_dim * (context + 1)
    assert cache.seq_len == context + 1  # the counted call appended its token, like a timed one


def _row(label: str, **values) -> dict:
    return {"label": label, "kind": label, "context": 32768, **values}


def test_roofline_takes_the_slower_of_memory_and_arithmetic():
    payload = {"rows": [_row("mem", cache_bytes=900, parameter_bytes=100, flops=10, median_s=2.0),
                        _row("com", cache_bytes=10, parameter_bytes=0, flops=4000, median_s=8.0)]}
    add_roofline(payload, read_bandwidth=1000.0, fma_rate=1000.0)
    mem, com = payload["rows"]
    assert (mem["roofline_s"], mem["roofline_bound"], mem["of_roofline"], mem["time_over_bound"]) == (1.0, "memory", 0.5, 2.0)
    assert (com["roofline_s"], com["roofline_bound"], com["of_roofline"], com["time_over_bound"]) == (4.0, "compute", 0.5, 2.0)
    assert mem["bytes_read"] == 1000 and com["bytes_read"] == 10


def test_a_compute_bound_target_says_whether_the_machine_can_reach_it():
    """MLA at 0.25 of MHA's bytes may take 0.3 of MHA's time; its roofline alone takes 0.5: the
    target is missed AND out of reach here; LRKV's roofline allows it."""
    rows = [_row("mha", cache_bytes=1000, median_s=1.0, roofline_s=0.8, gb_per_s=1e-6),
            _row("mla", cache_bytes=250, median_s=0.9, roofline_s=0.5),
            _row("lrkv", cache_bytes=500, median_s=0.9, roofline_s=0.3)]
    targets = {t["label"]: t for t in decode_targets({"settings": {"contexts": [32768]}, "rows": rows}, copy_bandwidth=1e9)}
    assert not targets["mla"]["met"] and targets["mla"]["reachable"] is False and targets["mla"]["roofline_time_ratio"] == pytest.approx(0.5)
    assert not targets["lrkv"]["met"] and targets["lrkv"]["reachable"] is True


def test_read_bound_and_kvm_targets_say_what_the_machine_allows():
    """SWA with 16 units of cache and 4 of weights can give at most 0.8 of the bandwidth to its
    cache; with 6 of weights it cannot reach 0.8."""
    rows = [_row("mha", cache_bytes=1000, parameter_bytes=4, median_s=1.0, roofline_s=0.8, gb_per_s=1e-6),
            _row("swa", cache_bytes=16, parameter_bytes=4, median_s=1.0, gb_per_s=1e-6),
            _row("mqa", cache_bytes=16, parameter_bytes=6, median_s=1.0, gb_per_s=1e-6)]
    targets = {t["label"]: t for t in decode_targets({"settings": {"contexts": [32768]}, "rows": rows}, copy_bandwidth=1e9)}
    assert targets["swa"]["ceiling"] == pytest.approx(0.8) and targets["swa"]["reachable"] is True
    assert targets["mqa"]["reachable"] is False


def test_benchmark_writes_rates_and_rooflines(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("slimkv.bench.decode.machine_rates", lambda dtype: machine_rates(dtype, read_bytes=1 << 20, gemm_size=32))
    variants = matched_width_variants(["mha", "gqa"], n_heads=2, head_dim=8)
    payload = run_decode_benchmark("decode_smoke", variants, [16], out_dir=tmp_path, d_model=16, n_heads=2, head_dim=8,
                                   dtype=torch.float64, warmup=0, repeats=1, rounds=1, targets=decode_targets_module.all_targets)
    written = json.loads((tmp_path / "decode_smoke.json").read_text())
    roofline = written["roofline"]
    assert roofline["read_bytes_per_s"] > 0 and roofline["fma_flop_per_s"] > 0 and written["copy_bandwidth"]["bytes_per_s"] > 0
    assert set(roofline["before"]["gemm"]) == {"float64", "float32"} and roofline["threads"] == torch.get_num_threads()
    assert roofline["kernel_isa"] == kernel_isa(torch.float64) and set(roofline["load_average"]) == {"before", "after"} and "cpu_model" in roofline
    for row in payload["rows"]:
        assert row["flops"] > 0 and row["gflop_per_s"] > 0 and 0 < row["roofline_s"] and row["roofline_bound"] in ("memory", "compute")
        assert row["time_over_bound"] == pytest.approx(row["median_s"] / row["roofline_s"]) and row["bytes_read"] == row["cache_bytes"] + row["parameter_bytes"]
    out = capsys.readouterr().out
    assert "roofline: read" in out and "x bound" in out and "bandwidth targets: stated for >= 32768 cached tokens; not evaluated" in out
