"""The native kernel's one-row linear layer (slimkv/ops/csrc/decode_linear.h) against
torch.nn.functional.linear, and ``slimkv.ops.linear.Linear``, which decode steps go through."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from slimkv.ops import linear as linear_ops
from slimkv.ops import native
from slimkv.ops.linear import Linear, linear

LIBRARY = native.decode_kernel()
needs_kernel = pytest.mark.skipif(LIBRARY is None, reason="no C compiler on this machine, so there is no native kernel to test: linear layers "
                                  "take torch's path, which every model test still checks")
ISAS = native.runnable_isas() if LIBRARY is not None else []
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _layer(out_f, in_f, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen).to(dtype)
    b = torch.randn(out_f, generator=gen).to(dtype) if bias else None
    return torch.randn(1, 1, in_f, generator=gen).to(dtype), w, b


def _tolerance(dtype):
    """float32: summation order; bfloat16: the output's one rounding."""
    return {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-2}


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f", [(576, 576), (1539, 576), (3, 17), (7, 1536), (64, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_isa_path_matches_torch(isa, dtype, out_f, in_f, bias):
    """Every path this CPU can run x float32/bfloat16 x widths (rows not a multiple of the 4 read together, odd inputs) x bias."""
    dtype = DTYPES[dtype]
    x, w, b = _layer(out_f, in_f, dtype, bias)
    assert native.supports_linear(x, w, b)
    out = native.native_linear(x, w, b, native.isa_kernel(dtype, isa))
    assert out.dtype == dtype and out.shape == (1, 1, out_f)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), None if b is None else b.float()), **_tolerance(dtype))


@needs_kernel
def test_threads_split_the_rows_without_changing_the_result(monkeypatch):
    x, w, b = _layer(1030, 300, torch.float32, True)
    one = native.native_linear(x, w, b, LIBRARY)
    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)
    torch.set_num_threads(2)
    try:
        two = native.native_linear(x, w, b, LIBRARY)
    finally:
        torch.set_num_threads(1)
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_calls_the_kernel_does_not_take_go_to_torch():
    x, w, b = _layer(32, 16, torch.float32, True)
    assert not native.supports_linear(x.repeat(1, 2, 1), w, b)  # two rows: prefill, a batch
    assert not native.supports_linear(x.double(), w.double(), b.double())
    assert not native.supports_linear(x, w.t().contiguous().t(), b)  # weight rows not contiguous
    assert not native.supports_linear(x, w, b.bfloat16())
    with torch.enable_grad():
        assert not native.supports_linear(x, w.clone().requires_grad_(), b)
    with FlopCounterMode(display=False) as counter:  # a FLOP counter sees a decode step's projections
        linear(x, w, b)
    assert counter.get_total_flops() == 2 * 32 * 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_nn_linear_with_the_same_answer(dtype, monkeypatch):
    dtype = DTYPES[dtype]
    torch.manual_seed(0)
    layer = Linear(48, 20).to(dtype)
    assert isinstance(layer, nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    calls = []
    original = native.native_linear
    monkeypatch.setattr(linear_ops, "native_linear", lambda *a: calls.append(1) or original(*a))
    x = torch.randn(1, 1, 48).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: small weights take the kernel (with more, torch's thread pool)
    try:
        with torch.no_grad():
            got, many = layer(x), layer(x.repeat(1, 3, 1))
    finally:
        torch.set_num_threads(threads)
    assert calls == ([1] if LIBRARY is not None else [])  # the one-row call only
    torch.testing.assert_close(got.float(), F.linear(x, layer.weight, layer.bias).float(), **_tolerance(dtype))
    torch.testing.assert_close(many.float(), F.linear(x.repeat(1, 3, 1), layer.weight, layer.bias).float(), rtol=0, atol=0)
    y = layer(x.float().to(dtype).requires_grad_()) if dtype == torch.float32 else None
    if y is not None:  # training keeps torch's differentiable path
        y.sum().backward()
        assert layer.weight.grad is not None
