"""Helpers the compression tests share."""

from __future__ import annotations

import math

from slimkv.compress.pipeline import iter_leaf_entries


def rank_step_slack(modules: list[dict]) -> float:
    """How much one more rank on every matrix would change the achieved ratio (the test tolerance)."""
    before = sum(e["params_before"] for e in iter_leaf_entries(modules))
    step = sum(e["in_features"] + e["out_features"] for e in iter_leaf_entries(modules))
    return step / before if before else math.inf
