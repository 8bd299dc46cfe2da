"""The plain KVM reference: a token-by-token loop with explicit per-(batch, head, token) loops,
written straight from the rules in docs/kvm.md. Slow; the tests' yardstick and the layer's
``reference`` backend."""

from __future__ import annotations

import math

import torch

from slimkv.common.buffer import GrowableBuffer
from slimkv.ops.kvm.core import TIE_ULPS, KVMParams, Rows, check_inputs
from slimkv.ops.kvm.settings import VALUE_EPS, KVMSettings
from slimkv.ops.kvm.state import KVMState, check_state
from slimkv.ops.norm import compute_dtype


def _ref_layer_norm(x: torch.Tensor, params: KVMParams) -> torch.Tensor:
    """LayerNorm written out: (x - mean) / sqrt(var + eps) * weight + bias."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + params.ln_eps)
    if params.ln_weight is not None:
        y = y * params.ln_weight.to(x.dtype)
    if params.ln_bias is not None:
        y = y + params.ln_bias.to(x.dtype)
    return y


def _ref_prepare(k: torch.Tensor, params: KVMParams, rot_dim: int) -> torch.Tensor:
    k = k.to(compute_dtype(k.dtype)).clone()
    k[..., :rot_dim] = 0.0
    return _ref_layer_norm(k, params)


def _ref_rows(s_k: torch.Tensor, s_v: torch.Tensor, radius: torch.Tensor, params: KVMParams, settings: KVMSettings) -> Rows:
    """Rows with their read cache computed from the spec's formulas."""
    if settings.value_norm == "count":
        read_v = s_v / radius.unsqueeze(-1)
    else:
        length = torch.sqrt((s_v * s_v).sum(dim=-1, keepdim=True))
        read_v = radius.unsqueeze(-1) * s_v / torch.clamp(length, min=VALUE_EPS)
    return Rows(s_k, s_v, radius, _ref_layer_norm(s_k, params), read_v)


def _ref_dot(a: torch.Tensor, b: torch.Tensor, routing_dtype: str) -> float:
    """One routing score (see ``routing_scores``: low precision rounds the operands, takes their
    exact dot product and rounds it once)."""
    a, b = a.detach(), b.detach()  # (routing carries no gradient)
    if routing_dtype == "float32":
        return float(torch.dot(a, b))
    low = getattr(torch, routing_dtype)
    return float(torch.dot(a.to(low).double(), b.to(low).double()).to(low))


class _Work:
    """A working copy of a ``KVMState`` for one call: plain tensors, so autograd can see every
    step, and nothing reaches the state before the call has succeeded."""

    def __init__(self, state: KVMState) -> None:
        self.seq_len, self.rows = state.seq_len, state.rows
        self.window_k, self.window_v = state.window_k.view(), state.window_v.view()
        self.window_gate = state.window_gate.view() if state.window_gate is not None else None

    def windows(self) -> tuple[str, ...]:
        return ("window_k", "window_v") + (("window_gate",) if self.window_gate is not None else ())

    def commit(self, state: KVMState) -> None:
        """Write this copy into ``state``, without autograd history."""
        for name in self.windows():
            old, new = getattr(state, name), getattr(self, name).detach()
            buffer = GrowableBuffer(*old.shape[:2], old.shape[2], dtype=old.dtype, device=old.device, capacity=2 * new.shape[2])
            buffer.append(new)
            setattr(state, name, buffer)
        state.rows, state.seq_len = self.rows.detached(), self.seq_len


def _ref_fold(work: _Work, ctx: int, params: KVMParams, settings: KVMSettings) -> None:
    """Fold the oldest window chunk into the rows, one (batch, kv head) and one token at a time."""
    c, rows = settings.chunk_size, work.rows
    dtype = rows.s_k.dtype
    k_o = work.window_k[:, :, :c].to(dtype)
    v_o = work.window_v[:, :, :c].to(dtype)
    g_o = work.window_gate[:, :, :c, 0].to(dtype) if work.window_gate is not None else torch.ones_like(k_o[..., 0])
    n_app = settings.append_count(rows.count, ctx)
    eps = torch.finfo(dtype).eps
    batch, heads = k_o.shape[:2]
    new_k, new_v, new_r = [], [], []
    for b in range(batch):
        for h in range(heads):
            s_k, s_v, radius = list(rows.s_k[b, h]), list(rows.s_v[b, h]), list(rows.radius[b, h])
            ko = [_ref_prepare(k_o[b, h, j], params, settings.rot_dim) for j in range(c)]
            g = [g_o[b, h, j] for j in range(c)]
            # a score within TIE_ULPS ulps of another (of its own size: rounding) ties with it
            read = [_ref_layer_norm(r, params) for r in s_k]
            # append: the n_app tokens least similar to any row (sink included, ungated keys);
            # each pick is the earliest token that ties with the lowest novelty left
            novelty = [max(_ref_dot(ko[j], r, settings.routing_dtype) for r in read) for j in range(c)]
            left, chosen = list(range(c)), []
            for _ in range(n_app):
                low = min(novelty[j] for j in left)
                pick = next(j for j in left if novelty[j] <= low + TIE_ULPS * eps * abs(low))
                chosen.append(pick)
                left.remove(pick)
            chosen.sort()
            for j in chosen:
                weight = g[j] if settings.gate_appends else 1.0
                s_k.append(weight * ko[j])
                s_v.append(weight * v_o[b, h, j])
                radius.append(torch.ones((), dtype=dtype) if settings.value_norm == "count" else torch.sqrt(((weight * v_o[b, h, j]) ** 2).sum()))
            # merge: every target is chosen against the post-append rows (ungated keys: g > 0
            # cannot change a choice), then the sums grow by the gated key and value
            read = [_ref_layer_norm(r, params) for r in s_k]
            targets = []
            for j in range(c):
                if j in chosen:
                    continue
                scores = {i: _ref_dot(ko[j], read[i], settings.routing_dtype) for i in range(settings.sink_len, len(s_k))}
                best = max(scores.values())
                targets.append((j, min(i for i, score in scores.items() if score >= best - TIE_ULPS * eps * abs(best))))  # ties: the lowest row
            for j, i in targets:
                s_k[i] = s_k[i] + g[j] * ko[j]
                s_v[i] = s_v[i] + g[j] * v_o[b, h, j]
                if settings.value_norm == "count":
                    radius[i] = radius[i] + 1
            new_k.append(torch.stack(s_k))
            new_v.append(torch.stack(s_v))
            new_r.append(torch.stack(radius))

    def unflat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts).unflatten(0, (batch, heads))

    work.rows = _ref_rows(unflat(new_k), unflat(new_v), unflat(new_r), params, settings)


