"""The speed section: decode layers, the native kernel, float32 against bfloat16, SmolLM2 decode."""

from __future__ import annotations

from typing import Any

from .text import f2, f3, link, table, when


def dtype_table(f32: dict[str, Any], bf16: dict[str, Any]) -> tuple[int, str]:
    """One layer at the last context in float32 and bfloat16 (decode_all.py --dtype): each variant's
    time against MHA's in the same dtype, that over its cache-bytes ratio, and bfloat16's speed-up."""
    last = f32["settings"]["contexts"][-1]
    at = {name: {r["label"]: r for r in d["rows"] if r["context"] == last} for name, d in (("f32", f32), ("bf16", bf16))}
    rows = []
    for label, r in at["f32"].items():
        b = at["bf16"].get(label)
        if b is None or label.endswith("-expanded"):
            continue
        t32, t16 = r["median_s"] / at["f32"]["mha"]["median_s"], b["median_s"] / at["bf16"]["mha"]["median_s"]
        rows.append([f"`{label}`", f3(r["cache_ratio_to_mha"]), f2(r["median_s"] * 1e3), f2(t32), f2(t32 / r["cache_ratio_to_mha"]),
                     f2(b["median_s"] * 1e3), f2(t16), f2(t16 / b["cache_ratio_to_mha"]), f2(r["median_s"] / b["median_s"])])
    header_cells = ["variant", "cache vs MHA", "float32 ms", "time vs MHA", "over bytes ratio", "bfloat16 ms", "time vs MHA", "over bytes ratio",
                    "bfloat16 speed-up"]
    return last, table(header_cells, rows, right=set(range(1, len(header_cells))))


EXACT_COPY = "slimkv exact copy (gqa)"  # decode_smollm2.py's label of slimkv's copy of the original
CONVERSION_SPEED_TARGET = 1.3  # every conversion at cache 0.5: tokens/s over the exact copy's in the same dtype, at the longest context
BF16_SPEED_TARGET = 1.6  # the exact copy in bfloat16 over itself in float32


def smollm2_targets(smollm2: dict[str, Any]) -> str:
    """The decode targets at the longest context of decode_smollm2.py's run: each converted model's
    tokens/s over the exact copy's in the same dtype, and the exact copy's bfloat16 speed-up."""
    last = smollm2["settings"]["contexts"][-1]
    rows = [r for r in smollm2["rows"] if r["context"] == last]
    exact = {r["dtype"]: r["tokens_per_s"] for r in rows if r["model"].removesuffix(f" {r['dtype']}") == EXACT_COPY}
    clauses = []
    for dtype, base in exact.items():
        ratios = [(r["model"].removesuffix(f" {dtype}").removeprefix("slimkv "), r["tokens_per_s"] / base) for r in rows
                  if r["dtype"] == dtype and r["model"].startswith("slimkv ") and r["model"].removesuffix(f" {dtype}") != EXACT_COPY]
        if not ratios:
            continue
        missed = [name for name, x in ratios if x < CONVERSION_SPEED_TARGET]
        listed = ", ".join(f"`{name}` {f2(x)}x" for name, x in ratios)
        clauses.append(f"in {dtype}, {listed} the exact copy's tokens/s (target {CONVERSION_SPEED_TARGET}x: "
                       + (f"**missed** by {len(missed)} of {len(ratios)})" if missed else "**met** by every one)"))
    if "float32" in exact and "bfloat16" in exact:
        gain = exact["bfloat16"] / exact["float32"]
        clauses.append(f"the exact copy in bfloat16 runs {f2(gain)}x its float32 speed (target {BF16_SPEED_TARGET}x: "
                       + ("**met**)" if gain >= BF16_SPEED_TARGET else "**missed**)"))
    if not clauses:
        return ""
    return f"\n\nAt {last // 1024}K: " + "; ".join(clauses) + "."


