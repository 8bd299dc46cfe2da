"""The compression methods, in a registry: a method is one function of a ``BlockContext`` plus
``register_method``. ``compress_model`` runs the method on every block in turn.

Built in (docs/compression.md): ``svd`` (truncated SVD of each weight, no data), ``asvd`` (SVD of
W diag(mean|x|^alpha), unscaled), ``rootcov`` (local activation-aware RootCov, all of a block's
statistics from one pass) and ``latentllm`` (``slimkv.compress.latentllm``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slimkv.common.checks import close_matches
from slimkv.compress.block import BlockContext
from slimkv.compress.latentllm import attention_stage, mlp_stage


@dataclass(frozen=True)
class Method:
    """A registered method: ``compress_block(ctx)`` plans and installs every projection of one
    block; ``needs_data``: whether it reads calibration activations; ``within_block``: how it
    calibrates inside a block (for the manifest)."""

    name: str
    compress_block: Callable[[BlockContext], None]
    needs_data: bool
    within_block: str
    description: str
    identity_blocks: bool = False  # factors are stored as identity blocks (unless options.identity_block is off): budgets count r^2 fewer weights


METHODS: dict[str, Method] = {}


def register_method(name: str, *, needs_data: bool = True, within_block: str = "one pass on the block's inputs", description: str = "",
                    identity_blocks: bool = False):
    """Decorator registering ``fn(ctx: BlockContext)`` as compression method ``name``."""

    def register(fn: Callable[[BlockContext], None]) -> Callable[[BlockContext], None]:
        if name in METHODS:
            raise ValueError(f"compression method {name!r} is already registered")
        METHODS[name] = Method(name, fn, needs_data, within_block if needs_data else "none", description or (fn.__doc__ or "").strip().splitlines()[0],
                               identity_blocks)
        return fn

    return register


def get_method(name: str) -> Method:
    """The registered method ``name``; ValueError listing the registered ones."""
    if name not in METHODS:
        raise ValueError(f"method={name!r} is not a compression method{close_matches(name, METHODS)}; allowed values: {', '.join(METHODS)}")
    return METHODS[name]


def _all(ctx: BlockContext) -> list[str]:
    """The projections to factor: all of the block's, less those the allocation leaves dense."""
    return [p.name for p in ctx.layout.projections() if not ctx.stays_dense(p.name)]


def _dense(ctx: BlockContext) -> None:
    ctx.keep_dense([p.name for p in ctx.layout.projections() if ctx.stays_dense(p.name)])


@register_method("svd", needs_data=False)
def svd(ctx: BlockContext) -> None:
    """Truncated SVD of each weight (no calibration data)."""
    for name in _all(ctx):
        ctx.factor_local(name, "svd", None)
    ctx.install(_all(ctx))
    _dense(ctx)


@register_method("asvd")
def asvd(ctx: BlockContext) -> None:
    """SVD of W diag(mean|x|^alpha), unscaled (ASVD)."""
    names = _all(ctx)
    stats = ctx.collect(names, stop=ctx.layout.mlp_out.name, need="mean_abs") if names else {}
    for name in names:
        ctx.factor_local(name, "asvd", stats[name])
    ctx.install(names)
    _dense(ctx)


@register_method("rootcov")
def rootcov(ctx: BlockContext) -> None:
    """Local activation-aware RootCov of each weight, all statistics from one pass."""
    names = _all(ctx)
    stats = ctx.collect(names, stop=ctx.layout.mlp_out.name) if names else {}
    for name in names:
        ctx.factor_local(name, "rootcov", stats[name])
    ctx.install(names)
    _dense(ctx)


@register_method(
    "latentllm",
    within_block="sequential (q/k/v, then o, then the MLP input, then down, each on the activations of the stages already compressed)",
    identity_blocks=True,
)
def latentllm(ctx: BlockContext) -> None:
    """RootCov + identity blocks, joint QK (RoPE-aware) and joint MLP, sequential inside the block."""
    attention_stage(ctx)
    mlp_stage(ctx)
