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
from typing import Any

import torch

from slimkv.common.buffer import GrowableBuffer


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
