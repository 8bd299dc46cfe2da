"""Timing and result files every benchmark uses (docs/evaluation.md, "Speed benchmarks").

Warm up, repeat, report median/min/max with the raw samples; record the machine, torch version,
thread count and load average beside the numbers; write JSON (and a PNG where a plot helps) into
a folder the caller names (benchmark scripts pass ``benchmarks/results``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slimkv.common.files import save_figure, write_json


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


def measure_matmul_rate(size: int = 1024, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", repeats: int = 7) -> float:
    """FLOP/s of a large square matmul (2 size^3 FLOPs per call): the arithmetic yardstick that,
    with ``measure_copy_bandwidth``, bounds how fast a kernel can be (a roofline)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    stats = time_fn(lambda: torch.mm(a, b), warmup=2, repeats=repeats, device=device)
    return 2 * size**3 / stats["median_s"]


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, and how busy the machine was (1/5/15-minute load)."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    return info


def write_results(name: str, payload: dict[str, Any], out_dir: str | Path, figure: Any = None) -> Path:
    """Write ``out_dir/<name>.json`` (with machine info and time) and, if given, ``<name>.png``; the JSON path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    body = {"benchmark": name, "machine": machine_info(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **payload}
    write_json(path, body)
    if figure is not None:
        save_figure(figure, out_dir / f"{name}.png")
    return path
