"""Shared test helpers: tolerances, random splits, and the registered attention cases."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import torch

from slimkv.attention import ATTENTION_KINDS, kind_spec

D_MODEL, N_HEADS, HEAD_DIM = 32, 4, 8
SEQ_LEN = 37
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """sqrt(mean((a-b)^2)) / sqrt(mean(b^2)), computed in float64."""
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300))


def random_splits(total: int, seed: int) -> list[int]:
    """Cut ``total`` tokens into call sizes drawn at random, always including a 1-token call."""
    rng = random.Random(seed)
    sizes, left = [], total
    while left:
        n = min(left, rng.choice([1, 1, 2, 3, 5, 8, 13]))
        sizes.append(n)
        left -= n
    return sizes


def attention_cases() -> list[tuple[str, dict]]:
    """(kind, own options) for every registered kind and each of its example configurations."""
    return [(kind, dict(opts)) for kind in ATTENTION_KINDS for opts in kind_spec(kind).example_options]


def case_id(case: tuple[str, dict]) -> str:
    kind, opts = case
    return kind + "".join(f"-{k}={v}" for k, v in opts.items())


def run_in_calls(attn, x: torch.Tensor, sizes: list[int], check=None) -> torch.Tensor:
    """Feed ``x`` through ``attn`` with a cache, in calls of the given sizes; concatenate outputs."""
    cache = attn.new_cache(x.shape[0], dtype=x.dtype)
    outs, t = [], 0
    for n in sizes:
        outs.append(attn(x[:, t : t + n], cache=cache))
        t += n
        if check is not None:
            check(cache)
    return torch.cat(outs, dim=1)


def assert_paths_agree(attn, x: torch.Tensor, expected: torch.Tensor, paths: tuple[str, ...] = ("absorbed", "expanded"),
                       splits: tuple[list[int], ...] = (), tol: float = 1e-10) -> None:
    """Every ``decode_path`` of ``attn`` computes ``expected`` on ``x`` in one call and in each of
    ``splits`` (lists of call sizes, the cache carrying the rest): the shared runner of the kinds
    with two exact decode paths (mla, latent)."""
    with torch.no_grad():
        for path in paths:
            attn.decode_path = path
            assert rel_rmse(attn(x), expected) < tol, path
            for sizes in splits:
                assert rel_rmse(run_in_calls(attn, x, list(sizes)), expected) < tol, (path, sizes)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str) -> ModuleType:
    """A script of ``benchmarks/`` (not a package) imported as a module, for tests of its rendering; as when the
    script runs, ``benchmarks/`` is on the path, so it can import the scripts beside it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{Path(script).stem}_under_test", BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def share_kernel_builds(folder: Path) -> None:
    """Point ``folder``'s kernel builds (``folder/kernels``, ``folder`` about to be $SLIMKV_CACHE) at
    the session's own cache's, so a private test cache does not compile the native kernel again:
    each build is keyed by its source, flags, compiler and CPU and written atomically, so tests and
    workers may share them (the build-cache tests use folders of their own)."""
    from slimkv.common.paths import cache_dir

    shared = cache_dir() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernels").symlink_to(shared, target_is_directory=True)
