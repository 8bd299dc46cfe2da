"""``kvm``: key-value means attention (docs/kvm.md).

The layer is the usual projections (+ QK-norm and RoPE), a merge gate g = 1 + ELU(x W_g) per token
and KV head, LN_s and two per-query-head temperatures, around the functional core in
``slimkv.ops.kvm`` (which documents the mechanism). Queries and window keys use partial RoPE by
default (``rope="partial"``, ``rope_fraction=0.5``: the FIRST half of each head's channels, as
adjacent pairs, like the paper's reference); those rotary channels are zeroed before a key enters
the compressed state. ``rope="none"`` is allowed; ``rope="full"`` is refused because it would leave
state keys with no content.

The cache (``KVMCache``) holds the compressed rows and the exact window; ``cache.state_rows`` is the
number of rows now. Its size after N tokens is flat in N for ``schedule="fixed"`` and grows as
``sqrt_coef * sqrt(N)`` rows for ``sqrt``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from slimkv.attention.base import Attention, LayerShape, Presets, register_attention
from slimkv.attention.cache import AttentionCache
from slimkv.attention.mha import MultiHeadAttention
from slimkv.common.checks import check_bool
from slimkv.ops.kvm import (
    KVMParams,
    KVMSettings,
    KVMState,
    kvm_attention,
    kvm_attention_reference,
    kvm_step_reference,
)
from slimkv.ops.kvm.state import step
from slimkv.ops.linear import Linear
from slimkv.ops.rope import ROPE_MODES, rotary_dim

LN_S_EPS = 1e-5
DEFAULT_ROPE_FRACTION = inspect.signature(Attention.__init__).parameters["rope_fraction"].default


def _check_rope_leaves_content(d_model, n_heads, head_dim, rope, fraction) -> None:
    """Refuse RoPE settings that rotate every channel: state keys drop the rotary channels, so
    nothing would be left. (Malformed shape/rope options are left to the base class to report.)"""
    if head_dim is None and isinstance(d_model, int) and isinstance(n_heads, int) and n_heads > 0:
        head_dim = d_model // n_heads
    if not isinstance(head_dim, int) or head_dim < 1 or rope not in ROPE_MODES or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        return
    if rotary_dim(head_dim, rope, fraction) >= head_dim:
        raise ValueError(
            f"rope={rope!r} rotates all {head_dim} channels of a head, leaving KVM's state keys (rotary channels zeroed) "
            "without content; use rope='partial' (the default, with rope_fraction < 1) or rope='none'"
        )


class KVMCache(AttentionCache):
    """Compressed rows + exact window of one KVM layer (see ``KVMState``); kernel layout
    (batch, kv_heads, time, dim). ``nbytes`` counts the window buffers (live part) and every row
    tensor, including the read cache (LN_s'd keys, radius-normalised values) decode reads.

    A cache is an inference object, but a cached call also works with grad enabled: its output is
    differentiable in the call's own tokens and the layer's parameters, while what the cache
    stores is detached. Earlier calls' tokens enter later calls as constants (gradients do not
    flow back through the cache into earlier calls), each call's output can be backpropagated
    on its own, before or after later calls, and a cache never keeps an autograd graph alive.
    Train without a cache: one call over the whole sequence. A call that raises leaves the cache
    exactly as it was, so it can be retried."""

    def __init__(self, owner_spec: tuple, batch_size: int, state: KVMState, *, dtype, device) -> None:
        super().__init__(owner_spec, batch_size, dtype, device)
        self.state = state

    @property
    def state_rows(self) -> int:
        """Rows in the compressed state now."""
        return self.state.state_rows

    def tensors(self):
        return iter(self.state.tensors())

    def mark(self) -> tuple:
        """The state's rows (never modified in place), its window buffers (objects and extents) and counts."""
        buffers = {name: getattr(self.state, name) for name in ("window_k", "window_v", "window_gate")}
        return self.seq_len, self.state.seq_len, self.state.rows, {name: (b, b.mark()) for name, b in buffers.items() if b is not None}

    def rollback(self, mark: tuple) -> None:
        self.seq_len, self.state.seq_len, self.state.rows, buffers = mark
        for name, (buffer, buffer_mark) in buffers.items():
            buffer.restore(buffer_mark)
            setattr(self.state, name, buffer)


