"""Cache storage shared by every mechanism.

``GrowableBuffer`` holds a sequence of per-token (or per-row) vectors in kernel layout
(batch, heads, time, dim) with spare capacity, so appending a token never copies what is stored
(capacity doubles when full: amortised O(1) per token) and dropping the oldest tokens (sliding
windows) only moves a pointer until the buffer is compacted. ``AttentionCache`` is the base every
mechanism's cache derives from: it knows its batch size, dtype, device and owner, counts
``seq_len`` and reports ``nbytes()`` from the live tensors it holds, never from a formula.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

MIN_CAPACITY = 64


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


class GrowableBuffer:
    """A (batch, heads, length, dim) tensor that grows along ``length`` without per-token copies."""

    def __init__(self, batch: int, heads: int, dim: int, *, dtype: torch.dtype, device: torch.device, capacity: int = 0) -> None:
        self.shape = (batch, heads, dim)
        self.dtype, self.device = dtype, torch.device(device)
        self._storage = torch.empty(batch, heads, max(capacity, 0), dim, dtype=dtype, device=device)
        self._start = 0
        self._end = 0

    def __len__(self) -> int:
        return self._end - self._start

    @property
    def capacity(self) -> int:
        return self._storage.shape[2]

    def view(self) -> torch.Tensor:
        """The live part, (batch, heads, len, dim); a view, writes go to the buffer."""
        return self._storage[:, :, self._start : self._end]

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Append ``x`` of shape (batch, heads, n, dim); returns the live view including it."""
        n = x.shape[2]
        if self._end + n > self.capacity:
            self._make_room(n)
        self._storage[:, :, self._end : self._end + n] = x
        self._end += n
        return self.view()

    def keep_last(self, n: int) -> None:
        """Drop all but the newest ``n`` entries (pointer move; storage is reused on the next compaction)."""
        if len(self) > n:
            self._start = self._end - n

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select batch rows (beam search)."""
        self._storage = self._storage.index_select(0, index)
        self.shape = (self._storage.shape[0], *self.shape[1:])

    def nbytes(self) -> int:
        b, h, d = self.shape
        return b * h * len(self) * d * self._storage.element_size()

    def _make_room(self, n: int) -> None:
        live = len(self)
        if live + n <= self.capacity and self._start >= live:
            storage = self._storage  # reclaim the dropped prefix; source and target do not overlap
        else:
            storage = torch.empty(
                *self.shape[:2], max(MIN_CAPACITY, 2 * (live + n)), self.shape[2], dtype=self.dtype, device=self.device
            )
        storage[:, :, :live] = self._storage[:, :, self._start : self._end]
        self._storage, self._start, self._end = storage, 0, live


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
        """The objects that hold live state (for ``nbytes`` and batch reordering)."""
        return iter(())

    def nbytes(self) -> int:
        """Bytes of the live state (the used part of each buffer, not its spare capacity)."""
        total = 0
        for t in self.tensors():
            total += t.nbytes() if isinstance(t, GrowableBuffer) else t.numel() * t.element_size()
        return total

    def check_compatible(self, spec: tuple, x: torch.Tensor) -> None:
        """Raise ValueError if this cache cannot serve a call with input ``x`` to a module with ``spec``."""
        if spec != self.owner_spec:
            raise ValueError(f"cache was made by a module {self.owner_spec} and cannot serve a module {spec}")
        if x.shape[0] != self.batch_size:
            raise ValueError(f"batch size {x.shape[0]} does not match the cache's batch_size={self.batch_size}")
        if x.dtype != self.dtype:
            raise ValueError(f"input dtype {x.dtype} does not match the cache's dtype={self.dtype}")
        if x.device.type != self.device.type:
            raise ValueError(f"input device {x.device} does not match the cache's device={self.device}")

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows in place (used by beam search). Caches holding plain tensors override this."""
        for t in self.tensors():
            if not isinstance(t, GrowableBuffer):
                raise NotImplementedError(f"{type(self).__name__} does not support reordering the batch")
            t.select_batch(index)
        self.batch_size = int(index.numel())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seq_len={self.seq_len}, batch_size={self.batch_size}, dtype={self.dtype}, nbytes={self.nbytes()})"
