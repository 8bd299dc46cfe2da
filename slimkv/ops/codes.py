"""Int8 / int4 codes in channel groups: the plain reference quantizer (``quantize_groups``), its
inverse (``dequantize_groups``) and ``QuantizedRows``, rows held as such codes.

This is the ground the quantized cache storage (``slimkv.ops.quantize``) and the native kernel
(``slimkv.ops.native``, which reads ``QuantizedRows`` in place and quantizes in C with the same
arithmetic) both stand on; the native paths are tested against these functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slimkv.common.buffer import RowSpan


def quantize_groups(x: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of (..., dim) rows in groups of ``group`` channels (the last group
    padded by repeating the row's last channel). Returns (codes uint8 (..., padded dim * bits / 8),
    scale and minimum (..., groups) in ``scale_dtype``); codes are computed with the stored (rounded)
    scale and minimum, so ``dequantize_groups`` sees exactly what they encode."""
    dim = x.shape[-1]
    groups = math.ceil(dim / group)
    if groups * group != dim:
        x = torch.cat((x, x[..., -1:].expand(*x.shape[:-1], groups * group - dim)), dim=-1)
    g = x.float().unflatten(-1, (groups, group))
    low, high = g.amin(-1), g.amax(-1)
    levels = 2**bits - 1
    stored_low = _round_toward(low, scale_dtype, -1)  # the stored range still covers the group
    scale = _round_toward((high - stored_low.float()) / levels, scale_dtype, 1)
    low = stored_low
    step = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    codes = ((g - low.float().unsqueeze(-1)) / step).round_().clamp_(0, levels).to(torch.uint8).flatten(-2)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale, low


def _round_toward(x: torch.Tensor, dtype: torch.dtype, direction: int) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, rounded down (direction -1) or up (+1) where the cast is inexact."""
    y = x.to(dtype)
    off = (y.float() > x) if direction < 0 else (y.float() < x)
    if off.any():
        y = torch.where(off, torch.nextafter(y, torch.full_like(y, direction * torch.inf)), y)
    return y


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows (..., dim) in ``dtype`` from ``quantize_groups``' codes, scales and minima."""
    if bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
    groups = scale.shape[-1]
    values = codes.unflatten(-1, (groups, -1)).float() * scale.float().unsqueeze(-1) + low.float().unsqueeze(-1)
    return values.flatten(-2)[..., :dim].to(dtype)


@dataclass(frozen=True)
class QuantizedRows:
    """Rows held as codes: ``codes`` (batch, heads, n, padded dim * bits / 8) uint8 and ``scale`` /
    ``low`` (batch, heads, n, groups) in the cache dtype, as ``quantize_groups`` makes them, for
    rows of ``dim`` channels."""

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    bits: int
    group: int
    dim: int

    def __len__(self) -> int:
        return self.codes.shape[2]

    @property
    def heads(self) -> int:
        return self.codes.shape[1]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.low

    def float_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors in the cache dtype (the scales and minima)."""
        return self.scale, self.low

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows (batch, heads, n, dim) in ``dtype`` (``dequantize_groups``)."""
        return dequantize_groups(self.codes, self.scale, self.low, self.bits, self.dim, dtype)


@dataclass(frozen=True)
class CodeSpans:
    """``QuantizedRows`` named by spans of their buffers' storage (``RowSpan``) instead of views:
    what a native call reads of them (a model's decode step names a few hundred segments)."""

    codes: RowSpan
    scale: RowSpan
    low: RowSpan
    bits: int
    group: int

    def __len__(self) -> int:
        return self.codes.count
