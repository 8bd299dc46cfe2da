"""KVM (key-value means) attention at the post-projection boundary (spec: ``shared/specs/kvm.md``).

Every query attends, in ONE softmax, to two regions:

* the **window**: the exact keys/values of the current (possibly partial) chunk and of the
  ``window_chunks - 1`` chunks before it (a chunk is ``chunk_size`` tokens, block-aligned);
* the **state**: compressed rows that summarise every older token. Row i holds a sum of prepared
  keys ``s_k``, a sum of values ``s_v`` and a value radius ``rho`` (a token count in the
  ``value_norm="count"`` ablation). Rows are read "just in time": keys as ``LN_s(s_k)``, values as
  ``rho * s_v / max(||s_v||, eps)``.

The first chunk is copied into rows as it arrives (prepared keys, values, ``rho = ||v||``) and
becomes visible once it leaves the window. Each later chunk is *folded* into the state when it
leaves the window, at the first token of a new chunk: a budget says how many of its tokens become
new rows, the least represented tokens (lowest max-similarity to the rows) get them, and every
other token is added, weighted by its merge gate, to the row its key is most similar to (hard
routing; the ``sink_len`` first rows are never targets). See ``fold_chunk`` and
``KVMSettings.append_count``.

Layout: kernel layout (batch, heads, time, dim) for q, k, v and the state. q has Hq heads, k/v and
the merge gate Hkv heads; query head h reads kv head h // (Hq // Hkv). Rows and gates are per kv
head, the two temperatures per query head. Keys arrive after QK-norm and RoPE; RoPE rotates their
first ``rot_dim`` channels, which are zeroed before ``LN_s`` when a key enters the state.

Ties: routing picks the LOWEST row index among equal scores (``torch.argmax``); the novelty ranking
prefers the EARLIEST token among equal scores (stable sort).

Two implementations of the same computation live here:

* ``kvm_attention`` (no state; differentiable, for training) and ``kvm_step`` (a ``KVMState``;
  any number of tokens per call) share ``_process``: a loop over chunk segments whose attention,
  fold and row updates are whole-tensor operations; only routing and selection carry no gradient.
* ``kvm_attention_reference`` / ``kvm_step_reference``: a token-by-token loop with explicit
  per-(batch, head, token) loops written straight from the spec. Slow; kept for the tests and the
  layer's ``reference`` backend.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimkv.attention.base import check_bool, check_choice, check_float, check_int
from slimkv.attention.cache import GrowableBuffer, dtype_bytes
from slimkv.ops.attention import fold_groups, visibility_mask
from slimkv.ops.norm import compute_dtype

SCHEDULES = ("fixed", "sqrt", "saturating")
VALUE_NORMS = ("radius", "count")
ROUTING_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MIN_ROWS = {"fixed": 256, "sqrt": 256, "saturating": 1}
DEFAULT_SQRT_COEF = 16.0
DEFAULT_SATURATING_ROWS = 1024
VALUE_EPS = 1e-12  # floor on ||s_v|| in the radius readout


# ---------------------------------------------------------------- settings and the budget rule


@dataclass(frozen=True)
class KVMSettings:
    """Everything about KVM that is not a tensor. Validated on construction (ValueError).

    ``schedule``: ``fixed`` (B = min_rows, default 256), ``sqrt`` (B = max(floor(sqrt_coef *
    ctx^0.5), min_rows), defaults 16 and 256), ``saturating`` (B = max(floor(saturating_rows * ctx /
    (saturating_rows + ctx)), min_rows), defaults 1024 and 1), or a callable ctx -> rows.
    ``max_rows`` caps the rows (None: no cap). ``sink_len`` rows at the start are never merge
    targets (0 = the "no sink" ablation). ``value_norm``: ``radius`` (rho fixed at row creation) or
    ``count`` (the plain-sum-over-count ablation). ``routing_dtype``: dtype of the novelty and
    routing scores; ``float32`` means full precision (float64 inputs keep float64).
    ``gate_appends``: weight appended rows by their merge gate (the reference does not).
    ``rot_dim``: leading key channels that carry RoPE (zeroed before LN_s).
    """

    chunk_size: int = 256
    window_chunks: int = 2
    schedule: str | Callable[[int], int] = "fixed"
    min_rows: int | None = None
    sqrt_coef: float | None = None
    saturating_rows: int | None = None
    max_rows: int | None = None
    sink_len: int = 1
    value_norm: str = "radius"
    routing_dtype: str = "float32"
    gate_appends: bool = False
    rot_dim: int = 0

    def __post_init__(self) -> None:
        check_int("chunk_size", self.chunk_size, 1)
        check_int("window_chunks", self.window_chunks, 1)
        custom = callable(self.schedule)
        if not custom and self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not allowed; allowed values: {', '.join(SCHEDULES)} or a callable ctx -> rows")
        if self.min_rows is not None:
            if custom:
                raise ValueError("min_rows applies to the built-in schedules (fixed, sqrt, saturating); a callable schedule returns the rows itself")
            check_int("min_rows", self.min_rows, 1)
        if self.sqrt_coef is not None:
            if self.schedule != "sqrt":
                raise ValueError(f"sqrt_coef applies only to schedule='sqrt', not schedule={self.schedule!r}")
            check_float("sqrt_coef", self.sqrt_coef, 0.0, open_low=True)
        if self.saturating_rows is not None:
            if self.schedule != "saturating":
                raise ValueError(f"saturating_rows applies only to schedule='saturating', not schedule={self.schedule!r}")
            check_int("saturating_rows", self.saturating_rows, 1)
        if self.max_rows is not None:
            check_int("max_rows", self.max_rows, 1)
        check_int("sink_len", self.sink_len, 0)
        if self.sink_len >= self.chunk_size:
            raise ValueError(
                f"sink_len={self.sink_len} must be below chunk_size={self.chunk_size}: the first chunk's rows must "
                "include at least one row that merges can target"
            )
        check_choice("value_norm", self.value_norm, VALUE_NORMS)
        check_choice("routing_dtype", self.routing_dtype, ROUTING_DTYPES)
        check_bool("gate_appends", self.gate_appends)
        check_int("rot_dim", self.rot_dim, 0)

    def budget(self, ctx: int) -> int:
        """B(ctx): the rows the schedule asks for once ``ctx`` tokens have been seen."""
        if callable(self.schedule):
            rows = self.schedule(ctx)
            try:
                rows = operator.index(rows)
            except TypeError:
                rows = -1
            if rows < 0 or isinstance(rows, bool):
                raise ValueError(f"schedule(ctx={ctx}) returned {rows!r}; a schedule must return a non-negative integer row count")
            return rows
        min_rows = DEFAULT_MIN_ROWS[self.schedule] if self.min_rows is None else self.min_rows
        if self.schedule == "fixed":
            return min_rows
        if self.schedule == "sqrt":
            coef = DEFAULT_SQRT_COEF if self.sqrt_coef is None else self.sqrt_coef
            return max(math.floor(coef * math.sqrt(ctx)), min_rows)
        n = DEFAULT_SATURATING_ROWS if self.saturating_rows is None else self.saturating_rows
        return max(n * ctx // (n + ctx), min_rows)

    def append_count(self, rows: int, ctx: int) -> int:
        """Rows a fold at ``ctx`` appends to a state of ``rows`` rows (the budget rule):
        M* = max(m, min(B(ctx), avail, max_rows)), n_app = min(M* - m, |O| = C, C), where avail =
        tokens that have left the window once this fold is done."""
        avail = ctx - (self.window_chunks - 1) * self.chunk_size
        cap = min(self.budget(ctx), avail, self.max_rows if self.max_rows is not None else avail)
        return min(max(rows, cap) - rows, self.chunk_size)

    def folds_at(self, pos: int) -> bool:
        """Whether the token at ``pos`` triggers a fold (of the chunk leaving the window) before it attends.
        The first chunk is never folded: its rows are made as it arrives."""
        c = self.chunk_size
        return pos % c == 0 and pos >= (self.window_chunks + 1) * c

    def state_visible(self, pos: int) -> bool:
        """Whether the token at ``pos`` reads the state (only once the first chunk left the window)."""
        return pos >= self.window_chunks * self.chunk_size

    def window_start(self, seq_len: int) -> int:
        """First position still held exactly after ``seq_len`` tokens (everything before is in the state)."""
        c = self.chunk_size
        return max(0, -(-seq_len // c) * c - self.window_chunks * c)

    def rows_after(self, seq_len: int) -> int:
        """State rows after ``seq_len`` tokens (data-independent: the budget rule uses counts only)."""
        c = self.chunk_size
        rows = min(seq_len, c)
        for ctx in range((self.window_chunks + 1) * c, seq_len, c):
            rows += self.append_count(rows, ctx)
        return rows


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

    def select_batch(self, index: torch.Tensor) -> Rows:
        return Rows(*(t.index_select(0, index) for t in self.tensors()))


def new_rows(prepared_k: torch.Tensor, v: torch.Tensor, params: KVMParams, settings: KVMSettings, weight: torch.Tensor | None = None) -> Rows:
    """Rows founded by single tokens: s_k = prep(k), s_v = v (each times ``weight`` if given),
    rho = ||v|| of the (unweighted) founding value, or count 1. (B, H, n, dim) -> n rows."""
    s_v = v.to(prepared_k.dtype)
    radius = torch.ones_like(s_v[..., 0]) if settings.value_norm == "count" else s_v.norm(dim=-1)
    s_k = prepared_k
    if weight is not None:
        s_k, s_v = s_k * weight, s_v * weight
    return Rows.build(s_k, s_v, radius, params, settings.value_norm)


# ---------------------------------------------------------------- the optimised path


def _routing_scores(keys: torch.Tensor, row_keys: torch.Tensor, routing_dtype: str) -> torch.Tensor:
    """<key_j, row_i> for every token j and row i, (batch, kv_heads, n, S), without gradient."""
    dtype = keys.dtype if routing_dtype == "float32" else getattr(torch, routing_dtype)
    with torch.no_grad():
        return keys.detach().to(dtype) @ row_keys.detach().to(dtype).transpose(-1, -2)


def _gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, n, dim) at token indices (B, H, m) -> (B, H, m, dim)."""
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


