"""The attention contract: the base class, option validation and the registry of kinds.

Every mechanism subclasses ``Attention`` and implements three things:

* ``_forward(x, cache)``: output for x of shape (batch, time, d_model), causal, starting at
  position ``cache.seq_len`` (0 without a cache); it updates the cache in place.
* ``new_cache(batch_size, dtype, device)``: an empty ``AttentionCache`` for this module.
* ``cache_bytes(seq_len, dtype, batch_size)``: the analytic size of that cache after seq_len tokens.

Mechanisms are registered with ``register_attention`` and built with ``build_attention``; the
registry also carries small ``example_options`` per kind, which the shared test runner uses, so a
newly registered kind is tested against the contract's oracles without writing new tests.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slimkv.attention.cache import AttentionCache
from slimkv.ops.attention import BACKENDS
from slimkv.ops.norm import RMSNorm
from slimkv.ops.rope import ROPE_MODES, Rotary

COMMON_OPTIONS = ("rope", "rope_fraction", "rope_theta", "qk_norm", "bias")


# ---------------------------------------------------------------- validation helpers


def close_matches(word: str, choices) -> str:
    """' (did you mean ...?)' suffix for error messages, or ''."""
    near = difflib.get_close_matches(str(word), [str(c) for c in choices], n=3)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not allowed; allowed values: {', '.join(map(str, choices))}")


def check_int(name: str, value: Any, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_float(name: str, value: Any, low: float = -math.inf, high: float = math.inf, *, open_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and value <= high
    if not ok:
        bound = f"> {low}" if open_low else f">= {low}"
        raise ValueError(f"{name} must be a finite number {bound} and <= {high}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


# ---------------------------------------------------------------- the base class


class Attention(nn.Module):
    """Base of every attention mechanism (see the module docstring for the contract).

    Shapes: activations are (batch, time, heads, head_dim); kernels and caches use
    (batch, heads, time, dim) so a head's history is contiguous in memory.
    """

    kind = "attention"

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        *,
        rope: str = "full",
        rope_fraction: float = 0.5,
        rope_theta: float = 10000.0,
        qk_norm: bool = False,
        bias: bool = False,
    ) -> None:
        check_int("d_model", d_model, 1)
        check_int("n_heads", n_heads, 1)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"n_heads={n_heads} does not divide d_model={d_model}; pass head_dim explicitly")
            head_dim = d_model // n_heads
        check_int("head_dim", head_dim, 1)
        check_choice("rope", rope, ROPE_MODES)
        check_float("rope_fraction", rope_fraction, 0.0, 1.0, open_low=True)
        check_float("rope_theta", rope_theta, 1.0, open_low=True)
        check_bool("qk_norm", qk_norm)
        check_bool("bias", bias)
        super().__init__()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.rope_mode, self.rope_fraction, self.rope_theta = rope, rope_fraction, float(rope_theta)
        self.rotary = Rotary(head_dim, rope, rope_fraction, rope_theta)
        self.use_qk_norm, self.use_bias = qk_norm, bias
        self.backend = "sdpa"  # per instance: "sdpa" (fused kernel) or "reference" (explicit softmax)

    # -- the contract ---------------------------------------------------------------

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        """x (batch, time, d_model) -> (batch, time, d_model); updates ``cache`` in place if given."""
        if x.dim() != 3 or x.shape[-1] != self.d_model or x.shape[1] < 1:
            raise ValueError(f"expected input of shape (batch, time>=1, {self.d_model}), got {tuple(x.shape)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not allowed; allowed values: {', '.join(BACKENDS)}")
        if cache is not None:
            cache.check_compatible(self.cache_spec(), x)
        return self._forward(x, cache)

    def _forward(self, x: torch.Tensor, cache: AttentionCache | None) -> torch.Tensor:
        raise NotImplementedError

    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> AttentionCache:
        raise NotImplementedError

    def cache_bytes(self, seq_len: int, dtype: torch.dtype = torch.float32, batch_size: int = 1) -> int:
        raise NotImplementedError

    def cache_spec(self) -> tuple:
        """What a cache must match to serve this module (kind and every shape that sizes the cache)."""
        return (self.kind, self.d_model, self.n_heads, self.head_dim)

    def head_qk_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Effective per-query-head maps (W^Q, W^K), each (n_heads, d_model, d_qk), such that the
        unscaled logit of head h between inputs x_i, x_j is (x_i W^Q_h) . (x_j W^K_h), before
        positional rotation and biases; qk-norm gains are folded in, the per-token rms scale is not
        (it depends on the input). Used by the head-diversity metric (slimkv.eval.diversity)."""
        raise NotImplementedError(f"attention kind {self.kind!r} does not expose its per-head query/key maps")

    # -- helpers for subclasses -------------------------------------------------------

    def _with_qk_gains(self, wq: torch.Tensor, wk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold the qk-norm gains (if any) into per-head maps (H, d_model, head_dim) for ``head_qk_maps``."""
        if self.use_qk_norm:
            return wq * self.q_norm.weight, wk * self.k_norm.weight
        return wq, wk

    def _cache_args(self, batch_size: int, dtype, device) -> tuple[int, torch.dtype, torch.device]:
        check_int("batch_size", batch_size, 1)
        ref = next(self.parameters())
        return batch_size, dtype or ref.dtype, torch.device(device) if device is not None else ref.device

    def _make_qk_norms(self, q_dim: int, k_dim: int) -> None:
        """Create per-head RMSNorms on queries and keys when ``qk_norm`` is on."""
        self.q_norm = RMSNorm(q_dim) if self.use_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(k_dim) if self.use_qk_norm else nn.Identity()

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        """Initialise weights: normal(std) for projections, ``out_std`` for the output projection,
        zeros for biases, ones for norms. Mechanisms with special factors extend this."""
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, nn.Linear):
                    s = out_std if (out_std is not None and name.split(".")[-1] == "o_proj") else std
                    module.weight.normal_(0.0, s)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind}, d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
            f"rope={self.rope_mode}, qk_norm={self.use_qk_norm}"
        )


# ---------------------------------------------------------------- registry


@dataclass
class KindSpec:
    """How to build one kind: its class, the options it accepts, options fixed by the kind, and
    small example configurations the shared contract tests run it with."""

    cls: type[Attention]
    fixed: dict[str, Any] = field(default_factory=dict)
    example_options: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    description: str = ""

    def own_options(self) -> tuple[str, ...]:
        params = inspect.signature(self.cls.__init__).parameters.values()
        names = (p.name for p in params if p.kind == p.KEYWORD_ONLY)
        return tuple(n for n in names if n not in COMMON_OPTIONS and n not in self.fixed)


_REGISTRY: dict[str, KindSpec] = {}
ATTENTION_KINDS: list[str] = []


def register_attention(kind: str, cls: type[Attention], *, fixed: dict | None = None, example_options: list[dict] | None = None, description: str = "") -> None:
    """Add a kind to the registry (and so to ``ATTENTION_KINDS`` and the contract tests)."""
    if kind in _REGISTRY:
        raise ValueError(f"attention kind {kind!r} is already registered")
    _REGISTRY[kind] = KindSpec(cls, dict(fixed or {}), list(example_options or [{}]), description)
    ATTENTION_KINDS.append(kind)


def kind_spec(kind: str) -> KindSpec:
    if kind not in _REGISTRY:
        raise ValueError(f"unknown attention kind {kind!r}{close_matches(kind, ATTENTION_KINDS)}; registered kinds: {', '.join(ATTENTION_KINDS)}")
    return _REGISTRY[kind]


def attention_options(kind: str) -> tuple[str, ...]:
    """Every option name ``build_attention`` accepts for ``kind`` (its own plus the common ones)."""
    return kind_spec(kind).own_options() + COMMON_OPTIONS


def build_attention(kind: str, d_model: int, n_heads: int, head_dim: int | None = None, **options: Any) -> Attention:
    """Build an attention module of a registered ``kind``; unknown options raise ValueError."""
    spec = kind_spec(kind)
    allowed = attention_options(kind)
    for name in options:
        if name not in allowed:
            raise ValueError(
                f"unknown option {name!r} for attention kind {kind!r}{close_matches(name, allowed)}; "
                f"allowed options: {', '.join(allowed)}"
            )
    module = spec.cls(d_model, n_heads, head_dim, **spec.fixed, **options)
    module.kind = kind
    return module
