"""Reliability of the attention kernels: KVM and MLA caches with autograd on, KVM calls that fail
midway, KVM's gated appends and routing ties (optimised path == token-by-token reference), and
memory-bounded long attention (no T x T tensor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slimkv.attention import build_attention
from slimkv.common.buffer import GrowableBuffer
from slimkv.ops import attention as attention_ops
from slimkv.ops.attention import attend, blocked_attention, causal_attention, reference_attention
from slimkv.ops.kvm import (
    KVMParams,
    KVMSettings,
    KVMState,
    Rows,
    fold_chunk,
    kvm_step,
    kvm_step_reference,
)
from slimkv.ops.kvm.core import least_novel, prepare_keys, route, routing_scores
from tests.helpers import D_MODEL, HEAD_DIM, N_HEADS, rel_rmse

ROOT = Path(__file__).resolve().parents[2]
SMALL_KVM = {"chunk_size": 4, "schedule": "sqrt", "sqrt_coef": 2.0, "min_rows": 1}  # appends and merges from token 12 on


def perturbed(kind: str, dtype=torch.float32, seed: int = 0, d_model: int = D_MODEL, n_heads: int = N_HEADS, head_dim=HEAD_DIM, **options):
    torch.manual_seed(seed)
    attn = build_attention(kind, d_model, n_heads, head_dim, **options).to(dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return attn


def cache_tensors(cache) -> list[torch.Tensor]:
    return [t.view() if isinstance(t, GrowableBuffer) else t for t in cache.tensors()]


# ---------------------------------------------------------------- 1. caches with autograd on


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_kvm_prefill_shorter_than_a_chunk_then_decode_with_grad(backend):
    """The reported failure: a cached prefill shorter than chunk_size, then a decode step, grad on."""
    torch.manual_seed(0)
    attn = build_attention("kvm", 64, 4, backend=backend)
    x = torch.randn(1, 100, 64)
    cache = attn.new_cache(1)
    y1 = attn(x[:, :90], cache=cache)
    y2 = attn(x[:, 90:91], cache=cache)
    y3 = attn(x[:, 91:], cache=cache)
    assert cache.seq_len == 100 and not any(t.requires_grad for t in cache_tensors(cache))
    with torch.no_grad():
        assert torch.allclose(torch.cat((y1, y2, y3), 1), attn(x), atol=1e-5)


@pytest.mark.parametrize("kind, options", [("kvm", SMALL_KVM), ("kvm", {**SMALL_KVM, "n_kv_heads": 2, "gate_appends": True}), ("mla", {"kv_rank": 6})])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_cached_calls_are_differentiable_in_their_own_tokens(kind, options, backend):
    """With grad on, each cached call's output backpropagates on its own (before or after later
    calls), the cache holds no graph, and the gradient of a call's outputs with respect to its own
    tokens is the uncached forward's (earlier tokens are constants in both)."""
    attn = perturbed(kind, torch.float64, backend=backend, **options)
    x = torch.randn(2, 30, D_MODEL, dtype=torch.float64)
    full_x = x.clone().requires_grad_(True)
    full = attn(full_x)
    cache = attn.new_cache(2, dtype=torch.float64)
    outs, start = [], 0
    for i, n in enumerate([13, 1, 5, 1, 10]):  # crosses the window (8 tokens) and several folds
        piece = x[:, start : start + n].clone().requires_grad_(True)
        out = attn(piece, cache=cache)
        assert not any(t.requires_grad for t in cache_tensors(cache))
        weight = torch.randn_like(out)
        (grad_call,) = torch.autograd.grad((out * weight).sum(), piece, retain_graph=True)
        (grad_full,) = torch.autograd.grad((full[:, start : start + n] * weight).sum(), full_x, retain_graph=True)
        assert rel_rmse(grad_call, grad_full[:, start : start + n]) < 1e-10
        assert not grad_full[:, start + n :].any()  # causality: later tokens play no part
        outs.append(out)
        start += n
        if i == 1:
            outs[0].square().sum().backward()  # an earlier call's backward, before later calls run
    for out in outs[1:]:
        out.square().sum().backward()  # ... and after later calls
    with torch.no_grad():
        assert rel_rmse(torch.cat(outs, 1), full) < 1e-10


