"""The optimised KVM computation: rows, the fold of a chunk into the state, one softmax over state +
window, and the chunk driver ``process`` shared by training (``kvm_attention``) and decode
(``slimkv.ops.kvm.state.kvm_step``). See the package docstring for the mechanism."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimkv.ops.attention import fold_groups, visibility_mask
from slimkv.ops.kvm.settings import VALUE_EPS, KVMSettings
from slimkv.ops.native import kernel_for, native_decode_attention
from slimkv.ops.norm import compute_dtype

# ---------------------------------------------------------------- parameters and rows


@dataclass
class KVMParams:
    """The tensors of KVM beyond the projections: LN_s (over head_dim) and the per-query-head
    temperatures (Hq,) of the state and window regions (None = 1, the "no temperatures" ablation)."""

    ln_weight: torch.Tensor | None
    ln_bias: torch.Tensor | None
    tau_state: torch.Tensor | None = None
    tau_window: torch.Tensor | None = None
    ln_eps: float = 1e-5


def layer_norm_s(x: torch.Tensor, params: KVMParams) -> torch.Tensor:
    """LN_s over the last dim, computed in x's dtype (callers pass the compute dtype)."""
    w = params.ln_weight.to(x.dtype) if params.ln_weight is not None else None
    b = params.ln_bias.to(x.dtype) if params.ln_bias is not None else None
    return F.layer_norm(x, (x.shape[-1],), w, b, params.ln_eps)


def prepare_keys(k: torch.Tensor, params: KVMParams, rot_dim: int) -> torch.Tensor:
    """prep(k) = LN_s(k with its first ``rot_dim`` (rotary) channels set to zero), in the compute
    dtype. Zero first, then LN_s: afterwards those channels are generally not zero but carry no
    position."""
    k = k.to(compute_dtype(k.dtype))
    return layer_norm_s(F.pad(k[..., rot_dim:], (rot_dim, 0)), params)


def read_values(s_v: torch.Tensor, radius: torch.Tensor, value_norm: str) -> torch.Tensor:
    """State values seen by the softmax: rho * s_v / max(||s_v||, eps), or s_v / count."""
    if value_norm == "count":
        return s_v / radius.unsqueeze(-1)
    return s_v * (radius / s_v.norm(dim=-1).clamp_min(VALUE_EPS)).unsqueeze(-1)


@dataclass
class Rows:
    """The compressed state of every (batch, kv head): S rows, (batch, kv_heads, S, dim) each,
    in the compute dtype. ``read_k``/``read_v`` cache what the softmax reads (LN_s(s_k) and the
    value readout) so decode does not re-normalise the state at every token; they are recomputed
    when a fold changes the rows (once per chunk)."""

    s_k: torch.Tensor
    s_v: torch.Tensor
    radius: torch.Tensor  # (batch, kv_heads, S): rho, or the token count in the "count" ablation
    read_k: torch.Tensor
    read_v: torch.Tensor

    @property
    def count(self) -> int:
        return self.s_k.shape[2]

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, v_dim: int, *, dtype: torch.dtype, device) -> Rows:
        k = torch.zeros(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
        v = torch.zeros(batch, kv_heads, 0, v_dim, dtype=dtype, device=device)
        return cls(k, v, torch.zeros(batch, kv_heads, 0, dtype=dtype, device=device), k, v)

    @classmethod
    def build(cls, s_k: torch.Tensor, s_v: torch.Tensor, radius: torch.Tensor, params: KVMParams, value_norm: str) -> Rows:
        """Rows from their sums, with the read cache computed (LN_s applied again on read)."""
        return cls(s_k, s_v, radius, layer_norm_s(s_k, params), read_values(s_v, radius, value_norm))

    def extend(self, new: Rows) -> Rows:
        """These rows followed by ``new`` ones."""
        if self.count == 0:
            return new
        parts = zip((self.s_k, self.s_v, self.radius, self.read_k, self.read_v), (new.s_k, new.s_v, new.radius, new.read_k, new.read_v))
        return Rows(*(torch.cat(pair, dim=2) for pair in parts))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.s_k, self.s_v, self.radius, self.read_k, self.read_v)

    def detached(self) -> Rows:
        """The same rows without autograd history (what a decode state stores)."""
        return Rows(*(t.detach() for t in self.tensors()))


