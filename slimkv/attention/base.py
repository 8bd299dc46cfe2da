"""The attention contract: the base class, option validation and the registry of kinds.

Every mechanism subclasses ``Attention`` and implements three things:

* ``_forward(x, cache)``: output for x of shape (batch, time, d_model), causal, starting at
  position ``cache.seq_len`` (0 without a cache); it updates the cache in place.
* ``new_cache(batch_size, dtype, device)``: an empty ``AttentionCache`` for this module.
* ``_cache_bytes(seq_len, dtype, batch_size)``: the analytic size of that cache after seq_len tokens
  (``cache_bytes`` checks the arguments and calls it).

Mechanisms are registered with ``register_attention`` and built with ``build_attention``; the
registry also carries small ``example_options`` per kind, which the shared test runner uses, so a
newly registered kind is tested against the contract's oracles without writing new tests, and its
``Presets`` (comparable options, decode-benchmark variants, cache sizes, demo entries), so compare,
the benchmarks and the demo need no per-kind code. docs/contract.md explains the contract.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slimkv.attention.cache import AttentionCache
from slimkv.common.checks import Checked, check_bool, check_choice, check_float, check_int, close_matches
from slimkv.common.vocabulary import renamed_layer_option
from slimkv.ops.attention import BACKENDS
from slimkv.ops.norm import RMSNorm
from slimkv.ops.quantize import KVStorage, parse_storage
from slimkv.ops.rope import ROPE_MODES, Rotary, check_rope_frequencies, rotary_dim

COMMON_OPTIONS = ("rope", "rope_fraction", "rope_theta", "rope_frequencies", "qk_norm", "bias", "backend")


# ---------------------------------------------------------------- the base class


class Attention(nn.Module):
    """Base of every attention mechanism (see the module docstring for the contract).

    Shapes: activations are (batch, time, heads, head_dim); kernels and caches use
    (batch, heads, time, dim) so a head's history is contiguous in memory.
    """

    kind = "attention"
    # Options that choose HOW the layer computes (a kernel, an exact decode path), never its
    # weights or cache: ``set_runtime_options`` may change them on a built layer.
    RUNTIME_OPTIONS: tuple[str, ...] = ("backend",)
    backend = Checked(check_choice, BACKENDS)  # "sdpa" (fused kernels) or "reference" (the plain implementation tests compare against)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        *,
        rope: str = "full",
        rope_fraction: float = 0.5,
        rope_theta: float = 10000.0,
        rope_frequencies: list[float] | None = None,
        qk_norm: bool = False,
        bias: bool = False,
        backend: str = "sdpa",
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
        check_rope_frequencies(rope_frequencies)
        check_bool("qk_norm", qk_norm)
        check_bool("bias", bias)
        check_choice("backend", backend, BACKENDS)
        super().__init__()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.rope, self.rope_fraction, self.rope_theta = rope, rope_fraction, float(rope_theta)
        # explicit frequencies of the rotated pairs (a converted layer's); with rope="none" nothing rotates and they are unused, as in mla
        self.rope_frequencies = list(rope_frequencies) if rope_frequencies is not None and rope != "none" else None
        rot_dim = rotary_dim(head_dim, rope, rope_fraction)
        if self.rope_frequencies is not None and len(self.rope_frequencies) != rot_dim // 2:
            raise ValueError(f"rope_frequencies has {len(self.rope_frequencies)} values but rope={rope!r}, rope_fraction={rope_fraction} rotates "
                             f"{rot_dim // 2} pairs of a {head_dim}-wide head: give one inverse frequency per rotary pair")
        self.rotary = Rotary(head_dim, rope, rope_fraction, rope_theta, self.rope_frequencies)
        self.use_qk_norm, self.use_bias = qk_norm, bias
        self.backend = backend

    def set_runtime_options(self, **options: Any) -> None:
        """Change runtime options (``RUNTIME_OPTIONS``: kernel or decode path) of this layer in place;
        ValueError for any other option. Benchmarks and tests use it to time or compare two exact
        paths on the same weights and cache."""
        for name, value in options.items():
            if name not in self.RUNTIME_OPTIONS:
                raise ValueError(f"{name!r} is not a runtime option of attention kind {self.kind!r}; runtime options: {', '.join(self.RUNTIME_OPTIONS)}")
            setattr(self, name, value)

    # -- the contract ---------------------------------------------------------------

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        """x (batch, time, d_model) -> (batch, time, d_model); updates ``cache`` in place if given."""
        if x.dim() != 3 or x.shape[-1] != self.d_model or x.shape[1] < 1:
            raise ValueError(f"expected input of shape (batch, time>=1, {self.d_model}), got {tuple(x.shape)}")
        if cache is None:
            return self._forward(x, None)
        spec = self.__dict__.get("_spec")
        if spec is None:  # computed once: a decode step should not rebuild it
            spec = self.__dict__["_spec"] = self.cache_spec()
        cache.check_compatible(spec, x)
        mark = cache.mark()
        try:
            return self._forward(x, cache)
        except BaseException:
            cache.rollback(mark)
            raise

    def _forward(self, x: torch.Tensor, cache: AttentionCache | None) -> torch.Tensor:
        raise NotImplementedError

    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                  storage: KVStorage | str | None = None) -> AttentionCache:
        """An empty cache; ``storage`` (``slimkv.ops.quantize``: ``full``, ``int8``, ``int4[:group=G,residual=R,block=B]``)
        says how its per-token rows are held."""
        raise NotImplementedError

    def cache_bytes(self, seq_len: int, dtype: torch.dtype = torch.float32, batch_size: int = 1) -> int:
        """The analytic size of this layer's cache after ``seq_len`` tokens (what ``nbytes()`` of a
        live cache must equal); ValueError for a negative or non-integer length or batch."""
        check_int("seq_len", seq_len, 0)
        check_int("batch_size", batch_size, 1)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        return self._cache_bytes(seq_len, dtype, batch_size)

    def _cache_bytes(self, seq_len: int, dtype: torch.dtype, batch_size: int) -> int:
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

    def _cache_args(self, batch_size: int, dtype, device, storage) -> tuple[int, torch.dtype, torch.device, KVStorage]:
        check_int("batch_size", batch_size, 1)
        ref = next(self.parameters())
        return batch_size, dtype or ref.dtype, torch.device(device) if device is not None else ref.device, parse_storage(storage)

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
            f"rope={self.rope}, qk_norm={self.use_qk_norm}"
        )


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class LayerShape:
    """The shape presets are computed for: one layer of ``n_heads`` x ``head_dim`` in a model of
    width ``d_model`` trained (or measured) at ``seq_len`` tokens of context."""

    d_model: int
    n_heads: int
    head_dim: int
    seq_len: int = 4096


@dataclass(frozen=True)
class Presets:
    """Ready-made options of a kind, so that ``compare``, the decode benchmark, the demo and the
    recall frontier need no per-kind code (a kind without presets falls back to its first
    example options there).

    ``comparable(shape, explicit)``: (options, why) putting the kind at a setting comparable with
    the others (tunable kinds at about half of MHA's cache); ``explicit`` are the options an
    entry sets itself, for presets that depend on them.
    ``decode(shape)``: [(label, options), ...] variants timed by the decode benchmark at the
    width of an n_heads x head_dim MHA layer (e.g. a second decode path).
    ``sizes(shape)``: [(label, options), ...] the kind at several cache sizes (frontier sweeps).
    ``demo``: entry texts the demo runs for this kind (``slimkv.common.spec`` grammar).
    """

    comparable: Callable[[LayerShape, dict[str, Any]], tuple[dict[str, Any], str]] | None = None
    decode: Callable[[LayerShape], list[tuple[str, dict[str, Any]]]] | None = None
    sizes: Callable[[LayerShape], list[tuple[str, dict[str, Any]]]] | None = None
    demo: tuple[str, ...] = ()


@dataclass
class KindSpec:
    """How to build one kind: its class, small example configurations the shared contract tests
    run it with, a one-line description and its presets."""

    cls: type[Attention]
    example_options: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    description: str = ""
    presets: Presets = field(default_factory=Presets)

    def own_options(self) -> tuple[str, ...]:
        params = inspect.signature(self.cls.__init__).parameters.values()
        names = (p.name for p in params if p.kind == p.KEYWORD_ONLY)
        return tuple(n for n in names if n not in COMMON_OPTIONS)

    def comparable(self, shape: LayerShape, explicit: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
        """The kind's comparable options for ``shape`` (or its first example options)."""
        if self.presets.comparable is not None:
            return self.presets.comparable(shape, dict(explicit or {}))
        return dict(self.example_options[0]), "the kind's first registered example options (it has no comparable preset)"

    def decode_variants(self, shape: LayerShape, kind: str) -> list[tuple[str, dict[str, Any]]]:
        """The kind's decode-benchmark variants for ``shape`` (or one with its first example options)."""
        if self.presets.decode is not None:
            return self.presets.decode(shape)
        return [(kind, dict(self.example_options[0]))]

    def size_variants(self, shape: LayerShape, kind: str) -> list[tuple[str, dict[str, Any]]]:
        """The kind at several cache sizes for ``shape`` (or once, with its comparable options)."""
        if self.presets.sizes is not None:
            return self.presets.sizes(shape)
        return [(kind, self.comparable(shape)[0])]


_REGISTRY: dict[str, KindSpec] = {}
ATTENTION_KINDS: list[str] = []


def register_attention(kind: str, cls: type[Attention], *, example_options: list[dict] | None = None, description: str = "",
                       presets: Presets | None = None) -> None:
    """Add a kind to the registry (and so to ``ATTENTION_KINDS``, the contract tests, compare,
    the decode benchmark and the demo)."""
    if kind in _REGISTRY:
        raise ValueError(f"attention kind {kind!r} is already registered")
    _REGISTRY[kind] = KindSpec(cls, list(example_options or [{}]), description, presets or Presets())
    ATTENTION_KINDS.append(kind)


def unregister_attention(kind: str) -> None:
    """Remove a kind registered with ``register_attention`` (tests that register toy kinds)."""
    kind_spec(kind)
    del _REGISTRY[kind]
    ATTENTION_KINDS.remove(kind)


def kind_spec(kind: str) -> KindSpec:
    if not isinstance(kind, str) or kind not in _REGISTRY:
        raise ValueError(f"unknown attention kind {kind!r}{close_matches(kind, ATTENTION_KINDS)}; registered kinds: {', '.join(ATTENTION_KINDS)}")
    return _REGISTRY[kind]


def attention_options(kind: str) -> tuple[str, ...]:
    """Every option name ``build_attention`` accepts for ``kind`` (its own plus the common ones)."""
    return kind_spec(kind).own_options() + COMMON_OPTIONS


def build_attention(kind: str, d_model: int, n_heads: int, head_dim: int | None = None, **options: Any) -> Attention:
    """Build an attention module of a registered ``kind``. This is the one validator of kinds and
    options: an unknown kind or option, a missing required option or a bad value raises
    ValueError naming it (with close matches and the allowed names) before any tensor is made; an
    option renamed since (``slimkv.common.vocabulary.RENAMED_LAYER_OPTIONS``) by a message naming today's spelling."""
    spec = kind_spec(kind)
    allowed = attention_options(kind)
    for name in options:
        if name not in allowed and renamed_layer_option(kind, name):
            raise ValueError(renamed_layer_option(kind, name))
        if name not in allowed:
            raise ValueError(
                f"unknown option {name!r} for attention kind {kind!r}{close_matches(name, allowed)}; "
                f"allowed options: {', '.join(allowed)}"
            )
    try:
        inspect.signature(spec.cls.__init__).bind(None, d_model, n_heads, head_dim, **options)
    except TypeError as err:
        raise ValueError(f"attention kind {kind!r} cannot be built with options {options}: {err}") from None
    module = spec.cls(d_model, n_heads, head_dim, **options)
    module.kind = kind
    return module
