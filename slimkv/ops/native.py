"""slimkv's native CPU kernel: single-pass decode attention in C (``csrc/decode_attention.c``).

Built on first use with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for this
machine's CPU (``-march=native``), cached as a shared library under ``cache_dir()/kernels`` (the
file name holds a hash of the source, the flags, the compiler and the CPU, so a changed source or
another machine never loads a stale build), and loaded with ctypes: no torch headers, about a
second to build. The same source is built twice: for caches stored in float32 and, with
``-DSLIMKV_BF16``, in bfloat16 (``ENTRIES``; rows widened to float32 as they are read, every
product and sum in float32). Without a compiler, or when the build fails, ``decode_kernel()``
returns None (with one warning saying why) and callers take the torch path; ``SLIMKV_NATIVE=0``
asks for that.

Instruction-set paths (``ISAS``; the C source picks one at build time from the target's flags,
and ``kernel_isa`` reports the one compiled): "amx-bf16" (bfloat16 caches on a CPU with AMX: the
logits of rows shared by several query rows (MLA, LRKV, and GQA / MQA heads of more rows than a
row tile holds) by AMX tiles, csrc/decode_amx.h), "avx512-bf16"
(bfloat16 caches on a CPU with AVX512-BF16), "avx512", "avx2" (AVX2 + FMA) and "portable" (plain
C). The default build is the CPU's best (``-march=native``); ``build(..., isa="avx2")`` builds a
named one, which tests use to check every path this CPU can run (``runnable_isas``).

``native_decode_attention`` is the fast path of ``slimkv.ops.attention.decode_attention``; the
plain reference beside it is ``reference_attention``, and tests/ops/test_native.py compares them.
The same library's one-row entries (a decode step's projections, norms, RoPE and SwiGLU block) are
called from ``slimkv.ops.native_rows``.
"""

from __future__ import annotations

import array
import ctypes
import functools
import os
import warnings
from collections.abc import Sequence

import torch

from slimkv.common.buffer import RowSpan
from slimkv.common.paths import cache_dir
from slimkv.ops.codes import CodeSpans, QuantizedRows
from slimkv.ops.native_build import (
    ENTRIES,
    ISAS,
    QUANTIZE_ENTRIES,
    QUANTIZED_ENTRIES,
    build,
    compiler,
    library_isa,
    library_linear_prefetch,
    library_row_prefetch_rule,
    library_tile_logits,
    load,
    runnable_isas,
)

MAX_SEGMENTS = 4  # MAX_SEGMENTS in the C source
# Below these a call runs on one thread; above, on torch's thread count (torch's own OpenMP team: csrc/threads.h).
# Measured by benchmarks/decode_threads.py (results/decode/decode_threads_2thread.md): with threads that need no start
# per call, two gained from attention over 512 keys (1.2 MFLOP) up (and from SmolLM2's smallest projection: native_rows).
ATTENTION_PARALLEL_MIN_FLOPS = 1 << 20  # an attention call's FLOPs (attention_threads)
ENV_SWITCH = "SLIMKV_NATIVE"
ISA_SWITCH = "SLIMKV_KERNEL_ISA"  # a named path (ISAS) the CPU can run instead of its best: e.g. avx2 on an AVX-512 machine, to see what AVX2 users get
SWITCH_VALUES = {"1": True, "0": False}  # SLIMKV_NATIVE: 1 (default) uses the kernel where it can, 0 the torch path


def attention_threads(flops: int) -> int:
    """Threads for one attention kernel call doing ``flops`` (2 per query head, key and channel, a
    measure of its work for rows and codes alike): torch's thread count, or 1 for a call too small to
    gain from them (``benchmarks/decode_threads.py`` measures where they do)."""
    threads = torch.get_num_threads()
    return threads if threads > 1 and flops >= ATTENTION_PARALLEL_MIN_FLOPS else 1


