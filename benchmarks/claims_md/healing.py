"""The healing curve's points: claims.md's healing section and ``convert_oneshot.py --curve-from`` read them."""

from __future__ import annotations

from typing import Any

CURVE_LR = 1e-4  # the peak learning rate of the curve's runs (convert's default when they ran); other rates are the sweep's


def curve_points(runs: list[dict[str, Any]]) -> dict[float, dict[int, tuple[dict[str, Any], dict[str, Any]]]]:
    """Per cache ratio, per healing tokens seen (0: one-shot): the ``latent`` row (uniform allocation, the default parameter
    set, peak learning rate ``CURVE_LR``) and its file. Two files with the same point are refused (the curve would depend on their order)."""
    points: dict[float, dict[int, tuple[dict[str, Any], dict[str, Any]]]] = {}
    for d in runs:
        for r in d["rows"]:
            healing = r.get("healing") or {}
            if r["method"] == "latent" and (not healing or (healing["config"]["params"], healing["config"]["lr"]) == ("changed", CURVE_LR)):
                if (tokens := healing.get("tokens_seen", 0)) in points.setdefault(r["cache_ratio"], {}):
                    raise ValueError(f"two results for R = {r['cache_ratio']} healed on {tokens} tokens: {d['benchmark']} and "
                                     f"{points[r['cache_ratio']][tokens][1]['benchmark']}")
                points[r["cache_ratio"]][tokens] = (r, d)
    return points
