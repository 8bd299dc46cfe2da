"""What keeps a compressed model good away from its calibration text: covariance shrinkage,
upstream correction, closed-form refits and non-uniform rank allocation (docs/compression.md)."""

from __future__ import annotations

import pytest
import torch

from slimkv.compress import CompressOptions, compress_model
from slimkv.compress.allocation import allocate, allocate_by_sensitivity
from slimkv.compress.cost import factor_params, rank_for_budget
from slimkv.compress.linalg import (
    Factors,
    StatsAccumulator,
    refit_output_factor,
    rootcov_factors,
    svd_factors,
)
from slimkv.compress.pipeline import iter_leaf_entries
from slimkv.compress.sweep import parse_methods, variant
from tests.compress.helpers import assert_reloads_with_identical_logits

from .conftest import calib_ids, tiny_model


def random_inputs(n: int = 400, d: int = 10, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)


def test_shrinkage_moves_the_covariance_towards_its_scaled_identity_and_keeps_projected_grams_consistent():
    x = random_inputs()
    W = torch.randn(4, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    full = StatsAccumulator(10, chunk=64)
    full.add(x)
    projected = StatsAccumulator(10, chunk=64, cov=False, mean_abs=False, out_weight=W)
    projected.add(x)
    stats, projected_stats = full.finish(), projected.finish()
    assert stats.shrunk(0.0) is stats
    assert stats.energy == pytest.approx(float((x * x).sum()) / (400 * 10))
    shrunk = stats.shrunk(0.3)
    expected = 0.7 * stats.cov + 0.3 * stats.energy * torch.eye(10, dtype=torch.float64)
    assert torch.allclose(shrunk.cov, expected)
    # the d_out x d_out shortcut gives the same W C W^T as the full covariance, shrunk or not
    assert torch.allclose(projected_stats.shrunk(0.3).weighted_gram(W, False), W @ expected @ W.T)
    with pytest.raises(ValueError, match="cov_shrinkage"):
        stats.shrunk(1.0)


def test_full_shrinkage_limit_turns_rootcov_into_plain_svd():
    x = random_inputs()
    W = torch.randn(6, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    acc = StatsAccumulator(10)
    acc.add(x)
    stats = acc.finish().shrunk(1.0 - 1e-12)
    near_svd = rootcov_factors(W, stats.cov, 3).product()
    assert torch.allclose(near_svd, svd_factors(W, 3).product(), atol=1e-6)


def test_corrected_weight_undoes_a_linear_distortion_of_the_input():
    """If the compressed model's input is x_hat = M x (M invertible), the map that reproduces the
    dense output W x from x_hat is W M^{-1}."""
    x = random_inputs()
    M = torch.eye(10, dtype=torch.float64) + 0.3 * torch.randn(10, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    W = torch.randn(5, 10, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    acc = StatsAccumulator(10, mean_abs=False, cross=True)
    acc.add(x @ M.T, dense=x)
    stats = acc.finish()
    assert torch.allclose(stats.corrected_weight(W, damping=0.0), W @ torch.linalg.inv(M), atol=1e-8)
    # same inputs on both paths: W itself (up to the ridge)
    same = StatsAccumulator(10, mean_abs=False, cross=True)
    same.add(x, dense=x)
    assert torch.allclose(same.finish().corrected_weight(W, damping=0.0), W, atol=1e-8)
    with pytest.raises(ValueError, match="dense inputs"):
        acc.add(x)


def test_refit_is_the_least_squares_output_factor_and_leaves_rootcov_unchanged():
    x = random_inputs()
    W = torch.randn(6, 10, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cov = x.T @ x / x.shape[0]
    rootcov = rootcov_factors(W, cov, 3)
    refitted = refit_output_factor(rootcov, W @ cov, cov, 0.0)
    assert torch.allclose(refitted.product(), rootcov.product(), atol=1e-8)
    svd = svd_factors(W, 3)
    refit_svd = refit_output_factor(svd, W @ cov, cov, 0.0)
    reference = torch.linalg.lstsq(x @ svd.A.T, x @ W.T).solution.T
    assert torch.allclose(refit_svd.B, reference, atol=1e-8)

    def error(f: Factors) -> float:
        return float(((x @ (W - f.product()).T) ** 2).sum())

    assert error(refit_svd) < error(svd)


def test_allocation_spends_the_uniform_budget_where_the_spectrum_is_flat():
    shapes = {(0, "flat"): (32, 32), (0, "sharp"): (32, 32), (1, "sharp"): (16, 48)}
    decay = 0.5 ** torch.arange(32, dtype=torch.float64)
    spectra = {(0, "flat"): torch.ones(32, dtype=torch.float64), (0, "sharp"): decay, (1, "sharp"): decay[:16]}
    ratio = 0.5
    for identity in (False, True):
        ranks = allocate(spectra, shapes, ratio, identity)
        used = sum(factor_params(d_in, d_out, ranks[k], identity) for k, (d_out, d_in) in shapes.items())
        budget = sum((1 - ratio) * d_out * d_in for d_out, d_in in shapes.values())
        assert budget - 64 < used <= budget  # all but less than one rank step of the budget is spent
        uniform = {k: rank_for_budget(d_in, d_out, (1 - ratio) * d_in * d_out, identity) for k, (d_out, d_in) in shapes.items()}
        assert ranks[(0, "flat")] > uniform[(0, "flat")]
        assert 1 <= ranks[(0, "sharp")] < uniform[(0, "sharp")] and 1 <= ranks[(1, "sharp")] < uniform[(1, "sharp")]
        assert all(ranks[k] <= min(shapes[k]) for k in shapes)


@torch.no_grad()
def calibration_error(model, reference, ids) -> float:
    return float(((model(ids).logits - reference) ** 2).mean())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_upstream_correction_is_lossless_at_full_rank(family):
    model = tiny_model(family)
    ids = calib_ids(2, 20)
    with torch.no_grad():
        before = model(ids).logits
    options = CompressOptions(method="latentllm", ratio=0.0, full_rank=True, correct_upstream=True, refit=True, correction_damping=0.0)
    manifest = compress_model(model, calib_ids(), options, progress=False)
    assert "corrected" in manifest["propagation"]
    with torch.no_grad():
        assert (model(ids).logits - before).abs().max() < 1e-4


@pytest.mark.parametrize("method", ["rootcov", "latentllm"])
def test_upstream_correction_lowers_the_calibration_error(method):
    ids = calib_ids(8, 48)
    reference = tiny_model("llama")
    with torch.no_grad():
        target = reference(ids).logits
    errors = {}
    for correct in (False, True):
        model = tiny_model("llama")
        compress_model(model, ids, CompressOptions(method=method, ratio=0.4, correct_upstream=correct, correction_damping=1e-4), progress=False)
        errors[correct] = calibration_error(model, target, ids)
    assert errors[True] < errors[False]


def test_spectrum_allocation_keeps_the_total_budget_and_records_the_ranks():
    model = tiny_model("llama")
    manifest = compress_model(model, calib_ids(), CompressOptions(method="latentllm", ratio=0.4, rank_allocation="spectrum"), progress=False)
    allocation = manifest["allocation"]
    assert allocation["rule"] == "spectrum" and set(allocation["ranks"]) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert all(len(ranks) == 2 for ranks in allocation["ranks"].values())
    assert manifest["achieved_ratio"] >= 0.4 - 0.02
    uniform = compress_model(tiny_model("llama"), calib_ids(), CompressOptions(method="latentllm", ratio=0.4), progress=False)
    assert uniform["allocation"]["rule"] == "uniform"


@pytest.mark.parametrize("bad", [{"cov_shrinkage": 1.0}, {"cov_shrinkage": -0.1}, {"rank_allocation": "greedy"}, {"correction_damping": -1.0},
                                 {"refit": "yes"}])
def test_bad_robustness_options_name_the_option(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        CompressOptions(method="latentllm", ratio=0.2, **bad).validate()


def test_sensitivity_threshold_search_keeps_the_least_damaged_fractions_and_may_leave_matrices_dense():
    sensitivity = {(0, "robust"): {0.2: 1.0, 0.5: 1.0}, (0, "fragile"): {0.2: 9.0, 0.5: 5.0}, (1, "middle"): {0.2: 3.0, 0.5: 2.0}}
    sizes = {key: 100 for key in sensitivity}
    keeps = allocate_by_sensitivity(sensitivity, sizes, ratio=0.4)  # 180 of 300 weights
    assert keeps == {(0, "robust"): 0.2, (0, "fragile"): 1.0, (1, "middle"): 0.5}
    assert sum(keeps[k] * sizes[k] for k in sizes) <= 0.6 * 300
    with pytest.raises(ValueError, match="ratio 0.9"):
        allocate_by_sensitivity(sensitivity, sizes, ratio=0.9)


@pytest.mark.parametrize("method", ["asvd", "rootcov"])
def test_sensitivity_allocation_compresses_saves_and_reloads(method, tmp_path):
    model = tiny_model("llama")
    options = CompressOptions(method=method, ratio=0.3, rank_allocation="sensitivity", sequential=False)
    manifest = compress_model(model, calib_ids(), options, progress=False)
    allocation = manifest["allocation"]
    assert allocation["rule"] == "sensitivity" and allocation["factorization_probed"] == method
    assert manifest["achieved_ratio"] >= 0.3 - 1e-9 and "dense model's activations" in manifest["propagation"]
    kinds = {entry["kind"] for entry in manifest["modules"]}
    assert kinds <= {"factored", "dense"} and "factored" in kinds
    assert len(allocation["dense"]) == sum(entry["kind"] == "dense" for entry in manifest["modules"])
    assert_reloads_with_identical_logits(model, manifest, tmp_path / "out", calib_ids(1, 16))


def test_correction_needs_sequential_calibration():
    with pytest.raises(ValueError, match="correct_upstream=True needs sequential=True"):
        CompressOptions(method="rootcov", ratio=0.2, correct_upstream=True, sequential=False).validate()


def test_sweep_labels_take_option_settings_and_name_what_is_wrong():
    assert variant("latentllm+cov_shrinkage=0.1+refit=true") == ("latentllm", {"cov_shrinkage": 0.1, "refit": True})
    assert variant("latentllm-no-joint-mlp+rank_allocation=spectrum") == ("latentllm", {"joint_mlp": False, "rank_allocation": "spectrum"})
    for label, message in [("latentlm", "did you mean latentllm"), ("rootcov+foo=1", "'foo=1' is not FIELD=VALUE"),
                           ("rootcov+refit=yes", "true or false"), ("rootcov+cov_shrinkage=x", "not a float"),
                           ("rootcov+rank_allocation=best", "allowed values: uniform, spectrum, sensitivity")]:
        with pytest.raises(ValueError, match=message):
            parse_methods(label)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_joint_mlp_is_kept_only_where_it_beats_separate_factors(family):
    manifest = compress_model(tiny_model(family), calib_ids(), CompressOptions(method="latentllm", ratio=0.5), progress=False)
    entries = [e for e in iter_leaf_entries(manifest["modules"]) if e["projection"] in ("gate", "up")]
    assert entries
    for entry in entries:
        errors = entry["mlp_output_error"]
        assert entry["chosen"] == min(errors, key=errors.get) and all(v >= 0 for v in errors.values())
        assert entry["how"] == ("rootcov" if entry["chosen"] == "separate" else ("joint_mlp_shared" if family == "llama" else "joint_mlp_weighted"))
    unchecked = compress_model(tiny_model(family), calib_ids(), CompressOptions(method="latentllm", ratio=0.5, joint_mlp_check=False), progress=False)
    assert all(e["how"].startswith("joint_mlp") for e in iter_leaf_entries(unchecked["modules"]) if e["projection"] in ("gate", "up"))


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_weight_shapes_match_the_weights_without_copying_them(family):
    from slimkv.compress.arch import Architecture

    arch = Architecture(tiny_model(family))
    for block in arch.blocks():
        assert all(arch.weight_shape(block, p) == tuple(arch.weight(block, p).shape) for p in arch.layout.projections())
