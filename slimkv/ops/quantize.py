"""Quantized cache storage: int8 / int4 codes in channel groups, with a full-precision residual window.

``KVStorage`` names how a cache stores its per-token rows: ``full`` (the cache dtype) or ``int8`` /
``int4`` (after KIVI, Liu et al. 2024, but keys like values, per token: each token's row is cut
into groups of ``group`` channels, each group stored as unsigned codes with its own scale and
minimum in the cache dtype; KIVI's per-channel keys measured no better on SmolLM2's retrieval,
docs/conversion.md "Fewer bits per exact head"; the newest
``residual`` tokens stay in full precision, and the older ones are quantized ``block`` at a time:
between ``residual`` and ``residual + block - 1`` rows are in full precision. Quantizing a block
at a time, as KIVI does its groups, spares a decode step the quantizer's calls at all but one
step in ``block``; ``block=1`` quantizes each row as it leaves the window).
``QuantizedBuffer`` has ``GrowableBuffer``'s interface, so any cache that stores rows in growable
buffers composes with it: ``append``/``view`` return the dequantized history (the codes are what it
holds; ``nbytes`` counts codes, scales, minima and the residual window), and ``segments`` returns
what it holds as it is (``QuantizedRows`` codes, then the residual rows), which
``slimkv.ops.attention.stored_decode_attention`` reads in place with the native kernel.

``quantize_groups`` / ``dequantize_groups`` (``slimkv.ops.codes``) are the plain reference the buffer is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slimkv.common.buffer import GrowableBuffer, RowSpan, dtype_bytes
from slimkv.common.spec import parse_item, split_items
from slimkv.ops import native
from slimkv.ops.codes import CodeSpans, QuantizedRows, dequantize_groups, quantize_groups

STORAGE_KINDS = {"full": None, "int8": 8, "int4": 4}
DEFAULT_GROUP = 32
DEFAULT_RESIDUAL = 128
DEFAULT_BLOCK = 16


@dataclass(frozen=True)
class KVStorage:
    """How a cache stores its rows: ``bits`` (8 or 4; None = full precision), channels per
    quantization ``group``, the newest ``residual`` tokens kept in full precision, and the rows
    past them quantized ``block`` at a time."""

    bits: int | None = None
    group: int = DEFAULT_GROUP
    residual: int = DEFAULT_RESIDUAL
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.bits not in (None, 4, 8):
            raise ValueError(f"storage bits must be 4 or 8 (or None for full precision), got {self.bits!r}")
        for name, value, low in (("group", self.group, 2), ("residual", self.residual, 0), ("block", self.block, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"storage {name} must be an integer >= {low}, got {value!r}")
        if self.bits == 4 and self.group % 2:
            raise ValueError(f"int4 storage packs two codes per byte: group must be even, got {self.group}")

    @property
    def name(self) -> str:
        if self.bits is None:
            return "full"
        return f"int{self.bits}:group={self.group},residual={self.residual},block={self.block}"

    def buffer(self, batch: int, heads: int, dim: int, *, dtype: torch.dtype, device: torch.device | str) -> GrowableBuffer | QuantizedBuffer:
        """An empty buffer for (batch, heads, time, dim) rows stored this way."""
        if self.bits is None:
            return GrowableBuffer(batch, heads, dim, dtype=dtype, device=device)
        return QuantizedBuffer(batch, heads, dim, self, dtype=dtype, device=device)

    def row_bytes(self, dim: int, dtype: torch.dtype) -> int:
        """Bytes of one quantized row of ``dim`` channels: codes, then a scale and a minimum per group."""
        groups = math.ceil(dim / self.group)
        return groups * self.group * self.bits // 8 + 2 * groups * dtype_bytes(dtype)


FULL = KVStorage()


def parse_storage(text: str | KVStorage | None, option: str = "storage") -> KVStorage:
    """``"int4"``, ``"int8:group=64,residual=32,block=16"``, ``"full"`` (or None) -> ``KVStorage``; ValueError naming ``option``."""
    if text is None:
        return FULL
    if isinstance(text, KVStorage):
        return text
    kind, _, tail = str(text).strip().partition(":")
    if kind not in STORAGE_KINDS:
        raise ValueError(f"{option} {text!r}: the storage must be one of {', '.join(STORAGE_KINDS)} (e.g. int4:group=32,residual=128,block=16)")
    values = dict(parse_item(item, f"{option} {text!r}") for item in split_items(tail, f"{option} {text!r}"))
    unknown = sorted(set(values) - {"group", "residual", "block"})
    if unknown:
        raise ValueError(f"{option} {text!r}: unknown setting(s) {', '.join(unknown)}; allowed: group, residual, block")
    if kind == "full":
        if values:
            raise ValueError(f"{option} {text!r}: full storage takes no settings")
        return FULL
    try:
        return KVStorage(bits=STORAGE_KINDS[kind], **values)
    except ValueError as err:
        raise ValueError(f"{option} {text!r}: {err}") from None


def quantize_rows(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_groups(x, bits, group, x.dtype)``, through the native kernel's quantizer where it
    takes the call (float32 or bfloat16 on the CPU, no autograd: the same codes, scales and minima;
    a cache calls this every decode step), else ``quantize_groups`` itself."""
    if x.dtype in native.QUANTIZE_ENTRIES and x.device.type == "cpu" and not x.requires_grad and torch._C._len_torch_dispatch_stack() == 0:
        library = native.decode_kernel(x.dtype)
        if library is not None:
            return native.native_quantize_groups(x, bits, group, library)
    return quantize_groups(x, bits, group, x.dtype)


