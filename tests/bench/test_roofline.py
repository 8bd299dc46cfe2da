"""The roofline's measurements and arithmetic (slimkv/bench/roofline.py)."""

import json
from pathlib import Path

import pytest
import torch

from slimkv.bench import roofline


def test_the_bound_is_the_slower_of_reading_and_computing():
    rates = {"read_bytes_per_s": 100.0, "fma_flop_per_s": 1000.0}
    assert roofline.step_bound(200, 1000, rates) == {"bound_s": 2.0, "bound": "memory", "memory_s": 2.0, "compute_s": 1.0}
    assert roofline.step_bound(50, 3000, rates)["bound"] == "compute" and roofline.step_bound(50, 3000, rates)["bound_s"] == 3.0


def test_add_bounds_gives_each_row_its_multiple_of_the_bound():
    rows = [{"flops": 10, "median_s": 3.0, "cache_bytes": 100, "weights": 100}]
    roofline.add_bounds(rows, {"read_bytes_per_s": 100.0, "fma_flop_per_s": 1e9}, bytes_key=lambda r: r["cache_bytes"] + r["weights"])
    assert rows[0]["bytes_read"] == 200 and rows[0]["bound_s"] == 2.0 and rows[0]["time_over_bound"] == pytest.approx(1.5)


def test_rates_are_measured_on_this_machine():
    rates = roofline.machine_rates(torch.bfloat16, read_bytes=4 << 20, gemm_size=32)
    assert rates["read_bytes_per_s"] > 0 and set(rates["gemm"]) == {"bfloat16", "float32"}
    assert rates["fma_flop_per_s"] == max(g["flop_per_s"] for g in rates["gemm"].values())
    merged = roofline.merge_rates(rates, {**rates, "read_bytes_per_s": 2 * rates["read_bytes_per_s"]})
    assert merged["read_bytes_per_s"] == 2 * rates["read_bytes_per_s"] and merged["before"] is rates


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs an x86 CPU with AVX2 (the held GEMM's ISA)")
def test_a_gemm_held_to_avx2_runs_in_a_torch_held_to_it():
    """An AVX2 kernel path on an AVX-512 machine is judged against an AVX2 GEMM: the child's torch says it ran AVX2."""
    rates = roofline.machine_rates(torch.float32, isa="avx2", read_bytes=4 << 20, gemm_size=32)
    gemm = rates["gemm"]["float32"]
    assert gemm["cpu_capability"] == "AVX2" and gemm["held_to"]["environment"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert rates["fma_isa"] == "avx2" and rates["fma_flop_per_s"] == gemm["flop_per_s"] > 0
    with pytest.raises(ValueError, match="isa 'sse9': a GEMM can be held to avx2 "):
        roofline.machine_rates(torch.float32, isa="sse9")


def test_the_context_names_the_cpu_the_kernel_path_threads_and_load():
    context = roofline.bound_context(torch.float32)
    assert set(context) == {"cpu_model", "kernel_isa", "kernel_threading", "kernel_row_prefetch", "kernel_tile_logits",
                            "kernel_linear_prefetch", "threads", "load_average"} and context["threads"] == torch.get_num_threads()
    assert context["kernel_isa"] in ("avx512", "avx2", "portable") or context["kernel_isa"].startswith("torch (")
    line = roofline.rates_line({"read_bytes_per_s": 2e10, "fma_flop_per_s": 1e11}, context)
    assert "read 20.00 GB/s" in line and "FMA 100.0 GFLOP/s" in line and context["kernel_isa"] in line


def _decode_native():
    """benchmarks/decode_native.py as a module (it imports its neighbour decode_all.py)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location("decode_native", folder / "decode_native.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module


def test_a_kernel_call_reads_values_inside_the_key_rows_once():
    bench = _decode_native()
    rows = torch.zeros(1, 1, 10, 288)
    q = torch.zeros(1, 8, 1, 288)
    assert bench.call_cost([q], [(rows, rows[..., 32:])]) == (10 * 288 * 4, 2 * 8 * 10 * (288 + 256))
    k, v = torch.zeros(1, 2, 10, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 10, 64, dtype=torch.bfloat16)
    assert bench.call_cost([q[..., :64]], [(k, v)]) == (2 * 10 * 128 * 2, 2 * 8 * 10 * 128)


def test_a_distinct_copy_of_a_kernel_call_is_the_same_call_over_other_memory():
    """``distinct_copy`` (--layers --distinct-mb): new memory, the same views of it: MLA's values inside
    the key rows, a buffer's [k | v] rows, stride-0 shared values; the same cost and the same result."""
    from slimkv.ops.attention import decode_attention

    bench = _decode_native()
    rows = torch.randn(1, 1, 16, 96)[:, :, 2:12]  # the live part of a longer buffer, not at its start
    shared = torch.randn(1, 1, 10, 24).expand(1, 3, 10, 24)
    q = torch.randn(1, 3, 1, 40)
    call = ([q, q[..., :8]], [(rows[..., :40], rows[..., 40:]), (torch.randn(1, 3, 10, 8), shared)], 0.3)
    queries, segments, scale = bench.distinct_copy(call)
    assert scale == 0.3
    for new, old in zip([*queries, *(t for pair in segments for t in pair)], [*call[0], *(t for pair in call[1] for t in pair)]):
        assert new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
        assert (new.shape, new.stride()) == (old.shape, old.stride()) and torch.equal(new, old)
    (k, v), (_, s) = segments
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() and s.stride(1) == 0  # still one buffer; still shared
    assert v.storage_offset() - k.storage_offset() == 40 and k.untyped_storage().nbytes() == 10 * 96 * 4  # the rows reached, no more
    assert queries[1].untyped_storage().data_ptr() == queries[0].untyped_storage().data_ptr()
    assert bench.call_cost(queries, segments) == bench.call_cost(*call[:2])
    torch.testing.assert_close(decode_attention(queries[0], k, v), decode_attention(q, rows[..., :40], rows[..., 40:]))


def test_layer_steps_can_be_routed_to_one_kernel_path():
    from slimkv.ops import native
    from slimkv.ops.attention import decode_attention

    library = native.decode_kernel()
    if library is None:
        pytest.skip("no C compiler: no kernel call to route")
    bench = _decode_native()
    calls = []
    q, k, v = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 50, 32), torch.randn(1, 2, 50, 32)
    with bench.routed_kernel(native.isa_kernel(torch.float32, "portable"), calls):
        out = decode_attention(q, k, v)
    assert len(calls) == 1 and calls[0][1][0][0] is k
    torch.testing.assert_close(out, decode_attention(q, k, v), rtol=1e-5, atol=2e-6)


def test_the_flop_counter_counts_torchs_cpu_fused_attention():
    """torch's own counter leaves CPU SDPA (the bfloat16 decode path outside the native kernel) at 0; ours counts its two matmuls."""
    import torch.nn.functional as F

    q, k = torch.randn(1, 3, 2, 16, dtype=torch.bfloat16), torch.randn(1, 3, 50, 16, dtype=torch.bfloat16)
    with roofline.flop_counter() as counter:
        F.scaled_dot_product_attention(q, k, k)
    assert counter.get_total_flops() == 2 * (2 * 3 * 2 * 50 * 16)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "decode").glob("decode_roofline_layer*.md")))
def test_the_committed_layer_pages_are_what_their_json_renders(name):
    """Every committed page of ``decode_native.py --layers`` is what its JSON renders today."""
    bench = _decode_native()
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "decode" / f"{name}.json"
    assert path.with_suffix(".md").read_text(encoding="utf-8") == bench.render_layers(json.loads(path.read_text(encoding="utf-8"))), \
        f"run .venv/bin/python benchmarks/decode_native.py --render benchmarks/results/decode/{name}.json"