@pytest.mark.parametrize(
    "kind, options",
    [("mha", {}), ("gqa", {"n_kv_heads": 2}), ("mqa", {}), ("swa", {"window": 5}), ("mla", {"kv_rank": 6}), ("lrkv", {"rank": 3}), ("kvm", SMALL_KVM)],
)
def test_every_kind_prefills_then_decodes_with_grad_on(kind, options):
    attn = perturbed(kind, **options)
    x = torch.randn(2, 20, D_MODEL)
    cache = attn.new_cache(2)
    outs = [attn(x[:, :11], cache=cache)] + [attn(x[:, t : t + 1], cache=cache) for t in range(11, 20)]
    with torch.no_grad():
        assert rel_rmse(torch.cat(outs, 1), attn(x)) < 1e-5


class FlakySchedule:
    """A schedule that raises once, at the first fold at or after ``ctx`` (a failure in the middle
    of a call, after the window was appended to)."""

    __name__ = "flaky"

    def __init__(self, ctx: int) -> None:
        self.ctx, self.raised = ctx, False

    def __call__(self, ctx: int) -> int:
        if ctx >= self.ctx and not self.raised:
            self.raised = True
            raise RuntimeError("schedule failed")
        return ctx // 2


def kvm_state_snapshot(state: KVMState) -> list[torch.Tensor]:
    return [t.clone() for t in cache_tensors(state)] + [torch.tensor(state.seq_len)]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_a_failed_kvm_call_leaves_the_cache_as_it_was(grad, backend):
    x = torch.randn(2, 40, D_MODEL, dtype=torch.float64)
    plain = perturbed("kvm", torch.float64, chunk_size=4, schedule=FlakySchedule(10**9), backend=backend)
    flaky = perturbed("kvm", torch.float64, chunk_size=4, schedule=FlakySchedule(20), backend=backend)
    with torch.no_grad():
        expected = plain(x)
    cache = flaky.new_cache(2, dtype=torch.float64)
    outs = []
    with torch.set_grad_enabled(grad):
        outs.append(flaky(x[:, :14], cache=cache))
        before, nbytes = kvm_state_snapshot(cache.state), cache.nbytes()
        with pytest.raises(RuntimeError, match="schedule failed"):
            flaky(x[:, 14:30], cache=cache)  # the fold at position 20 raises
        after = kvm_state_snapshot(cache.state)
        assert cache.seq_len == cache.state.seq_len == 14 and cache.nbytes() == nbytes
        assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        outs.append(flaky(x[:, 14:30], cache=cache))  # the retry works (no "different settings" error)
        outs.append(flaky(x[:, 30:], cache=cache))
    assert rel_rmse(torch.cat(outs, 1).detach(), expected) < 1e-10


# ---------------------------------------------------------------- 2. gate_appends: rho = ||g v||