class QuantizedBuffer:
    """A ``GrowableBuffer`` look-alike whose rows older than the newest ``storage.residual`` are
    held as int8 / int4 codes. ``append`` and ``view`` return the whole history in the buffer's
    dtype (quantized part dequantized, then the residual window); a returned tensor is a copy, not
    a view into the storage."""

    def __init__(self, batch: int, heads: int, dim: int, storage: KVStorage, *, dtype: torch.dtype, device: torch.device | str) -> None:
        if storage.bits is None:
            raise ValueError("QuantizedBuffer needs int8 or int4 storage")
        self.shape = (batch, heads, dim)
        self.dtype, self.device, self.storage = dtype, torch.device(device), storage
        groups = math.ceil(dim / storage.group)
        self.codes = GrowableBuffer(batch, heads, groups * storage.group * storage.bits // 8, dtype=torch.uint8, device=device)
        self.scale = GrowableBuffer(batch, heads, groups, dtype=dtype, device=device)
        self.low = GrowableBuffer(batch, heads, groups, dtype=dtype, device=device)
        self.recent = GrowableBuffer(batch, heads, dim, dtype=dtype, device=device)
        self.stored = 0  # rows ever stored: how many stay in full precision depends on it alone, whatever keep_last dropped

    def _parts(self) -> tuple[GrowableBuffer, ...]:
        return self.codes, self.scale, self.low, self.recent

    def __len__(self) -> int:
        return len(self.codes) + len(self.recent)

    def quantized_len(self) -> int:
        """Rows held as codes (the rest are the full-precision residual window)."""
        return len(self.codes)

    def segments(self) -> list[QuantizedRows | torch.Tensor]:
        """What the buffer holds, oldest first, without dequantizing: the rows held as codes
        (``QuantizedRows``), then the residual window's rows (batch, heads, n, dim), each only when
        it has rows."""
        parts: list[QuantizedRows | torch.Tensor] = []
        if len(self.codes):
            parts.append(QuantizedRows(self.codes.view(), self.scale.view(), self.low.view(), self.storage.bits, self.storage.group, self.shape[2]))
        if len(self.recent):
            parts.append(self.recent.view())
        return parts

    def spans(self) -> list[CodeSpans | RowSpan]:
        """``segments()`` named by spans of the storage (``CodeSpans``, ``RowSpan``: no views made)."""
        parts: list[CodeSpans | RowSpan] = []
        if len(self.codes):
            (codes,), (scale,), (low,) = self.codes.spans(), self.scale.spans(), self.low.spans()
            parts.append(CodeSpans(codes, scale, low, self.storage.bits, self.storage.group))
        return parts + self.recent.spans()

    def view(self) -> torch.Tensor:
        """Every live row, (batch, heads, len, dim) in the buffer's dtype (a fresh tensor)."""
        if not len(self.codes):
            return self.recent.view()
        old = dequantize_groups(self.codes.view(), self.scale.view(), self.low.view(), self.storage.bits, self.shape[2], self.dtype)
        return torch.cat((old, self.recent.view()), dim=2) if len(self.recent) else old

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Append (batch, heads, n, dim) rows (``store``) and return ``view()``."""
        self.store(x)
        return self.view()

    def store(self, x: torch.Tensor) -> None:
        """Append (batch, heads, n, dim) rows without returning the history; rows past the
        residual window are quantized, whole blocks of ``storage.block`` at a time: after
        ``stored`` rows, the newest ``full_rows()`` stay in full precision."""
        self.recent.append(x)
        self._count(x.shape[2])

    def reserve(self, n: int) -> tuple[torch.Tensor, int, int]:
        """Room for ``n`` more full-precision rows, written by someone else (a native step writes
        a token's row straight into the storage): ``GrowableBuffer.reserve`` of the residual
        window. The rows count only after ``commit(n)``."""
        return self.recent.reserve(n)

    def span(self, first: int, count: int) -> RowSpan:
        """Rows of the residual window's storage as ``reserve`` numbers them (``GrowableBuffer.span``)."""
        return self.recent.span(first, count)

    def commit(self, n: int) -> None:
        """Count the ``n`` rows written after the window's live ones (``reserve``) as ``store``
        would: the rows they push out of the residual window are quantized."""
        self.recent.commit(n)
        self._count(n)

    def _count(self, n: int) -> None:
        """The window's newest ``n`` rows are new: count them, and quantize what leaves the window."""
        self.stored += n
        overflow = len(self.recent) - self.full_rows()
        if overflow > 0:
            self._quantize_oldest(overflow)

    def quantize_ahead(self) -> bool:
        """Quantize now the rows that storing one more row will push out of the residual window
        (they do not depend on it), so a reader of ``segments()`` with the next row sees the codes
        ``store`` would leave; its ``commit`` then quantizes nothing more. False, with nothing
        changed, when that row itself would leave the window at once (a residual of 0)."""
        overflow = self.rows_ahead()
        if overflow > len(self.recent):
            return False
        if overflow > 0:
            self._quantize_oldest(overflow)
        return True

    def rows_ahead(self) -> int:
        """How many rows storing one more row will quantize (``quantize_ahead`` quantizes them now)."""
        return len(self.recent) + 1 - self.full_rows(self.stored + 1)

    def _quantize_oldest(self, n: int) -> None:
        """The window's oldest ``n`` rows, as codes after the others."""
        codes, scale, low = quantize_rows(self.recent.view()[:, :, :n], self.storage.bits, self.storage.group)
        self.codes.append(codes)
        self.scale.append(scale)
        self.low.append(low)
        self.recent.keep_last(len(self.recent) - n)

    def full_rows(self, stored: int | None = None) -> int:
        """How many of the newest rows are held in full precision (fewer when fewer are held): the
        ``residual`` window and the rows of a block not yet full, counted from the rows ever
        stored (``stored``, default the buffer's)."""
        residual, block = self.storage.residual, self.storage.block
        stored = self.stored if stored is None else stored
        return stored if stored <= residual else residual + (stored - residual) % block

    def keep_last(self, n: int) -> None:
        """Drop all but the newest ``n`` rows."""
        if n >= len(self):
            return
        recent = len(self.recent)
        if n >= recent:
            for part in (self.codes, self.scale, self.low):
                part.keep_last(n - recent)
        else:
            for part in (self.codes, self.scale, self.low):
                part.keep_last(0)
            self.recent.keep_last(n)

    def mark(self) -> tuple:
        return (*(part.mark() for part in self._parts()), self.stored)

    def restore(self, mark: tuple) -> None:
        for part, part_mark in zip(self._parts(), mark):
            part.restore(part_mark)
        self.stored = mark[-1]

    def nbytes(self, float_size: int | None = None) -> int:
        """Bytes held: codes, scales, minima and the residual rows (``float_size``: ``slimkv.common.buffer.element_bytes``)."""
        return sum(part.nbytes(float_size) for part in self._parts())
