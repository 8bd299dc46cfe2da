"""``CompressOptions``: everything that decides the result of a compression (stored in the manifest)."""

from __future__ import annotations

from dataclasses import dataclass

from slimkv.common.checks import check_bool, check_choice, check_float, check_int
from slimkv.compress.joint_mlp import UD_DAMPING

RANK_ALLOCATIONS = ("uniform", "spectrum", "sensitivity")


@dataclass
class CompressOptions:
    """The method (a name in ``slimkv.compress.methods.METHODS``), the ratio of block-projection
    weights to remove, and the knobs of the methods (defaults are the documented choices)."""

    method: str
    ratio: float
    damping: float = UD_DAMPING  # relative damping (x mean diag C) of the least-squares maps of the ReLU joint MLP
    asvd_alpha: float = 0.5
    qk_iterations: int = 8
    mlp_iterations: int = 4
    joint_qk: bool = True  # latentllm components (ablations switch them off)
    rope_aware_qk: bool = True  # average the joint QK objective over RoPE offsets (models with RoPE)
    joint_mlp: bool = True
    joint_mlp_check: bool = True  # per block, keep the joint MLP only if its MLP output error beats separate RootCov factors (latentllm.mlp_output_errors)
    identity_block: bool = True
    cov_shrinkage: float = 0.0  # C -> (1 - s) C + s (tr C / d) I before factoring (Stats.shrunk): robustness away from the calibration text
    correct_upstream: bool = False  # fit each projection to the dense model's output from the compressed model's input (Stats.corrected_weight)
    refit: bool = False  # after the input factor is chosen, refit the output factor in closed form (BlockContext.refit)
    correction_damping: float = 1e-2  # relative ridge (x tr(C)/d) of the least-squares maps of correct_upstream and refit
    # uniform: every matrix keeps (1 - ratio) of its weights; spectrum / sensitivity: one budget spread by slimkv.compress.allocation
    rank_allocation: str = "uniform"
    sequential: bool = True  # calibrate each block on the compressed blocks' outputs (False: on the dense model's, as ASVD does)
    full_rank: bool = False  # keep every matrix at full rank: a check that the machinery is lossless

    def validate(self) -> None:
        """ValueError naming the option for a value that cannot compress (the method name is
        checked against the registry by ``compress_model``)."""
        if not isinstance(self.method, str):
            raise ValueError(f"method must be a method name, got {self.method!r}")
        if not self.full_rank and isinstance(self.ratio, (int, float)) and self.ratio == 0:
            raise ValueError("ratio=0 removes nothing: there is nothing to compress; give a ratio in (0, 1), e.g. 0.1")
        check_float("ratio", self.ratio, 0.0, 1.0, open_low=not self.full_rank, open_high=True)
        check_float("damping", self.damping, 0.0)
        check_float("asvd_alpha", self.asvd_alpha, 0.0)
        check_float("correction_damping", self.correction_damping, 0.0)
        check_float("cov_shrinkage", self.cov_shrinkage, 0.0, 1.0, open_high=True)
        check_int("qk_iterations", self.qk_iterations, 1)
        check_int("mlp_iterations", self.mlp_iterations, 1)
        check_choice("rank_allocation", self.rank_allocation, RANK_ALLOCATIONS)
        if self.correct_upstream is True and self.sequential is False:
            raise ValueError("correct_upstream=True needs sequential=True: the correction fits the compressed model's inputs to the dense model's outputs")
        for name in ("joint_qk", "rope_aware_qk", "joint_mlp", "joint_mlp_check", "identity_block", "correct_upstream", "refit", "sequential", "full_rank"):
            check_bool(name, getattr(self, name))