def speed_section(decode: dict[str, dict[str, Any]], native: dict[str, dict[str, Any]], smollm2: dict[str, Any]) -> str:
    """Decode speed on the development machine: one layer per variant, the native kernel, both dtypes, SmolLM2."""
    d1, d2 = decode["decode_all_1thread.json"], decode["decode_all_2thread.json"]
    last = d1["settings"]["contexts"][-1]

    def at(d: dict[str, Any], label: str) -> dict[str, Any]:
        return next(r for r in d["rows"] if r["label"] == label and r["context"] == last)

    mha1, mha2 = at(d1, "mha"), at(d2, "mha")
    bandwidth = d1["copy_bandwidth"]["bytes_per_s"]
    rows = []
    for variant in d1["variants"]:
        label = variant["label"]
        r1, r2 = at(d1, label), at(d2, label)
        read = r1["cache_bytes"] / r1["median_s"] / bandwidth
        rows.append([f"`{label}`", f3(r1["cache_ratio_to_mha"]), f2(r1["median_s"] * 1e3), f2(r1["median_s"] / mha1["median_s"]), f2(read),
                     f2(r2["median_s"] * 1e3), f2(r2["median_s"] / mha2["median_s"])])
    n_rows = []
    for name, d in native.items():
        for r in d["rows"]:
            if r["context"] == d["settings"]["contexts"][-1]:
                n_rows.append([link(name), str(r["kv_heads"]), f"{r['cache_bytes'] / 2**20:.0f}", f2(r["native_ms"]), f2(r["torch_ms"]), f2(r["native_over_torch"]),
                               f2(r["native_of_copy"]), f2(r["torch_of_copy"])])
    dtype_last, dtypes = dtype_table(decode["decode_roofline_1thread.json"], decode["decode_roofline_bf16_1thread.json"])
    s_rows = []
    contexts = smollm2["settings"]["contexts"]
    for model in smollm2["settings"]["models"]:
        tps = {r["context"]: r["tokens_per_s"] for r in smollm2["rows"] if r["model"] == model}
        s_rows.append([model] + [f"{tps[c]:.1f}" for c in contexts])
    return f"""## Speed on the development machine

Not claims of any paper, but the measurements the README's benchmark table points to. One
decode layer of 8 heads x 64, batch 1, float32, at {last // 1024}K cached tokens ({link('decode_all_1thread.json')}: {when(d1)};
{link('decode_all_2thread.json')}: {when(d2)}). "Of copy bandwidth" is the cache bytes a step reads per second over
the machine's measured copy bandwidth.

{table(['variant', 'cache vs MHA', 'ms, 1 thread', 'time vs MHA', 'of copy bandwidth', 'ms, 2 threads', 'time vs MHA, 2 threads'], rows, right={1, 2, 3, 4, 5, 6})}

The native decode kernel against the torch path, attention alone, 8 query heads x 64 at
{native['decode_native_1thread.json']['settings']['contexts'][-1] // 1024}K keys (conditions: {link('decode_native_1thread.json')} {when(native['decode_native_1thread.json'])}; {link('decode_native_2thread.json')} {when(native['decode_native_2thread.json'])}):

{table(['file', 'kv heads', 'cache MiB', 'native ms', 'torch ms', 'native / torch', 'native of copy bw', 'torch of copy bw'], n_rows, right={1, 2, 3, 4, 5, 6, 7})}

The same layer at {dtype_last // 1024}K cached tokens with float32 and with bfloat16 weights and caches, 1 thread
({link('decode_roofline_1thread.json')}: {when(decode['decode_roofline_1thread.json'])}; {link('decode_roofline_bf16_1thread.json')}:
{when(decode['decode_roofline_bf16_1thread.json'])}). "Over bytes ratio" is the time against MHA's divided by the cache
against MHA's: 1.00 means the step costs exactly its share of MHA's bytes. The two dtypes ran one
after the other, not interleaved, so the speed-up column compares two runs (this VM's speed drifts
between runs); the ratios within each dtype come from one interleaved run. MLA takes the native
kernel in both dtypes; its absorbed step does 8 x (rope + latent + latent) multiply-adds per cached
row, which makes it compute-bound on a CPU ("roofline" in docs/evaluation.md).

{dtypes}

SmolLM2-135M decode, tokens per second after a prefill of each context, models interleaved
({link('decode_smollm2_1thread.json')}, {when(smollm2)}):

{table(['model'] + [f'{c // 1024}K' for c in contexts], s_rows, right=set(range(1, len(contexts) + 1)))}{smollm2_targets(smollm2)}"""
