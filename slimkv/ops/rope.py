"""Rotary position embedding (RoPE), the one implementation every mechanism uses.

Convention: the rotated channels are the FIRST ``rot_dim`` channels of a head, taken as adjacent
pairs (0,1), (2,3), ...; the remaining channels pass through untouched. ``mode`` is ``full`` (all
channels), ``partial`` (``fraction`` of them, rounded down to an even count) or ``none``.
"""

from __future__ import annotations

import torch

from slimkv.ops.norm import compute_dtype

ROPE_MODES = ("full", "partial", "none")


def rotary_dim(head_dim: int, mode: str, fraction: float = 0.5) -> int:
    """Number of leading channels of a ``head_dim``-wide head that RoPE rotates."""
    if mode == "full":
        return head_dim - head_dim % 2
    if mode == "partial":
        n = int(head_dim * fraction)
        return n - n % 2
    return 0


class Rotary:
    """Applies RoPE at absolute positions. Stateless: angles are computed for the positions asked,
    so the result for a token never depends on how a sequence was split into calls."""

    def __init__(self, head_dim: int, mode: str = "full", fraction: float = 0.5, theta: float = 10000.0) -> None:
        self.head_dim = head_dim
        self.mode = mode
        self.theta = float(theta)
        self.rot_dim = rotary_dim(head_dim, mode, fraction)

    def angles(self, start: int, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape (length, rot_dim // 2) for positions start .. start+length-1."""
        half = self.rot_dim // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(half, device=device, dtype=torch.float64) * 2 / self.rot_dim))
        pos = torch.arange(start, start + length, device=device, dtype=torch.float64)
        ang = torch.outer(pos, inv_freq)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def __call__(self, x: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Rotate ``x`` of shape (batch, time, heads, head_dim) whose first token sits at ``start``."""
        if self.rot_dim == 0:
            return x
        work = compute_dtype(x.dtype)
        cos, sin = self.angles(int(start), x.shape[1], x.device, work)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        rot = x[..., : self.rot_dim].to(work).unflatten(-1, (-1, 2))
        even, odd = rot[..., 0], rot[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat((rotated.to(x.dtype), x[..., self.rot_dim :]), dim=-1)

    def __repr__(self) -> str:
        return f"Rotary(mode={self.mode!r}, rot_dim={self.rot_dim}, theta={self.theta})"
