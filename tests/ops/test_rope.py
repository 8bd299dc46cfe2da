"""RoPE against its plain formula: channel pair i of the token at position p turns by p * f_i, f_i =
theta^(-2i / rot_dim) (or the explicit frequencies), in float64, on every input shape and layout the
attention kinds pass (a whole contiguous head, leading channels of a wider head, strided views)."""

from __future__ import annotations

import math

import pytest
import torch

from slimkv.ops.rope import TABLE_POSITIONS, Rotary


def plain_rope(x: torch.Tensor, start: int, rot_dim: int, frequencies: list[float]) -> torch.Tensor:
    """x (batch, time, heads, head_dim) with its first rot_dim channels rotated pair by pair, one scalar at a time."""
    out = x.to(torch.float64).clone()
    src = x.to(torch.float64)
    for t in range(x.shape[1]):
        for i in range(rot_dim // 2):
            angle = (start + t) * frequencies[i]
            c, s = math.cos(angle), math.sin(angle)
            even, odd = src[:, t, :, 2 * i], src[:, t, :, 2 * i + 1]
            out[:, t, :, 2 * i] = even * c - odd * s
            out[:, t, :, 2 * i + 1] = even * s + odd * c
    return out.to(x.dtype)


def ladder(rot_dim: int, theta: float) -> list[float]:
    return [theta ** (-2 * i / rot_dim) for i in range(rot_dim // 2)]


@pytest.mark.parametrize("start", [0, 7, TABLE_POSITIONS - 1, 3 * TABLE_POSITIONS + 5])
@pytest.mark.parametrize("time", [1, 3])
def test_whole_contiguous_heads_follow_the_formula(start, time):
    torch.manual_seed(start + time)
    rope = Rotary(16, "full", theta=500.0)
    x = torch.randn(2, time, 3, 16)
    torch.testing.assert_close(rope(x, start), plain_rope(x, start, 16, ladder(16, 500.0)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["partial", "strided", "offset-slice", "bfloat16", "frequencies"])
def test_other_layouts_follow_the_formula(layout):
    torch.manual_seed(1)
    head_dim, start = 12, 1030
    rope = Rotary(head_dim, "partial" if layout == "partial" else "full", fraction=0.5, theta=100.0)
    x = torch.randn(1, 2, 4, head_dim)
    if layout == "strided":
        x = torch.randn(1, 4, 2, head_dim).transpose(1, 2)  # (batch, time, heads, dim) not contiguous
    elif layout == "offset-slice":
        x = torch.randn(1, 2, 4, head_dim + 3)[..., 3:]  # pairs start at an odd offset
    elif layout == "bfloat16":
        x = x.to(torch.bfloat16)
    frequencies = ladder(rope.rot_dim, 100.0)
    if layout == "frequencies":
        frequencies = [0.5, 2.0, 0.1, 1.0, 0.3, 0.7]
        rope = Rotary(head_dim, "full", frequencies=frequencies)
    tolerance = 1e-2 if layout == "bfloat16" else 1e-5
    torch.testing.assert_close(rope(x, start), plain_rope(x, start, rope.rot_dim, frequencies), rtol=tolerance, atol=tolerance)


def test_the_input_is_left_as_it_was():
    rope = Rotary(8)
    x = torch.randn(1, 1, 2, 8)
    before = x.clone()
    rope(x, 5)
    torch.testing.assert_close(x, before, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["full", "partial"])
def test_gradients_of_the_contiguous_path_equal_the_general_paths(mode):
    """A contiguous head (the short path) and the same values in a strided view (the general path) give one gradient."""
    torch.manual_seed(2)
    rope = Rotary(12, mode, fraction=0.5)
    values = torch.randn(1, 3, 2, 12, dtype=torch.float64)
    weight = torch.randn_like(values)
    contiguous = values.clone().requires_grad_(True)
    strided_source = values.transpose(1, 2).contiguous().requires_grad_(True)
    (rope(contiguous, 4) * weight).sum().backward()
    (rope(strided_source.transpose(1, 2), 4) * weight).sum().backward()
    torch.testing.assert_close(contiguous.grad, strided_source.grad.transpose(1, 2))
    torch.autograd.gradcheck(lambda x: rope(x, 4), (values.clone().requires_grad_(True),))
