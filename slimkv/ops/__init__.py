"""Functional building blocks shared by every mechanism: attention kernels, RoPE, norms."""

from slimkv.ops.attention import attend, reference_attention, visibility_mask
from slimkv.ops.norm import RMSNorm, compute_dtype
from slimkv.ops.rope import Rotary

__all__ = ["attend", "reference_attention", "visibility_mask", "RMSNorm", "compute_dtype", "Rotary"]
