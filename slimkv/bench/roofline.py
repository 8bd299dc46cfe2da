"""The decode roofline (docs/evaluation.md, "Roofline and kernel paths"): what one step must read
and compute, what this machine can read and compute, measured in the same run on the same
threads, and how far a measured step is from the bound.

The bound of a step is max(bytes read / read bandwidth, FLOPs / FMA rate): no step can read
faster than a read-only pass over a large buffer, nor compute faster than a small GEMM that stays
in cache. The read bandwidth is a sum over a buffer much larger than the caches (each byte read
once, nothing written); the FMA rate is the best of a small GEMM in the step's dtype and in float32
(the native kernel widens bfloat16 rows and does every product in float32, so either arithmetic
may set the pace). A kernel path held to fewer instructions than the CPU has (``avx2`` on an
AVX-512 machine) is judged against the GEMM of a torch held to the same
(``machine_rates(isa=...)``: a fresh process with ``ISA_ENVIRONMENTS``' settings), not against the
machine's AVX-512 peak, which such a path cannot reach. ``bound_context`` records what the numbers
depend on: the CPU model, the kernel's instruction-set path (what the loaded library says it
compiled), the threads and the load.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from slimkv.ops.native import kernel_isa, kernel_linear_prefetch, kernel_row_prefetch, kernel_threading, kernel_tile_logits

READ_BYTES = 512 << 20  # larger than any last-level cache here, so the sum streams from memory
GEMM_SIZE = 256  # three 256 x 256 float32 matrices (768 KiB) stay in a core's L2
# what holds torch's own kernels, oneDNN's and MKL's GEMMs to AVX2 (their documented switches; MKL takes its switch on Intel
# CPUs only, and on AMD's Zen 4, whose AVX-512 runs on 256-bit units, the AVX2 and AVX-512 peaks are the same anyway)
ISA_ENVIRONMENTS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of torch's CPU fused attention, by torch's own formula for its GPU kernels (two matmuls per query row)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    """``torch.utils.flop_counter.FlopCounterMode`` that also counts torch's CPU fused attention
    (``scaled_dot_product_attention`` on the CPU: bfloat16 decode steps outside the native kernel),
    which torch's counter leaves at 0."""
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops})


