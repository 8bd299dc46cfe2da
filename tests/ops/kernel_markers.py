"""What the native-kernel tests share: the default library, the instruction-set paths this CPU can
run (``native.runnable_isas``) and the skips for a machine that lacks them.

The kernel tests skip only where there is no kernel to test by design: no C compiler, or
``SLIMKV_NATIVE=0``. A machine with a compiler whose build fails runs them, and they fail: a
broken build is a bug to see, not a reason to skip."""

import os

import pytest

from slimkv.ops import native, native_build

LIBRARY = native.decode_kernel()
ISAS = native.runnable_isas() if LIBRARY is not None else []


def _no_kernel_reason() -> str | None:
    """Why this machine has no kernel to test, or None when it should have one."""
    if not native.SWITCH_VALUES.get(os.environ.get(native.ENV_SWITCH, "1").strip(), True):
        return f"{native.ENV_SWITCH}=0 asks for the torch path, so there is no native kernel to test; the attention and model tests check that path"
    if native_build.compiler() is None:
        return ("no C compiler on this machine, so there is no native kernel to test: decode, linear layers and blocks take the torch "
                "(module) path, which the attention and model tests still check")
    return None


NO_KERNEL = _no_kernel_reason()
needs_kernel = pytest.mark.skipif(NO_KERNEL is not None, reason=NO_KERNEL or "not skipped: this machine builds the native kernel")
needs_compiler = pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler on this machine, so there is no kernel build to "
                                    "test; without one slimkv takes the torch path, which test_without_a_compiler_decode_falls_back_with_one_warning checks")
needs_avx512_bf16 = pytest.mark.skipif("avx512-bf16" not in ISAS, reason="TILE_DOT_BF16 chooses between two tiles of the avx512-bf16 build, "
                                       "which runs only on a CPU with AVX512-BF16 and this one lacks it; the tiles this CPU builds are "
                                       "checked by the every-path tests")
needs_amx = pytest.mark.skipif("amx-bf16" not in ISAS, reason="the AMX logits need a CPU with AMX-TILE and AMX-BF16 (Intel Sapphire Rapids or "
                               "later) and the OS's leave to use them; this machine lacks one, and the tiles it runs are checked by the "
                               "every-path tests")
FLOAT32_PATH = {"amx-bf16": "avx512", "avx512-bf16": "avx512"}
"""What a float32 build of a named path is (their extra instructions serve bfloat16 rows only): the path itself where absent."""

RULES_ISA = next((isa for isa in ("avx512-bf16", "avx512") if isa in ISAS), ISAS[0] if ISAS else None)
"""The path whose build-time rules (ROW_PREFETCH_ALWAYS, TILE_DOT_BF16, LINEAR_PREFETCH_BYTES: each
chosen per CPU) the rule tests run both ways: avx512-bf16 where the CPU has it, else avx512, else
this CPU's best (which has the linear rows' rule only)."""
needs_avx512 = pytest.mark.skipif(RULES_ISA not in ("avx512-bf16", "avx512"), reason="the AVX-512 row tiles need a CPU with AVX-512F and AVX-512BW, and this one "
                                  "lacks them; the tiles it runs are checked by the every-path tests")
RULE_SIDES = ("default", "flipped")


def rule_kernel(dtype, side: str):
    """The ``RULES_ISA`` build for ``dtype`` as this CPU gets it (``side`` "default"), or with every
    build-time rule set the other way ("flipped"): one extra build per dtype gives each rule's other
    value, where a build per rule and value gave a dozen (each about a minute to compile)."""
    library = native.isa_kernel(dtype, RULES_ISA)
    if side == "default":
        return library
    always = native_build.library_row_prefetch_rule(library) == "always"
    dot = native_build.library_tile_logits(library) == "vdpbf16ps"
    ahead = native_build.library_linear_prefetch(library) != "none"
    flags = (f"-DROW_PREFETCH_ALWAYS={int(not always)}", f"-DTILE_DOT_BF16={int(not dot)}", f"-DLINEAR_PREFETCH_BYTES={0 if ahead else 2048}")
    return native.isa_kernel(dtype, RULES_ISA, flags)