class KVMRegions:
    """KVM's own parameters and forward around projections a layer makes itself: LN_s, the merge
    gate, the two temperatures, the call into the functional core with or without a ``KVMCache``,
    and the cache half of the contract (``new_cache``, ``_cache_bytes``, ``cache_spec``). Shared by
    ``kvm`` (per-head keys) and ``mla-kvm`` (latent rows as the one key head): the layer lists
    this class first among its bases, sets ``self.settings`` (with ``rot_dim``) before calling
    ``_add_kvm_parameters`` and gives its ``state_shape``."""

    def _add_kvm_parameters(self, key_width: int, d_model: int, n_heads: int, n_kv_heads: int, *, merge_gate: bool, use_temperatures: bool) -> None:
        """LN_s over a state key (``key_width``), a gate per KV head, temperatures per query head."""
        self.ln_s = nn.LayerNorm(key_width, eps=LN_S_EPS)
        self.gate_proj = Linear(d_model, n_kv_heads, bias=False) if merge_gate else None
        if use_temperatures:
            self.tau_state = nn.Parameter(torch.ones(n_heads))
            self.tau_window = nn.Parameter(torch.ones(n_heads))
        else:
            self.tau_state = self.tau_window = None

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        """The projections as the layer's base class; LN_s to identity; temperatures to 1 (the gate
        is a Linear: the base class draws it)."""
        super().reset_parameters(std, out_std)
        with torch.no_grad():
            self.ln_s.reset_parameters()
            for tau in (self.tau_state, self.tau_window):
                if tau is not None:
                    tau.fill_(1.0)

    def state_shape(self) -> tuple[int, int, int]:
        """(KV heads, key width, value width) of the state's rows and window; the layer says."""
        raise NotImplementedError

    def cache_spec(self) -> tuple:
        return super().cache_spec() + (self.settings, self.gate_proj is not None)

    def new_cache(self, batch_size: int, dtype=None, device=None, storage=None) -> KVMCache:
        b, dtype, device, storage = self._cache_args(batch_size, dtype, device, storage)
        if storage.bits is not None:
            raise ValueError(f"storage={storage.name!r}: attention kind {self.kind!r} updates its memory rows in place (running means), "
                             "which quantized storage cannot hold; use storage='full'")
        state = KVMState(b, *self.state_shape(), dtype=dtype, device=device, gated=self.gate_proj is not None)
        return KVMCache(self.cache_spec(), b, state, dtype=dtype, device=device)

    def _cache_bytes(self, seq_len: int, dtype: torch.dtype, batch_size: int) -> int:
        return KVMState.expected_nbytes(self.settings, seq_len, batch_size, *self.state_shape(), dtype, self.gate_proj is not None)

    def kvm_params(self) -> KVMParams:
        """The tensors the functional core needs besides q, k, v and the gate."""
        return KVMParams(self.ln_s.weight, self.ln_s.bias, self.tau_state, self.tau_window, self.ln_s.eps)

    def merge_gates(self, x: torch.Tensor) -> torch.Tensor | None:
        """g = 1 + ELU(x W_g): (batch, time, d_model) -> (batch, kv_heads, time), or None without a gate."""
        if self.gate_proj is None:
            return None
        return (1.0 + F.elu(self.gate_proj(x))).transpose(1, 2)

    def _kvm_attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVMCache | None,
                    scale: float | None = None) -> torch.Tensor:
        """KVM over q (batch, Hq, time, d), k (batch, Hkv, time, d), v (batch, Hkv, time, dv) of
        the tokens of x, through the ``reference`` or the optimised core; advances ``cache``.
        Returns (batch, Hq, time, dv)."""
        gate, params = self.merge_gates(x), self.kvm_params()
        reference = self.backend == "reference"
        if cache is None:
            run = kvm_attention_reference if reference else kvm_attention
            return run(q, k, v, gate, params, self.settings, scale=scale)
        advance = kvm_step_reference if reference else step  # ``step``: kvm_step without input checks (built here)
        out = advance(q, k, v, gate, params, self.settings, cache.state, scale=scale)
        cache.seq_len = cache.state.seq_len
        return out

    def _kvm_repr(self) -> str:
        s = self.settings
        schedule = getattr(s.schedule, "__name__", "callable") if callable(s.schedule) else s.schedule
        return (f", chunk_size={s.chunk_size}, window_chunks={s.window_chunks}, schedule={schedule}, sink_len={s.sink_len}, "
                f"value_norm={s.value_norm}, merge_gate={self.gate_proj is not None}, temperatures={self.tau_state is not None}")