def new_rows(prepared_k: torch.Tensor, v: torch.Tensor, params: KVMParams, settings: KVMSettings, weight: torch.Tensor | None = None) -> Rows:
    """Rows founded by single tokens: s_k = prep(k), s_v = v, each times ``weight`` if given (the
    merge gate of ``gate_appends``), and rho = ||s_v||, the norm of the value the row holds (so
    ||g v|| = g ||v|| for a gated append), or count 1. (B, H, n, dim) -> n rows. The sums are
    never views of ``v`` (which may be a window buffer that later calls write into)."""
    s_k, s_v = prepared_k, v.to(prepared_k.dtype, copy=True)
    if weight is not None:
        s_k, s_v = s_k * weight, s_v * weight
    radius = torch.ones_like(s_v[..., 0]) if settings.value_norm == "count" else s_v.norm(dim=-1)
    return Rows.build(s_k, s_v, radius, params, settings.value_norm)


# ---------------------------------------------------------------- the optimised path


TIE_ULPS = 4  # scores within TIE_ULPS ulps of the best (of its own magnitude) count as ties: rounding, not a margin


def routing_scores(keys: torch.Tensor, row_keys: torch.Tensor, routing_dtype: str) -> torch.Tensor:
    """<key_j, row_i> for every token j and row i, (..., n, S) in the keys' dtype, without gradient.

    ``float32`` (full precision): a product in the compute dtype. ``bfloat16``/``float16``: both
    operands rounded to that dtype, their exact dot product (accumulated in float64, where the
    products of 8- or 11-bit mantissas and their sums are exact) rounded once to that dtype, so
    the score does not depend on how a kernel orders its sums (the reference scores alike)."""
    with torch.no_grad():
        keys, row_keys = keys.detach(), row_keys.detach()
        if routing_dtype == "float32":
            return keys @ row_keys.transpose(-1, -2)
        low = getattr(torch, routing_dtype)
        exact = keys.to(low).double() @ row_keys.to(low).double().transpose(-1, -2)
        return exact.to(low).to(keys.dtype)


def tie_margin(score: torch.Tensor) -> torch.Tensor:
    """How far below ``score`` another score may lie and still tie with it: TIE_ULPS units in the
    last place of ``score`` itself (eps of its dtype x |score|). That is the size of the rounding
    by which two ways of computing one dot product differ, so an exact tie stays a tie in both
    implementations, while any real difference (a few ulps and up) is decided by the higher score,
    as the authors' argmax decides it."""
    return TIE_ULPS * torch.finfo(score.dtype).eps * score.abs()


