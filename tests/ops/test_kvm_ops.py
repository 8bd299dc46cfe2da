"""KVM's functional core (``slimkv.ops.kvm``): the budget rule, the optimised path against the
token-by-token reference, the state's invariants, ties, ablations and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimkv.ops.kvm import (
    KVMParams,
    KVMSettings,
    KVMState,
    Rows,
    fold_chunk,
    kvm_attention,
    kvm_attention_reference,
    kvm_step,
    kvm_step_reference,
    layer_norm_s,
    prepare_keys,
)
from tests.helpers import random_splits, rel_rmse

CONTEXTS = [768, 1024, 2048, 4096, 8192, 16384, 32768]
SPEC_TABLE = {
    "fixed": [256] * 7,
    "sqrt": [443, 512, 724, 1024, 1448, 2048, 2896],
    "saturating": [438, 512, 682, 819, 910, 963, 992],
}


def problem(t=45, b=2, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0, gated=True, temps=True):
    """Random q, k, v (kernel layout), positive gates and non-trivial KVM parameters."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    gate = 1.0 + F.elu(torch.randn(b, hkv, t, generator=g, dtype=dtype)) if gated else None
    tau = (1.0 + 0.3 * torch.randn(2, hq, generator=g, dtype=dtype)) if temps else (None, None)
    params = KVMParams(1.0 + 0.2 * torch.randn(d, generator=g, dtype=dtype), 0.2 * torch.randn(d, generator=g, dtype=dtype), tau[0], tau[1])
    return q, k, v, gate, params


def new_state(k, gate):
    return KVMState(k.shape[0], k.shape[1], k.shape[-1], dtype=k.dtype, device=k.device, gated=gate is not None)


def run_split(step, q, k, v, gate, params, settings, sizes, state=None, after=None):
    """Feed the sequence through ``step`` in calls of ``sizes``; returns (outputs, state)."""
    state = state or new_state(k, gate)
    outs, t = [], 0
    for n in sizes:
        sl = slice(t, t + n)
        outs.append(step(q[:, :, sl], k[:, :, sl], v[:, :, sl], gate[:, :, sl] if gate is not None else None, params, settings, state))
        t += n
        if after is not None:
            after(state)
    return torch.cat(outs, dim=2), state


