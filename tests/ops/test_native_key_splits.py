"""Key splits in the native decode kernel (csrc/decode_attention.c, ``split_keys``): with fewer
(batch, kv_head) work items than threads, each item's keys are cut into ranges attended on separate
threads and merged by their softmax statistics. Every path and cache layout against the reference."""

import math

import pytest
import torch

from slimkv.ops import native
from slimkv.ops.attention import buffer_segments, reference_attention
from tests.ops.test_native import DTYPES, ISAS, _isa_cache, _tolerance, needs_kernel


@pytest.fixture
def many_threads(monkeypatch):
    """Every call may use 16 threads (more threads than work items in every layout below)."""
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(16)
    yield
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["mqa64", "gqa32x9", "mha-odd", "mla288", "mla-odd", "lrkv192", "latent-shared-odd"])
def test_key_splits_match_the_reference_on_every_path_and_layout(isa, dtype, layout, many_threads):
    """4,100 keys (4 ranges of at least 1,024 keys, boundaries on 64-key blocks, a ragged last one):
    MQA/GQA rows, MHA's odd widths, MLA's rows with the values inside, LRKV's [k | v] rows, the
    latent kind's shared values (items are shares of the heads there)."""
    dtype = DTYPES[dtype]
    q, k, v = _isa_cache(layout, 4100, dtype, seed=3)
    out = native.native_decode_attention([q], [(k, v)], 1 / math.sqrt(q.shape[-1]), native.isa_kernel(dtype, isa))
    torch.testing.assert_close(out.float(), reference_attention(q.float(), k.float(), v.float()), **_tolerance(dtype))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_key_splits_cross_segment_boundaries_under_one_softmax(isa, dtype, many_threads):
    """KVM's regions: four segments with their own queries; the ranges start and end inside and
    between segments, and one range holds parts of three."""
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(7)
    lengths = (1500, 37, 2600, 64)
    segments = [(torch.randn(1, 1, n, 64, generator=gen).to(dtype), torch.randn(1, 1, n, 64, generator=gen).to(dtype)) for n in lengths]
    q = torch.randn(1, 4, 1, 64, generator=gen)
    queries = [(q * (0.5 + torch.rand(4, generator=gen)).view(1, -1, 1, 1)).to(dtype) for _ in lengths]
    out = native.native_decode_attention(queries, segments, 0.125, native.isa_kernel(dtype, isa))
    logits = torch.cat([qi.float() @ k.float().expand(1, 4, -1, -1).transpose(-1, -2) for qi, (k, _) in zip(queries, segments)], dim=-1) * 0.125
    expected = logits.softmax(-1) @ torch.cat([v.float().expand(1, 4, -1, -1) for _, v in segments], dim=2)
    torch.testing.assert_close(out.float(), expected, **_tolerance(dtype))


@needs_kernel
def test_a_split_call_sums_in_another_order_than_one_thread(monkeypatch):
    """The split path really runs (its merge adds the ranges in another order, so float32 bits move),
    and below two ranges' worth of keys it does not (the same bits as one thread)."""
    q, k, v = _isa_cache("mqa64", 4100, torch.float32, seed=1)
    short = (k[:, :, :2000], v[:, :, :2000])
    one = native.native_decode_attention([q], [(k, v)], 0.125, native.decode_kernel())
    one_short = native.native_decode_attention([q], [short], 0.125, native.decode_kernel())
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        split = native.native_decode_attention([q], [(k, v)], 0.125, native.decode_kernel())
        unsplit_short = native.native_decode_attention([q], [short], 0.125, native.decode_kernel())
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(one, split)
    torch.testing.assert_close(split, one, rtol=1e-5, atol=2e-6)
    assert torch.equal(one_short, unsplit_short)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_items_the_threads_do_not_divide_are_split_to_share_out_evenly(isa, dtype, threads, monkeypatch):
    """SmolLM2's layout, 3 KV heads of one sequence, on 2, 3 and 4 threads: on 2 each head's keys are cut in
    2 ranges (6 jobs, 3 a thread, where one thread once took two heads and the other one), on 4 in 4 (12
    jobs); on 3 the heads share out as they are. Against the reference, and the split really ran (float32
    bits move) exactly where the threads do not divide the heads."""
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 9, 1, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, 3, 4100, 64, generator=gen).to(dtype) for _ in range(2))
    library = native.isa_kernel(dtype, isa)
    one = native.native_decode_attention([q], [(k, v)], 0.125, library)
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native.native_decode_attention([q], [(k, v)], 0.125, library)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.float(), reference_attention(q.float(), k.float(), v.float(), scale=0.125), **_tolerance(dtype))
    if dtype == torch.float32:
        assert torch.equal(out, one) == (threads == 3)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["mqa32x8", "gqa64x3", "odd48"])
