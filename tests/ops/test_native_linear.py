"""The native kernel's one-row linear layer (slimkv/ops/csrc/decode_linear.h) against
torch.nn.functional.linear, and ``slimkv.ops.linear.Linear``, which decode steps go through."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from slimkv.ops import linear as linear_ops
from slimkv.ops import native, native_build, native_rows
from slimkv.ops.linear import Linear, linear
from slimkv.ops.rope import Rotary
from tests.ops.kernel_markers import ISAS, LIBRARY, RULE_SIDES, needs_kernel, rule_kernel

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
@pytest.mark.parametrize("out_f,in_f", [(576, 576), (1539, 576), (3, 17), (7, 1536), (64, 1), (5, 50), (9, 110)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_isa_path_matches_torch(isa, dtype, out_f, in_f, bias):
    """Every path this CPU can run x float32/bfloat16 x widths (rows not a multiple of the 4 read together;
    odd inputs, which bfloat16 reads one element at a time; inputs with tails after the last whole
    step of 128 or 32 elements, which the AVX512-BF16 loop reads in steps of both) x bias."""
    dtype = DTYPES[dtype]
    x, w, b = _layer(out_f, in_f, dtype, bias)
    assert native_rows.supports_linear(x, w, b)
    out = native_rows.native_linear(x, w, b, native.isa_kernel(dtype, isa))
    assert out.dtype == dtype and out.shape == (1, 1, out_f)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), None if b is None else b.float()), **_tolerance(dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side", RULE_SIDES)
def test_either_linear_prefetch_rule_matches_torch(dtype, side):
    """The weights' software prefetch (LINEAR_PREFETCH_BYTES, chosen per CPU at build time): this
    CPU's rule and the other one (``rule_kernel``): torch's answer, and the rule said."""
    dtype = DTYPES[dtype]
    library = rule_kernel(dtype, side)
    assert {native_build.library_linear_prefetch(rule_kernel(dtype, s)) for s in RULE_SIDES} == {"2048 bytes ahead", "none"}
    x, w, b = _layer(1539, 576, dtype, True, seed=len(side))
    torch.testing.assert_close(native_rows.native_linear(x, w, b, library).float(), F.linear(x.float(), w.float(), b.float()), **_tolerance(dtype))


@needs_kernel
def test_threads_split_the_rows_without_changing_the_result(monkeypatch):
    x, w, b = _layer(1030, 300, torch.float32, True)
    one = native_rows.native_linear(x, w, b, LIBRARY)
    monkeypatch.setattr(native_rows, "PARALLEL_MIN_BYTES", 0)
    torch.set_num_threads(2)
    try:
        two = native_rows.native_linear(x, w, b, LIBRARY)
    finally:
        torch.set_num_threads(1)
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_calls_the_kernel_does_not_take_go_to_torch():
    x, w, b = _layer(32, 16, torch.float32, True)
    assert not native_rows.supports_linear(x.repeat(1, 2, 1), w, b)  # two rows: prefill, a batch
    assert not native_rows.supports_linear(x.double(), w.double(), b.double())
    assert not native_rows.supports_linear(x, w.t().contiguous().t(), b)  # weight rows not contiguous
    assert not native_rows.supports_linear(x, w, b.bfloat16())
    with torch.enable_grad():
        assert not native_rows.supports_linear(x, w.clone().requires_grad_(), b)
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
    original = native_rows.native_linear
    monkeypatch.setattr(linear_ops, "native_linear", lambda *a: calls.append(1) or original(*a))
    x = torch.randn(1, 1, 48).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
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


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_several_projections_of_one_row_match_each_layer(isa, dtype, bias):
    """``native_project``: q, k, v (or gate, up) of one row in one call, each as F.linear, outputs one after the other."""
    dtype = DTYPES[dtype]
    x, _, _ = _layer(1, 96, dtype, False)
    layers = [_layer(out_f, 96, dtype, bias, seed=s)[1:] for s, out_f in enumerate((96, 33, 33))]
    outs = native_rows.native_project(x, [w for w, _ in layers], [b for _, b in layers], native.isa_kernel(dtype, isa))
    assert [o.shape for o in outs] == [(1, 1, 96), (1, 1, 33), (1, 1, 33)] and all(o.dtype == dtype for o in outs)
    for out, (w, b) in zip(outs, layers):
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), None if b is None else b.float()), **_tolerance(dtype))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_down_projection_matches_silu_times_up(isa, dtype):
    """silu(gate) * up rounded to the row's dtype as torch rounds it, then the down projection."""
    dtype = DTYPES[dtype]
    gate, w, b = _layer(40, 300, dtype, True)
    up = torch.randn(1, 1, 300).to(dtype)
    (out,) = native_rows.native_project(up, [w], [b], native.isa_kernel(dtype, isa), gate=gate)
    assert out.dtype == dtype
    row = F.silu(gate) * up  # in dtype: each rounded
    torch.testing.assert_close(out.float(), F.linear(row.float(), w.float(), b.float()), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_project_and_glu_linear_give_each_layers_answer(dtype):
    """The ops every decode step's attention and MLP go through: one row natively, several rows (prefill) through torch, the same numbers."""
    dtype = DTYPES[dtype]
    torch.manual_seed(0)
    layers = [Linear(64, n, bias=False).to(dtype) for n in (64, 16, 16)]
    for rows in (1, 5):
        x = torch.randn(1, rows, 64).to(dtype)
        with torch.no_grad():
            outs = linear_ops.project(x, layers)
            for out, layer in zip(outs, layers):
                torch.testing.assert_close(out.float(), F.linear(x, layer.weight).float(), **_tolerance(dtype))
            down = Linear(64, 8, bias=False).to(dtype)
            gate, up = outs[0], torch.randn_like(outs[0])
            torch.testing.assert_close(linear_ops.glu_linear(gate, up, down).float(), F.linear(F.silu(gate) * up, down.weight).float(),
                                       **_tolerance(dtype))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_one_row_matches_torch(isa, dtype):
    dtype = DTYPES[dtype]
    x, _, _ = _layer(1, 577, dtype, False)
    weight = torch.randn(577).to(dtype)
    assert native_rows.supports_norm(x, weight)
    out = native_rows.native_rms_norm(x, weight, 1e-5, native.isa_kernel(dtype, isa))
    want = F.rms_norm(x.float(), (577,), weight.float(), 1e-5).to(dtype)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), want.float(), **({"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-2}))
    assert not native_rows.supports_norm(x.repeat(1, 2, 1), weight) and not native_rows.supports_norm(x, weight[:-1])
    if dtype == torch.bfloat16:  # a row of another dtype takes torch's path
        assert not native_rows.supports_norm(x.float(), weight)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["full", "partial"])
def test_rotation_of_one_token_matches_the_pair_formula(isa, dtype, mode):
    """``native_rotate`` (a decode step's RoPE) against the formula written out: pairs (e, o) of the
    first rot_dim channels -> (e cos - o sin, e sin + o cos) in float32, rounded once; the rest copied."""
    dtype = DTYPES[dtype]
    rotary = Rotary(64, mode, fraction=0.25)
    x = torch.randn(1, 1, 9, 64).to(dtype)
    start = 1234
    rotation = rotary.rotation(start, 1, x.device, torch.float32)
    assert native_rows.supports_rotation(x)
    out = native_rows.native_rotate(x, rotation, rotary.rot_dim, native.isa_kernel(dtype, isa))
    cos, sin = rotary.angles(start, 1, x.device, torch.float32)
    e, o = x[..., 0 : rotary.rot_dim : 2].float(), x[..., 1 : rotary.rot_dim : 2].float()
    want = x.float().clone()
    want[..., 0 : rotary.rot_dim : 2], want[..., 1 : rotary.rot_dim : 2] = e * cos - o * sin, e * sin + o * cos
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), want.to(dtype).float(), **_tolerance(dtype))
    assert torch.equal(out[..., rotary.rot_dim :], x[..., rotary.rot_dim :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_takes_the_native_call_for_one_token_and_torch_for_more(dtype):
    """``Rotary`` gives a token the same rotation alone (a decode step, native where the kernel is) as
    inside a prefill (torch's complex product)."""
    dtype = DTYPES[dtype]
    rotary = Rotary(64, "full")
    x = torch.randn(1, 5, 4, 64).to(dtype)
    together = rotary(x, 100)
    alone = torch.cat([rotary(x[:, t : t + 1].contiguous(), 100 + t) for t in range(5)], dim=1)
    torch.testing.assert_close(alone.float(), together.float(), **_tolerance(dtype))


@needs_kernel
def test_rotation_refuses_a_rotation_of_the_wrong_size():
    rotary = Rotary(64, "full")
    with pytest.raises(ValueError, match="rotation must be 32 contiguous complex64 values, got 64"):
        native_rows.native_rotate(torch.randn(1, 1, 4, 64), rotary.rotation(0, 2, torch.device("cpu"), torch.float32), 64, LIBRARY)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_block_of_one_row_matches_its_modules(isa, dtype):
    """``native_swiglu_residual`` (norm, gate and up, SwiGLU, down, the sum in one call) against the
    same steps through torch in the row's dtype (the plain path ``MLP.residual`` composes); a decode
    step runs without autograd."""
    dtype = DTYPES[dtype]
    torch.manual_seed(0)
    d_model, d_ff = 160, 300
    with torch.no_grad():
        x = torch.randn(1, 1, d_model).to(dtype)
        norm_weight = (1 + 0.1 * torch.randn(d_model)).to(dtype)
        gate, up, down = (Linear(i, o, bias=False).to(dtype) for i, o in ((d_model, d_ff), (d_model, d_ff), (d_ff, d_model)))
        assert native_rows.supports_swiglu_residual(x, norm_weight, gate.weight, up.weight, down.weight)
        out = native_rows.native_swiglu_residual(x, norm_weight, 1e-5, gate.weight, up.weight, down.weight, native.isa_kernel(dtype, isa))
        n = F.rms_norm(x.float(), (d_model,), norm_weight.float(), 1e-5).to(dtype)
        want = x + F.linear(F.silu(F.linear(n, gate.weight)) * F.linear(n, up.weight), down.weight)
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out.float(), want.float(), **_tolerance(dtype))
        assert linear_ops.swiglu_residual(x, norm_weight, 1e-5, gate, up, down) is not None
        assert linear_ops.swiglu_residual(x.repeat(1, 2, 1), norm_weight, 1e-5, gate, up, down) is None  # several rows: torch's path
        assert not native_rows.supports_swiglu_residual(x, norm_weight, gate.weight, up.weight, down.weight.t())
    assert not native_rows.supports_swiglu_residual(x, norm_weight, gate.weight, up.weight, down.weight)  # training keeps torch's path


HEADS_CASES = {  # x's shape (..., matrices, rows per matrix, in), out: MLA's per-head products, LRKV's per-group ones, chunk tails
    "mla-absorb": ((2, 9, 1, 64), 160),
    "mla-expand": ((1, 9, 1, 160), 64),
    "lrkv-groups": ((1, 3, 3, 40), 16),
    "odd": ((2, 3, 2, 17), 33),
    "one-out": ((1, 4, 1, 5), 1),
}


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", HEADS_CASES)
@pytest.mark.parametrize("layout", [1, 0])
def test_per_head_products_match_torch_matmul(isa, dtype, case, layout):
    """``native_heads_matmul`` on every path this CPU runs, both weight layouts (w contiguous, or the
    transposed view of contiguous (matrices, out, in) weights), against torch's float32 product."""
    dtype = DTYPES[dtype]
    shape, out_f = HEADS_CASES[case]
    gen = torch.Generator().manual_seed(len(case) + layout)
    x = torch.randn(*shape, generator=gen).to(dtype)
    w = torch.randn(shape[-3], shape[-1], out_f, generator=gen).to(dtype)
    if layout == 0:
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert native_rows.heads_layout(x, w) == (1 if out_f == 1 else layout)  # one output: both layouts are the same memory
    out = native_rows.native_heads_matmul(x, w, native_rows.heads_layout(x, w), native.isa_kernel(dtype, isa))
    assert out.dtype == dtype and out.shape == (*shape[:-1], out_f)
    torch.testing.assert_close(out.float(), torch.matmul(x.float(), w.float()), **_tolerance(dtype))


@needs_kernel
def test_heads_matmul_takes_decode_steps_and_leaves_the_rest_to_torch(monkeypatch):
    """``heads_matmul``: a decode step's rows in one native call; strided rows (a slice of the
    queries) read in place; prefill-sized calls, autograd, another weight layout and a FLOP counter go to torch."""
    x = torch.randn(1, 9, 1, 80).bfloat16()[..., 16:]  # queries' content channels: a strided slice
    w = torch.randn(9, 64, 32).bfloat16()
    calls = []
    monkeypatch.setattr(linear_ops, "native_heads_matmul", lambda *a: calls.append(a) or native_rows.native_heads_matmul(*a))
    torch.testing.assert_close(linear_ops.heads_matmul(x, w).float(), torch.matmul(x.float(), w.float()), **_tolerance(torch.bfloat16))
    assert len(calls) == 1
    assert native_rows.heads_layout(torch.randn(1, 9, 40, 64), w) is None  # 360 rows: a prefill chunk
    assert native_rows.heads_layout(x, w[:, :, :16]) is None  # neither layout
    assert native_rows.heads_layout(x, w.requires_grad_()) is None
    with FlopCounterMode(display=False) as counter:
        linear_ops.heads_matmul(x, w.detach())
    assert counter.get_total_flops() == 2 * 9 * 64 * 32 and len(calls) == 1
    x32, w32 = x.float(), w.detach().float()  # float32: torch's product, the faster one there
    torch.testing.assert_close(linear_ops.heads_matmul(x32, w32), torch.matmul(x32, w32))
    assert len(calls) == 1
