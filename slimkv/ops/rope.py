"""Rotary position embedding (RoPE), the one implementation every mechanism uses.

Convention: the rotated channels are the FIRST ``rot_dim`` channels of a head, taken as adjacent
pairs (0,1), (2,3), ...; the remaining channels pass through untouched. ``mode`` is ``full`` (all
channels), ``partial`` (``fraction`` of them, rounded down to an even count) or ``none``. Pair i
turns at the inverse frequency theta^(-2i / rot_dim), or at ``frequencies[i]`` when an explicit
list is given (one positive value per pair, any order, repeats allowed: a converted model keeps
the original frequencies its fit chose).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from slimkv.ops.native import decode_kernel
from slimkv.ops.native_rows import native_rotate, supports_rotation
from slimkv.ops.norm import compute_dtype

ROPE_MODES = ("full", "partial", "none")
TABLE_POSITIONS = 1024  # positions whose rotations a Rotary keeps at a time (a block of the angle table)


def rotary_dim(head_dim: int, mode: str, fraction: float = 0.5) -> int:
    """Number of leading channels of a ``head_dim``-wide head that RoPE rotates."""
    if mode == "full":
        return head_dim - head_dim % 2
    if mode == "partial":
        n = int(head_dim * fraction)
        return n - n % 2
    return 0


def check_rope_frequencies(rope_frequencies: Any) -> None:
    """``rope_frequencies`` must be None or a non-empty list of finite numbers > 0."""
    if rope_frequencies is None:
        return
    ok = isinstance(rope_frequencies, (list, tuple)) and len(rope_frequencies) > 0
    ok = ok and all(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0 for f in rope_frequencies)
    if not ok:
        raise ValueError(f"rope_frequencies must be a non-empty list of finite numbers > 0 (one inverse frequency per rotary pair), got {rope_frequencies!r}")


class Rotary:
    """Applies RoPE at absolute positions. Stateless: angles are computed for the positions asked,
    so the result for a token never depends on how a sequence was split into calls."""

    def __init__(self, head_dim: int, mode: str = "full", fraction: float = 0.5, theta: float = 10000.0,
                 frequencies: Sequence[float] | None = None) -> None:
        self.head_dim = head_dim
        self.mode = mode
        self.theta = float(theta)
        self.rot_dim = rotary_dim(head_dim, mode, fraction)
        self.frequencies = None if frequencies is None else tuple(float(f) for f in frequencies)
        if self.frequencies is not None:
            if len(self.frequencies) != self.rot_dim // 2:
                raise ValueError(f"frequencies: {len(self.frequencies)} values for {self.rot_dim // 2} rotary pairs (rot_dim={self.rot_dim})")
            if not all(math.isfinite(f) and f > 0 for f in self.frequencies):
                raise ValueError(f"frequencies must be finite numbers > 0, got {list(self.frequencies)}")
        # Per-call overhead matters at decode (one token, every layer, twice): the inverse
        # frequencies are computed once per device, and the rotations of a block of
        # ``TABLE_POSITIONS`` positions are kept, so consecutive decode steps slice a table instead
        # of computing angles. Values are those of the float64 formula.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._table: tuple[tuple, int, torch.Tensor] | None = None

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        """The inverse frequency of each channel pair i: ``frequencies[i]`` or theta^(-2i / rot_dim),
        float64, shape (rot_dim // 2,)."""
        device = torch.device(device)
        if device not in self._inv_freq:
            if self.frequencies is not None:
                self._inv_freq[device] = torch.tensor(self.frequencies, device=device, dtype=torch.float64)
            else:
                pairs = torch.arange(self.rot_dim // 2, device=device, dtype=torch.float64)
                self._inv_freq[device] = 1.0 / (self.theta ** (pairs * 2 / self.rot_dim))
        return self._inv_freq[device]

    def angles(self, start: int, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape (length, rot_dim // 2) for positions start .. start+length-1."""
        pos = torch.arange(start, start + length, device=device, dtype=torch.float64)
        ang = torch.outer(pos, self.inverse_frequencies(device))
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def rotation(self, start: int, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """cos + i sin as a complex tensor (length, 1, rot_dim // 2) of ``dtype``'s complex type."""
        key = (torch.device(device), dtype)
        table = self._table
        if table is None or table[0] != key or start < table[1] or start + length > table[1] + table[2].shape[0]:
            first = start - start % TABLE_POSITIONS
            count = max(TABLE_POSITIONS, start + length - first)
            cos, sin = self.angles(first, count, device, dtype)
            table = self._table = (key, first, torch.complex(cos, sin)[:, None, :])
        return table[2][start - table[1] : start - table[1] + length]

    def __call__(self, x: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Rotate ``x`` of shape (batch, time, heads, head_dim) whose first token sits at ``start``.

        A channel pair (even, odd) is the complex number even + i odd; the rotation by angle a is
        the product with cos a + i sin a, i.e. (even cos - odd sin, even sin + odd cos)."""
        if self.rot_dim == 0:
            return x
        work = compute_dtype(x.dtype)
        rotation = self.rotation(int(start), x.shape[1], x.device, work)
        if x.shape[1] == 1 and work == torch.float32 and supports_rotation(x):  # one token (a decode step): one native call
            library = decode_kernel(x.dtype)
            if library is not None:
                return native_rotate(x, rotation, self.rot_dim, library)
        if x.dtype == work and x.is_contiguous() and x.shape[-1] % 2 == 0 and x.storage_offset() % 2 == 0:
            # pairs already in place for a complex view (a decode step's q and k): the same product,
            # without the slice, casts and concatenation below, which cost more than it at one token
            if self.rot_dim == x.shape[-1]:
                return torch.view_as_real(torch.view_as_complex(x.view(*x.shape[:-1], -1, 2)) * rotation).view(x.shape)
            out = x.clone()
            torch.view_as_complex(out[..., : self.rot_dim].unflatten(-1, (-1, 2))).mul_(rotation)
            return out
        rot = x[..., : self.rot_dim].to(work)
        if rot.stride(-1) != 1 or rot.storage_offset() % 2 or any(st % 2 for st in rot.stride()[:-1]):
            rot = rot.contiguous()  # a complex view needs every pair to start at an even offset
        pairs = torch.view_as_complex(rot.unflatten(-1, (-1, 2)))
        rotated = torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)
        if self.rot_dim == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., self.rot_dim :]), dim=-1)

    def __repr__(self) -> str:
        ladder = f"theta={self.theta}" if self.frequencies is None else f"frequencies={list(self.frequencies)}"
        return f"Rotary(mode={self.mode!r}, rot_dim={self.rot_dim}, {ladder})"