def kvm_settings(*, chunk_size: int, window_chunks: int, schedule, min_rows, sqrt_coef, saturating_rows, max_rows, sink_len: int,
                 value_norm: str, routing_dtype: str, gate_appends: bool, merge_gate: bool, use_temperatures: bool) -> KVMSettings:
    """The layer options of a KVM kind as ``KVMSettings`` (rot_dim set later), with the layer-level checks."""
    settings = KVMSettings(chunk_size=chunk_size, window_chunks=window_chunks, schedule=schedule, min_rows=min_rows, sqrt_coef=sqrt_coef,
                           saturating_rows=saturating_rows, max_rows=max_rows, sink_len=sink_len, value_norm=value_norm,
                           routing_dtype=routing_dtype, gate_appends=gate_appends)
    check_bool("use_temperatures", use_temperatures)
    check_bool("merge_gate", merge_gate)
    if gate_appends and not merge_gate:
        raise ValueError("gate_appends=True needs merge_gate=True (there is no gate to weight appended rows with)")
    return settings


class KVMAttention(KVMRegions, MultiHeadAttention):
    """Key-value means: one softmax over exact recent chunks and a compressed, optionally growing
    state of key/value means. Options are those of ``KVMSettings`` (chunk_size, window_chunks,
    schedule, min_rows, sqrt_coef, saturating_rows, max_rows, sink_len, value_norm, routing_dtype,
    gate_appends), plus ``n_kv_heads`` (GQA: rows and gates per KV head, temperatures per query
    head) and the ablation switches ``use_temperatures`` and ``merge_gate``. (A callable
    ``schedule`` works for a module built here; a ``ModelConfig`` refuses one, since its options are saved as JSON.)"""

    kind = "kvm"

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        *,
        chunk_size: int = 256,
        window_chunks: int = 2,
        schedule: str | Callable[[int], int] = "fixed",
        min_rows: int | None = None,
        sqrt_coef: float | None = None,
        saturating_rows: int | None = None,
        max_rows: int | None = None,
        sink_len: int = 1,
        n_kv_heads: int | None = None,
        use_temperatures: bool = True,
        value_norm: str = "radius",
        merge_gate: bool = True,
        routing_dtype: str = "float32",
        gate_appends: bool = False,
        rope: str = "partial",
        **common,
    ) -> None:
        settings = kvm_settings(chunk_size=chunk_size, window_chunks=window_chunks, schedule=schedule, min_rows=min_rows, sqrt_coef=sqrt_coef,
                                saturating_rows=saturating_rows, max_rows=max_rows, sink_len=sink_len, value_norm=value_norm,
                                routing_dtype=routing_dtype, gate_appends=gate_appends, merge_gate=merge_gate, use_temperatures=use_temperatures)
        _check_rope_leaves_content(d_model, n_heads, head_dim, rope, common.get("rope_fraction", DEFAULT_ROPE_FRACTION))
        super().__init__(d_model, n_heads, head_dim, n_kv_heads=n_kv_heads, rope=rope, **common)
        self.settings = replace(settings, rot_dim=self.rotary.rot_dim)
        self._add_kvm_parameters(self.head_dim, d_model, n_heads, self.n_kv_heads, merge_gate=merge_gate, use_temperatures=use_temperatures)

    def state_shape(self) -> tuple[int, int, int]:
        """Per KV head: keys and values of head_dim."""
        return self.n_kv_heads, self.head_dim, self.head_dim

    def _forward(self, x: torch.Tensor, cache: KVMCache | None) -> torch.Tensor:
        start = cache.seq_len if cache is not None else 0
        q, k, v = self.project_qkv(x, start)
        out = self._kvm_attend(x, q, k, v, cache)
        b, t = x.shape[:2]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        return super().extra_repr() + self._kvm_repr()


