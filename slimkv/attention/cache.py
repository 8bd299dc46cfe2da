"""``AttentionCache``: the base of every mechanism's cache.

It knows its batch size, dtype, device and owner, counts ``seq_len`` and reports ``nbytes()`` from
the live tensors it holds, never from a formula (the contract compares it with the analytic
``cache_bytes``). Storage that grows per token is a ``slimkv.common.buffer.GrowableBuffer``.

A cache is an inference object: what it stores never carries autograd history. A cached call made
with gradients enabled is differentiable in its own tokens (and the parameters); earlier tokens
are constants. A call that raises leaves the cache as it was before the call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from slimkv.common.buffer import GrowableBuffer, state_bytes
from slimkv.ops.quantize import FULL, KVStorage, QuantizedBuffer

BUFFERS = (GrowableBuffer, QuantizedBuffer)


class AttentionCache:
    """Base of every mechanism's cache: bookkeeping, validation and honest byte counts.

    Subclasses hold their state in ``GrowableBuffer``s or tensors and list them in ``tensors()``.
    """

    def __init__(self, owner_spec: tuple, batch_size: int, dtype: torch.dtype, device: torch.device, storage: KVStorage = FULL) -> None:
        self.owner_spec = owner_spec
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.storage = storage
        self.seq_len = 0

    def row_buffer(self, heads: int, dim: int) -> GrowableBuffer | QuantizedBuffer:
        """An empty buffer for per-token rows (batch, heads, time, dim), held as ``self.storage`` says."""
        return self.storage.buffer(self.batch_size, heads, dim, dtype=self.dtype, device=self.device)

    def reads_codes(self, new_tokens: int, backend: str) -> bool:
        """Whether a call of ``new_tokens`` should read this cache's rows as stored (int8 / int4 codes
        in place: ``slimkv.ops.attention.stored_decode_attention``) rather than dequantized: a
        decode step (one new token) on quantized storage, the fused backend, no autograd."""
        return new_tokens == 1 and self.storage.bits is not None and backend != "reference" and not torch.is_grad_enabled()

    def reads_stored(self, new_tokens: int, backend: str) -> bool:
        """Whether a call of ``new_tokens`` should read this cache's segments as stored, one after
        the other under one softmax (``stored_decode_attention``), rather than concatenated and
        masked: a decode step on the fused backend with no autograd, over full-precision rows, or
        over codes where ``reads_codes`` says so. Bounded caches (sinks + a window) take it: every
        row they hold is visible to the next token, so the step needs no mask."""
        if self.storage.bits is not None:
            return self.reads_codes(new_tokens, backend)
        return new_tokens == 1 and backend != "reference" and not torch.is_grad_enabled()

    def tensors(self) -> Iterator[GrowableBuffer | QuantizedBuffer | torch.Tensor]:
        """The objects that hold live state (for ``nbytes``)."""
        return iter(())

    def nbytes(self, float_size: int | None = None) -> int:
        """Bytes of the live state (the used part of each buffer, not its spare capacity); with
        ``float_size``, floating elements counted at that size (``slimkv.common.buffer.element_bytes``)."""
        return sum(state_bytes(t, float_size) for t in self.tensors())

    def mark(self) -> Any:
        """A mark of the current state; ``rollback(mark)`` undoes every change made after it (a call
        that fails half way must not leave the cache advanced). Caches whose state is not only
        growable buffers override both."""
        return self.seq_len, [t.mark() for t in self.tensors() if isinstance(t, BUFFERS)]

    def rollback(self, mark: Any) -> None:
        self.seq_len, marks = mark
        for buffer, buffer_mark in zip((t for t in self.tensors() if isinstance(t, BUFFERS)), marks):
            buffer.restore(buffer_mark)

    def check_compatible(self, spec: tuple, x: torch.Tensor) -> None:
        """Raise ValueError if this cache cannot serve a call with input ``x`` to a module with ``spec``."""
        if spec is not self.owner_spec:
            if spec != self.owner_spec:
                raise ValueError(f"cache was made by a module {self.owner_spec} and cannot serve a module {spec}")
            self.owner_spec = spec  # the same spec: later calls compare identity
        if x.shape[0] != self.batch_size:
            raise ValueError(f"batch size {x.shape[0]} does not match the cache's batch_size={self.batch_size}")
        if x.dtype != self.dtype:
            raise ValueError(f"input dtype {x.dtype} does not match the cache's dtype={self.dtype}")
        if x.device.type != self.device.type:
            raise ValueError(f"input device {x.device} does not match the cache's device={self.device}")

    def __repr__(self) -> str:
        storage = "" if self.storage.bits is None else f", storage={self.storage.name}"
        return f"{type(self).__name__}(seq_len={self.seq_len}, batch_size={self.batch_size}, dtype={self.dtype}{storage}, nbytes={self.nbytes()})"


class LRKVEntries(NamedTuple):
    """What LRKV caches per token; used for the new tokens of a call and for views of the whole
    cache alike. The latents are time-last: for one group an r x L block whose channel rows are
    read as the right operand of q_lat Z (in the cache they are strided views of the token rows,
    ``LRKVCache``).

    shared_k:  (batch, 1, time, head_dim)  shared key; in ``decoupled`` mode its rotary channels are
               already scaled by the qk-norm gain (if any) and rotated
    shared_v:  (batch, 1, time, head_dim)  shared value
    latent_k:  (batch, groups, rank_k, time)  z^K_g = x U^K_g
    latent_v:  (batch, groups, rank_v, time)  z^V_g = x U^V_g
    key_scale: (batch, groups, time, 1)  s = 1 / rms(k_g) with ``qk_norm``, else None
    """

    shared_k: torch.Tensor
    shared_v: torch.Tensor
    latent_k: torch.Tensor
    latent_v: torch.Tensor
    key_scale: torch.Tensor | None

    def tokens(self, start: int, stop: int) -> LRKVEntries:
        """The entries of tokens start..stop-1 (views)."""
        return LRKVEntries(
            self.shared_k[:, :, start:stop],
            self.shared_v[:, :, start:stop],
            self.latent_k[..., start:stop],
            self.latent_v[..., start:stop],
            None if self.key_scale is None else self.key_scale[:, :, start:stop],
        )


class LRKVCache(AttentionCache):
    """Every past token's LRKV entries as one row of ``row_width`` elements in a buffer of kernel
    layout (batch, 1, time, row_width): [shared key | G key latents | shared value | G value latents]
    (group-major), and (with qk_norm) the per-group key scales beside it. A decode step can then
    read the rows as the keys (the first ``key_width`` elements) and the values (the rest) of one
    key/value head shared by every query head (``LowRankKVAttention._decode_rows``); ``entries``
    gives the same storage as ``LRKVEntries`` views."""

    def __init__(self, owner_spec: tuple, batch_size: int, groups: int, head_dim: int, rank_k: int, rank_v: int, key_scale: bool, *, dtype, device,
                 storage: KVStorage = FULL) -> None:
        super().__init__(owner_spec, batch_size, dtype, device, storage)
        self.groups, self.head_dim, self.rank_k, self.rank_v = groups, head_dim, rank_k, rank_v
        self.key_width = head_dim + groups * rank_k
        self.row_width = self.key_width + head_dim + groups * rank_v
        self.rows = self.row_buffer(1, self.row_width)
        self.key_scale = GrowableBuffer(batch_size, groups, 1, dtype=dtype, device=device) if key_scale else None

    def tensors(self):
        return iter(b for b in (self.rows, self.key_scale) if b is not None)

    def pack(self, new: LRKVEntries) -> torch.Tensor:
        """The rows (batch, 1, time, row_width) of entries ``new``."""
        b, _, t, _ = new.shared_k.shape
        latent_k = new.latent_k.permute(0, 3, 1, 2).reshape(b, 1, t, self.groups * self.rank_k)
        latent_v = new.latent_v.permute(0, 3, 1, 2).reshape(b, 1, t, self.groups * self.rank_v)
        return torch.cat((new.shared_k, latent_k, new.shared_v, latent_v), dim=-1)

    def entries(self, rows: torch.Tensor, key_scale: torch.Tensor | None) -> LRKVEntries:
        """``LRKVEntries`` views of ``rows`` (batch, 1, time, row_width)."""
        hd, kw = self.head_dim, self.key_width

        def latents(first: int, rank: int) -> torch.Tensor:  # (batch, G, rank, time), strided
            return rows[:, 0, :, first : first + self.groups * rank].unflatten(-1, (self.groups, rank)).permute(0, 2, 3, 1)

        return LRKVEntries(rows[..., :hd], rows[..., kw : kw + hd], latents(hd, self.rank_k), latents(kw + hd, self.rank_v), key_scale)

    def extend(self, new: LRKVEntries) -> tuple[LRKVEntries, torch.Tensor]:
        """Append the new tokens' entries; return views of every cached entry (past and new) and
        the rows they view. With autograd recording, the returned entries are a fresh copy
        (differentiable in the new tokens) and the buffer stores the new entries detached."""
        self.seq_len += new.shared_k.shape[2]
        rows = self.pack(new)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in new):
            rows = torch.cat((self.rows.view(), rows), dim=2)
            scale = None if self.key_scale is None else torch.cat((self.key_scale.view(), new.key_scale), dim=2)
            self.rows.append(rows[:, :, -new.shared_k.shape[2] :].detach())
            if self.key_scale is not None:
                self.key_scale.append(new.key_scale.detach())
            return self.entries(rows, scale), rows
        live = self.rows.append(rows)
        scale = None if self.key_scale is None else self.key_scale.append(new.key_scale)
        return self.entries(live, scale), live


