"""Helpers the compression tests share."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from slimkv.compress import load, save
from slimkv.compress.pipeline import iter_leaf_entries


def rank_step_slack(modules: list[dict]) -> float:
    """How much one more rank on every matrix would change the achieved ratio (the test tolerance)."""
    before = sum(e["params_before"] for e in iter_leaf_entries(modules))
    step = sum(e["in_features"] + e["out_features"] for e in iter_leaf_entries(modules))
    return step / before if before else math.inf


def assert_reloads_with_identical_logits(model: torch.nn.Module, manifest: dict, folder: Path, ids: torch.Tensor) -> None:
    """Save the compressed ``model`` to ``folder``, load it back and check its logits on ``ids`` are bit-identical."""
    save(model, None, manifest, folder)
    reloaded, _ = load(folder)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
