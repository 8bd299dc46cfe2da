"""slimkv's KVM (the optimised path over a whole sequence, its decode state fed in pieces, and the
token-by-token reference) against an independent transcription of the paper's algorithm
(``tests/ops/kvm_paper.py``, which shares no code with ``slimkv.ops.kvm``), on random inputs over
schedules, GQA and MHA, dtypes and call splits. A rule changed in both slimkv paths at once (as the
1024-ulp tie tolerance was) fails here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slimkv.ops.kvm import KVMParams, KVMSettings, KVMState, kvm_attention, kvm_step, kvm_step_reference
from tests.ops.kvm_paper import kvm_paper

# name -> (slimkv settings, the same budget B(ctx) written from the paper's formulas, heads (q, kv))
CASES = {
    "fixed-gqa": (KVMSettings(chunk_size=4, schedule="fixed", min_rows=7, rot_dim=4), lambda ctx: 7, (4, 2)),
    "sqrt-mha": (KVMSettings(chunk_size=4, schedule="sqrt", sqrt_coef=2.0, min_rows=1, rot_dim=2), lambda ctx: max(math.floor(2.0 * ctx**0.5), 1), (4, 4)),
    "saturating-w3-mqa": (KVMSettings(chunk_size=3, window_chunks=3, schedule="saturating", saturating_rows=8, min_rows=1, rot_dim=2),
                          lambda ctx: max(8 * ctx // (8 + ctx), 1), (4, 1)),
    "sqrt-w1-sink2": (KVMSettings(chunk_size=5, window_chunks=1, schedule="sqrt", sqrt_coef=1.5, min_rows=6, sink_len=2, rot_dim=0),
                      lambda ctx: max(math.floor(1.5 * ctx**0.5), 6), (2, 2)),
}
# many rows and folds: routing decisions with small score gaps, where a tie margin shows
LONG = ("fixed-long", (KVMSettings(chunk_size=8, schedule="fixed", min_rows=24, rot_dim=4), lambda ctx: 24, (4, 2)), {"length": 160, "d": 16})
CASES[LONG[0]] = LONG[1]
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


def random_problem(case: str, dtype: torch.dtype, seed: int, length: int = 70, d: int = 8):
    if case == LONG[0]:
        length, d = LONG[2]["length"], LONG[2]["d"]
    g = torch.Generator().manual_seed(seed)
    hq, hkv = CASES[case][2]
    q, k, v = (torch.randn(2, h, length, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv))
    gate = (1.0 + F.elu(torch.randn(2, hkv, length, generator=g, dtype=torch.float64))).to(dtype)
    ln_weight, ln_bias = 1.0 + 0.2 * torch.randn(d, generator=g, dtype=torch.float64), 0.2 * torch.randn(d, generator=g, dtype=torch.float64)
    tau = 1.0 + 0.3 * torch.randn(2, hq, generator=g, dtype=torch.float64)
    params = KVMParams(ln_weight.to(dtype), ln_bias.to(dtype), tau[0].to(dtype), tau[1].to(dtype))
    return q, k, v, gate, params


def paper(case: str, q, k, v, gate, params):
    settings, budget, _ = CASES[case]
    return kvm_paper(q, k, v, gate, chunk=settings.chunk_size, window=settings.window_chunks, budget=budget, sink=settings.sink_len, rot=settings.rot_dim,
                     ln_weight=params.ln_weight, ln_bias=params.ln_bias, tau_state=params.tau_state, tau_window=params.tau_window)


def in_pieces(step, q, k, v, gate, params, settings, sizes):
    state = KVMState(k.shape[0], k.shape[1], k.shape[-1], dtype=k.dtype, device=k.device, gated=True)
    outs, t = [], 0
    for n in sizes:
        s = slice(t, t + n)
        outs.append(step(q[:, :, s], k[:, :, s], v[:, :, s], gate[:, :, s], params, settings, state))
        t += n
    return torch.cat(outs, 2), state


def random_sizes(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    sizes = []
    while sum(sizes) < length:
        sizes.append(min(int(torch.randint(1, 12, (1,), generator=g)), length - sum(sizes)))
    return sizes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_every_path_matches_the_paper_transcription(case, dtype):
    settings = CASES[case][0]
    q, k, v, gate, params = random_problem(case, dtype, seed=len(case))
    expected, states = paper(case, q, k, v, gate, params)
    tol = TOLERANCE[dtype]
    with torch.no_grad():
        whole = kvm_attention(q, k, v, gate, params, settings)
        pieces, state = in_pieces(kvm_step, q, k, v, gate, params, settings, random_sizes(q.shape[2], 1))
        tokens, _ = in_pieces(kvm_step, q, k, v, gate, params, settings, [1] * q.shape[2])
        reference, ref_state = in_pieces(kvm_step_reference, q, k, v, gate, params, settings, random_sizes(q.shape[2], 2))
    for name, out in (("kvm_attention", whole), ("kvm_step in pieces", pieces), ("kvm_step token by token", tokens), ("reference", reference)):
        error = float((out.double() - expected).abs().max())
        assert error <= tol, f"{name}: max error {error:.3g} against the paper's algorithm"
    for rows in (state.rows, ref_state.rows):  # the state itself: row sums and radii
        for b, per_head in enumerate(states):
            for h, expected_rows in enumerate(per_head):
                assert rows.count == len(expected_rows["s_k"])
                for got, want in ((rows.s_k, expected_rows["s_k"]), (rows.s_v, expected_rows["s_v"]), (rows.radius, expected_rows["rho"])):
                    assert float((got[b, h].double() - torch.tensor(want, dtype=torch.float64)).abs().max()) <= tol * 10


def test_a_tie_margin_above_rounding_fails_the_check(monkeypatch):
    """The check has teeth for the failure it is there for: with ties counted up to 2^14 ulps of
    the score (about 1e-2 here: the size of the old bound-based tolerance), float32 routing leaves
    the authors' argmax and the outputs move beyond the tolerance."""
    case = LONG[0]
    settings = CASES[case][0]
    q, k, v, gate, params = random_problem(case, torch.float32, seed=len(case))
    expected, _ = paper(case, q, k, v, gate, params)
    monkeypatch.setattr("slimkv.ops.kvm.core.TIE_ULPS", 2**14)
    with torch.no_grad():
        assert float((kvm_attention(q, k, v, gate, params, settings).double() - expected).abs().max()) > TOLERANCE[torch.float32]


def test_the_transcription_can_tell_routing_rules_apart():
    """The check has teeth: routing ties to the SECOND-best row (a rule a shared tolerance could
    introduce) moves the outputs far beyond the tolerance."""
    case = "fixed-gqa"
    settings = CASES[case][0]
    q, k, v, gate, params = random_problem(case, torch.float64, seed=3)
    expected, _ = paper(case, q, k, v, gate, params)
    shifted = KVMSettings(chunk_size=4, schedule="fixed", min_rows=7, rot_dim=4, sink_len=2)  # one more protected row
    with torch.no_grad():
        assert float((kvm_attention(q, k, v, gate, params, settings) - expected).abs().max()) <= 1e-10
        assert float((kvm_attention(q, k, v, gate, params, shifted) - expected).abs().max()) > 1e-3