def _best_seconds(fn: Callable[[], Any], repeats: int, calls: int = 1) -> list[float]:
    """Seconds per call of ``fn`` in ``repeats`` timed runs of ``calls`` calls each, after one untimed."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return samples


def measure_read_bandwidth(nbytes: int = READ_BYTES, repeats: int = 5) -> dict[str, Any]:
    """Bytes/s of a read-only sum over ``nbytes`` of float32 on torch's threads (best run: the
    machine's read speed; the median beside it)."""
    buffer = torch.ones(nbytes // 4)
    samples = _best_seconds(lambda: buffer.sum(), repeats)
    return {"bytes_per_s": nbytes / min(samples), "median_bytes_per_s": nbytes / statistics.median(samples), "samples_s": samples,
            "definition": f"bytes / time of torch.sum over {nbytes >> 20} MiB of float32 (read once, nothing written), best of {repeats}"}


def measure_fma_rate(dtype: torch.dtype = torch.float32, size: int = GEMM_SIZE, repeats: int = 5) -> dict[str, Any]:
    """FLOP/s of a size x size GEMM in ``dtype`` on torch's threads (2 size^3 FLOPs per call; best run)."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(dtype) for _ in range(2))
    calls = max(1, (64 << 20) // (2 * size**3))  # about 64 MFLOP per timed run
    samples = _best_seconds(lambda: torch.mm(a, b), repeats, calls)
    return {"flop_per_s": 2 * size**3 / min(samples), "median_flop_per_s": 2 * size**3 / statistics.median(samples), "samples_s": samples,
            "dtype": str(dtype).removeprefix("torch."), "definition": f"2 n^3 / time of an n x n GEMM (n {size}), best of {repeats} runs of {calls}"}


def fma_rate_held_to(isa: str, dtype: torch.dtype, size: int = GEMM_SIZE) -> dict[str, Any]:
    """``measure_fma_rate`` in a fresh python whose torch and oneDNN are held to ``isa``'s
    instructions (``ISA_ENVIRONMENTS``), on this process's threads: the peak a kernel path of that
    ISA can be asked to reach, with the capability the child's torch reports (``cpu_capability``).
    RuntimeError with the child's message when it fails."""
    code = ("import json, sys, torch; from slimkv.bench.roofline import measure_fma_rate; torch.set_num_threads(int(sys.argv[1])); "
            "rate = measure_fma_rate(getattr(torch, sys.argv[2]), int(sys.argv[3])); rate['cpu_capability'] = torch.backends.cpu.get_cpu_capability(); "
            "print(json.dumps(rate))")
    command = [sys.executable, "-c", code, str(torch.get_num_threads()), str(dtype).removeprefix("torch."), str(size)]
    done = subprocess.run(command, env={**os.environ, **ISA_ENVIRONMENTS[isa]}, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the GEMM held to {isa} failed: {done.stderr.strip()[-500:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "held_to": {"isa": isa, "environment": ISA_ENVIRONMENTS[isa]}}


def machine_rates(dtype: torch.dtype = torch.float32, *, isa: str | None = None, read_bytes: int = READ_BYTES,
                  gemm_size: int = GEMM_SIZE) -> dict[str, Any]:
    """The read bandwidth and the FMA rate the bound uses (``fma_flop_per_s``: the best of the GEMM
    in ``dtype`` and in float32), with their measurements; with ``isa`` (a key of
    ``ISA_ENVIRONMENTS``), the GEMMs of a torch held to that instruction set (``fma_rate_held_to``)."""
    if isa is not None and isa not in ISA_ENVIRONMENTS:
        raise ValueError(f"isa {isa!r}: a GEMM can be held to {', '.join(ISA_ENVIRONMENTS)} (or None: the machine's best)")
    read = measure_read_bandwidth(read_bytes)
    gemms = {str(d).removeprefix("torch."): measure_fma_rate(d, gemm_size) if isa is None else fma_rate_held_to(isa, d, gemm_size)
             for d in dict.fromkeys((dtype, torch.float32))}
    return {"read_bytes_per_s": read["bytes_per_s"], "fma_flop_per_s": max(g["flop_per_s"] for g in gemms.values()), "read": read, "gemm": gemms,
            "fma_isa": isa or "the machine's best"}


def merge_rates(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Rates measured before and after a run: the best of each (the machine's capability), both kept."""
    return {"read_bytes_per_s": max(before["read_bytes_per_s"], after["read_bytes_per_s"]),
            "fma_flop_per_s": max(before["fma_flop_per_s"], after["fma_flop_per_s"]), "before": before, "after": after}


def bound_context(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """What the bound and the times depend on: CPU model, the kernel's path for ``dtype`` and how it gets its threads, threads, load now."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"cpu_model": model, "kernel_isa": kernel_isa(dtype), "kernel_threading": kernel_threading(dtype),
            "kernel_row_prefetch": kernel_row_prefetch(dtype), "kernel_tile_logits": kernel_tile_logits(dtype),
            "kernel_linear_prefetch": kernel_linear_prefetch(dtype),
            "threads": torch.get_num_threads(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def step_bound(bytes_read: float, flops: float, rates: dict[str, Any]) -> dict[str, Any]:
    """The least time of a step that reads ``bytes_read`` bytes and does ``flops`` FLOPs here."""
    memory_s, compute_s = bytes_read / rates["read_bytes_per_s"], flops / rates["fma_flop_per_s"]
    return {"bound_s": max(memory_s, compute_s), "bound": "memory" if memory_s >= compute_s else "compute", "memory_s": memory_s, "compute_s": compute_s}


def add_bounds(rows: list[dict[str, Any]], rates: dict[str, Any], *, bytes_key: Callable[[dict[str, Any]], float],
               time_key: str = "median_s") -> None:
    """Give every row ``bytes_read``, its bound (``step_bound``) and ``time_over_bound`` (the step
    time as a multiple of the bound: 1.0 is as fast as this machine allows)."""
    for row in rows:
        row["bytes_read"] = bytes_key(row)
        row.update(step_bound(row["bytes_read"], row["flops"], rates))
        row["time_over_bound"] = row[time_key] / row["bound_s"]


def rates_line(rates: dict[str, Any], context: dict[str, Any]) -> str:
    """One line: the rates the bound uses and what they were measured on."""
    load = context.get("load_average")
    return (f"roofline: read {rates['read_bytes_per_s'] / 1e9:.2f} GB/s (read-only sum), FMA {rates['fma_flop_per_s'] / 1e9:.1f} GFLOP/s "
            f"(small GEMM); CPU {context.get('cpu_model')}, kernel path {context.get('kernel_isa')}, {context.get('threads')} thread(s), "
            f"load {', '.join(f'{x:.2f}' for x in load) if load else 'unknown'}; bound = max(bytes / read, FLOPs / FMA)")