def _kvm_comparable(shape: LayerShape, explicit: dict) -> tuple[dict, str]:
    """KVM at the recipe's scale: chunks of seq_len/8, so it compresses within one training window
    (the paper's 256-token chunks and 256 rows would never compress a 128-token window)."""
    chunk = max(2, shape.seq_len // 8)
    schedule = explicit.get("schedule", "fixed")
    options: dict = {"chunk_size": chunk, "schedule": schedule}
    if schedule == "sqrt":
        options.update(min_rows=max(1, chunk // 2), sqrt_coef=2.0)
        return options, f"chunk_size = seq_len/8 = {chunk}; rows = max(2 sqrt(N), {chunk // 2})"
    if schedule == "fixed":
        options["min_rows"] = chunk
        return options, f"chunk_size = seq_len/8 = {chunk}; {chunk} state rows"
    return options, f"chunk_size = seq_len/8 = {chunk}"


def _kvm_sizes(shape: LayerShape) -> list[tuple[str, dict]]:
    """Fixed state of 1, 2 and 4 chunks' worth of rows, and the sqrt schedule (rows never fall
    below one chunk: the first chunk enters the state whole, so smaller settings would coincide)."""
    chunk = max(2, shape.seq_len // 16)
    sizes = [(f"kvm:chunk_size={chunk},min_rows={rows}", {"chunk_size": chunk, "schedule": "fixed", "min_rows": rows}) for rows in (chunk, 2 * chunk, 4 * chunk)]
    sizes.append((f"kvm:chunk_size={chunk},schedule=sqrt", {"chunk_size": chunk, "schedule": "sqrt", "min_rows": chunk, "sqrt_coef": 2.0}))
    return sizes


register_attention(
    "kvm",
    KVMAttention,
    example_options=[
        # chunk 4, window 2 chunks: the state appears at token 8 and folds run at 12, 16, ..., 36
        {"chunk_size": 4, "schedule": "fixed", "min_rows": 6},  # 2 appends at the first fold, merges after
        {"chunk_size": 4, "schedule": "sqrt", "sqrt_coef": 2.0, "min_rows": 1, "n_kv_heads": 2},  # grows 4 -> 12 rows
        {"chunk_size": 3, "window_chunks": 3, "schedule": "saturating", "saturating_rows": 8},  # grows 3 -> 6 rows
        {"chunk_size": 4, "min_rows": 5, "sink_len": 0, "value_norm": "count", "merge_gate": False, "use_temperatures": False},
        {"chunk_size": 4, "min_rows": 6, "n_kv_heads": 2, "rope_frequencies": [0.9, 0.01]},  # a converted layer's shape (convert --to kvm)
    ],
    description="key-value means: exact window + compressed growing state",
    presets=Presets(
        comparable=_kvm_comparable,
        decode=lambda shape: [("kvm-fixed", {"chunk_size": 256, "schedule": "fixed"}), ("kvm-sqrt", {"chunk_size": 256, "schedule": "sqrt"})],
        sizes=_kvm_sizes,
        demo=("kvm:schedule=fixed", "kvm:schedule=sqrt", "swa+kvm"),
    ),
)
