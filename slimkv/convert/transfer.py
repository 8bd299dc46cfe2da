"""Attention transfer: fit converted layers, one at a time, to reproduce the original attention's
outputs on long calibration windows (LoLCATs' first stage, for conversions whose one-shot fit
leaves parameters the statistics cannot set, as KVM's LN_s, temperatures and merge gate).

Every layer sees the ORIGINAL model's attention inputs (teacher forcing: errors of earlier
converted layers do not reach later ones) and is fitted by Adam on the mean squared error between
its output and the original layer's, relative to the original output's mean square, over the
positions ``first_position`` onwards (for KVM: where the compressed state is read). The windows
must be long enough that the converted layer's approximations are used (KVM: several windows'
worth of tokens). Distillation of the whole model (``convert.heal``) can follow.

A fit that ends with a larger error than the layer started with (a learning rate too high for the
parameters fitted) is not kept: the layer gets its one-shot parameters back, the manifest records
both errors and ``kept: "one-shot"``, and a line on stderr says so.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from slimkv.convert.calibrate import feed_windows

PARAMETER_SETS = ("kvm", "attention")  # KVM's own parameters (LN_s, temperatures, gate) / every parameter of the layer
DEFAULT_LR = {"kvm": 0.05, "attention": 1e-3}  # the peak rate per parameter set (docs/conversion.md: 0.05 on every weight diverges)
MAX_LR = 1.0


@dataclass(frozen=True)
class TransferConfig:
    """How each layer is fitted: Adam steps (one window per step, cycling), peak learning rate
    (cosine decay to 10%), which parameters (``PARAMETER_SETS``), the first position that counts."""

    steps: int
    lr: float
    params: str = "kvm"
    first_position: int = 0
    seed: int = 0


def trainable(attn: nn.Module, params: str) -> list[nn.Parameter]:
    """The parameters of ``attn`` a transfer with ``params`` fits."""
    if params == "attention":
        return list(attn.parameters())
    own = [p for name, p in attn.named_parameters() if name.startswith(("ln_s.", "gate_proj.", "tau_"))]
    if not own:
        raise ValueError(f"transfer_params=kvm: the layer ({type(attn).__name__}) has no KVM parameters; use transfer_params=attention")
    return own


@torch.no_grad()
def capture_attention(model: nn.Module, windows: torch.Tensor, *, progress: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every attention layer of a transformers Llama-family ``model`` on
    ``windows`` (n, T) token ids: per layer two float32 tensors (n, T, d_model)."""
    layers = model.model.layers
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]
    outputs: list[list[torch.Tensor]] = [[] for _ in layers]
    feed_windows(model, windows, lambda i, x: inputs[i].append(x.float().cpu()), lambda i, y: outputs[i].append(y.float().cpu()),
                 desc="transfer targets", progress=progress)
    return [(torch.cat(x), torch.cat(y)) for x, y in zip(inputs, outputs)]


def relative_error(attn: nn.Module, x: torch.Tensor, y: torch.Tensor, first: int) -> float:
    """Mean squared error of ``attn(x)`` against ``y`` over positions ``first`` on, relative to y's mean square."""
    with torch.no_grad():
        out = torch.cat([attn(row[None]) for row in x])
    return float((out[:, first:] - y[:, first:]).square().mean() / y[:, first:].square().mean())


def transfer_layer(attn: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TransferConfig) -> dict[str, float]:
    """Fit ``attn`` (in place) so that attn(x) matches y (module docstring); x, y (n, T, d).
    Returns the relative error before and after, on the same windows."""
    first = cfg.first_position
    if first >= x.shape[1]:
        raise ValueError(f"transfer windows of {x.shape[1]} tokens never reach position {first}, where the converted layer's "
                         "approximation starts: use longer windows (transfer_seq_len)")
    before = relative_error(attn, x, y, first)
    one_shot = {name: value.detach().clone() for name, value in attn.state_dict().items()}
    params = trainable(attn, cfg.params)
    frozen = [p for p in attn.parameters() if all(p is not q for q in params)]
    for p in frozen:
        p.requires_grad_(False)
    optimizer = torch.optim.Adam(params, lr=cfg.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * step / max(cfg.steps, 1))))
    scale = y[:, first:].square().mean()
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(cfg.seed))
    try:
        for step in range(cfg.steps):
            row = order[step % len(order)]
            out = attn(x[row][None])
            loss = (out[0, first:] - y[row, first:]).square().mean() / scale
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        for p in attn.parameters():
            p.requires_grad_(True)
    after = relative_error(attn, x, y, first)
    if math.isfinite(after) and after <= before:
        return {"relative_error_before": before, "relative_error_after": after, "kept": "fitted"}
    attn.load_state_dict(one_shot)
    return {"relative_error_before": before, "relative_error_after": before, "relative_error_fitted": after, "kept": "one-shot"}


def transfer_model(layers: list[nn.Module], targets: list[tuple[torch.Tensor, torch.Tensor]], cfg: TransferConfig, *,
                   progress: bool = True) -> list[dict[str, float]]:
    """``transfer_layer`` for each converted attention layer with its captured (input, output)."""
    facts = []
    for index, (attn, (x, y)) in enumerate(tqdm(list(zip(layers, targets)), desc="attention transfer", unit="layer", disable=not progress)):
        facts.append({"layer": index, **transfer_layer(attn, x, y, cfg)})
        if facts[-1]["kept"] == "one-shot":
            tqdm.write(f"attention transfer, layer {index}: the fit made the layer worse (relative error {facts[-1]['relative_error_before']:.4g} -> "
                       f"{facts[-1]['relative_error_fitted']:.4g} at lr {cfg.lr:g}, params {cfg.params}); kept its one-shot parameters "
                       "(a lower transfer_lr, or transfer_params=kvm, may fit it)", file=sys.stderr)
    return facts