@pytest.mark.parametrize("storage", ["int4", "int8:group=8,residual=0", "int4:group=16,residual=5"])
def test_quantized_key_splits_match_the_reference(isa, dtype, layout, storage, many_threads):
    """The quantized entry (codes read in place) splits keys too: 4,100 keys of int4/int8 codes and a
    full-precision residual window, ranges cut inside the codes and across into the window."""
    from tests.ops.test_native_quantized import _expected, _filled
    from tests.ops.test_native_quantized import _tolerance as quantized_tolerance

    dtype = DTYPES[dtype]
    q, kb, vb = _filled(layout, storage, 4100, dtype, seed=5, batch=1)
    segments = buffer_segments(kb, vb)
    out = native.native_stored_attention(q, segments, 1 / math.sqrt(q.shape[-1]), native.isa_kernel(dtype, isa))
    torch.testing.assert_close(out.float(), _expected(q, segments), **quantized_tolerance(dtype))


@needs_kernel
def test_a_split_quantized_call_sums_in_another_order_than_one_thread(monkeypatch):
    """The quantized entry's split path really runs (float32 bits move), and not below two ranges of keys."""
    from tests.ops.test_native_quantized import _filled

    q, kb, vb = _filled("mqa32x8", "int4", 4100, torch.float32, seed=2, batch=1)
    q_short, kb_short, vb_short = _filled("mqa32x8", "int4", 2000, torch.float32, seed=2, batch=1)
    calls = [(q, buffer_segments(kb, vb)), (q_short, buffer_segments(kb_short, vb_short))]
    one = [native.native_stored_attention(qi, seg, 0.125, native.decode_kernel()) for qi, seg in calls]
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        split, unsplit_short = (native.native_stored_attention(qi, seg, 0.125, native.decode_kernel()) for qi, seg in calls)
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(one[0], split)
    torch.testing.assert_close(split, one[0], rtol=1e-5, atol=2e-6)
    assert torch.equal(one[1], unsplit_short)


@needs_kernel
def test_the_threads_serve_many_calls_of_changing_thread_counts(monkeypatch):
    """The threads torch keeps (csrc/threads.h): 300 calls alternating 2, 3 and 4 threads, split and not, each
    close to its one-thread result (a thread reading another call's jobs would differ, a lost one would hang)."""
    gen = torch.Generator().manual_seed(5)
    calls = [(torch.randn(1, 9, 1, 64, generator=gen), *(torch.randn(1, 3, n, 64, generator=gen) for _ in range(2))) for n in (300, 2100, 4100)]
    library = native.decode_kernel()
    one = [native.native_decode_attention([q], [(k, v)], 0.125, library) for q, k, v in calls]
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    before = torch.get_num_threads()
    try:
        for i in range(300):
            torch.set_num_threads(2 + i % 3)
            q, k, v = calls[i % 3]
            out = native.native_decode_attention([q], [(k, v)], 0.125, library)
            torch.testing.assert_close(out, one[i % 3], rtol=1e-5, atol=2e-6)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="os.fork is POSIX-only")
def test_a_forked_child_gets_threaded_calls_done(monkeypatch):
    """After the parent's threads have run a call, a forked child (which has none of them) still gets threaded
    calls done: it exits 0 within the timeout instead of waiting on threads that do not exist there."""
    import os
    import signal

    q = torch.randn(1, 9, 1, 64)
    k, v = torch.randn(1, 3, 4100, 64), torch.randn(1, 3, 4100, 64)
    library = native.decode_kernel()
    monkeypatch.setattr(native, "ATTENTION_PARALLEL_MIN_FLOPS", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = native.native_decode_attention([q], [(k, v)], 0.125, library)  # the parent's threads run once
        assert native.kernel_threading() == "torch's OpenMP team"
        pid = os.fork()
        if pid == 0:  # the child: one threaded call, then leave without running the parent's cleanup
            signal.alarm(60)
            ok = torch.allclose(native.native_decode_attention([q], [(k, v)], 0.125, library), expected)
            ok = ok and native.kernel_threading().startswith("started per call (a child forked")
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(before)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with status {status}"