def fold_chunk(rows: Rows, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, ctx: int, params: KVMParams, settings: KVMSettings) -> Rows:
    """Fold one chunk leaving the window into the state; returns the new rows (out of place).

    k, v: (batch, kv_heads, C, dim) keys (after RoPE) and values of the overflow tokens; gate:
    (batch, kv_heads, C, 1) merge gates or None (g = 1). ``ctx`` is the position of the token that
    triggers the fold (= tokens seen through the end of the chunk just attended).

    1. n_app = ``settings.append_count``. 2. The n_app tokens whose ungated prepared key is least
    similar to every row (sink included) become rows, in position order. 3. Every other token j
    goes to argmax_i <g_j prep(k_j), LN_s(s_k)_i> over the non-sink rows, appended ones included,
    all targets chosen before any sum changes; s_k and s_v of the target grow by g_j prep(k_j) and
    g_j v_j; rho does not change (a count grows by one).

    Step 3 scores with the ungated key: g_j > 0 scales all of token j's scores alike and cannot
    change its argmax, so the similarities of step 2 are reused (one C x S product per fold).
    """
    ko = prepare_keys(k, params, settings.rot_dim)
    vo = v.to(ko.dtype)
    g = gate.to(ko.dtype) if gate is not None else None
    kg, vg = (ko * g, vo * g) if g is not None else (ko, vo)
    n_tokens, n_old = ko.shape[2], rows.count
    n_app = settings.append_count(n_old, ctx)
    similarity = _routing_scores(ko, rows.read_k, settings.routing_dtype)  # (B, H, C, S)
    if n_app:
        chosen = similarity.amax(dim=-1).argsort(dim=-1, stable=True)[..., :n_app].sort(dim=-1).values
        weight = _gather_tokens(g, chosen) if (settings.gate_appends and g is not None) else None
        appended = new_rows(_gather_tokens(ko, chosen), _gather_tokens(vo, chosen), params, settings, weight)
        if n_app == n_tokens:
            return rows.extend(appended)
        merge_weight = torch.ones_like(kg[..., 0]).scatter(-1, chosen, 0.0)  # 0 for appended tokens
        kg, vg = kg * merge_weight.unsqueeze(-1), vg * merge_weight.unsqueeze(-1)
    # targets: best non-sink old row, unless a fresh row scores strictly higher (ties -> lower index)
    similarity[..., : settings.sink_len] = float("-inf")
    best, target = similarity.max(dim=-1)
    if n_app:
        fresh_best, fresh_target = _routing_scores(ko, appended.read_k, settings.routing_dtype).max(dim=-1)
        target = torch.where(fresh_best > best, fresh_target + n_old, target)
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
    concatenated from the chunks (see ``_process``); otherwise they are a view of ``whole``."""
    if torch.is_grad_enabled() and whole.requires_grad:
        return torch.cat(chunks[first : last + 1], dim=2)
    return whole[:, :, lo:hi]


def _process(
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


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, params: KVMParams) -> None:
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
    _check_inputs(q, k, v, gate, params)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, hkv, _, d = k.shape
    rows = Rows.empty(b, hkv, d, v.shape[-1], dtype=compute_dtype(q.dtype), device=q.device)
    gates = gate.unsqueeze(-1) if gate is not None else None
    out, _ = _process(q, k, v, gates, 0, 0, rows, params, settings, scale)
    return out


# ---------------------------------------------------------------- the decode state


class KVMState:
    """What KVM keeps between calls: the rows (compute dtype) and the exact window keys, values and
    merge gates (input dtype) of every token not yet folded, in growable buffers (kernel layout)."""

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int, v_dim: int | None = None, *, dtype: torch.dtype, device, gated: bool) -> None:
        v_dim = head_dim if v_dim is None else v_dim
        self.seq_len = 0
        self.rows = Rows.empty(batch_size, kv_heads, head_dim, v_dim, dtype=compute_dtype(dtype), device=device)
        self.window_k = GrowableBuffer(batch_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.window_v = GrowableBuffer(batch_size, kv_heads, v_dim, dtype=dtype, device=device)
        self.window_gate = GrowableBuffer(batch_size, kv_heads, 1, dtype=dtype, device=device) if gated else None

    @property
    def state_rows(self) -> int:
        """Rows in the compressed state now."""
        return self.rows.count

    def buffers(self) -> list[GrowableBuffer]:
        return [b for b in (self.window_k, self.window_v, self.window_gate) if b is not None]

    def tensors(self) -> list:
        """Everything that holds live state (the window buffers and the row tensors)."""
        return [*self.buffers(), *self.rows.tensors()]

    def nbytes(self) -> int:
        return sum(t.nbytes() if isinstance(t, GrowableBuffer) else t.numel() * t.element_size() for t in self.tensors())

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select batch rows (beam search)."""
        for buf in self.buffers():
            buf.select_batch(index)
        self.rows = self.rows.select_batch(index)

    def append_window(self, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None) -> tuple:
        """Append new tokens' keys, values, gates (B, Hkv, n); return the live views."""
        keys, values = self.window_k.append(k), self.window_v.append(v)
        gates = self.window_gate.append(gate.unsqueeze(-1)) if self.window_gate is not None else None
        return keys, values, gates

    def trim_window(self, settings: KVMSettings) -> None:
        """Keep only tokens not yet folded; give back storage a long prefill left behind."""
        keep = self.seq_len - settings.window_start(self.seq_len)
        for name in ("window_k", "window_v", "window_gate"):
            buf = getattr(self, name)
            if buf is None:
                continue
            buf.keep_last(keep)
            if buf.capacity > 4 * settings.window_chunks * settings.chunk_size + 64:
                small = GrowableBuffer(*buf.shape[:2], buf.shape[2], dtype=buf.dtype, device=buf.device, capacity=2 * keep)
                small.append(buf.view())
                setattr(self, name, small)

    @staticmethod
    def expected_nbytes(settings: KVMSettings, seq_len: int, batch_size: int, kv_heads: int, head_dim: int, v_dim: int, dtype: torch.dtype, gated: bool) -> int:
        """Analytic ``nbytes()`` after ``seq_len`` tokens: rows x (s_k, s_v, rho, read_k, read_v) in
        the compute dtype plus window tokens x (k, v, gate) in ``dtype``."""
        rows = settings.rows_after(seq_len)
        window = seq_len - settings.window_start(seq_len)
        row_bytes = (2 * head_dim + 2 * v_dim + 1) * dtype_bytes(compute_dtype(dtype))
        token_bytes = (head_dim + v_dim + int(gated)) * dtype_bytes(dtype)
        return batch_size * kv_heads * (rows * row_bytes + window * token_bytes)