# Settings spanning schedules, window sizes, GQA and every ablation; each gets appends AND merges.
CASES = {
    "fixed": (KVMSettings(chunk_size=4, schedule="fixed", min_rows=6, rot_dim=4), {}),
    "sqrt": (KVMSettings(chunk_size=4, schedule="sqrt", sqrt_coef=2.0, min_rows=1, rot_dim=4), {}),
    "saturating-w3": (KVMSettings(chunk_size=3, window_chunks=3, schedule="saturating", saturating_rows=8, rot_dim=2), {}),
    "fixed-w1": (KVMSettings(chunk_size=5, window_chunks=1, schedule="fixed", min_rows=7, rot_dim=0), {"hkv": 1}),
    "ablations": (KVMSettings(chunk_size=4, schedule="fixed", min_rows=5, sink_len=0, value_norm="count", rot_dim=4), {"gated": False, "temps": False}),
    "gate-appends-max-rows": (KVMSettings(chunk_size=4, schedule="sqrt", sqrt_coef=3.0, min_rows=1, max_rows=9, gate_appends=True, rot_dim=2), {"hkv": 4}),
    "callable-sink2": (KVMSettings(chunk_size=4, schedule=lambda ctx: ctx // 4, sink_len=2, rot_dim=4), {}),
}


# ---------------------------------------------------------------- the budget rule


@pytest.mark.parametrize("schedule", SPEC_TABLE)
def test_rows_after_each_update_match_the_spec_table(schedule):
    settings = KVMSettings(chunk_size=256, schedule=schedule)
    # the update at ctx fires at the token at position ctx, so it is done once ctx + 1 tokens were seen
    assert [settings.rows_after(ctx + 1) for ctx in CONTEXTS] == SPEC_TABLE[schedule]
    # and nothing changes between updates
    assert [settings.rows_after(ctx + 256) for ctx in CONTEXTS] == SPEC_TABLE[schedule]
    assert settings.rows_after(200) == 200 and settings.rows_after(768) == 256  # first chunk rows; no update yet


def test_budget_values_and_caps():
    sqrt, sat = KVMSettings(schedule="sqrt"), KVMSettings(schedule="saturating")
    assert [sqrt.budget(c) for c in (100, 768, 32768)] == [256, 443, 2896]  # min_rows floor, then 16 sqrt(ctx)
    assert [sat.budget(c) for c in (1, 768, 32768)] == [1, 438, 992]  # N ctx / (N + ctx), min_rows 1
    # avail caps: rows cannot exceed the tokens that have left the window
    big = KVMSettings(schedule="fixed", min_rows=600)
    assert big.rows_after(769) == 512 and big.rows_after(1025) == 600
    # max_rows caps the schedule
    assert KVMSettings(schedule="sqrt", max_rows=1000).rows_after(32769) == 1000
    # at most one chunk of appends per update, and rows never shrink when the schedule does
    greedy = KVMSettings(chunk_size=4, window_chunks=1, schedule=lambda ctx: 10 * ctx)
    rows = [greedy.rows_after(t) for t in range(1, 60)]
    assert max(b - a for a, b in zip(rows, rows[1:])) == 4 and rows[-1] == 56
    shrinking = KVMSettings(chunk_size=4, schedule=lambda ctx: 1)
    assert shrinking.rows_after(100) == 4


@pytest.mark.parametrize(
    "options, match",
    [
        ({"schedule": "linear"}, "schedule"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"window_chunks": 0}, "window_chunks"),
        ({"sink_len": 4, "chunk_size": 4}, "sink_len"),
        ({"sqrt_coef": 2.0}, "sqrt_coef"),
        ({"schedule": "sqrt", "saturating_rows": 8}, "saturating_rows"),
        ({"schedule": lambda c: c, "min_rows": 3}, "min_rows"),
        ({"value_norm": "mean"}, "value_norm"),
        ({"routing_dtype": "int8"}, "routing_dtype"),
        ({"max_rows": 0}, "max_rows"),
    ],
)
def test_settings_refuse_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        KVMSettings(**options)


def test_callable_schedule_must_return_a_row_count():
    for bad in (lambda ctx: -1, lambda ctx: 2.5):
        with pytest.raises(ValueError, match="schedule"):
            KVMSettings(chunk_size=4, schedule=bad).rows_after(20)


# ---------------------------------------------------------------- optimised == reference


@pytest.mark.parametrize("name", CASES)
def test_optimised_matches_reference(name):
    settings, shape = CASES[name]
    q, k, v, gate, params = problem(**shape)
    with torch.no_grad():
        fast = kvm_attention(q, k, v, gate, params, settings)
        ref = kvm_attention_reference(q, k, v, gate, params, settings)
        assert rel_rmse(fast, ref) < 1e-12
        # stateful: optimised in random calls vs reference in other random calls; same outputs and rows
        fast_split, fast_state = run_split(kvm_step, q, k, v, gate, params, settings, random_splits(q.shape[2], 1))
        ref_split, ref_state = run_split(kvm_step_reference, q, k, v, gate, params, settings, random_splits(q.shape[2], 2))
    assert rel_rmse(fast_split, fast) < 1e-12 and rel_rmse(ref_split, fast) < 1e-12
    assert fast_state.state_rows == ref_state.state_rows == settings.rows_after(q.shape[2])
    for a, b in zip(fast_state.rows.tensors(), ref_state.rows.tensors()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(fast_state.window_k.view(), ref_state.window_k.view())


def test_decode_after_prefill_crosses_every_boundary():
    """Prefill lengths ending just before, at and just after chunk/window boundaries, then one token per call."""
    settings, _ = CASES["sqrt"]
    q, k, v, gate, params = problem(t=40)
    with torch.no_grad():
        full = kvm_attention(q, k, v, gate, params, settings)
        for prefill in (3, 4, 5, 7, 8, 9, 11, 12, 13):
            out, _ = run_split(kvm_step, q, k, v, gate, params, settings, [prefill] + [1] * (40 - prefill))
            assert rel_rmse(out, full) < 1e-12, prefill


# ---------------------------------------------------------------- state invariants


def test_state_invariants_token_by_token():
    """After every token: rows never disappear, rho is fixed once a row exists, the sink row is
    exactly the first token's, the row count follows the budget rule, each row's readout has norm rho."""
    settings = KVMSettings(chunk_size=4, schedule="sqrt", sqrt_coef=2.0, min_rows=1, rot_dim=4)
    q, k, v, gate, params = problem(t=60)
    history = []

    def check(state):
        rows = state.rows
        assert rows.count == settings.rows_after(state.seq_len)
        if history:
            before = history[-1]
            assert rows.count >= before.count
            assert torch.equal(rows.radius[:, :, : before.count], before.radius)
        history.append(rows)

    with torch.no_grad():
        run_split(kvm_step, q, k, v, gate, params, settings, [1] * 60, after=check)
    final = history[-1]
    assert final.count == 14  # 4 first-chunk rows, then floor(2 sqrt(ctx)) at ctx = 12 .. 56
    assert torch.equal(final.s_k[:, :, 0], prepare_keys(k[:, :, 0], params, 4))
    assert torch.equal(final.s_v[:, :, 0], v[:, :, 0])
    assert torch.allclose(final.read_v.norm(dim=-1), final.radius)
    assert torch.allclose(final.radius[:, :, :4], v[:, :, :4].norm(dim=-1))
    assert not torch.equal(final.s_v[:, :, 1], v[:, :, 1])  # other first-chunk rows do receive merges


def test_without_a_sink_the_first_row_is_merged_into():
    with_sink = KVMSettings(chunk_size=4, schedule="fixed", min_rows=4, rot_dim=4)
    no_sink = KVMSettings(chunk_size=4, schedule="fixed", min_rows=4, rot_dim=4, sink_len=0)
    q, k, v, gate, params = problem(t=60, seed=1)
    with torch.no_grad():
        _, a = run_split(kvm_step, q, k, v, gate, params, with_sink, [60])
        _, b = run_split(kvm_step, q, k, v, gate, params, no_sink, [60])
    assert torch.equal(a.rows.s_v[:, :, 0], v[:, :, 0])
    assert not torch.equal(b.rows.s_v[:, :, 0], v[:, :, 0])


def covered(settings, t):
    """Tokens summarised by the state after t tokens."""
    return max(min(t, settings.chunk_size), settings.window_start(t))


def test_nothing_is_lost_without_a_gate():
    """With g = 1 the row sums add up to the sums of every token the state covers (merges only add)."""
    settings = KVMSettings(chunk_size=4, schedule="sqrt", sqrt_coef=1.5, min_rows=1, rot_dim=4)
    q, k, v, _, params = problem(t=50, gated=False)
    with torch.no_grad():
        _, state = run_split(kvm_step, q, k, v, None, params, settings, [50])
    n = covered(settings, 50)
    assert torch.allclose(state.rows.s_v.sum(2), v[:, :, :n].sum(2))
    assert torch.allclose(state.rows.s_k.sum(2), prepare_keys(k[:, :, :n], params, 4).sum(2))


def test_count_norm_reads_the_plain_mean():
    settings = KVMSettings(chunk_size=4, schedule="fixed", min_rows=6, rot_dim=4, value_norm="count")
    q, k, v, _, params = problem(t=50, gated=False)
    with torch.no_grad():
        _, state = run_split(kvm_step, q, k, v, None, params, settings, [7, 1, 42])
    rows = state.rows
    assert torch.equal(rows.radius, rows.radius.round()) and rows.radius.min() >= 1
    assert torch.allclose(rows.radius.sum(2), torch.full_like(rows.radius[:, :, 0], covered(settings, 50)))
    assert torch.allclose(rows.read_v * rows.radius.unsqueeze(-1), rows.s_v)  # sum / count = mean of members
    assert rows.radius.max() > 1  # some rows really are means of several tokens


def test_gate_appends_weights_appended_rows_only():
    """Gated appends: every token after the first chunk enters the sums times its gate; the first
    chunk stays ungated. Without the switch the gated total differs (appended rows are unweighted)."""
    gated = KVMSettings(chunk_size=4, schedule="sqrt", sqrt_coef=2.0, min_rows=1, rot_dim=4, gate_appends=True)
    plain = KVMSettings(chunk_size=4, schedule="sqrt", sqrt_coef=2.0, min_rows=1, rot_dim=4)
    q, k, v, gate, params = problem(t=50)
    n = covered(gated, 50)
    expected = v[:, :, :4].sum(2) + (gate[:, :, 4:n, None] * v[:, :, 4:n]).sum(2)
    with torch.no_grad():
        _, a = run_split(kvm_step, q, k, v, gate, params, gated, [50])
        _, b = run_split(kvm_step, q, k, v, gate, params, plain, [50])
    assert torch.allclose(a.rows.s_v.sum(2), expected)
    assert not torch.allclose(b.rows.s_v.sum(2), expected)


def test_switches_that_equal_a_neutral_value():
    """No temperatures == temperatures of 1; no merge gate == a gate of 1 everywhere."""
    settings, _ = CASES["fixed"]
    q, k, v, gate, params = problem()
    ones = KVMParams(params.ln_weight, params.ln_bias, torch.ones(4, dtype=q.dtype), torch.ones(4, dtype=q.dtype))
    no_temps = KVMParams(params.ln_weight, params.ln_bias)
    with torch.no_grad():
        assert torch.equal(kvm_attention(q, k, v, gate, no_temps, settings), kvm_attention(q, k, v, gate, ones, settings))
        assert torch.equal(kvm_attention(q, k, v, None, params, settings), kvm_attention(q, k, v, torch.ones_like(gate), params, settings))
        assert not torch.allclose(kvm_attention(q, k, v, gate, params, settings), kvm_attention(q, k, v, None, params, settings))


def test_low_precision_routing_changes_routing_only():
    full = KVMSettings(chunk_size=8, schedule="fixed", min_rows=8, rot_dim=4)
    low = KVMSettings(chunk_size=8, schedule="fixed", min_rows=8, rot_dim=4, routing_dtype="bfloat16")
    q, k, v, gate, params = problem(t=200, d=8, seed=3)
    with torch.no_grad():
        a, sa = run_split(kvm_step, q, k, v, gate, params, full, [200])
        b, sb = run_split(kvm_step, q, k, v, gate, params, low, [200])
    first_fold = 3 * 8
    assert torch.equal(a[:, :, :first_fold], b[:, :, :first_fold])  # identical until routing matters
    assert sa.state_rows == sb.state_rows
    assert not torch.equal(sa.rows.s_k, sb.rows.s_k)  # near-ties route differently


# ---------------------------------------------------------------- ties and the fold's rules


def hadamard_rows() -> torch.Tensor:
    """Rows 1..7 of the 8x8 Hadamard matrix: zero-mean, unit-variance, mutually orthogonal keys
    (LN leaves them unchanged up to eps, and every dot product is 0 or 8)."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(torch.kron(h2, h2), h2)[1:]


def fold(row_keys, tokens, gates, min_rows, seed=0):
    """Fold 4 tokens into 4 rows (one batch element, one head, no LN affine, no RoPE)."""
    g = torch.Generator().manual_seed(seed)
    params = KVMParams(None, None)
    settings = KVMSettings(chunk_size=4, schedule="fixed", min_rows=min_rows, sink_len=1)
    s_v = torch.randn(1, 1, 4, 8, dtype=torch.float64, generator=g)
    rows = Rows.build(torch.stack(row_keys)[None, None], s_v, torch.ones(1, 1, 4, dtype=torch.float64), params, "radius")
    values = torch.randn(1, 1, 4, 8, dtype=torch.float64, generator=g)
    gate = torch.tensor(gates, dtype=torch.float64).view(1, 1, 4, 1)
    new = fold_chunk(rows, torch.stack(tokens)[None, None], values, gate, 100, params, settings)
    prep = prepare_keys(torch.stack(tokens), params, 0)
    return rows, new, values[0, 0], prep


def test_routing_ties_go_to_the_lowest_row_and_the_sink_is_skipped():
    h = hadamard_rows()
    # every token scores the same against the sink and rows 1 and 2, and 0 against row 3
    rows, new, values, prep = fold([h[0], h[1], h[1], h[2]], [h[0] + h[1]] * 4, [1.0, 2.0, 0.5, 1.5], min_rows=1)
    assert new.count == 4  # no appends
    assert torch.equal(new.s_v[0, 0, 0], rows.s_v[0, 0, 0]) and torch.equal(new.s_v[0, 0, 2:], rows.s_v[0, 0, 2:])
    assert torch.allclose(new.s_v[0, 0, 1], rows.s_v[0, 0, 1] + values.T @ torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64))
    assert torch.allclose(new.s_k[0, 0, 1], h[1] + 5.0 * prep[0])


def test_novelty_ties_take_the_earliest_token_and_merges_see_fresh_rows():
    h = hadamard_rows()
    # tokens 1 and 2 are the same novel key (similarity 0 to every row); tokens 0 and 3 match rows 1 and 2
    rows, new, values, prep = fold([h[0], h[1], h[2], h[3]], [h[1], h[4], h[4], h[2]], [1.0, 2.0, 0.5, 1.5], min_rows=5)
    assert new.count == 5
    assert torch.allclose(new.s_v[0, 0, 4], values[1] + 0.5 * values[2])  # token 1 founded row 4 (ungated), token 2 merged into it
    assert torch.allclose(new.s_k[0, 0, 4], prep[1] + 0.5 * prep[2])
    assert torch.allclose(new.s_v[0, 0, 1], rows.s_v[0, 0, 1] + values[0])
    assert torch.allclose(new.s_v[0, 0, 2], rows.s_v[0, 0, 2] + 1.5 * values[3])
    assert torch.equal(new.radius[0, 0, 4], values[1].norm())


def test_novelty_uses_ungated_keys_and_counts_the_sink():
    h = hadamard_rows()
    t0 = h[0] - 0.5 * (h[1] + h[2]) + 0.05 * h[3]  # matches only the sink; slightly row 3
    t1, t2 = h[4] + 0.2 * h[1], h[4] + 0.1 * h[1]  # both novel, t2 the more so
    gates = [1.0, 0.1, 3.0, 1.0]  # gated novelty would rank t1 below t2
    rows, new, values, prep = fold([h[0], h[1], h[2], h[3]], [t0, t1, t2, h[2]], gates, min_rows=5)
    reads = layer_norm_s(torch.stack([h[0], h[1], h[2], h[3]]), KVMParams(None, None))
    novelty = (prep @ reads.T).amax(-1)
    gated = (torch.tensor(gates, dtype=torch.float64)[:, None] * prep @ reads.T).amax(-1)
    without_sink = (prep @ reads[1:].T).amax(-1)
    assert novelty.argmin() == 2 and gated.argmin() == 1 and without_sink.argmin() == 0  # the three rules disagree
    assert torch.allclose(new.s_v[0, 0, 4], values[2] + 0.1 * values[1])  # t2 appended; t1 merged into it
    assert torch.allclose(new.s_v[0, 0, 3], rows.s_v[0, 0, 3] + values[0])  # t0 skips the sink
    assert torch.equal(new.s_v[0, 0, 0], rows.s_v[0, 0, 0])


# ---------------------------------------------------------------- gradients and cost


def test_gradients_are_exact_where_defined():
    """gradcheck through the whole chunked computation (routing and selection held fixed)."""
    settings = KVMSettings(chunk_size=3, schedule="fixed", min_rows=4, rot_dim=2)
    q, k, v, gate, params = problem(t=13, b=1, hq=2, hkv=1, d=4, seed=5)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, gate, params.ln_weight, params.ln_bias, params.tau_state, params.tau_window)]

    def fn(q, k, v, gate, w, b, ts, tw):
        return kvm_attention(q, k, v, gate, KVMParams(w, b, ts, tw), settings)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, fast_mode=True)
    out = fn(*inputs)
    out.square().sum().backward()
    for t in inputs:
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_fixed_decode_state_stays_constant():
    """Decode with ``fixed``: after the first update the rows stop growing, the state's bytes repeat
    with the chunk period and the window storage stays bounded: O(1) memory and work per token."""
    settings = KVMSettings(chunk_size=8, schedule="fixed", min_rows=10, rot_dim=4)
    q, k, v, gate, params = problem(t=400, b=1, hq=2, hkv=2, seed=2)
    sizes = []

    def record(state):
        sizes.append((state.seq_len, state.state_rows, state.nbytes(), len(state.window_k), state.window_k.capacity))

    with torch.no_grad():
        run_split(kvm_step, q, k, v, gate, params, settings, [1] * 400, after=record)
    late = [s for s in sizes if s[0] > 4 * 8]
    assert {rows for _, rows, _, _, _ in late} == {10}
    by_phase = {}
    for t, _, nbytes, _, _ in late:
        by_phase.setdefault(t % 8, set()).add(nbytes)
    assert all(len(v) == 1 for v in by_phase.values())
    assert max(w for _, _, _, w, _ in late) == 16 and max(c for *_, c in late) <= 4 * 16 + 64


def test_long_prefill_leaves_no_oversized_buffers():
    settings = KVMSettings(chunk_size=4, schedule="fixed", min_rows=4)
    q, k, v, gate, params = problem(t=600, b=1, hq=2, hkv=2)
    with torch.no_grad():
        _, state = run_split(kvm_step, q, k, v, gate, params, settings, [600])
    assert len(state.window_k) == 8 and state.window_k.capacity <= 4 * 8 + 64


def test_bad_inputs_raise():
    settings, _ = CASES["fixed"]
    q, k, v, gate, params = problem()
    with pytest.raises(ValueError, match="gate"):
        kvm_attention(q, k, v, gate[:, :1], params, settings)
    with pytest.raises(ValueError, match="tau_state"):
        kvm_attention(q, k, v, gate, KVMParams(params.ln_weight, params.ln_bias, torch.ones(3, dtype=q.dtype)), settings)
    with pytest.raises(ValueError, match="kv_heads"):
        kvm_attention(q, k[:, :, :3], v, gate, params, settings)
    state = new_state(k, None)
    with pytest.raises(ValueError, match="gate"):
        kvm_step(q, k, v, gate, params, settings, state)
    state = new_state(k, gate)
    kvm_step(q[:, :, :5], k[:, :, :5], v[:, :, :5], gate[:, :, :5], params, settings, state)
    other = KVMSettings(chunk_size=2, schedule="fixed", min_rows=6, rot_dim=4)
    with pytest.raises(ValueError, match="settings"):
        kvm_step(q[:, :, 5:6], k[:, :, 5:6], v[:, :, 5:6], gate[:, :, 5:6], params, other, state)