def kvm_problem(t=45, b=2, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    gate = 1.0 + F.elu(torch.randn(b, hkv, t, generator=g, dtype=dtype))
    tau = 1.0 + 0.3 * torch.randn(2, hq, generator=g, dtype=dtype)
    params = KVMParams(1.0 + 0.2 * torch.randn(d, generator=g, dtype=dtype), 0.2 * torch.randn(d, generator=g, dtype=dtype), tau[0], tau[1])
    return q, k, v, gate, params


def run_state(step, q, k, v, gate, params, settings, sizes):
    state = KVMState(k.shape[0], k.shape[1], k.shape[-1], dtype=k.dtype, device=k.device, gated=gate is not None)
    outs, t = [], 0
    for n in sizes:
        s = slice(t, t + n)
        outs.append(step(q[:, :, s], k[:, :, s], v[:, :, s], gate[:, :, s] if gate is not None else None, params, settings, state))
        t += n
    return torch.cat(outs, 2), state


def test_gate_appends_radius_is_the_norm_of_the_gated_value_in_both_paths():
    settings = KVMSettings(chunk_size=4, schedule="sqrt", sqrt_coef=3.0, min_rows=1, gate_appends=True, rot_dim=2)
    q, k, v, gate, params = kvm_problem()
    with torch.no_grad():
        fast, fast_state = run_state(kvm_step, q, k, v, gate, params, settings, [45])
        ref, ref_state = run_state(kvm_step_reference, q, k, v, gate, params, settings, [7, 1, 20, 17])
    assert rel_rmse(fast, ref) < 1e-12
    for a, b in zip(fast_state.rows.tensors(), ref_state.rows.tensors()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    # every appended row's radius is g_j ||v_j|| of one token j after the first chunk (first-chunk rows stay ||v_j||)
    radius = fast_state.rows.radius
    for b in range(2):
        for h in range(2):
            gated = gate[b, h, 4:] * v[b, h, 4:].norm(dim=-1)
            assert torch.allclose(radius[b, h, :4], v[b, h, :4].norm(dim=-1), rtol=1e-12)
            for r in radius[b, h, 4:]:
                assert torch.isclose(gated, r, rtol=1e-12).any()


def test_a_gated_append_founds_a_row_of_radius_g_times_norm_v():
    """One fold, one novel token (orthogonal to every row): it is appended with s_v = g v and rho = g ||v||."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    had = torch.kron(torch.kron(h2, h2), h2)[1:]  # zero-mean, mutually orthogonal, LN-invariant keys
    params = KVMParams(None, None)
    settings = KVMSettings(chunk_size=4, schedule="fixed", min_rows=5, gate_appends=True)
    g = torch.Generator().manual_seed(0)
    rows = Rows.build(had[:4][None, None], torch.randn(1, 1, 4, 8, dtype=torch.float64, generator=g), torch.ones(1, 1, 4, dtype=torch.float64), params, "radius")
    tokens = torch.stack([had[1], had[5], had[2], had[3]])[None, None]  # token 1 is the novel one
    values = torch.randn(1, 1, 4, 8, dtype=torch.float64, generator=g)
    gate = torch.tensor([1.0, 2.5, 0.5, 1.5], dtype=torch.float64).view(1, 1, 4, 1)
    new = fold_chunk(rows, tokens, values, gate, 100, params, settings)
    assert new.count == 5
    assert torch.allclose(new.s_v[0, 0, 4], 2.5 * values[0, 0, 1])
    assert torch.allclose(new.radius[0, 0, 4], 2.5 * values[0, 0, 1].norm())
    assert torch.allclose(new.read_v[0, 0, 4], 2.5 * values[0, 0, 1])  # the readout is the gated value itself


# ---------------------------------------------------------------- 3. routing ties


def repeated_token_problem(dtype, routing_dtype, seed=0, vocab=5, d_model=32, n_heads=4, chunk=8, t=120, batch=2, **options):
    """A KVM layer's q, k, v, gates on a sequence of a few repeated tokens: identical prepared keys
    (rotary channels zeroed), hence rows with identical keys and exact score ties."""
    attn = perturbed("kvm", dtype, seed=seed, d_model=d_model, n_heads=n_heads, head_dim=None, chunk_size=chunk, schedule="sqrt",
                     sqrt_coef=2.0, min_rows=4, routing_dtype=routing_dtype, **options)
    table = torch.randn(vocab, d_model, dtype=dtype)
    x = table[torch.randint(0, vocab, (batch, t))]
    with torch.no_grad():
        q, k, v = attn.project_qkv(x, 0)
        return q, k, v, attn.merge_gates(x), attn.kvm_params(), attn.settings


@pytest.mark.parametrize(
    "dtype, routing_dtype, seed, shape",
    [
        (torch.float32, "float32", 0, {}),
        (torch.float64, "float32", 0, {}),
        (torch.float64, "float32", 1, {"vocab": 3, "chunk": 4, "t": 80, "gate_appends": True}),
        (torch.float64, "bfloat16", 1, {"vocab": 16, "n_heads": 8, "t": 100, "batch": 1}),
        (torch.float64, "bfloat16", 5, {"vocab": 16, "chunk": 4, "t": 80, "batch": 1}),
    ],
)
def test_repeated_tokens_route_the_same_in_both_paths(dtype, routing_dtype, seed, shape):
    """Repeated tokens give exact score ties (and near ties once rows sum the same keys in another
    order); the two paths used to break them by rounding (output errors up to 0.01 in float32,
    0.2 with bfloat16 routing, for these cases). (bfloat16 routing of float32 inputs is left out: the paths' LN_s
    outputs differ in the last float32 bit, which can round a key to a different bfloat16 value.)"""
    torch.manual_seed(seed)
    q, k, v, gate, params, settings = repeated_token_problem(dtype, routing_dtype, seed, **shape)
    with torch.no_grad():
        fast, fast_state = run_state(kvm_step, q, k, v, gate, params, settings, [q.shape[2]])
        ref, ref_state = run_state(kvm_step_reference, q, k, v, gate, params, settings, [q.shape[2]])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (fast - ref).abs().max() < 10 * tol
    for a, b in zip(fast_state.rows.tensors(), ref_state.rows.tensors()):
        assert torch.allclose(a, b, rtol=tol, atol=tol)


def test_tie_rules_lowest_row_and_earliest_token_on_exact_ties_only():
    """Ties are exact (up to a few ulps of the score: rounding); anything larger is a real
    difference, and the higher score wins as in the authors' argmax."""
    ulp = torch.finfo(torch.float32).eps * 5.0
    scores = torch.tensor([[[[9.0, 5.0, 5.0, 5.0 - 1e-3, 4.0],  # an exact tie between rows 1 and 2
                             [9.0, 5.0, 5.0 + ulp, 4.0, 4.0],  # one ulp apart: still a tie (rounding)
                             [9.0, 5.0, 5.0 + 1e-4, 4.0, 4.0],  # 1e-4 apart: real, though the old 1024-ulp bound tied it
                             [9.0, 1.0, 2.0, 3.0, 3.0 + 1e-3]]]], dtype=torch.float32)
    assert route(scores, sink_len=1).tolist() == [[[1, 1, 2, 4]]]  # the sink (9.0) is never a target
    novelty = torch.tensor([[[3.0, 1.0 + 1e-4, 2.0, 1.0, 1.0, 0.5]]], dtype=torch.float32)
    assert least_novel(novelty, 3).tolist() == [[[3, 4, 5]]]  # 0.5, then the earliest of the exact 1.0 tie, then the other
    assert least_novel(novelty, 4).tolist() == [[[1, 3, 4, 5]]]


def test_routing_follows_the_argmax_where_the_old_tolerance_tied():
    """A fold whose two candidate rows score 1e-4 apart (more than rounding, less than the
    1024 eps x |key| x |row| tolerance that moved routing away from the authors' rule): the
    higher row takes every token."""
    h = torch.kron(torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), torch.tensor([[1.0, 1.0], [1.0, -1.0]])), torch.tensor([[1.0, 1.0], [1.0, -1.0]]))[1:]
    params = KVMParams(None, None)
    settings = KVMSettings(chunk_size=4, schedule="fixed", min_rows=4, sink_len=1)
    row_keys = torch.stack([h[0], h[1], h[1] + 2e-5 * h[2], h[3]])[None, None]  # rows 1 and 2 nearly equal; row 2 leans to h[2]
    rows = Rows.build(row_keys, torch.randn(1, 1, 4, 8), torch.ones(1, 1, 4), params, "radius")
    tokens = torch.stack([h[1] + h[2]] * 4)[None, None]
    reads = rows.read_k[0, 0]
    prepared = prepare_keys(tokens[0, 0, :1], params, 0)[0]
    gap = float(prepared @ reads[2] - prepared @ reads[1])
    old_tolerance = 1024 * torch.finfo(torch.float32).eps * float(prepared.norm()) * float(reads.norm(dim=-1).max())
    assert 1e-5 < gap < old_tolerance
    values = torch.randn(1, 1, 4, 8)
    new = fold_chunk(rows, tokens, values, None, 100, params, settings)
    assert torch.allclose(new.s_v[0, 0, 2], rows.s_v[0, 0, 2] + values[0, 0].sum(0))  # every token went to row 2
    assert torch.equal(new.s_v[0, 0, 1], rows.s_v[0, 0, 1])
    assert route(routing_scores(prepare_keys(tokens, params, 0), rows.read_k, "float32"), sink_len=1).tolist() == [[[2, 2, 2, 2]]]


