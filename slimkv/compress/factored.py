"""Drop-in factored replacements for ``nn.Linear`` (and GPT-2 ``Conv1D``) leaves.

Every replacement maps (..., in_features) -> (..., out_features) like the leaf it replaces, so the
model's own attention, RoPE, GQA and generation code runs unchanged.

- ``FactoredLinear``: y = B z + bias with z = input_factor(x) of size ``rank``.
- input factors: ``DenseInputFactor`` (z = A x) or ``IdentityBlockInputFactor``
  (z = x[perm[:r]] + A_rest x[perm[r:]]: the r x r identity is implicit, saving r^2 weights);
  ``SharedInputFactor`` lets several leaves (gate and up) share one input factor, computed once
  when they read the same tensor.
- ``SplitOutputLinear``: a fused leaf (GPT-2's c_attn = [q; k; v]) as the concatenation of parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimkv.compress.linalg import Factors, IdentityBlockFactors


class DenseInputFactor(nn.Module):
    """z = A x with A (rank, in_features)."""

    def __init__(self, in_features: int, rank: int):
        super().__init__()
        self.in_features, self.rank = in_features, rank
        self.weight = nn.Parameter(torch.empty(rank, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def num_weights(self) -> int:
        return self.weight.numel()


class IdentityBlockInputFactor(nn.Module):
    """z = x[..., perm[:r]] + x[..., perm[r:]] @ A_rest^T: A = [I | A_rest] up to a column permutation.

    ``perm`` (in_features,) is a buffer saved with the weights; ``rest_weight`` is A_rest
    (rank, in_features - rank). One gather puts x in permuted order; the identity part is an add.
    The gather is ``torch.gather`` with a broadcast index: a last-dimension ``index_select`` is a
    strided copy several times slower, which ate most of the FLOP saving in prefill.
    ``dense_weight()`` is the plain A the tests compare against.
    """

    def __init__(self, in_features: int, rank: int):
        super().__init__()
        self.in_features, self.rank = in_features, rank
        self.register_buffer("perm", torch.arange(in_features))
        self.rest_weight = nn.Parameter(torch.empty(rank, in_features - rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        permuted = torch.gather(rows, 1, self.perm.expand(rows.shape[0], -1))
        z = torch.addmm(permuted[:, :self.rank], permuted[:, self.rank:], self.rest_weight.T)
        return z.reshape(*x.shape[:-1], self.rank)

    def dense_weight(self) -> torch.Tensor:
        """A (rank, in_features) with z = x A^T: the identity and A_rest scattered back to their columns."""
        dense = torch.zeros(self.rank, self.in_features, dtype=self.rest_weight.dtype, device=self.rest_weight.device)
        dense[torch.arange(self.rank), self.perm[: self.rank]] = 1.0
        dense[:, self.perm[self.rank :]] = self.rest_weight.detach()
        return dense

    def num_weights(self) -> int:
        return self.rest_weight.numel()


class SharedInputFactor(nn.Module):
    """One input factor used by several ``FactoredLinear`` leaves (gate and up of a gated MLP).

    Calling it twice in a row on the same tensor object (gate_proj(x), then up_proj(x)) computes
    the factor once: the first call keeps (x, z) and the next call on that very tensor takes z and
    drops the reference. With ``reuse=False`` it recomputes every time (the plain reference path).
    """

    def __init__(self, factor: nn.Module, consumers: int = 2):
        super().__init__()
        self.factor = factor
        self.rank, self.in_features = factor.rank, factor.in_features
        self.consumers = consumers
        self.reuse = True
        self._last: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reuse and self._last is not None and self._last[0] is x:
            _, z, uses = self._last
            self._last = (x, z, uses + 1) if uses + 1 < self.consumers else None
            return z
        z = self.factor(x)
        self._last = (x, z, 1) if self.reuse and self.consumers > 1 else None
        return z

    def num_weights(self) -> int:
        return self.factor.num_weights()


class FactoredLinear(nn.Module):
    """y = B input_factor(x) + bias: a drop-in for an ``nn.Linear(in_features, out_features)``."""

    def __init__(self, input_factor: nn.Module, out_features: int, bias: bool):
        super().__init__()
        self.input_factor = input_factor
        self.in_features, self.out_features, self.rank = input_factor.in_features, out_features, input_factor.rank
        self.out_weight = nn.Parameter(torch.empty(out_features, self.rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.input_factor(x), self.out_weight, self.bias)

    def num_weights(self, count_input: bool = True) -> int:
        """Stored weights (biases excluded); a shared input factor is counted by whoever owns it."""
        return self.out_weight.numel() + (self.input_factor.num_weights() if count_input else 0)


class SplitOutputLinear(nn.Module):
    """A fused leaf as parts stacked along the output: y = cat([part(x) for part in parts], -1)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def make_input_factor(in_features: int, rank: int, identity: bool) -> nn.Module:
    return IdentityBlockInputFactor(in_features, rank) if identity else DenseInputFactor(in_features, rank)


@torch.no_grad()
def fill_input_factor(module: nn.Module, factors: Factors | IdentityBlockFactors) -> None:
    """Copy an input factor's values (float64 -> the module's dtype)."""
    if isinstance(module, IdentityBlockInputFactor):
        module.perm.copy_(factors.perm)
        module.rest_weight.copy_(factors.A_rest)
    else:
        module.weight.copy_(factors.A)


def build_factored(factors: Factors | IdentityBlockFactors, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str,
                   shared: SharedInputFactor | None = None) -> FactoredLinear:
    """A ``FactoredLinear`` holding ``factors`` (and ``bias``), or using ``shared`` as its input factor."""
    d_out, rank = factors.B.shape
    identity = isinstance(factors, IdentityBlockFactors)
    if shared is None:
        d_in = factors.perm.numel() if identity else factors.A.shape[1]
        input_factor = make_input_factor(d_in, rank, identity)
    else:
        input_factor = shared
    module = FactoredLinear(input_factor, d_out, bias is not None).to(dtype=dtype, device=device)
    with torch.no_grad():
        if shared is None:
            fill_input_factor(input_factor, factors)
        module.out_weight.copy_(factors.B)
        if bias is not None:
            module.bias.copy_(bias)
    return module
