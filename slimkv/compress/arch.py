"""Where the projections of a decoder block live, in one representation for every family.

A ``Projection`` is a logical weight matrix W (d_out, d_in) acting as y = W x (+ b), named
``q, k, v, o, gate, up, down`` in every family (OPT's fc1/fc2 and GPT-2's c_fc/c_proj are
``up``/``down``). GPT-2 stores weights transposed in ``Conv1D`` leaves and fuses q/k/v into one
``c_attn`` leaf: its q, k and v are row slices of that leaf's transposed weight, and its
replacement is a ``SplitOutputLinear`` of the three factored parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slimkv.pretrained.families import family_of


@dataclass(frozen=True)
class Projection:
    name: str  # logical name: q, k, v, o, gate, up, down
    path: str  # leaf module path inside the block, e.g. "self_attn.q_proj"
    rows: tuple[int, int] | None = None  # output rows of a fused leaf (GPT-2 c_attn)
    conv1d: bool = False  # weight stored (d_in, d_out) as in transformers' Conv1D


@dataclass(frozen=True)
class BlockLayout:
    """The compressible projections of one decoder block, grouped by the input they read."""

    family: str
    attn_in: tuple[Projection, ...]  # q, k, v (one input)
    attn_out: Projection  # o
    mlp_in: tuple[Projection, ...]  # gate, up (gated) or up
    mlp_out: Projection  # down
    gated: bool  # MLP is down(act(gate x) * up x)
    activation_path: str  # the activation module inside the block
    mlp_path: str | None  # a submodule computing the whole MLP from its input (None: the MLP is inlined in the block)
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def projections(self) -> tuple[Projection, ...]:
        return (*self.attn_in, self.attn_out, *self.mlp_in, self.mlp_out)

    def get(self, name: str) -> Projection:
        return next(p for p in self.projections() if p.name == name)


def _llama_layout(config) -> BlockLayout:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    proj = lambda name, path: Projection(name, path)  # noqa: E731
    return BlockLayout(
        family="llama",
        attn_in=(proj("q", "self_attn.q_proj"), proj("k", "self_attn.k_proj"), proj("v", "self_attn.v_proj")),
        attn_out=proj("o", "self_attn.o_proj"),
        mlp_in=(proj("gate", "mlp.gate_proj"), proj("up", "mlp.up_proj")),
        mlp_out=proj("down", "mlp.down_proj"),
        gated=True,
        activation_path="mlp.act_fn",
        mlp_path="mlp",
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
    )


def _opt_layout(config) -> BlockLayout:
    heads = config.num_attention_heads
    return BlockLayout(
        family="opt",
        attn_in=(Projection("q", "self_attn.q_proj"), Projection("k", "self_attn.k_proj"), Projection("v", "self_attn.v_proj")),
        attn_out=Projection("o", "self_attn.out_proj"),
        mlp_in=(Projection("up", "fc1"),),
        mlp_out=Projection("down", "fc2"),
        gated=False,
        activation_path="activation_fn",
        mlp_path=None,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=config.hidden_size // heads,
    )


def _gpt2_layout(config) -> BlockLayout:
    d, heads = config.hidden_size, config.num_attention_heads
    qkv = lambda name, i: Projection(name, "attn.c_attn", rows=(i * d, (i + 1) * d), conv1d=True)  # noqa: E731
    return BlockLayout(
        family="gpt2",
        attn_in=(qkv("q", 0), qkv("k", 1), qkv("v", 2)),
        attn_out=Projection("o", "attn.c_proj", conv1d=True),
        mlp_in=(Projection("up", "mlp.c_fc", conv1d=True),),
        mlp_out=Projection("down", "mlp.c_proj", conv1d=True),
        gated=False,
        activation_path="mlp.act",
        mlp_path="mlp",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d // heads,
    )


_LAYOUTS = {"llama": _llama_layout, "opt": _opt_layout, "gpt2": _gpt2_layout}


class Architecture:
    """The blocks of a supported transformers causal LM and how to read/replace their projections."""

    def __init__(self, model: nn.Module):
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("encoder-decoder models are not supported")
        self.family = family_of(config.model_type)
        self.layout = _LAYOUTS[self.family](config)
        if self.family == "llama":
            self.blocks_path = "model.layers"
        elif self.family == "opt":
            self.blocks_path = "model.decoder.layers"
        else:
            self.blocks_path = "transformer.h"
        self.model = model

    def blocks(self) -> nn.ModuleList:
        return self.model.get_submodule(self.blocks_path)

    def block_prefix(self, index: int) -> str:
        return f"{self.blocks_path}.{index}"

    @staticmethod
    def leaf(block: nn.Module, proj: Projection) -> nn.Module:
        return block.get_submodule(proj.path)

    @staticmethod
    def activation(block: nn.Module, layout: BlockLayout) -> nn.Module:
        return block.get_submodule(layout.activation_path)

    def weight(self, block: nn.Module, proj: Projection) -> torch.Tensor:
        """W (d_out, d_in) as float64 (a copy)."""
        leaf = self.leaf(block, proj)
        W = leaf.weight.detach().T if proj.conv1d else leaf.weight.detach()
        if proj.rows is not None:
            W = W[proj.rows[0]:proj.rows[1]]
        return W.to(torch.float64).clone()

    def weight_shape(self, block: nn.Module, proj: Projection) -> tuple[int, int]:
        """(d_out, d_in) of ``proj`` without copying its weight."""
        d_out, d_in = self.leaf(block, proj).weight.shape[::-1] if proj.conv1d else self.leaf(block, proj).weight.shape
        return (proj.rows[1] - proj.rows[0] if proj.rows is not None else d_out), d_in

    def bias(self, block: nn.Module, proj: Projection) -> torch.Tensor | None:
        leaf = self.leaf(block, proj)
        if getattr(leaf, "bias", None) is None:
            return None
        b = leaf.bias.detach()
        if proj.rows is not None:
            b = b[proj.rows[0]:proj.rows[1]]
        return b.to(torch.float64).clone()

    @staticmethod
    def set_leaf(block: nn.Module, path: str, module: nn.Module) -> None:
        parent_path, _, name = path.rpartition(".")
        parent = block.get_submodule(parent_path) if parent_path else block
        setattr(parent, name, module)

    def rope_inv_freq(self) -> torch.Tensor | None:
        """The rotary frequencies (head_dim / 2,) of a rotate-half RoPE covering the whole head, or
        None (no RoPE: OPT, GPT-2; or a partial rotary this code does not model)."""
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None) if self.family == "llama" else None
        inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None or 2 * inv_freq.numel() != self.layout.head_dim:
            return None
        return inv_freq.detach().to(torch.float64).cpu()

    def leaf_groups(self) -> dict[str, tuple[Projection, ...]]:
        """Leaf path -> its projections in output order (one for plain leaves, q/k/v for c_attn)."""
        groups: dict[str, list[Projection]] = {}
        for proj in self.layout.projections():
            groups.setdefault(proj.path, []).append(proj)
        return {path: tuple(projs) for path, projs in groups.items()}
