"""benchmarks/decode_linear.py: a tiny run times every kernel path this CPU has (each checked
against F.linear first) and torch's, and the committed page is what its JSON renders."""

import json

import pytest
import torch

from slimkv.common.results import results_path
from slimkv.ops import native
from tests.helpers import load_benchmark

bench = load_benchmark("decode_linear.py")


@pytest.mark.skipif(native.decode_kernel() is None, reason="no C compiler on this machine, so no native kernel to benchmark")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_run_times_every_path_once(dtype):
    rows = bench.measure(dtype, layers=1, rounds=1)
    passes = [r["path"] for r in rows if r["variant"].startswith("model pass") and r["path"] != "portable" and not r["path"].startswith("torch")]
    assert len(passes) == len(set(passes)) >= 1  # each build timed once (a float32 build of avx512-bf16 is the avx512 path)
    assert [r["variant"] for r in rows][-3:] == ["model pass, portable", "one call, portable", "model pass, torch"]
    assert all(r["median_s"] > 0 and r["bytes_read"] > 0 for r in rows)
    assert len({r["bytes_read"] // 10**5 for r in rows}) == 1  # the one-call matrix holds the pass's bytes

def test_the_committed_page_is_what_its_json_renders():
    path = results_path(bench.RESULTS, "decode_linear_1thread.json")
    payload = json.loads(path.read_text())
    assert results_path(bench.RESULTS, "decode_linear_1thread.md").read_text() == bench.render(payload)