def decode_kernel(dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The loaded kernel library for caches of ``dtype``, or None: for a dtype without a build
    (not in ``ENTRIES``), or (one warning says why) when it cannot be had. Loaded once per dtype
    (``decode_kernel.cache_clear()`` forgets them). A cached build that cannot be loaded (a damaged
    file in slimkv's own cache) is built again once."""
    return _load_kernel(dtype) if dtype in ENTRIES else None


@functools.lru_cache(maxsize=len(ENTRIES))
def _load_kernel(dtype: torch.dtype) -> ctypes.CDLL | None:
    switch = os.environ.get(ENV_SWITCH, "1").strip()
    if switch not in SWITCH_VALUES:
        raise ValueError(f"{ENV_SWITCH}={switch!r} is not allowed; allowed values: 1 (the native kernel where it applies, the default), 0 (the torch path)")
    if not SWITCH_VALUES[switch]:
        return None
    isa = os.environ.get(ISA_SWITCH, "").strip() or None
    if isa is not None and isa not in runnable_isas():
        raise ValueError(f"{ISA_SWITCH}={isa!r} is not allowed on this CPU; allowed values: {', '.join(runnable_isas())} (unset: the CPU's best)")
    cc = compiler()
    if cc is None:
        warnings.warn("slimkv: no C compiler found ($CC, cc, gcc, clang); decode uses the torch path (install gcc for the native kernel)", stacklevel=2)
        return None
    try:
        path = build(cc, cache_dir() / "kernels", dtype, isa)
        try:
            return load(path, dtype)
        except (OSError, AttributeError):  # a damaged cached build (ours, keyed by source and flags): build it again
            path.unlink(missing_ok=True)
            return load(build(cc, cache_dir() / "kernels", dtype, isa), dtype)
    except (RuntimeError, OSError, AttributeError) as err:
        warnings.warn(f"slimkv: the native decode kernel could not be built or loaded; decode uses the torch path ({err})", stacklevel=2)
        return None


decode_kernel.cache_clear = _load_kernel.cache_clear


def kernel_path(dtype: torch.dtype = torch.float32) -> str | None:
    """The file of the kernel loaded for caches of ``dtype`` (what a benchmark records), or None
    when such calls take the torch path."""
    library = decode_kernel(dtype)
    return None if library is None else library._name


@functools.lru_cache(maxsize=4 * len(ENTRIES) * len(ISAS))
def isa_kernel(dtype: torch.dtype, isa: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernel for caches of ``dtype`` built for the named path ``isa`` (tests and benchmarks
    set the paths side by side) with ``extra_flags`` (``-DSLIMKV_PORTABLE`` on "avx2": the
    portable C built for an AVX2 CPU), cached like the default build. The caller checks the CPU can
    run it (``runnable_isas``); RuntimeError when there is no compiler or the build fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
    return load(build(cc, cache_dir() / "kernels", dtype, isa, extra_flags), dtype)


def kernel_threading(dtype: torch.dtype = torch.float32) -> str | None:
    """How the kernel for caches of ``dtype`` gets its threads ("torch's OpenMP team", or "started
    per call (...)" with the reason), or None when such calls take the torch path."""
    library = decode_kernel(dtype)
    return None if library is None else library.slimkv_kernel_threading().decode()


def kernel_row_prefetch(dtype: torch.dtype = torch.float32) -> str | None:
    """The prefetch rule of the kernel's AVX-512 row tiles for caches of ``dtype`` ("always" or
    "several-tiles", chosen per CPU at build time: ``ROW_PREFETCH_ALWAYS`` in csrc/decode_avx512.h;
    "none" in a build without software prefetch), or None where decode calls take another path or
    the torch path."""
    library = decode_kernel(dtype)
    return None if library is None else library_row_prefetch_rule(library)


def kernel_linear_prefetch(dtype: torch.dtype = torch.float32) -> str | None:
    """How far ahead the kernel's linear rows for ``dtype`` prefetch their weights ("2048 bytes ahead"
    or "none": ``LINEAR_PREFETCH_BYTES`` in csrc/decode_linear.h, chosen per CPU at build time), or
    None where decode calls take the torch path."""
    library = decode_kernel(dtype)
    return None if library is None else library_linear_prefetch(library)


def kernel_tile_logits(dtype: torch.dtype = torch.float32) -> str | None:
    """How the kernel's AVX-512 tiles compute logits over caches of ``dtype`` ("vdpbf16ps" or
    "widened fma" for bfloat16, chosen per CPU at build time: ``TILE_DOT_BF16`` in
    csrc/decode_avx512.h), or None where there is no such choice (float32, AVX2, portable, torch)."""
    library = decode_kernel(dtype)
    return None if library is None else library_tile_logits(library)


def kernel_isa(dtype: torch.dtype = torch.float32) -> str:
    """Which path decode calls on caches of ``dtype`` take: the loaded kernel's own answer
    ("amx-bf16", "avx512-bf16", "avx512", "avx2", "portable"), or "torch (...)" with the reason there is no kernel."""
    library = decode_kernel(dtype)
    if library is not None:
        return library_isa(library)
    if dtype not in ENTRIES:
        return f"torch (no native build for {str(dtype).removeprefix('torch.')})"
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return f"torch ({ENV_SWITCH}=0)"
    return "torch (no compiler)" if compiler() is None else "torch (the kernel failed to build)"


def kernel_for(queries: Sequence[torch.Tensor], segments: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ctypes.CDLL | None:
    """The kernel library when it takes this call (``supports``) and could be built, else None:
    the one test every caller makes before ``native_decode_attention``."""
    return decode_kernel(segments[0][0].dtype) if supports(queries, segments) else None


def supports(queries: Sequence[torch.Tensor], segments: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the native kernel takes this call: float32 or bfloat16 (queries, keys and values
    alike) on the CPU, no autograd, one query per
    head, shapes that agree (the kernel trusts them: a mismatch takes the torch path, which raises),
    each row of keys and values contiguous (rows may be any distance apart: values that are a slice
    of the key rows, as MLA's latent rows, are read in place), at most ``MAX_SEGMENTS`` segments, and no torch dispatch
    mode active (the kernel bypasses torch's dispatcher, so a FLOP counter or a fake-tensor trace
    would not see it: those calls take the torch path). Checked on every decode step, so written to
    cost a few microseconds (``is_cpu``, one shape tuple per tensor)."""
    if not 1 <= len(segments) <= MAX_SEGMENTS or len(queries) != len(segments) or torch._C._len_torch_dispatch_stack() > 0:
        return False
    grad = torch.is_grad_enabled()
    q_shape = queries[0].shape
    if len(q_shape) != 4:
        return False
    batch, q_heads, _, dim = q_shape
    dtype = queries[0].dtype
    if dtype not in ENTRIES:
        return False
    k_shape, v_shape = segments[0][0].shape, segments[0][1].shape
    if len(k_shape) != 4 or len(v_shape) != 4:
        return False
    kv_heads, v_dim = k_shape[1], v_shape[3]
    if kv_heads < 1 or q_heads % kv_heads:
        return False
    for q in queries:
        if q.dtype != dtype or not q.is_cpu or q.shape != (batch, q_heads, 1, dim) or (grad and q.requires_grad):
            return False
    for k, v in segments:
        ks, vs = k.shape, v.shape
        if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3] or ks[0] != batch or ks[1] != kv_heads or ks[3] != dim or vs[3] != v_dim:
            return False
        for x, last in ((k, dim), (v, v_dim)):
            if x.dtype != dtype or not x.is_cpu or (grad and x.requires_grad) or (last > 1 and x.stride(3) != 1):
                return False
    return True


def rows_place(x: torch.Tensor | RowSpan) -> tuple[int, int, tuple[int, ...]]:
    """(address, rows, batch / head / row strides in elements) of (batch, heads, rows, dim) rows,
    a view or a ``RowSpan`` of a buffer's storage: what a native call reads of them."""
    if isinstance(x, RowSpan):  # already that triple
        return x
    return x.data_ptr(), x.shape[2], x.stride()[:3]


def segment_fields(q_address: int, k: torch.Tensor | RowSpan, v: torch.Tensor | RowSpan) -> tuple[int, ...]:
    """One (keys, values) segment as the plain entry reads it (the C struct Segment's order, FIELDS
    integers): the query, key and value addresses, the keys, then the key and the value strides
    (batch, head, row; elements)."""
    (k_address, keys, ks), (v_address, _, vs) = rows_place(k), rows_place(v)
    return q_address, k_address, v_address, keys, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2]


def native_decode_attention(queries: Sequence[torch.Tensor], segments: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float,
                            library: ctypes.CDLL) -> torch.Tensor:
    """One query per head over the keys of every (k, v) segment under one softmax; segment i's
    logits are ``queries[i]`` . k * scale (the same tensor for plain attention).

    each query (batch, q_heads, 1, dim); each k (batch, kv_heads, keys_i, dim), v (batch, kv_heads,
    keys_i, v_dim) -> (batch, q_heads, 1, v_dim), in the queries' dtype (the kernel works in
    float32: bfloat16 queries are widened first, once per distinct query tensor, and the output
    rounded once at the end). Values every head shares (value head stride 0 in every segment, as
    the latent kind passes them) are read once per step for all heads. Call ``supports`` first,
    and pass the library ``decode_kernel`` gave for the cache's dtype. The Python around the call
    is kept to a few microseconds: a decode step of a small cache (KVM's regions) takes tens."""
    batch, q_heads, _, dim = queries[0].shape
    k0, v0 = segments[0]
    kv_heads, v_dim, dtype = k0.shape[1], v0.shape[3], k0.dtype
    rows: dict[int, torch.Tensor] = {}  # float32 query rows by the query tensor's id (KVM may pass one tensor for several segments)
    fields = []
    keys = 0
    for q, (k, v) in zip(queries, segments):
        row = rows.get(id(q))
        if row is None:
            row = rows[id(q)] = q if q.dtype == torch.float32 and q.is_contiguous() else q.to(torch.float32).contiguous()
        keys += k.shape[2]
        fields += segment_fields(row.data_ptr(), k, v)
    out = torch.empty(batch, q_heads, 1, v_dim, dtype=torch.float32)
    threads = attention_threads(2 * batch * q_heads * keys * (dim + v_dim))
    packed = array.array("q", fields)
    status = getattr(library, ENTRIES[dtype][1])(packed.buffer_info()[0], len(segments), out.data_ptr(), batch, kv_heads, q_heads // kv_heads,
                                                 dim, v_dim, scale, threads)
    if status != 0:
        raise RuntimeError(f"native decode attention failed (status {status}: {'out of memory or threads' if status == 1 else 'bad arguments'})")
    out_dtype = queries[0].dtype
    return out if out_dtype == torch.float32 else out.to(out_dtype)


StoredRows = torch.Tensor | QuantizedRows
"""One segment of one side (keys or values) of a cache: plain rows (batch, heads, n, dim) in the
cache dtype, or int8 / int4 codes with their scales and minima (``QuantizedRows``)."""


def supports_stored(query: torch.Tensor, segments: Sequence[tuple[StoredRows, StoredRows]]) -> bool:
    """Whether ``native_stored_attention`` takes this call: ``supports``' conditions for the
    plain rows and the query, at least one quantized segment, every quantized segment of the same
    bits and group with scales and minima in the cache dtype and codes rows contiguous, keys and
    values of a segment both plain or both codes of the same length."""
    if not 1 <= len(segments) <= MAX_SEGMENTS or torch._C._len_torch_dispatch_stack() > 0 or query.dtype not in QUANTIZED_ENTRIES:
        return False
    if torch.is_grad_enabled() and query.requires_grad:
        return False
    batch, q_heads, q_len, _ = query.shape
    settings = {(part.bits, part.group) for pair in segments for part in pair if isinstance(part, QuantizedRows)}
    if len(settings) != 1 or q_len != 1 or query.device.type != "cpu":
        return False
    kv_heads = None
    for k, v in segments:
        if isinstance(k, QuantizedRows) != isinstance(v, QuantizedRows) or len(k) != len(v):
            return False
        for part in (k, v):
            tensors = part.tensors() if isinstance(part, QuantizedRows) else (part,)
            for x in tensors:
                if x.dim() != 4 or x.device.type != "cpu" or x.stride(-1) != 1 or (torch.is_grad_enabled() and x.requires_grad) \
                        or x.shape[:2] != tensors[0].shape[:2]:
                    return False
            cache_dtypes = part.float_tensors() if isinstance(part, QuantizedRows) else (part,)
            if any(x.dtype != query.dtype for x in cache_dtypes):
                return False
            heads = part.heads if isinstance(part, QuantizedRows) else part.shape[1]
            kv_heads = heads if kv_heads is None else kv_heads
            if heads != kv_heads or tensors[0].shape[0] != batch:
                return False
        if (k.dim if isinstance(k, QuantizedRows) else k.shape[-1]) != query.shape[-1]:
            return False
    v_dims = {(v.dim if isinstance(v, QuantizedRows) else v.shape[-1]) for _, v in segments}
    return len(v_dims) == 1 and q_heads % kv_heads == 0


def stored_segment_fields(q_address: int, k: StoredRows | RowSpan | CodeSpans, v: StoredRows | RowSpan | CodeSpans) -> list[int]:
    """One (keys, values) segment as the quantized entry reads it (the C struct QSegment's order,
    QFIELDS integers): codes with their scales and minima (``QuantizedRows`` or ``CodeSpans``), or
    plain rows (bits 0; a view or a ``RowSpan``)."""
    if isinstance(k, (QuantizedRows, CodeSpans)):
        places = [rows_place(x) for x in (k.codes, v.codes, k.scale, k.low, v.scale, v.low)]
        fields = [q_address, k.bits, k.group, len(k), *(address for address, _, _ in places)]
        strides = [place_strides for _, _, place_strides in places]
    else:
        (k_address, keys, ks), (v_address, _, vs) = rows_place(k), rows_place(v)
        fields = [q_address, 0, 0, keys, k_address, v_address, 0, 0, 0, 0]
        strides = [ks, vs, ks, ks, ks, ks]
    for place_strides in strides:
        fields += place_strides
    return fields


def native_stored_attention(query: torch.Tensor, segments: Sequence[tuple[StoredRows, StoredRows]], scale: float,
                            library: ctypes.CDLL) -> torch.Tensor:
    """One query per head over every (keys, values) segment under one softmax, quantized segments
    read as codes in place (csrc/decode_quantized.h): query (batch, q_heads, 1, dim) -> (batch,
    q_heads, 1, v_dim) in the query's dtype. Call ``supports_stored`` first, and pass the library
    ``decode_kernel`` gave for the cache dtype."""
    batch, q_heads, _, dim = query.shape
    first_key = segments[0][0]
    kv_heads = first_key.heads if isinstance(first_key, QuantizedRows) else first_key.shape[1]
    last_value = segments[0][1]
    v_dim = last_value.dim if isinstance(last_value, QuantizedRows) else last_value.shape[-1]
    q = query.to(torch.float32).contiguous()
    out = torch.empty(batch, q_heads, 1, v_dim, dtype=torch.float32)
    fields = []
    keys = 0
    for k, v in segments:
        fields += stored_segment_fields(q.data_ptr(), k, v)
        keys += len(k) if isinstance(k, QuantizedRows) else k.shape[2]
    threads = attention_threads(2 * batch * q_heads * keys * (dim + v_dim))
    status = getattr(library, QUANTIZED_ENTRIES[query.dtype])((ctypes.c_int64 * len(fields))(*fields), len(segments), out.data_ptr(), batch,
                                                               kv_heads, q_heads // kv_heads, dim, v_dim, scale, threads)
    if status != 0:
        raise RuntimeError(f"native quantized decode attention failed (status {status}: {'out of memory or threads' if status == 1 else 'bad arguments'})")
    return out.to(query.dtype)


def native_quantize_groups(x: torch.Tensor, bits: int, group: int, library: ctypes.CDLL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``slimkv.ops.codes.quantize_groups(x, bits, group, x.dtype)`` in C (csrc/quantize_rows.h):
    the same codes, scales and minima (equal values: a zero minimum may carry the other sign). x (..., dim) float32 or bfloat16 on the CPU with
    contiguous rows, no autograd (the caller checks; ``quantize_groups`` takes everything else)."""
    dim = x.shape[-1]
    groups = -(-dim // group)
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    codes = torch.empty(rows.shape[0], groups * group * bits // 8, dtype=torch.uint8)
    scale, low = (torch.empty(rows.shape[0], groups, dtype=x.dtype) for _ in range(2))
    status = getattr(library, QUANTIZE_ENTRIES[x.dtype])(rows.data_ptr(), rows.shape[0], dim, rows.stride(0) if rows.shape[0] > 1 else dim, bits,
                                                          group, codes.data_ptr(), scale.data_ptr(), low.data_ptr())
    if status != 0:
        raise RuntimeError(f"native quantization failed (status {status}: bad arguments)")
    lead = x.shape[:-1]
    return codes.view(*lead, -1), scale.view(*lead, groups), low.view(*lead, groups)