# ---------------------------------------------------------------- 4. long attention in bounded memory


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads, widths", [((4, 4), (6, 6)), ((4, 4), (9, 5)), ((4, 1), (9, 7)), ((4, 2), (6, 6))])
@pytest.mark.parametrize("q_len", [37, 20])
def test_blocked_attention_matches_one_block_and_the_reference(window, heads, widths, q_len):
    torch.manual_seed(q_len)
    (hq, hkv), (dk, dv) = heads, widths
    q = torch.randn(2, hq, q_len, dk, dtype=torch.float64)
    k = torch.randn(2, hkv, 37, dk, dtype=torch.float64)
    v = torch.randn(2, hkv, 37, dv, dtype=torch.float64)
    whole = blocked_attention(q, k, v, window=window, scale=0.3, block=q_len)
    ref = reference_attention(q, k, v, window=window, scale=0.3)
    assert rel_rmse(whole, ref) < 1e-12
    for block in (1, 3, 8):
        assert rel_rmse(blocked_attention(q, k, v, window=window, scale=0.3, block=block), ref) < 1e-12


@pytest.mark.parametrize("heads, widths", [((4, 4), (9, 5)), ((4, 4), (5, 9)), ((4, 1), (9, 7)), ((4, 2), (6, 6))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_attention_with_different_widths_matches_the_reference(heads, widths, dtype):
    (hq, hkv), (dk, dv) = heads, widths
    q, k, v = torch.randn(2, hq, 29, dk, dtype=dtype), torch.randn(2, hkv, 29, dk, dtype=dtype), torch.randn(2, hkv, 29, dv, dtype=dtype)
    for scale in (None, 0.3):
        out = causal_attention(q, k, v, scale=scale)
        assert out.shape == (2, hq, 29, dv)
        assert rel_rmse(out, reference_attention(q, k, v, scale=scale)) < {torch.float64: 1e-12, torch.float32: 1e-6}[dtype]


def test_attend_runs_long_masked_calls_in_blocks(monkeypatch):
    """With a tiny score budget every masked call is blocked, and still equals the reference."""
    calls = []
    real = attention_ops.masked_attention
    monkeypatch.setattr(attention_ops, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(attention_ops, "MIN_QUERY_BLOCK", 4)
    monkeypatch.setattr(attention_ops, "masked_attention", lambda q, *a, **kw: calls.append(q.shape[2]) or real(q, *a, **kw))
    torch.manual_seed(0)
    for (hq, hkv), (dk, dv), window, q_len in [((4, 1), (9, 7), None, 15), ((4, 4), (6, 6), 5, 22), ((4, 4), (9, 5), None, 10)]:
        calls.clear()
        q = torch.randn(1, hq, q_len, dk, dtype=torch.float64)
        k, v = torch.randn(1, hkv, 22, dk, dtype=torch.float64), torch.randn(1, hkv, 22, dv, dtype=torch.float64)
        assert rel_rmse(attend(q, k, v, window=window), reference_attention(q, k, v, window=window)) < 1e-12
        assert max(calls) == 4 and sum(calls) == q_len
    # and a whole MLA layer (a cached chunk with context, both paths) agrees with its reference backend
    for path in ("absorbed", "expanded"):
        attn = perturbed("mla", torch.float64, kv_rank=6, decode_path=path)
        ref = perturbed("mla", torch.float64, kv_rank=6, decode_path=path, backend="reference")
        x = torch.randn(2, 30, D_MODEL, dtype=torch.float64)
        with torch.no_grad():
            outs = []
            for layer in (attn, ref):
                cache = layer.new_cache(2, dtype=torch.float64)
                outs.append(torch.cat([layer(x[:, :9], cache=cache), layer(x[:, 9:], cache=cache)], 1))
        assert rel_rmse(outs[0], outs[1]) < 1e-10


MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from slimkv.attention import build_attention
    from slimkv.ops import attention as ops
    from slimkv.ops.attention import attend

    T, H = int(sys.argv[1]), 4
    ops.SCORE_BLOCK_ELEMENTS = 1 << 18  # small query blocks for the masked calls
    torch.manual_seed(0)
    layers = {path: build_attention("mla", 64, H, kv_rank=56, rope_dim=8, decode_path=path) for path in ("auto", "absorbed", "expanded")}
    for path in ("absorbed", "expanded"):
        layers[path].load_state_dict(layers["auto"].state_dict())
    x = torch.randn(1, T, 64)
    q, k = torch.randn(1, H, T, 16), torch.randn(1, H, T, 16)
    with torch.no_grad():
        for layer in layers.values():  # warm up (kernels, thread pools) at a small size
            layer(x[:, :64]); cache = layer.new_cache(1); layer(x[:, :32], cache=cache); layer(x[:, 32:64], cache=cache)
        attend(q[:, :, :64], k[:, :, :64], k[:, :, :64], window=16)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        outs = {"auto": layers["auto"](x), "absorbed": layers["absorbed"](x)}  # causal self-attention, no cache
        for path in ("absorbed", "expanded"):  # a cached prompt in two calls: the second is masked
            cache = layers[path].new_cache(1)
            outs[path + "-cached"] = torch.cat([layers[path](x[:, : T // 2], cache=cache), layers[path](x[:, T // 2 :], cache=cache)], 1)
        windowed = attend(q, k, k, window=256)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        errors = {name: float((out - outs["auto"]).abs().max()) for name, out in outs.items()}
        local = attend(q[:, :, -300:], k[:, :, -555:], k[:, :, -555:], window=256)  # the last 300 queries alone
        errors["windowed"] = float((windowed[:, :, -300:] - local).abs().max())
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    print(json.dumps({"delta_bytes": (peak - base) * unit, "errors": errors}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="needs the resource module")
def test_long_mla_attention_never_forms_a_t_by_t_tensor():
    """MLA at T = 4096 (4 heads): uncached forwards (both paths), a cached prompt in two calls (both
    paths, small query blocks) and a windowed call all agree, and the peak RSS of a fresh process
    grows by far less than one T x T x heads float32 tensor (268 MB): about 28 MB, against about
    700 MB for the old path. (A fixed glibc mmap threshold returns freed blocks to the system, so
    the peak follows what is live rather than the allocator's history; without it, 60-100 MB.)"""
    t, heads = 4096, 4
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(t)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(err < 1e-4 for err in report["errors"].values()), report
    assert report["delta_bytes"] < t * t * 4 * heads / 2, report


# ---------------------------------------------------------------- every kind: grad mode and failed calls


@pytest.mark.parametrize("kind, options", [("mha", {}), ("gqa", {"n_kv_heads": 2}), ("swa", {"window": 5}), ("lrkv", {"rank": 2}),
                                           ("lrkv", {"rank": 2, "rope_placement": "full", "n_kv_heads": 2}), ("mla", {"kv_rank": 6})])
def test_every_kind_is_differentiable_call_by_call(kind, options):
    """Each cached call's output backpropagates on its own, before or after later calls, and its
    gradient in its own tokens equals the uncached forward's (earlier tokens are constants)."""
    torch.manual_seed(0)
    attn = build_attention(kind, 32, 4, **options).double()
    x = torch.randn(1, 12, 32, dtype=torch.float64, requires_grad=True)
    cache = attn.new_cache(1, dtype=torch.float64)
    first = attn(x[:, :9], cache=cache)
    second = attn(x[:, 9:], cache=cache)
    second.sum().backward()
    first.sum().backward()  # an earlier call's graph is intact after a later call
    grad_cached = x.grad.clone()
    x.grad = None
    full = attn(x)
    (full[:, :9].sum() + full[:, 9:].sum()).backward()
    assert torch.allclose(grad_cached[:, 9:], x.grad[:, 9:], atol=1e-10)  # the later call's own tokens
    assert cache.seq_len == 12


@pytest.mark.parametrize("kind, options", [("mha", {}), ("swa", {"window": 5}), ("lrkv", {"rank": 2}), ("mla", {"kv_rank": 6})])
def test_a_call_that_fails_leaves_every_cache_as_it_was(kind, options, monkeypatch):
    torch.manual_seed(0)
    attn = build_attention(kind, 32, 4, **options).double()
    x = torch.randn(1, 14, 32, dtype=torch.float64)
    with torch.no_grad():
        cache = attn.new_cache(1, dtype=torch.float64)
        attn(x[:, :10], cache=cache)
        before = cache.nbytes(), cache.seq_len
        target = attn.o_proj

        def fail(*args, **kwargs):
            raise RuntimeError("out of memory (simulated)")

        monkeypatch.setattr(target, "forward", fail)
        with pytest.raises(RuntimeError, match="simulated"):
            attn(x[:, 10:], cache=cache)
        monkeypatch.undo()
        assert (cache.nbytes(), cache.seq_len) == before
        retried = attn(x[:, 10:], cache=cache)
        assert torch.allclose(retried, attn(x)[:, 10:], atol=1e-10)
