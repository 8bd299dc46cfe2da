"""KVM settings: everything about the mechanism that is not a tensor, and the row budget rule."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

from slimkv.common.checks import check_bool, check_choice, check_float, check_int

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
    ``gate_appends``: weight appended rows by their merge gate (off by default, as in the
    reference); such a row holds g prep(k) and g v, and its radius is ||g v|| = g ||v||.
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