def _first(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim (0 where there is none: NaN scores)."""
    return mask.to(torch.uint8).argmax(dim=-1, keepdim=True)  # argmax returns the first of equal maxima


def least_novel(novelty: torch.Tensor, count: int) -> torch.Tensor:
    """Token indices (batch, kv_heads, count), ascending, of the ``count`` least novel tokens:
    repeatedly the EARLIEST remaining token whose novelty ties with (``tie_margin``) or is the
    lowest remaining one: an ascending sort, stable on ties, as the authors' ``argsort``."""
    n = novelty.shape[-1]
    if count >= n:
        return torch.arange(n, device=novelty.device).expand(*novelty.shape[:-1], n)
    left, picks = novelty.clone(), []
    for _ in range(count):
        low = left.amin(dim=-1, keepdim=True)
        pick = _first(left <= low + tie_margin(low))
        picks.append(pick)
        left = left.scatter(-1, pick, math.inf)
    return torch.cat(picks, dim=-1).sort(dim=-1).values


def route(scores: torch.Tensor, sink_len: int, fresh: torch.Tensor | None = None) -> torch.Tensor:
    """Merge targets (batch, kv_heads, n): for each token the row of its highest score, the
    ``sink_len`` first rows excluded; on a tie (``tie_margin`` of the best) the LOWEST row index,
    as the authors' argmax. ``scores`` (batch, kv_heads, n, S) are against the S existing rows and
    ``fresh`` (optional, n x S_new) against rows appended after them (indices S, S + 1, ...)."""
    old = scores[..., sink_len:]
    best = old_best = old.amax(dim=-1, keepdim=True)
    if fresh is not None:
        best = torch.maximum(old_best, fresh.amax(dim=-1, keepdim=True))
    threshold = best - tie_margin(best)
    target = _first(old >= threshold) + sink_len
    if fresh is not None:  # a fresh row only where no existing row ties with the best
        target = torch.where(old_best >= threshold, target, _first(fresh >= threshold) + scores.shape[-1])
    return target.squeeze(-1)


def _gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, n, dim) at token indices (B, H, m) -> (B, H, m, dim)."""
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


def fold_chunk(rows: Rows, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, ctx: int, params: KVMParams, settings: KVMSettings) -> Rows:
    """Fold one chunk leaving the window into the state; returns the new rows (out of place).

    k, v: (batch, kv_heads, C, dim) keys (after RoPE) and values of the overflow tokens; gate:
    (batch, kv_heads, C, 1) merge gates or None (g = 1). ``ctx`` is the position of the token that
    triggers the fold (= tokens seen through the end of the chunk just attended).

    1. n_app = ``settings.append_count``. 2. The n_app tokens whose prepared key is least similar
    to every row (sink included) become rows, in position order. 3. Every other token j goes to
    the row of the highest <prep(k_j), LN_s(s_k)_i> over the non-sink rows, appended ones included,
    all targets chosen before any sum changes; s_k and s_v of the target grow by g_j prep(k_j) and
    g_j v_j; rho does not change (a count grows by one).

    Scores are taken with the ungated key: g_j > 0 scales all of token j's scores alike and cannot
    change its choice, so step 3 reuses step 2's similarities (one C x S product per fold). Ties
    (``tie_margin``: a few ulps of the score, i.e. rounding): routing takes the lowest row index,
    the novelty ranking the earliest token (``route``, ``least_novel``), as the authors' argmax
    and argsort do.
    """
    ko = prepare_keys(k, params, settings.rot_dim)
    vo = v.to(ko.dtype)
    g = gate.to(ko.dtype) if gate is not None else None
    kg, vg = (ko * g, vo * g) if g is not None else (ko, vo)
    n_tokens, n_old = ko.shape[2], rows.count
    n_app = settings.append_count(n_old, ctx)
    scores = routing_scores(ko, rows.read_k, settings.routing_dtype)  # (B, H, C, S)
    if n_app:
        chosen = least_novel(scores.amax(dim=-1), n_app)
        weight = _gather_tokens(g, chosen) if (settings.gate_appends and g is not None) else None
        appended = new_rows(_gather_tokens(ko, chosen), _gather_tokens(vo, chosen), params, settings, weight)
        if n_app == n_tokens:
            return rows.extend(appended)
        merge_weight = torch.ones_like(kg[..., 0]).scatter(-1, chosen, 0.0)  # 0 for appended tokens
        kg, vg = kg * merge_weight.unsqueeze(-1), vg * merge_weight.unsqueeze(-1)
    # targets: the best non-sink row, old or fresh; an exact tie -> the lowest index (an existing
    # row beats a fresh one only when they tie)
    fresh = routing_scores(ko, appended.read_k, settings.routing_dtype) if n_app else None
    target = route(scores, settings.sink_len, fresh)
    index_k, index_v = target.unsqueeze(-1).expand_as(kg), target.unsqueeze(-1).expand_as(vg)
    if n_app:  # the concatenation is a fresh tensor: add in place
        s_k = torch.cat((rows.s_k, appended.s_k), dim=2).scatter_add_(2, index_k, kg)
        s_v = torch.cat((rows.s_v, appended.s_v), dim=2).scatter_add_(2, index_v, vg)
        radius = torch.cat((rows.radius, appended.radius), dim=2)
    else:
        s_k, s_v, radius = rows.s_k.scatter_add(2, index_k, kg), rows.s_v.scatter_add(2, index_v, vg), rows.radius
    if settings.value_norm == "count":
        radius = radius.scatter_add(2, target, merge_weight if n_app else torch.ones_like(radius[..., :1]).expand_as(target))
    return Rows.build(s_k, s_v, radius, params, settings.value_norm)


def _per_query_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, Hkv, L, dim) -> (B, Hkv * group, L, dim): each kv head repeated for its query heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _attend_one(q: torch.Tensor, rows: Rows | None, win_k: torch.Tensor, win_v: torch.Tensor, params: KVMParams, scale: float) -> torch.Tensor:
    """``_attend`` for a single query per head (decode): explicit scores against the cached rows
    and the window, no mask and no copies of the keys. Grouped query heads share their kv head."""
    b, hq = q.shape[:2]
    hkv = win_k.shape[1]
    work = compute_dtype(q.dtype)
    grouped = fold_groups(q.to(work), hkv)  # (B, Hkv, group, d)

    def scores(keys: torch.Tensor, tau: torch.Tensor | None) -> torch.Tensor:
        raw = grouped @ keys.transpose(-1, -2)  # (B, Hkv, group, keys)
        return raw * (tau.to(work).view(hkv, -1, 1) * scale if tau is not None else scale)

    win_v = win_v.to(work)
    window_scores = scores(win_k.to(work), params.tau_window)
    if rows is None or rows.count == 0:
        out = window_scores.softmax(dim=-1) @ win_v
    else:
        s = rows.count
        probs = torch.cat((scores(rows.read_k, params.tau_state), window_scores), dim=-1).softmax(dim=-1)
        out = probs[..., :s] @ rows.read_v + probs[..., s:] @ win_v
    return out.reshape(b, hq, 1, -1).to(q.dtype)


def decode_token(q: torch.Tensor, rows: Rows, win_k: torch.Tensor, win_v: torch.Tensor, params: KVMParams, scale: float) -> torch.Tensor:
    """One decode step between folds, when the state is visible: the same softmax over the rows
    and the window as ``_attend_one`` in fewer operations, for float32/float64 inputs (whose rows
    share their dtype). The temperatures and the scale are folded into the two query copies (one
    per region), the logits are keys x queries^T (the cache is the large row-major operand; see
    ``slimkv.ops.attention.decode_attention``), and one softmax covers both regions. In float32
    on the CPU the native kernel (``slimkv.ops.native``) reads the rows and the window as two
    segments of one single-pass softmax, each with its own tempered query.
    q (B, Hq, 1, d), win_k/win_v (B, Hkv, L, .) -> (B, Hq, 1, dv)."""
    b, hq = q.shape[:2]
    hkv = win_k.shape[1]
    segments = [(rows.read_k, rows.read_v), (win_k, win_v)]
    if (library := kernel_for([q, q], segments)) is not None:
        queries = [q * (tau.view(1, hq, 1, 1) * scale) if tau is not None else q * scale for tau in (params.tau_state, params.tau_window)]
        return native_decode_attention(queries, segments, 1.0, library)
    grouped = fold_groups(q, hkv)  # (B, Hkv, group, d)
    tau_s = params.tau_state.view(hkv, -1, 1) * scale if params.tau_state is not None else scale
    tau_w = params.tau_window.view(hkv, -1, 1) * scale if params.tau_window is not None else scale
    logits = torch.cat((rows.read_k @ (grouped * tau_s).transpose(-1, -2), win_k @ (grouped * tau_w).transpose(-1, -2)), dim=-2)
    probs = logits.transpose(-1, -2).contiguous().softmax(dim=-1)  # (B, Hkv, group, S + L)
    s = rows.count
    out = torch.baddbmm(
        (probs[..., s:] @ win_v).flatten(0, 1), probs[..., :s].flatten(0, 1), rows.read_v.flatten(0, 1)
    )
    return out.view(b, hq, 1, -1)


def _attend(q: torch.Tensor, rows: Rows | None, win_k: torch.Tensor, win_v: torch.Tensor, params: KVMParams, scale: float) -> torch.Tensor:
    """One softmax over the state rows (all visible; None = no state yet) and the window keys
    (causal, queries aligned to the END of the window). q (B, Hq, n, d), win_k/win_v (B, Hkv, L, .)
    -> (B, Hq, n, dv), in q's dtype; computed in the compute dtype.

    The temperatures multiply each region's keys, so with temperatures the keys are laid out per
    query head (a copy of S + L rows per head, small next to the n x (S + L) scores) and one fused
    ``scaled_dot_product_attention`` call with a mask does the rest."""
    n = q.shape[2]
    if n == 1:
        return _attend_one(q, rows, win_k, win_v, params, scale)
    hq, hkv, length = q.shape[1], win_k.shape[1], win_k.shape[2]
    work, group = compute_dtype(q.dtype), hq // hkv
    tempered = params.tau_state is not None or params.tau_window is not None

    def region(k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A region's keys times its temperature (then per query head) and its values alike."""
        if not tempered:
            return k, v
        k, v = _per_query_head(k, group), _per_query_head(v, group)
        return (k * tau.to(work).view(1, hq, 1, 1) if tau is not None else k), v

    keys, values = region(win_k.to(work), win_v.to(work), params.tau_window)
    n_state = rows.count if rows is not None else 0
    if n_state:
        state_k, state_v = region(rows.read_k, rows.read_v, params.tau_state)
        keys, values = torch.cat((state_k, keys), dim=2), torch.cat((state_v, values), dim=2)
    gqa = keys.shape[1] != hq
    if n_state == 0 and n == length:
        out = F.scaled_dot_product_attention(q.to(work), keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = F.pad(visibility_mask(n, length, device=q.device), (n_state, 0), value=True)
        out = F.scaled_dot_product_attention(q.to(work), keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.to(q.dtype)


def _span(whole: torch.Tensor, chunks: tuple[torch.Tensor, ...], first: int, last: int, lo: int, hi: int) -> torch.Tensor:
    """Tokens lo..hi-1 of ``whole`` (= its chunks first..last along time). Under autograd they are
    concatenated from the chunks (see ``process``); otherwise they are a view of ``whole``."""
    if torch.is_grad_enabled() and whole.requires_grad:
        return torch.cat(chunks[first : last + 1], dim=2)
    return whole[:, :, lo:hi]


def process(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    gates: torch.Tensor | None,
    base: int,
    start: int,
    rows: Rows,
    params: KVMParams,
    settings: KVMSettings,
    scale: float,
) -> tuple[torch.Tensor, Rows]:
    """The optimised computation for queries at positions start .. start+T-1.

    keys/values/gates hold every token not yet folded plus the new ones: positions base ..
    start+T-1 (base is chunk-aligned), (B, Hkv, ., dim) (gates (B, Hkv, ., 1)). The queries are
    cut at chunk boundaries; for each segment: fold the chunk leaving the window (at a chunk's first
    token), add first-chunk rows, then one attention call over state + window. Returns the outputs
    and the new rows.

    The inputs are split into chunks ONCE: slicing the whole sequence for every segment would make
    autograd build a full-length zero gradient per slice, O(N^2) work in the backward pass.
    """
    c, w = settings.chunk_size, settings.window_chunks
    end = start + q.shape[2]
    bounds = [(a, min(end, (a // c + 1) * c)) for a in [start, *range((start // c + 1) * c, end, c)]]
    queries = q.split([b - a for a, b in bounds], dim=2)
    k_chunks, v_chunks = keys.split(c, dim=2), values.split(c, dim=2)
    g_chunks = gates.split(c, dim=2) if gates is not None else None
    outs = []
    for (a, b), q_seg in zip(bounds, queries):
        chunk = (a - base) // c  # index of the segment's chunk among k_chunks
        if settings.folds_at(a):
            old = chunk - w
            rows = fold_chunk(rows, k_chunks[old], v_chunks[old], g_chunks[old] if g_chunks is not None else None, a, params, settings)
        if a < c:
            lo, hi = a - base - chunk * c, b - base - chunk * c
            first = prepare_keys(k_chunks[chunk][:, :, lo:hi], params, settings.rot_dim)
            rows = rows.extend(new_rows(first, v_chunks[chunk][:, :, lo:hi], params, settings))
        lo = settings.window_start(b) - base
        win_k, win_v = (_span(whole, parts, lo // c, chunk, lo, b - base) for whole, parts in ((keys, k_chunks), (values, v_chunks)))
        visible = rows if settings.state_visible(a) else None
        outs.append(_attend(q_seg, visible, win_k, win_v, params, scale))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), rows


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, params: KVMParams) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, time, dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    if t < 1:
        raise ValueError("q, k, v must hold at least one token (time >= 1)")
    if k.shape != (b, hkv, t, d) or v.shape[:3] != (b, hkv, t) or hq % hkv:
        raise ValueError(f"k must be (batch, kv_heads, time, {d}) with kv_heads dividing {hq} and v (batch, kv_heads, time, dv); got {tuple(k.shape)}, {tuple(v.shape)}")
    if gate is not None and gate.shape != (b, hkv, t):
        raise ValueError(f"gate must be (batch, kv_heads, time) = {(b, hkv, t)}, got {tuple(gate.shape)}")
    for name in ("tau_state", "tau_window"):
        tau = getattr(params, name)
        if tau is not None and tau.shape != (hq,):
            raise ValueError(f"{name} must have one entry per query head ({hq},), got {tuple(tau.shape)}")


def kvm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    params: KVMParams,
    settings: KVMSettings,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """KVM over a whole sequence from an empty state (training / prefill without a cache).

    q (B, Hq, T, d); k (B, Hkv, T, d) after RoPE; v (B, Hkv, T, dv); gate (B, Hkv, T) positive
    merge gates or None. Returns (B, Hq, T, dv). Differentiable except routing and selection; the
    fold after the last chunk is never run (it would only serve later tokens).
    """
    check_inputs(q, k, v, gate, params)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, hkv, _, d = k.shape
    rows = Rows.empty(b, hkv, d, v.shape[-1], dtype=compute_dtype(q.dtype), device=q.device)
    gates = gate.unsqueeze(-1) if gate is not None else None
    out, _ = process(q, k, v, gates, 0, 0, rows, params, settings, scale)
    return out
