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

from slimkv.common.buffer import GrowableBuffer, TimeLastBuffer


class AttentionCache:
    """Base of every mechanism's cache: bookkeeping, validation and honest byte counts.

    Subclasses hold their state in ``GrowableBuffer``s or tensors and list them in ``tensors()``.
    """

    def __init__(self, owner_spec: tuple, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.owner_spec = owner_spec
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.seq_len = 0

    def tensors(self) -> Iterator[GrowableBuffer | torch.Tensor]:
        """The objects that hold live state (for ``nbytes``)."""
        return iter(())

    def nbytes(self) -> int:
        """Bytes of the live state (the used part of each buffer, not its spare capacity)."""
        total = 0
        for t in self.tensors():
            total += t.nbytes() if isinstance(t, GrowableBuffer) else t.numel() * t.element_size()
        return total

    def mark(self) -> Any:
        """A mark of the current state; ``rollback(mark)`` undoes every change made after it (a call
        that fails half way must not leave the cache advanced). Caches whose state is not only
        growable buffers override both."""
        return self.seq_len, [t.mark() for t in self.tensors() if isinstance(t, GrowableBuffer)]

    def rollback(self, mark: Any) -> None:
        self.seq_len, marks = mark
        for buffer, buffer_mark in zip((t for t in self.tensors() if isinstance(t, GrowableBuffer)), marks):
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
        return f"{type(self).__name__}(seq_len={self.seq_len}, batch_size={self.batch_size}, dtype={self.dtype}, nbytes={self.nbytes()})"


class LRKVEntries(NamedTuple):
    """What LRKV caches per token; used for the new tokens of a call and for views of the whole
    cache alike. The latents are time-last ("channel-major"): for one head the r x L block is
    contiguous along time, so the decode products q_lat Z^T and a Z are plain streaming GEMMs
    (faster on CPU than the (L, r) layout when the layout was chosen; benchmarks/decode_all.py
    times the whole decode step, ``lrkv`` and ``lrkv-expanded``).

    shared_k:  (batch, 1, time, head_dim)  shared key; in ``decoupled`` mode its rotary channels are
               already scaled by the qk-norm gain (if any) and rotated
    shared_v:  (batch, 1, time, head_dim)  shared value
    latent_k:  (batch, heads, rank_k, time)  z^K_h = x U^K_h
    latent_v:  (batch, heads, rank_v, time)  z^V_h = x U^V_h
    key_scale: (batch, heads, time, 1)  s = 1 / rms(k_h) with ``qk_norm``, else None
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
    """Shared keys/values, per-head latents and (with qk_norm) per-head key scales of every past token."""

    def __init__(self, owner_spec: tuple, batch_size: int, n_heads: int, head_dim: int, rank_k: int, rank_v: int, key_scale: bool, *, dtype, device) -> None:
        super().__init__(owner_spec, batch_size, dtype, device)
        kw = {"dtype": dtype, "device": device}
        self.shared_k = GrowableBuffer(batch_size, 1, head_dim, **kw)
        self.shared_v = GrowableBuffer(batch_size, 1, head_dim, **kw)
        self.latent_k = TimeLastBuffer(batch_size, n_heads, rank_k, **kw)
        self.latent_v = TimeLastBuffer(batch_size, n_heads, rank_v, **kw)
        self.key_scale = GrowableBuffer(batch_size, n_heads, 1, **kw) if key_scale else None

    def tensors(self):
        buffers = (self.shared_k, self.shared_v, self.latent_k.buffer, self.latent_v.buffer, self.key_scale)
        return iter(b for b in buffers if b is not None)

    def extend(self, new: LRKVEntries) -> LRKVEntries:
        """Append the new tokens' entries; return views of every cached entry (past and new). With
        autograd recording, the returned entries are a fresh copy (differentiable in the new
        tokens) and the buffers store the new entries detached."""
        buffers = (self.shared_k, self.shared_v, self.latent_k, self.latent_v, self.key_scale)
        self.seq_len += new.shared_k.shape[2]
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in new):
            dims = (2, 2, -1, -1, 2)  # the time dimension of each entry
            entries = LRKVEntries(*(None if buf is None else torch.cat((buf.view(), t), dim=d) for buf, t, d in zip(buffers, new, dims)))
            for buf, t in zip(buffers, new):
                if buf is not None:
                    buf.append(t.detach())
            return entries
        return LRKVEntries(*(None if buf is None else buf.append(t) for buf, t in zip(buffers, new)))
