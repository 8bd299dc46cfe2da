"""Per-token decode time of one ``mha`` layer (the MHA decode measurement).

8 heads x 64 (d_model 512), batch 1, float32, at 1K, 8K and 32K cached tokens, and the GB/s that
implies for reading the cache, beside the machine's memory-copy bandwidth. The same sweep as
benchmarks/decode_all.py restricted to ``mha``; it accepts the same flags.

    .venv/bin/python benchmarks/decode_mha.py [--threads N] [--quick]

Writes benchmarks/results/decode_mha.json and decode_mha.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_all import parser, run  # noqa: E402

if __name__ == "__main__":
    p = parser(__doc__)
    p.set_defaults(contexts=[1024, 8192, 32768], name="decode_mha")
    args = p.parse_args()
    try:
        run(args, args.kinds or ["mha"])
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