def _check_state(state: KVMState, settings: KVMSettings, k: torch.Tensor, gate: torch.Tensor | None) -> None:
    held = len(state.window_k)
    if held != state.seq_len - settings.window_start(state.seq_len):
        raise ValueError("this KVMState was advanced with different settings (its window does not match chunk_size/window_chunks)")
    if (gate is None) != (state.window_gate is None):
        raise ValueError("pass a gate exactly when the state was made with gated=True")
    if k.shape[:2] != state.window_k.shape[:2] or k.dtype != state.window_k.dtype:
        raise ValueError(f"keys {tuple(k.shape)} {k.dtype} do not match the state (batch, kv_heads)={state.window_k.shape[:2]} {state.window_k.dtype}")


def kvm_step(
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
    """Advance ``state`` by T >= 1 tokens (prefill or decode; any T) and return their outputs.

    Shapes as in ``kvm_attention``; the tokens sit at positions state.seq_len .. +T-1. Outputs do
    not depend on how a sequence is cut into calls. Per decoded token the work is the attention
    over S rows + at most W*C window keys, plus one fold every C tokens: O(1) for ``fixed``,
    O(sqrt N) for ``sqrt``.
    """
    _check_inputs(q, k, v, gate, params)
    _check_state(state, settings, k, gate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    start = state.seq_len
    keys, values, gates = state.append_window(k, v, gate)
    out, state.rows = _process(q, keys, values, gates, settings.window_start(start), start, state.rows, params, settings, scale)
    state.seq_len = start + q.shape[2]
    state.trim_window(settings)
    return out


# ---------------------------------------------------------------- the plain reference


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
    dtype = a.dtype if routing_dtype == "float32" else getattr(torch, routing_dtype)
    return float(torch.dot(a.to(dtype), b.to(dtype)))


def _ref_fold(state: KVMState, ctx: int, params: KVMParams, settings: KVMSettings) -> None:
    """Fold the oldest window chunk into the rows, one (batch, kv head) and one token at a time."""
    c, rows = settings.chunk_size, state.rows
    work = rows.s_k.dtype
    k_o = state.window_k.view()[:, :, :c].to(work)
    v_o = state.window_v.view()[:, :, :c].to(work)
    g_o = state.window_gate.view()[:, :, :c, 0].to(work) if state.window_gate is not None else torch.ones_like(k_o[..., 0])
    n_app = settings.append_count(rows.count, ctx)
    batch, heads = k_o.shape[:2]
    new_k, new_v, new_r = [], [], []
    for b in range(batch):
        for h in range(heads):
            s_k, s_v, radius = list(rows.s_k[b, h]), list(rows.s_v[b, h]), list(rows.radius[b, h])
            ko = [_ref_prepare(k_o[b, h, j], params, settings.rot_dim) for j in range(c)]
            g = [g_o[b, h, j] for j in range(c)]
            # append: the n_app tokens least similar to any row (sink included, ungated keys)
            read = [_ref_layer_norm(r, params) for r in s_k]
            novelty = [max(_ref_dot(ko[j], r, settings.routing_dtype) for r in read) for j in range(c)]
            chosen = sorted(sorted(range(c), key=lambda j: (novelty[j], j))[:n_app])
            for j in chosen:
                weight = g[j] if settings.gate_appends else 1.0
                s_k.append(weight * ko[j])
                s_v.append(weight * v_o[b, h, j])
                radius.append(torch.ones((), dtype=work) if settings.value_norm == "count" else torch.sqrt((v_o[b, h, j] ** 2).sum()))
            # merge: every target is chosen against the post-append rows, then the sums grow
            read = [_ref_layer_norm(r, params) for r in s_k]
            targets = []
            for j in range(c):
                if j in chosen:
                    continue
                best, best_score = None, -math.inf
                for i in range(settings.sink_len, len(s_k)):
                    score = _ref_dot(g[j] * ko[j], read[i], settings.routing_dtype)
                    if score > best_score:  # strictly greater: ties keep the lowest row index
                        best, best_score = i, score
                targets.append((j, best))
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

    state.rows = _ref_rows(unflat(new_k), unflat(new_v), unflat(new_r), params, settings)


def _ref_read(q: torch.Tensor, state: KVMState, show_state: bool, params: KVMParams, scale: float) -> torch.Tensor:
    """Output of one token: q (B, Hq, d) against every visible row and window key, head by head."""
    batch, hq, _ = q.shape
    win_k, win_v, rows = state.window_k.view(), state.window_v.view(), state.rows
    work = rows.s_k.dtype
    group = hq // win_k.shape[1]
    out = []
    for b in range(batch):
        for h in range(hq):
            kv = h // group
            tau_s = params.tau_state[h].to(work) if params.tau_state is not None else 1.0
            tau_w = params.tau_window[h].to(work) if params.tau_window is not None else 1.0
            qh = q[b, h].to(work)
            scores = [(win_k[b, kv].to(work) * tau_w) @ qh * scale]
            values = [win_v[b, kv].to(work)]
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
    """``kvm_step`` written token by token from the spec (slow; the tests' yardstick)."""
    _check_inputs(q, k, v, gate, params)
    _check_state(state, settings, k, gate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    c, w = settings.chunk_size, settings.window_chunks
    outs = []
    for i in range(q.shape[2]):
        t = state.seq_len
        if t % c == 0 and t >= w * c:  # the oldest window chunk leaves the window
            if t >= (w + 1) * c:  # (the first chunk is already in the rows)
                _ref_fold(state, t, params, settings)
            for buf in state.buffers():
                buf.keep_last(len(buf) - c)
        state.append_window(k[:, :, i : i + 1], v[:, :, i : i + 1], gate[:, :, i : i + 1] if gate is not None else None)
        if t < c:  # the first chunk becomes rows as it arrives
            ki = _ref_prepare(k[:, :, i : i + 1], params, settings.rot_dim)
            vi = v[:, :, i : i + 1].to(ki.dtype)
            ri = torch.ones_like(vi[..., 0]) if settings.value_norm == "count" else torch.sqrt((vi**2).sum(dim=-1))
            rows = state.rows
            state.rows = _ref_rows(torch.cat((rows.s_k, ki), 2), torch.cat((rows.s_v, vi), 2), torch.cat((rows.radius, ri), 2), params, settings)
        outs.append(_ref_read(q[:, :, i], state, t >= w * c, params, scale))
        state.seq_len = t + 1
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
