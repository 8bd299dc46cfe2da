"""Building and loading slimkv's native kernel library: the C compiler, the CPU's instruction-set
paths (``ISAS``, ``runnable_isas``), the build cache keyed by source, flags, compiler and CPU, and
the ctypes signatures of every entry point. ``slimkv.ops.native`` loads it once per dtype and wraps
its calls; this module holds what happens before the first call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from slimkv.common.files import waiting_lock

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"  # includes the headers beside it (decode_avx2.h, decode_avx512.h, decode_amx.h)
FLAGS = ("-O3", "-ffp-contract=fast", "-fno-math-errno", "-fPIC", "-shared", "-std=c11", "-pthread")
THREADING = (("-fopenmp",), ("-fopenmp-simd",))  # tried in order: threads from torch's OpenMP team (csrc/threads.h), else started per call
ARCH_FLAGS = (("-march=native",), ())  # tried in order: this CPU's vector units, then the compiler's default target
ISAS = {"amx-bf16": ("-march=native",), "avx512-bf16": ("-march=native", "-DSLIMKV_NO_AMX"), "avx512": ("-march=native", "-mno-avx512bf16"),
        "avx2": ("-march=native", "-mno-avx512f"), "portable": ("-DSLIMKV_PORTABLE",)}
"""Named instruction-set path -> the flags that build it on a CPU that has it (``runnable_isas``).
"amx-bf16", "avx512-bf16" and "avx512" differ in bfloat16 builds only: "avx512-bf16" has
AVX512-BF16's conversions (and, on AMD Zen, its dot products for the logits), "amx-bf16" also AMX
tiles for the logits of rows shared by several query rows (MLA, LRKV, and GQA / MQA heads of more
rows than a row tile holds; csrc/decode_amx.h); a float32
build of either is the avx512 path and says so."""
ISA_CPU_FLAGS = {"amx-bf16": ("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"), "avx512-bf16": ("avx512f", "avx512bw", "avx512_bf16"),
                 "avx512": ("avx512f", "avx512bw"), "avx2": ("avx2", "fma"), "portable": ()}
"""Named path -> the /proc/cpuinfo flags a CPU needs to run it ("amx-bf16" also the OS's leave: ``amx_permitted``)."""
ENTRIES = {torch.float32: ((), "slimkv_decode_attention_f32"), torch.bfloat16: (("-DSLIMKV_BF16",), "slimkv_decode_attention_bf16")}
"""Cache element type -> (the build's extra flags, its entry point)."""
QUANTIZED_ENTRIES = {torch.float32: "slimkv_decode_quantized_f32", torch.bfloat16: "slimkv_decode_quantized_bf16"}
"""Cache element type -> the entry point that reads int8 / int4 codes in place (csrc/decode_quantized.h)."""
PROJECT_ENTRIES = {torch.float32: "slimkv_decode_project_f32", torch.bfloat16: "slimkv_decode_project_bf16"}
"""Weight element type -> the entry point for one row through several linear layers (csrc/decode_linear.h)."""
NORM_ENTRIES = {torch.float32: "slimkv_rms_norm_row_f32", torch.bfloat16: "slimkv_rms_norm_row_bf16"}
"""Gain element type -> the entry point for one row's RMS norm (csrc/decode_linear.h)."""
ROTATE_ENTRIES = {torch.float32: "slimkv_rotate_row_f32", torch.bfloat16: "slimkv_rotate_row_bf16"}
"""Element type -> the entry point for RoPE on one token's heads (csrc/decode_linear.h)."""
SWIGLU_ENTRIES = {torch.float32: "slimkv_swiglu_residual_f32", torch.bfloat16: "slimkv_swiglu_residual_bf16"}
"""Element type -> the entry point for a pre-norm SwiGLU block's second half, one row (csrc/decode_linear.h)."""
BLOCK_ENTRIES = {torch.float32: "slimkv_decode_block_f32", torch.bfloat16: "slimkv_decode_block_bf16"}
"""Element type -> the entry point for a pre-norm block's decode step over its cache roles (rows or int8 / int4 codes), one token (csrc/decode_block.h)."""
BLOCK_INPUT_ENTRIES = {torch.float32: "slimkv_block_input_f32", torch.bfloat16: "slimkv_block_input_bf16"}
"""Element type -> a block's first half for one token: norm, q/k/v, RoPE (csrc/decode_block.h)."""
BLOCK_OUTPUT_ENTRIES = {torch.float32: "slimkv_block_output_f32", torch.bfloat16: "slimkv_block_output_bf16"}
"""Element type -> a block's second half for one token: Wo, the residual, the SwiGLU half (csrc/decode_block.h)."""
HEADS_ENTRIES = {torch.float32: "slimkv_heads_product_f32", torch.bfloat16: "slimkv_heads_product_bf16"}
"""Element type -> the entry point for one token's rows each through its own small matrix (MLA's and LRKV's per-head products, csrc/decode_linear.h)."""
LATENT_INPUT_ENTRIES = {torch.float32: "slimkv_latent_input_f32", torch.bfloat16: "slimkv_latent_input_bf16"}
"""Element type -> an MLA block's first half for one token: norm, q and the cache row, RoPE (csrc/decode_block.h)."""
QUANTIZE_ENTRIES = {torch.float32: "slimkv_quantize_rows_f32", torch.bfloat16: "slimkv_quantize_rows_bf16"}
"""Cache element type -> the entry point that quantizes rows into codes (csrc/quantize_rows.h)."""


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` or the first of cc, gcc, clang on PATH (None: none)."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags (read once per process)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (x86 ``flags``; empty where /proc/cpuinfo has none)."""
    for line in _cpu_identity().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.lru_cache(maxsize=1)
def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX's tile state (asked once: arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA, what the kernel library asks too; False off x86-64 Linux)."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


def runnable_isas() -> list[str]:
    """The named paths (``ISAS``) this CPU can run, best first: x86 flags decide (and, for AMX, the
    OS's leave); "portable" always."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    flags = _cpu_flags()
    return [isa for isa, needs in ISA_CPU_FLAGS.items()
            if not needs or (x86 and all(f in flags for f in needs) and (not isa.startswith("amx") or amx_permitted()))]


def _sources() -> bytes:
    """The kernel's source and the headers it includes, as one key for the build cache."""
    return b"\0".join(path.read_bytes() for path in [SOURCE, *sorted(SOURCE.parent.glob("*.h"))])


def build(cc: str, folder: Path, dtype: torch.dtype = torch.float32, isa: str | None = None, extra_flags: Sequence[str] = ()) -> Path:
    """Compile the kernel for caches of ``dtype`` into ``folder`` (atomically: a temporary file
    renamed into place), or return the build already there. ``isa`` None builds the CPU's best
    path (``ARCH_FLAGS`` in order), else the named one of ``ISAS`` (the caller checks that the CPU
    can run it: ``runnable_isas``), each with OpenMP threads where the compiler has them (``THREADING``).
    RuntimeError with the compiler's message when every flag set fails."""
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa {isa!r} is not allowed; allowed values: {', '.join(ISAS)}")
    source = _sources()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    errors = []
    for arch, threading in ((a, t) for a in (ARCH_FLAGS if isa is None else (ISAS[isa],)) for t in THREADING):
        flags = (*FLAGS, *threading, *arch, *ENTRIES[dtype][0], *extra_flags)
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_identity().encode()])).hexdigest()[:16]
        target = folder / f"decode_attention-{key}.so"
        if target.is_file():
            return target
        folder.mkdir(parents=True, exist_ok=True)
        with waiting_lock(folder / f".decode_attention-{key}.lock"):  # another process building the same waits, then finds it
            if target.is_file():
                return target
            handle, temporary = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(handle)
            result = subprocess.run([cc, *flags, "-o", temporary, str(SOURCE)], capture_output=True, text=True, check=False)
            if result.returncode == 0:
                os.replace(temporary, target)
                return target
            os.unlink(temporary)
        errors.append(f"{cc} {' '.join(flags)}: {result.stderr.strip()[:400]}")
    raise RuntimeError("; ".join(errors))


def load(path: Path, dtype: torch.dtype = torch.float32) -> ctypes.CDLL:
    """A built kernel library with its entry point's and ``slimkv_kernel_isa``'s signatures set."""
    library = ctypes.CDLL(str(path))
    function = getattr(library, ENTRIES[dtype][1])
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, ctypes.c_int, pointer, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    function.restype = ctypes.c_int
    quantized = getattr(library, QUANTIZED_ENTRIES[dtype])
    quantized.argtypes, quantized.restype = function.argtypes, ctypes.c_int
    project = getattr(library, PROJECT_ENTRIES[dtype])
    project.argtypes, project.restype = [pointer, pointer, i64, ctypes.c_int, pointer, pointer, pointer, pointer, ctypes.c_int], ctypes.c_int  # y: one buffer
    norm = getattr(library, NORM_ENTRIES[dtype])
    norm.argtypes, norm.restype = [pointer, pointer, pointer, i64, ctypes.c_float], ctypes.c_int
    rotate = getattr(library, ROTATE_ENTRIES[dtype])
    rotate.argtypes, rotate.restype = [pointer, i64, i64, i64, pointer, pointer], ctypes.c_int
    swiglu = getattr(library, SWIGLU_ENTRIES[dtype])
    swiglu.argtypes, swiglu.restype = [pointer, pointer, ctypes.c_float, pointer, pointer, pointer, i64, i64, pointer, ctypes.c_int, ctypes.c_int], ctypes.c_int
    block = getattr(library, BLOCK_ENTRIES[dtype])
    block.argtypes, block.restype = [pointer, pointer, ctypes.c_int, pointer, ctypes.c_float, ctypes.c_float, ctypes.c_float], ctypes.c_int
    block_input = getattr(library, BLOCK_INPUT_ENTRIES[dtype])
    block_input.argtypes = [pointer, pointer, ctypes.c_float, pointer, pointer, pointer, i64, i64, i64, i64, i64, pointer, pointer, ctypes.c_int]
    block_input.restype = ctypes.c_int
    block_output = getattr(library, BLOCK_OUTPUT_ENTRIES[dtype])
    block_output.argtypes = [pointer, pointer, pointer, pointer, ctypes.c_float, pointer, pointer, pointer, i64, i64, i64, pointer, ctypes.c_int,
                             ctypes.c_int, ctypes.c_int]
    block_output.restype = ctypes.c_int
    heads = getattr(library, HEADS_ENTRIES[dtype])
    heads.argtypes, heads.restype = [pointer, i64, i64, pointer, i64, i64, i64, i64, ctypes.c_int, pointer, i64], ctypes.c_int
    latent_input = getattr(library, LATENT_INPUT_ENTRIES[dtype])
    latent_input.argtypes = [pointer, pointer, ctypes.c_float, pointer, pointer, i64, i64, i64, i64, i64, pointer, pointer, ctypes.c_int]
    latent_input.restype = ctypes.c_int
    quantize = getattr(library, QUANTIZE_ENTRIES[dtype])
    quantize.argtypes, quantize.restype = [pointer, i64, i64, i64, ctypes.c_int, i64, pointer, pointer, pointer], ctypes.c_int
    for name in ("slimkv_kernel_isa", "slimkv_kernel_threading", "slimkv_row_prefetch_rule", "slimkv_tile_logits"):
        getattr(library, name).argtypes, getattr(library, name).restype = [], ctypes.c_char_p
    library.slimkv_linear_prefetch_bytes.argtypes, library.slimkv_linear_prefetch_bytes.restype = [], ctypes.c_int
    return library


def library_isa(library: ctypes.CDLL) -> str:
    """The instruction-set path a loaded kernel library takes: "amx-bf16", "avx512-bf16", "avx512", "avx2" or "portable" (what was
    compiled; an AMX build the OS refused AMX says "avx512-bf16", the tiles it then runs)."""
    return library.slimkv_kernel_isa().decode()


def library_row_prefetch_rule(library: ctypes.CDLL) -> str | None:
    """The AVX-512 row tiles' prefetch rule a loaded kernel library was built with (``ROW_PREFETCH_ALWAYS``
    in csrc/decode_avx512.h): "always", "several-tiles" or "none"; None for a path without those tiles."""
    return library.slimkv_row_prefetch_rule().decode() or None


def library_linear_prefetch(library: ctypes.CDLL) -> str:
    """How far ahead a loaded kernel library's linear rows prefetch their weights ("2048 bytes ahead",
    or "none": the hardware prefetchers alone; chosen per CPU at build time, ``LINEAR_PREFETCH_BYTES``
    in csrc/decode_linear.h)."""
    ahead = library.slimkv_linear_prefetch_bytes()
    return f"{ahead} bytes ahead" if ahead > 0 else "none"


def library_tile_logits(library: ctypes.CDLL) -> str | None:
    """How a loaded kernel library's AVX-512 tiles compute a bfloat16 cache's logits ("vdpbf16ps" or
    "widened fma", chosen per CPU at build time: ``TILE_DOT_BF16`` in csrc/decode_avx512.h); None
    where the build has no such choice (float32, AVX2, portable)."""
    return library.slimkv_tile_logits().decode() or None
