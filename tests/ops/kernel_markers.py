"""What the native-kernel tests share: the default library, the instruction-set paths this CPU can
run (``native.runnable_isas``) and the skips for a machine that lacks them."""

import pytest

from slimkv.ops import native

LIBRARY = native.decode_kernel()
ISAS = native.runnable_isas() if LIBRARY is not None else []
needs_kernel = pytest.mark.skipif(LIBRARY is None, reason="no C compiler on this machine, so there is no native kernel to test: decode, "
                                  "linear layers and blocks take the torch (module) path, which the attention and model tests still check")
needs_avx512_bf16 = pytest.mark.skipif("avx512-bf16" not in ISAS, reason="TILE_DOT_BF16 chooses between two tiles of the avx512-bf16 build, "
                                       "which runs only on a CPU with AVX512-BF16 and this one lacks it; the tiles this CPU builds are "
                                       "checked by the every-path tests")
