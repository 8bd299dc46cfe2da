"""The KVM decode state and ``kvm_step``: advance a state by any number of tokens."""

from __future__ import annotations

import math

import torch

from slimkv.common.buffer import GrowableBuffer, dtype_bytes, state_bytes
from slimkv.ops.kvm.core import KVMParams, Rows, check_inputs, decode_token, process
from slimkv.ops.kvm.settings import KVMSettings
from slimkv.ops.norm import compute_dtype

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

    def nbytes(self, float_size: int | None = None) -> int:
        """Bytes of the live state (``float_size``: ``slimkv.common.buffer.element_bytes``)."""
        return sum(state_bytes(t, float_size) for t in self.tensors())


    def append_window(self, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None) -> tuple:
        """Append new tokens' keys, values, gates (B, Hkv, n); return the live views."""
        keys, values = self.window_k.append(k), self.window_v.append(v)
        gates = self.window_gate.append(gate.unsqueeze(-1)) if self.window_gate is not None else None
        return keys, values, gates

    def window_with(self, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None) -> tuple:
        """The window followed by new tokens, as fresh tensors (the state is not changed)."""
        gates = torch.cat((self.window_gate.view(), gate.unsqueeze(-1)), dim=2) if self.window_gate is not None else None
        return torch.cat((self.window_k.view(), k), dim=2), torch.cat((self.window_v.view(), v), dim=2), gates

    def window_lengths(self) -> tuple[int, ...]:
        return tuple(len(b) for b in self.buffers())

    def restore_window(self, lengths: tuple[int, ...]) -> None:
        """Drop what was appended to the window buffers since they held ``lengths`` tokens."""
        for name, length in zip(("window_k", "window_v", "window_gate"), lengths):
            buf = getattr(self, name)
            if len(buf) == length:
                continue
            kept = GrowableBuffer(*buf.shape[:2], buf.shape[2], dtype=buf.dtype, device=buf.device, capacity=buf.capacity)
            kept.append(buf.view()[:, :, :length])
            setattr(self, name, kept)

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


def check_state(state: KVMState, settings: KVMSettings, k: torch.Tensor, gate: torch.Tensor | None) -> None:
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

    Autograd: with grad enabled the outputs are differentiable in this call's inputs (q, k, v,
    gate and the parameters), while what the state stores is detached: earlier calls' tokens enter
    as constants, a later call never reaches back into an earlier call's graph, and a state never
    keeps a graph alive. A call that raises leaves the state exactly as it was.
    """
    check_inputs(q, k, v, gate, params)
    check_state(state, settings, k, gate)
    return step(q, k, v, gate, params, settings, state, scale=scale)


def can_decode_fast(q: torch.Tensor, state: KVMState, settings: KVMSettings) -> bool:
    """Whether a call is one token between folds with the state visible, in a dtype the rows share,
    without autograd (``decode_token``'s conditions)."""
    pos = state.seq_len
    return (q.shape[2] == 1 and pos % settings.chunk_size != 0 and settings.state_visible(pos) and q.dtype == state.rows.read_k.dtype
            and not torch.is_grad_enabled())


def step(
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
    """``kvm_step`` without the input checks (the layer builds its inputs itself)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if can_decode_fast(q, state, settings):
        keys, values, _ = state.append_window(k, v, gate)
        state.seq_len += 1
        return decode_token(q, state.rows, keys, values, params, scale)
    start = state.seq_len
    base = settings.window_start(start)
    tracked = (q, k, v, gate, params.ln_weight, params.ln_bias, params.tau_state, params.tau_window)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked):
        # fresh tensors for autograd (the buffers are written in place by later calls); the state
        # is only written once the call has succeeded
        keys, values, gates = state.window_with(k, v, gate)
        out, rows = process(q, keys, values, gates, base, start, state.rows, params, settings, scale)
        state.append_window(k.detach(), v.detach(), gate.detach() if gate is not None else None)
    else:
        lengths = state.window_lengths()
        keys, values, gates = state.append_window(k, v, gate)
        try:
            out, rows = process(q, keys, values, gates, base, start, state.rows, params, settings, scale)
        except BaseException:
            state.restore_window(lengths)
            raise
    state.rows = rows.detached()
    state.seq_len = start + q.shape[2]
    state.trim_window(settings)
    return out
