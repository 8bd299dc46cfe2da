"""KVM transcribed from the paper's algorithm (arXiv:2605.09877, "Key-Value Means") and its
authors' eager prefill, for the tests only. It shares NO code with ``slimkv.ops.kvm``: its own
layer norm, budget, novelty ranking, routing and attention, written with explicit loops over
(batch, head, token) and row. A rule that moved both slimkv paths (the optimised one and its
token-by-token reference) cannot move this one.

The algorithm, for one sequence of T tokens (chunks of C tokens, a window of W chunks):

* the first chunk's tokens become state rows as they arrive: s_k = prep(k), s_v = v,
  rho = ||v|| (prep(k) = LN_s(k with its first ``rot`` channels zeroed));
* a query at position t attends, in one softmax, to the exact keys of the window (positions
  from max(0, ceil((t + 1) / C) C - W C) to t) scaled by the window temperature, and, once
  t >= W C, to every state row (key LN_s(s_k), scaled by the state temperature; value
  rho s_v / max(||s_v||, 1e-12));
* at the first token of chunk m (m >= W + 1), chunk m - W leaves the window and is folded at
  ctx = m C: with avail = ctx - (W - 1) C tokens outside the window once it is done, the state
  grows to max(rows, min(B(ctx), avail)) rows by appending (at most C) the tokens whose highest
  score <prep(k_j), LN_s(s_k)_i> over all rows (sink included) is lowest (ascending, earliest
  first on equal scores), ungated, in position order; every other token j is added, gated (g_j
  prep(k_j), g_j v_j), to the row of its highest score over the rows after the append, the
  ``sink`` first rows excluded (the first such row on equal scores); rho does not change.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def _layer_norm(x: list[float], weight: list[float], bias: list[float], eps: float) -> list[float]:
    n = len(x)
    mean = sum(x) / n
    var = sum((a - mean) ** 2 for a in x) / n
    return [(a - mean) / math.sqrt(var + eps) * w + b for a, w, b in zip(x, weight, bias)]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _norm(a: list[float]) -> float:
    return math.sqrt(sum(x * x for x in a))


def kvm_paper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    *,
    chunk: int,
    window: int,
    budget: Callable[[int], int],
    sink: int,
    rot: int,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    tau_state: torch.Tensor,
    tau_window: torch.Tensor,
    ln_eps: float = 1e-5,
) -> tuple[torch.Tensor, list[list[dict[str, list]]]]:
    """Outputs (B, Hq, T, dv) and the state after the last token, per [batch][kv head]:
    {"s_k": rows of key sums, "s_v": rows of value sums, "rho": radii}. q (B, Hq, T, d), k
    (B, Hkv, T, d), v (B, Hkv, T, dv), gate (B, Hkv, T) or None (= 1). Python floats
    (double precision) throughout; the inputs are read once as floats."""
    batch, hq, length, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    weight, bias = ln_weight.tolist(), ln_bias.tolist()

    def prep(key: list[float]) -> list[float]:
        return _layer_norm([0.0] * rot + key[rot:], weight, bias, ln_eps)

    out = torch.zeros(batch, hq, length, v.shape[-1], dtype=torch.float64)
    states = []
    for b in range(batch):
        per_head = []
        for kv in range(hkv):
            keys, values = k[b, kv].tolist(), v[b, kv].tolist()
            gates = gate[b, kv].tolist() if gate is not None else [1.0] * length
            s_k: list[list[float]] = []
            s_v: list[list[float]] = []
            rho: list[float] = []
            for t in range(length):
                if t % chunk == 0 and t >= (window + 1) * chunk:
                    _fold(s_k, s_v, rho, keys, values, gates, t - window * chunk, t, chunk, window, budget, sink, prep, weight, bias, ln_eps)
                if t < chunk:
                    s_k.append(prep(keys[t]))
                    s_v.append(list(values[t]))
                    rho.append(_norm(values[t]))
                start = max(0, -(-(t + 1) // chunk) * chunk - window * chunk)
                for h in range(kv * group, (kv + 1) * group):
                    query = q[b, h, t].tolist()
                    logits, rows = [], []
                    if t >= window * chunk:
                        for sk, sv, r in zip(s_k, s_v, rho):
                            logits.append(_dot(query, _layer_norm(sk, weight, bias, ln_eps)) * float(tau_state[h]) * scale)
                            rows.append([r * x / max(_norm(sv), 1e-12) for x in sv])
                    for j in range(start, t + 1):
                        logits.append(_dot(query, keys[j]) * float(tau_window[h]) * scale)
                        rows.append(values[j])
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    total = sum(weights)
                    out[b, h, t] = torch.tensor([sum(w * row[c] for w, row in zip(weights, rows)) / total for c in range(len(rows[0]))], dtype=torch.float64)
            per_head.append({"s_k": s_k, "s_v": s_v, "rho": rho})
        states.append(per_head)
    return out, states


def _fold(s_k, s_v, rho, keys, values, gates, first, ctx, chunk, window, budget, sink, prep, weight, bias, ln_eps) -> None:
    """Fold tokens first .. first + chunk - 1 into the rows (in place)."""
    tokens = list(range(first, first + chunk))
    prepared = {j: prep(keys[j]) for j in tokens}
    avail = ctx - (window - 1) * chunk
    grown = max(len(s_k), min(budget(ctx), avail))
    n_append = min(grown - len(s_k), chunk)
    reads = [_layer_norm(row, weight, bias, ln_eps) for row in s_k]
    novelty = {j: max(_dot(prepared[j], r) for r in reads) for j in tokens}
    ranked = sorted(tokens, key=lambda j: (novelty[j], j))  # ascending; the earlier token first on equal novelty
    appended = sorted(ranked[:n_append])
    for j in appended:
        s_k.append(list(prepared[j]))
        s_v.append(list(values[j]))
        rho.append(_norm(values[j]))
    reads = [_layer_norm(row, weight, bias, ln_eps) for row in s_k]
    targets = {}
    for j in tokens:
        if j in appended:
            continue
        scores = [_dot(prepared[j], reads[i]) for i in range(len(s_k))]
        best = max(scores[sink:])
        targets[j] = next(i for i in range(sink, len(s_k)) if scores[i] == best)  # the first row on equal scores
    for j, i in targets.items():
        s_k[i] = [a + gates[j] * x for a, x in zip(s_k[i], prepared[j])]
        s_v[i] = [a + gates[j] * x for a, x in zip(s_v[i], values[j])]
