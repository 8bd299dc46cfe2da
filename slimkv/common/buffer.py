"""Growable storage for caches, and the element size of a dtype.

``GrowableBuffer`` holds a sequence of per-token (or per-row) vectors in kernel layout
(batch, heads, time, dim) with spare capacity, so appending a token never copies what is stored
(capacity doubles when full: amortised O(1) per token) and dropping the oldest tokens (sliding
windows) only moves a pointer until the buffer is compacted. ``nbytes`` counts the live part only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN_CAPACITY = 64


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (no tensor made: ``nbytes`` asks for it per buffer)."""
    return dtype.itemsize


def element_bytes(dtype: torch.dtype, float_size: int | None = None) -> int:
    """Bytes per element of ``dtype`` as stored, or ``float_size`` for a floating dtype when given:
    a float32 cache counted as the bfloat16 cache it stands for (``float_size=2``; its codes are
    the same, its scales and full-precision rows are in the cache's dtype)."""
    return float_size if float_size is not None and dtype.is_floating_point else dtype_bytes(dtype)


def state_bytes(part: torch.Tensor | GrowableBuffer, float_size: int | None = None) -> int:
    """Bytes of one part of a cache's live state: a tensor, or anything with ``nbytes(float_size)``
    (a buffer's live rows, a quantized buffer's codes, scales and rows)."""
    if isinstance(part, torch.Tensor):
        return part.numel() * element_bytes(part.dtype, float_size)
    return part.nbytes(float_size)


class RowSpan(NamedTuple):
    """``count`` rows of a (batch, heads, capacity, dim) storage named without a tensor view: the
    address of the first (of the first batch row and head) and the storage's batch / head / row
    strides in elements, what a native call reads of them. A view costs microseconds to make, and a
    model's decode step names a few hundred segments."""

    address: int
    count: int
    strides: tuple[int, int, int]


class GrowableBuffer:
    """A (batch, heads, length, dim) tensor that grows along ``length`` without per-token copies."""

    def __init__(self, batch: int, heads: int, dim: int, *, dtype: torch.dtype, device: torch.device | str, capacity: int = 0) -> None:
        self.shape = (batch, heads, dim)
        self.dtype, self.device = dtype, torch.device(device)
        self._storage = torch.empty(batch, heads, max(capacity, 0), dim, dtype=dtype, device=device)
        self._start = 0
        self._end = 0
        self._layout: tuple[torch.Tensor, int, tuple[int, int, int], int] | None = None  # (storage, address, strides, row bytes) for span

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

    def store(self, x: torch.Tensor) -> None:
        """``append`` without returning the view (the interface ``QuantizedBuffer`` shares)."""
        self.append(x)

    def reserve(self, n: int) -> tuple[torch.Tensor, int, int]:
        """Room for ``n`` more rows, written by someone else (a native step writes a token's row
        straight into the storage): (the storage, its first live row, its first free row). The
        rows count only after ``commit(n)``; until then the buffer is as it was."""
        if self._end + n > self.capacity:
            self._make_room(n)
        return self._storage, self._start, self._end

    def commit(self, n: int) -> None:
        """Count the ``n`` rows written after the live ones (``reserve``) as appended."""
        if self._end + n > self.capacity:
            raise ValueError(f"commit({n}): only {self.capacity - self._end} rows were reserved past the live ones")
        self._end += n

    def segments(self) -> list[torch.Tensor]:
        """The live part as one segment (the interface ``QuantizedBuffer`` shares), none when empty."""
        return [self.view()] if len(self) else []

    def span(self, first: int, count: int) -> RowSpan:
        """Rows ``first`` .. ``first + count - 1`` of the storage (as ``reserve`` numbers them) as a
        ``RowSpan``: no view made, the storage's address and strides read once per storage."""
        layout = self._layout
        if layout is None or layout[0] is not self._storage:
            strides = self._storage.stride()
            layout = self._layout = (self._storage, self._storage.data_ptr(), strides[:3], strides[2] * self._storage.element_size())
        return RowSpan(layout[1] + first * layout[3], count, layout[2])

    def spans(self) -> list[RowSpan]:
        """``segments()`` as a ``RowSpan`` (no view made), none when empty."""
        return [self.span(self._start, self._end - self._start)] if len(self) else []

    def keep_last(self, n: int) -> None:
        """Drop all but the newest ``n`` entries (pointer move; storage is reused on the next compaction)."""
        if len(self) > n:
            self._start = self._end - n

    def mark(self) -> tuple[torch.Tensor, int, int]:
        """What ``restore`` needs to undo every append and trim made after this call."""
        return self._storage, self._start, self._end

    def restore(self, mark: tuple[torch.Tensor, int, int]) -> None:
        """Undo the appends and trims since ``mark`` (the marked live entries are never overwritten:
        a later compaction writes only into dropped slots or into new storage)."""
        self._storage, self._start, self._end = mark

    def nbytes(self, float_size: int | None = None) -> int:
        """Bytes of the live rows (``float_size``: see ``element_bytes``)."""
        b, h, d = self.shape
        return b * h * len(self) * d * element_bytes(self.dtype, float_size)

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
