"""Quantized cache storage (slimkv.ops.quantize): the reference codes, the buffer against it, the
byte counts, and the option grammar."""

from __future__ import annotations

import pytest
import torch

from slimkv.ops.codes import dequantize_groups, quantize_groups
from slimkv.ops.quantize import FULL, KVStorage, QuantizedBuffer, parse_storage


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [64, 37, 288])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_codes_are_within_half_a_step(bits, dim, scale_dtype):
    torch.manual_seed(dim)
    x = torch.randn(2, 3, 9, dim) * 3 + 1
    codes, scale, low = quantize_groups(x, bits, 32, scale_dtype)
    groups = -(-dim // 32)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == groups * 32 * bits // 8 and scale.shape[-1] == groups
    back = dequantize_groups(codes, scale, low, bits, dim, torch.float32)
    step = scale.float().repeat_interleave(32, dim=-1)[..., :dim]
    assert float(((back - x).abs() / step).max()) <= 0.5 + 1e-4
    constant = dequantize_groups(*quantize_groups(torch.full((1, 1, 2, dim), 0.75), bits, 32, scale_dtype), bits, dim, torch.float32)
    assert torch.equal(constant, torch.full_like(constant, 0.75))  # a zero range stores its value exactly


@pytest.mark.parametrize("spec", ["int4:group=8,residual=3,block=1", "int8:group=16,residual=0,block=1", "int4:group=8,residual=3,block=4",
                                  "int8:group=16,residual=0,block=5"])
def test_buffer_matches_the_reference_whatever_the_calls(spec):
    """Rows past the newest ``residual`` are codes, whole blocks of ``block`` at a time (block=1: each row as it leaves)."""
    storage = parse_storage(spec)
    torch.manual_seed(0)
    rows = torch.randn(1, 2, 23, 40)
    for sizes in ([23], [1] * 23, [5, 1, 7, 10]):
        buffer = storage.buffer(1, 2, 40, dtype=torch.float32, device="cpu")
        start = 0
        for n in sizes:
            out = buffer.append(rows[:, :, start:start + n])
            start += n
            old = max(0, start - storage.residual)
            old -= old % storage.block
            expected = torch.cat((dequantize_groups(*quantize_groups(rows[:, :, :old], storage.bits, storage.group, torch.float32),
                                                    storage.bits, 40, torch.float32), rows[:, :, old:start]), dim=2)
            assert torch.equal(out, expected)
            assert buffer.quantized_len() == old
            assert buffer.nbytes() == 2 * (old * storage.row_bytes(40, torch.float32) + (start - old) * 40 * 4)


def test_buffer_mark_restore_and_keep_last():
    buffer = QuantizedBuffer(1, 1, 8, KVStorage(bits=8, group=4, residual=2, block=1), dtype=torch.float32, device="cpu")
    rows = torch.randn(1, 1, 6, 8)
    buffer.append(rows)
    before = buffer.view().clone()
    mark = buffer.mark()
    buffer.append(torch.randn(1, 1, 3, 8))
    buffer.keep_last(1)
    buffer.restore(mark)
    assert torch.equal(buffer.view(), before)
    buffer.keep_last(3)  # one quantized row and the two residual rows
    assert len(buffer) == 3 and buffer.quantized_len() == 1 and torch.equal(buffer.view(), before[:, :, -3:])
    buffer.keep_last(1)
    assert len(buffer) == 1 and torch.equal(buffer.view(), rows[:, :, -1:])


def test_storage_grammar():
    assert parse_storage(None) is FULL and parse_storage("full") is FULL
    assert parse_storage("int4") == KVStorage(bits=4, group=32, residual=128)
    assert parse_storage("int8:group=64,residual=0") == KVStorage(bits=8, group=64, residual=0)
    assert parse_storage(parse_storage("int4").name) == parse_storage("int4")
    assert KVStorage(bits=4).row_bytes(64, torch.bfloat16) == 40  # 32 code bytes + 2 groups x (scale, minimum) x 2 bytes: 0.3125 of 128
    for bad, words in [("int3", "full, int8, int4"), ("int4:size=3", "allowed: group, residual"), ("int4:group=5", "even"),
                       ("full:group=2", "no settings"), ("int8:residual=-1", "residual"), ("int8:group=1", "group")]:
        with pytest.raises(ValueError, match=words):
            parse_storage(bad, "--cache-storage")


@pytest.mark.parametrize("spec", ["int4:group=8,residual=3,block=1", "full"])
def test_spans_name_what_the_segments_view(spec):
    """A buffer's spans (what a native block step reads: no views) give the fields its segments'
    views give, through growth, trims and a restore that brings back older storage."""
    from slimkv.ops.native import stored_segment_fields

    storage = parse_storage(spec)
    buffer = storage.buffer(1, 2, 16, dtype=torch.float32, device="cpu")
    rows = torch.randn(1, 2, 200, 16)
    mark = None
    for start, n in ((0, 5), (5, 1), (6, 70), (76, 3), (79, 100)):  # the 76th row outgrows the first storage
        buffer.store(rows[:, :, start:start + n])
        if start == 6:
            mark = buffer.mark()
        if start == 79:
            buffer.keep_last(40)
        spans, segments = buffer.spans(), buffer.segments()
        assert len(spans) == len(segments)
        for span, view in zip(spans, segments):
            assert stored_segment_fields(0, span, span) == stored_segment_fields(0, view, view)
    buffer.restore(mark)
    assert [stored_segment_fields(0, s, s) for s in buffer.spans()] == [stored_segment_fields(0, v, v) for v in buffer.segments()]