def _ref_read(q: torch.Tensor, work: _Work, show_state: bool, params: KVMParams, scale: float) -> torch.Tensor:
    """Output of one token: q (B, Hq, d) against every visible row and window key, head by head."""
    batch, hq, _ = q.shape
    win_k, win_v, rows = work.window_k, work.window_v, work.rows
    dtype = rows.s_k.dtype
    group = hq // win_k.shape[1]
    out = []
    for b in range(batch):
        for h in range(hq):
            kv = h // group
            tau_s = params.tau_state[h].to(dtype) if params.tau_state is not None else 1.0
            tau_w = params.tau_window[h].to(dtype) if params.tau_window is not None else 1.0
            qh = q[b, h].to(dtype)
            scores = [(win_k[b, kv].to(dtype) * tau_w) @ qh * scale]
            values = [win_v[b, kv].to(dtype)]
            if show_state:
                scores.insert(0, (rows.read_k[b, kv] * tau_s) @ qh * scale)
                values.insert(0, rows.read_v[b, kv])
            weights = torch.softmax(torch.cat(scores), dim=0)
            out.append(weights @ torch.cat(values))
    return torch.stack(out).view(batch, hq, -1).to(q.dtype)


def kvm_step_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    params: KVMParams,
    settings: KVMSettings,
    state: KVMState,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """``kvm_step`` written token by token from the spec (slow; the tests' yardstick). Like
    ``kvm_step``, differentiable in this call's inputs; the state is updated only once the whole
    call has succeeded and keeps no autograd history."""
    check_inputs(q, k, v, gate, params)
    check_state(state, settings, k, gate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    c, w = settings.chunk_size, settings.window_chunks
    work = _Work(state)
    outs = []
    for i in range(q.shape[2]):
        t = work.seq_len
        if t % c == 0 and t >= w * c:  # the oldest window chunk leaves the window
            if t >= (w + 1) * c:  # (the first chunk is already in the rows)
                _ref_fold(work, t, params, settings)
            for name in work.windows():
                setattr(work, name, getattr(work, name)[:, :, c:])
        work.window_k = torch.cat((work.window_k, k[:, :, i : i + 1]), dim=2)
        work.window_v = torch.cat((work.window_v, v[:, :, i : i + 1]), dim=2)
        if gate is not None:
            work.window_gate = torch.cat((work.window_gate, gate[:, :, i : i + 1, None]), dim=2)
        if t < c:  # the first chunk becomes rows as it arrives
            ki = _ref_prepare(k[:, :, i : i + 1], params, settings.rot_dim)
            vi = v[:, :, i : i + 1].to(ki.dtype)
            ri = torch.ones_like(vi[..., 0]) if settings.value_norm == "count" else torch.sqrt((vi**2).sum(dim=-1))
            rows = work.rows
            work.rows = _ref_rows(torch.cat((rows.s_k, ki), 2), torch.cat((rows.s_v, vi), 2), torch.cat((rows.radius, ri), 2), params, settings)
        outs.append(_ref_read(q[:, :, i], work, t >= w * c, params, scale))
        work.seq_len = t + 1
    work.commit(state)
    return torch.stack(outs, dim=2)


def kvm_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    params: KVMParams,
    settings: KVMSettings,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """``kvm_attention`` via the token-by-token reference from an empty state."""
    state = KVMState(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1], dtype=k.dtype, device=k.device, gated=gate is not None)
    return kvm_step_reference(q, k, v, gate, params, settings, state, scale=scale)
