"""Timing and result files every benchmark uses (docs/evaluation.md, "Speed benchmarks").

Warm up, repeat, report median/min/max with the raw samples; record the machine (CPU model and
instruction set), thread count and load average, and the provenance (git commit, command line,
package versions) beside the numbers; write JSON (and a PNG where a plot helps) into
a folder the caller names (benchmark scripts pass ``benchmarks/results``).
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from slimkv.common.files import save_figure, write_json
from slimkv.common.vocabulary import VOCABULARY


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued device work (no-op on CPU) so wall-clock timings are honest."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 7, device: torch.device | str | None = None) -> dict[str, Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed; seconds per call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples), "samples_s": samples}


def measure_copy_bandwidth(nbytes: int = 256 * 2**20, device: torch.device | str = "cpu", repeats: int = 7) -> float:
    """Bytes/s of a large tensor copy (read + write both counted), the machine's memory-speed yardstick."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    stats = time_fn(lambda: dst.copy_(src), warmup=2, repeats=repeats, device=device)
    return 2 * nbytes / stats["median_s"]


def _cpu_facts() -> dict[str, Any]:
    """CPU model and widest vector instruction set from ``/proc/cpuinfo`` (Linux; ``{}`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    facts: dict[str, Any] = {"cpu_model": names[0]} if names else {}
    if flags:
        facts["instruction_set"] = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    return facts


PROVENANCE_PACKAGES = ("torch", "transformers", "numpy", "lm_eval", "optimum-quanto", "hqq")


def package_versions(names: tuple[str, ...] = PROVENANCE_PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution in ``names`` (None when it is not installed)."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(folder: str | Path | None = None) -> str | None:
    """The commit checked out where slimkv's source lies (or at ``folder``), ``+dirty`` when the
    tracked files differ from it; None outside a git checkout or without git."""
    folder = Path(folder) if folder is not None else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, and how busy the machine was (1/5/15-minute load); and
    how they were made: the git commit, the command line and the versions of the packages that
    shape them. What cannot change within a process (the CPU, the commit, the packages) is read
    once per process (``_process_facts``); the threads, the load and the command every call."""
    return {**_process_facts(), "threads": torch.get_num_threads(), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "command": list(sys.argv)}


@functools.lru_cache(maxsize=1)
def _process_facts() -> dict[str, Any]:
    """The part of ``machine_info`` fixed for the process: platform, CPU (``_cpu_facts``), git commit, packages."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        **_cpu_facts(),
        "git_commit": git_commit(),
        "packages": package_versions(),
    }


def write_results(name: str, payload: dict[str, Any], out_dir: str | Path, figure: Any = None) -> Path:
    """Write ``out_dir/<name>.json`` (with machine info and time) and, if given, ``<name>.png``; the JSON path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    body = {"benchmark": name, "machine": machine_info(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vocabulary": VOCABULARY, **payload}
    write_json(path, body)
    if figure is not None:
        save_figure(figure, out_dir / f"{name}.png")
    return path
