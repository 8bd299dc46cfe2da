"""The figures of claims.md, read or computed from the JSON of benchmarks/results/: one function per
section of ``claims.md.in``, returning the fields its template names, and ``FORMATS``, the one spelling of
each kind of number. The verdicts apply ``rules``; the words are the template's."""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path
from typing import Any

from slimkv.common.results import relative_name, results_dir, results_path
from slimkv.common.vocabulary import in_todays_words

from .healing import curve_points
from .rules import BOUNDED_TARGET, BUDGET_RETENTION, CONVERSION_TARGETS, RULES, WORDS, missed, ppl_verdict, seed_verdict

RESULTS, TEMPLATE = Path(__file__).resolve().parents[1] / "results", Path(__file__).with_name("claims.md.in")
LATENT_RUNS = [f"convert_{name}_smollm2.json" for name in ("latent", "latent_healed", "latent_healed_all", "latent25_healed", "latent_seed1",
               "latent_allocation", "measured_allocation", "measured_allocation_seed1", "lrkv_split", "latent25_sensitivity_healed",
               "lrkv_decoupled", "lrkv_decoupled_more")] + ["heal_lrkv_decoupled05_30000_lr3e-5.json"]
LATENT_PAIRS = [("latent", "mla"), ("latent:allocation=spectrum", "latent"), ("latent:allocation=sensitivity", "latent"),
                ("mla:pairs=measured", "mla"), ("lrkv", "latent"), ("lrkv:split=measured", "lrkv")]  # (method, its baseline)
DECODE_RUNS = [f"decode_{name}.json" for name in ("all_1thread", "all_2thread", "torch_path_1thread", "roofline_1thread", "roofline_bf16_1thread")]
TRANSFORMERS, EXACT_COPY = "transformers (SDPA, DynamicCache)", "slimkv exact copy (gqa)"  # decode_smollm2.py's model labels


@functools.cache
def load(name: str) -> dict[str, Any]:
    """The JSON file ``name`` of benchmarks/results/ (read once: treat it as read-only)."""
    return in_todays_words(json.loads(results_path(RESULTS, name).read_text(encoding="utf-8")))  # a file of vocabulary 1 read in today's words


def when(name: str) -> str:
    """Threads, 1-minute load average and date of a results file."""
    d = load(name)
    threads, load_average = d["machine"].get("threads"), d["machine"].get("load_average") or d.get("load_average")
    return ", ".join(([f"{threads} thread{'s' if threads != 1 else ''}"] if threads else []) + [
        f"load {load_average[0]:.2f} when written" if load_average else "load not recorded"] + ([d["time"][:10]] if d.get("time") else []))


def healing_text(row: dict[str, Any]) -> str:
    """``one-shot``, or a healing's tokens, minutes, machine load, parameter set and learning rate."""
    if not (h := row.get("healing")):
        return "one-shot"
    taken = f"load {row['load_average_1min']['before']:.1f} to {row['load_average_1min']['after']:.1f}" if row.get("load_average_1min") else "load not recorded"
    return f"{h['tokens_seen']:,} tokens, {h['train_seconds'] / 60:.0f} min ({taken}), `{h['heal_config']['params']}`, lr {h['heal_config']['lr']:g}"


FORMATS = {
    "ppl": lambda x: f"{x:.2f}" if x < 1e4 else f"{x / 10 ** math.floor(math.log10(x)):.1f}e{math.floor(math.log10(x))}",
    "x": lambda x: f"{x:.1f}x" if x >= 10 else f"{x:.2f}x",  # a factor
    "xr": lambda pair: FORMATS["x"](pair[0]) + (f" ({pair[1]:.0%})" if pair[1] is not None else ""),  # a multiple and a share removed
    "acc": lambda s: f"{s['mean']:.3f} [{s['min']:.2f}, {s['max']:.2f}]" if s["n"] > 1 else f"{s['mean']:.3f}",
    "bpb": lambda s: f"{s['mean']:.4f} ± {s['std']:.4f} [{s['min']:.4f}, {s['max']:.4f}]",
    "K": lambda tokens: f"{tokens // 1024}K",
    "code": lambda name: f"`{name}`",
    "link": lambda name: f"[`{name}`]({relative_name(name)})",
    "when": when,
    "source": lambda name: f"[`{name}`]({relative_name(name)}): {when(name)}",
}


def recall() -> dict[str, dict[str, Any]]:
    """recall_frontier.json by entry: kinds, options, B/token and seeds solved at the training length, accuracy per length, seed runs."""
    d = load("recall_frontier.json")
    lengths, entries = [f"{n}x" for n in d["recipe"]["lengths"]], {e["label"]: e for e in d["entries"]}
    return {row["label"]: {"label": row["label"], "kinds": tuple(entries[row["label"]]["kinds"]), "options": entries[row["label"]]["options"],
                           "lengths": lengths, "at": row["lengths"], "cache": row["lengths"][lengths[0]]["cache_bytes_per_token"],
                           "solved": row["lengths"][lengths[0]]["solved_seeds"], "accuracy": [row["lengths"][n]["accuracy"] for n in lengths],
                           "seeds": len(row["seeds"]), "longest_cache": row["lengths"][lengths[-1]]["cache_bytes_per_token"],
                           "runs": sorted((r for r in d["runs"] if r["label"] == row["label"]), key=lambda r: r["seed"])} for row in d["aggregate"]}


def accuracy_against(a: dict[str, Any], b: dict[str, Any]) -> list[int]:
    """Recall entry ``a`` against ``b`` at each length by the seed rule."""
    return [seed_verdict(a["at"][n]["accuracy"], b["at"][n]["accuracy"]) for n in a["lengths"]]


def bpb_against(rows: dict[str, dict[str, Any]], label: str, other: str) -> list[int]:
    """LM frontier entry ``label`` against ``other``: val and Austen BPB by the seed rule."""
    return [seed_verdict(rows[label][metric], rows[other][metric]) for metric in ("val_bpb", "other_bpb")]


def lrkv() -> dict[str, Any]:
    """LRKV against GQA, MQA and MHA at equal cache: recall, the LM frontier, the one-shot conversion."""
    entries, lm = recall(), {r["label"]: r for r in load("lm_frontier.json")["aggregate"]}
    lrkvs = [e for e in entries.values() if e["kinds"] == ("lrkv",)]
    baselines = [next(e for e in entries.values() if e["kinds"] == (kind,)) for kind in ("gqa", "mqa", "mha")]
    pairs = [a | {"other": b["label"], "other_cache": b["cache"], "signs": accuracy_against(a, b)} for a in lrkvs for b in baselines
             if b["cache"] >= a["cache"]]
    smaller = [p for p in pairs if p["other"] != baselines[-1]["label"]]  # against GQA and MQA
    cache = {label: row["cache"]["bytes_per_token_per_layer"] for label, row in lm.items()}
    lm_pairs = [{"label": a, "other": b, "cache": cache[a], "other_cache": cache[b], "signs": bpb_against(lm, a, b)}
                for a in lm if a.startswith("lrkv") for b in ("gqa", "mqa", "mha") if cache[b] >= cache[a]]
    vs_gqa = [s for p in lm_pairs if p["other"] == "gqa" for s in p["signs"]]
    convert = load("convert_oneshot_smollm2.json")
    ratio = next(r["cache_ratio"] for r in convert["rows"] if r["method"] == "lrkv")
    by = {r["method"]: r["ppl"] for r in convert["rows"] if r["cache_ratio"] == ratio}
    beats = [f"`{p['label']}` over `{p['other']}`" for p in smaller if max(p["signs"]) > 0 and min(p["signs"]) >= 0]
    loses = [f"`{p['label']}` under `{p['other']}`" for p in smaller if min(p["signs"]) < 0]
    return {"lengths": baselines[0]["lengths"], "rows": lrkvs + baselines, "pairs": pairs, "beats": beats, "loses": loses,
            "recall_claim": 1 if beats and not loses else 0, "lm_pairs": lm_pairs, "lm_claim": (max(vs_gqa) < 0) - (max(vs_gqa) > 0),
            "dataset": load("lm_frontier.json")["recipe"]["dataset"], "convert": convert, "texts": list(convert["original_ppl"]),
            "ratio": ratio, "conv_claim": -ppl_verdict(by["lrkv"], by["gqa"]), "lrkv_gqa": [by["lrkv"][t] / by["gqa"][t] - 1 for t in by["gqa"]],
            "mla_lrkv": [by["mla"][t] / by["lrkv"][t] - 1 for t in by["lrkv"]], "mla_sign": ppl_verdict(by["mla"], by["lrkv"])}


def calibration() -> dict[str, Any]:
    """The default calibration mix against the plays alone, on a source neither saw, and with the handbook added: each pair of
    one-shot runs matched by method and cache ratio, text by text."""
    def pair(first: str, last: str) -> dict[str, Any]:
        found = [{(r["method"], r["cache_ratio"]): r for r in load(name)["rows"]} for name in (first, last)]
        return {"files": [first, last], "calib": [load(n).get("calib", "shakespeare") for n in (first, last)], "tokens": load(last)["eval_tokens"],
                "rows": [{"method": key[0], "ratio": key[1], "text": t, "change": row["ppl"][t] / found[0][key]["ppl"][t] - 1,
                          "over": [found[0][key]["ppl_over_original"][t], row["ppl_over_original"][t]]}
                         for key, row in found[1].items() if key in found[0] for t in load(first)["original_ppl"]]}

    return {"default": pair("convert_oneshot_smollm2.json", "convert_oneshot_mix_smollm2.json"),
            "held_out": pair("convert_heldout_plays_smollm2.json", "convert_heldout_mix3_smollm2.json"),
            "modern": pair("convert_latent_smollm2.json", "convert_latent_mix5_smollm2.json")}


def target_cell(row: dict[str, Any]) -> str | None:
    """The conversion target a row is held to (by method, cache ratio, one-shot or healed): met, or what it misses."""
    for target in CONVERSION_TARGETS:
        if row["method"].startswith(target["method"]) and row["cache_ratio"] == target["ratio"] and bool(row.get("healing")) == target["healed"]:
            miss = missed(row["ppl_over_original"], target, row["healing"]["train_seconds"] / 60 if row.get("healing") else 0)
            return WORDS["target"][0 if miss else 2] + (f" ({', '.join(miss)})" if miss else "")
    return None


def probed_kl(d: dict[str, Any], method: str, probed_by: str) -> list[float] | None:
    """Each layer's KL with that layer alone converted as ``method``'s one-shot row plans it: the probe of ``probed_by``'s
    measured plan that agrees with the row's per-layer options (None without one)."""
    rows = {r["method"]: r for r in d["rows"] if not r.get("healing")}
    measured, plan = rows.get(probed_by, {}).get("sensitivity"), rows.get(method, {}).get("layer_options")
    return next((kl for probe, kl in zip(measured["probe_plans"], measured["kl_per_plan_and_layer"]) if all(
        options.get(k, v) == v for p, options in zip(probe, plan) for k, v in p.items())), None) if measured and plan else None


def latent() -> dict[str, Any]:
    """Every latent conversion once (a folder measured again shows at its first file), the pairs, the targets, where lrkv loses."""
    texts, shown, compared, pairs, rows = list(load(LATENT_RUNS[0])["original_ppl"]), set(), set(), [], []
    for d in map(load, LATENT_RUNS):
        for r in d["rows"]:
            if (key := (r["folder"], tuple(r["ppl"].values()))) not in shown:
                shown.add(key)
                rows.append(r | {"calib_texts": len(d["calib"].split(",")), "seed": d.get("seed", 0), "target": target_cell(r),
                                 "healed": healing_text(r), "cells": [r["ppl_over_original"][t] for t in texts]})
    for (method, base), d in ((pair, load(name)) for pair in LATENT_PAIRS for name in LATENT_RUNS):
        found = {(r["method"], r["cache_ratio"]): r for r in d["rows"] if not r.get("healing")}
        for (name, ratio), row in found.items():
            if name == method and (other := found.get((base, ratio))) and (row["folder"], other["folder"]) not in compared:
                compared.add((row["folder"], other["folder"]))
                pairs.append({"method": method, "base": base, "ratio": ratio, "seed": d.get("seed", 0), "calib_texts": len(d["calib"].split(",")),
                              "sign": ppl_verdict(row["ppl"], other["ppl"]), "changes": [row["ppl"][t] / other["ppl"][t] - 1 for t in texts]})
    lost = ("convert_lrkv_split_smollm2.json", probed_kl(load("convert_lrkv_split_smollm2.json"), "lrkv", "lrkv:split=measured"),
            probed_kl(load("convert_lrkv_split_smollm2.json"), "latent", "latent:allocation=sensitivity"))  # lrkv's and latent's per layer
    excess = [s - f for s, f in zip(lost[1], lost[2])]
    return {"files": LATENT_RUNS, "texts": texts, "mixes": sorted({load(n)["calib"] for n in LATENT_RUNS}, key=len), "rows": rows,
            "run": load(LATENT_RUNS[0]), "originals": [f"{t} {p:.2f}" for t, p in load(LATENT_RUNS[0])["original_ppl"].items()],
            "pairs": pairs, "oneshot_targets": [t for t in CONVERSION_TARGETS if not t["healed"]], "lost_file": lost[0],
            "healed_targets": [t for t in CONVERSION_TARGETS if t["healed"]], "lost_sums": [sum(lost[1]), sum(lost[2])],
            "late_share": sum(excess[len(excess) // 2:]) / sum(excess),
            "lost_layers": [f"{i} ({lost[1][i]:.3f} / {lost[2][i]:.3f})" for i in sorted(range(len(excess)), key=lambda i: -excess[i])[:3]]}


def healing() -> dict[str, Any]:
    """The healing curve per cache ratio, with the share of the one-shot excess each budget removed, and the learning-rate sweep."""
    names = ["convert_latent_mix5_smollm2.json", "convert_latent_healed_smollm2.json", "convert_latent25_healed_smollm2.json",
             *sorted(p.name for p in results_dir(RESULTS, "heal_").glob("heal_curve_latent*.json"))]
    points, texts = curve_points([load(name) for name in names]), list(load(names[0])["original_ppl"])
    rows = [{"ratio": ratio, "tokens": tokens, "file": d["benchmark"] + ".json", "minutes": r["healing"]["train_seconds"] / 60 if tokens else None,
             "cells": [(x[t], 1 - (x[t] - 1) / (y[t] - 1) if tokens else None) for t in texts]}  # the multiple and the excess removed
            for ratio in sorted(points, reverse=True) for tokens, (r, d) in sorted(points[ratio].items())
            for x, y in [(r["ppl_over_original"], points[ratio][0][0]["ppl_over_original"])]]
    return {"texts": texts, "rows": rows, "lr_files": sorted(p.name for p in results_dir(RESULTS, "heal_").glob("heal_lr_latent*.json")), "run": load(names[0]),
            "config": next(r["healing"]["config"] for p in points.values() for r, _ in p.values() if r.get("healing"))}


def kvm() -> dict[str, Any]:
    """KVM's claims: retrieval past its window, LM quality against MHA, the sqrt schedule, decode, prefill and backward speed."""
    entries, lm = recall(), {r["label"]: r for r in load("lm_frontier.json")["aggregate"]}
    by_kinds = {k: [e for e in entries.values() if e["kinds"] == k] for k in (("mha",), ("swa",), ("kvm",), ("swa", "kvm"))}
    (mha,), hybrid = by_kinds[("mha",)], max(by_kinds[("swa", "kvm")], key=lambda e: e["cache"])
    first, longest = mha["lengths"][0], mha["lengths"][-1]
    window, far = hybrid["options"]["swa"]["window"], list(hybrid["at"][longest]["by_gap"])[-1]
    solving = [r["lengths"][longest]["by_gap"][far]["accuracy"] for r in hybrid["runs"] if r["lengths"][first]["accuracy"] >= RULES["solved"]]
    swa_far = max(r["lengths"][longest]["by_gap"][far]["accuracy"] for e in by_kinds[("swa",)] for r in e["runs"])
    kvm_lm = {x.rpartition("=")[2]: x for x in lm if x.startswith("kvm")}  # by schedule
    alone = {e["options"]["kvm"]["schedule"]: e for e in sorted(by_kinds[("kvm",)], key=lambda e: e["cache"])}  # the largest per schedule
    signs = [-v for v in bpb_against(lm, kvm_lm["sqrt"], kvm_lm["fixed"])] + accuracy_against(alone["sqrt"], alone["fixed"])
    lm_signs = [bpb_against(lm, x, "mha")[0] for x in kvm_lm.values()]
    d1, contexts = load(DECODE_RUNS[0]), load(DECODE_RUNS[0])["settings"]["contexts"]
    log_ms = {x: [math.log(next(r["median_s"] for r in d1["rows"] if r["label"] == x and r["context"] == c)) for c in contexts]
              for x in ("mha", "kvm-fixed", "kvm-sqrt")}
    exponent = {x: statistics.linear_regression([math.log(c) for c in contexts], y).slope for x, y in log_ms.items()}
    targets = [t for name in DECODE_RUNS for t in load(name)["targets"] if t["label"].startswith("kvm")]
    return {"lengths": mha["lengths"], "longest": longest, "rows": [e for k in by_kinds.values() for e in k], "hybrid": hybrid, "window": window,
            "far": far, "far_windows": "-".join(str(int(g) // window) for g in far.split("-")), "solving": solving, "swa_far": swa_far,
            "past_window": len(solving) >= RULES["past_window_seeds"] and min(solving) > swa_far, "mha_far": mha["at"][longest]["by_gap"][far],
            "vs_mha": seed_verdict(hybrid["at"][longest]["accuracy"], mha["at"][longest]["accuracy"]),
            "mha_acc": mha["at"][longest]["accuracy"], "hybrid_acc": hybrid["at"][longest]["accuracy"],
            "lm_recipe": load("lm_frontier.json")["recipe"], "lm_mha": lm["mha"], "lm_seeds": len(lm["mha"]["seeds"]),
            "lm_rows": [r | {"vs": bpb_against(lm, x, "mha") if x != "mha" else ["reference"] * 2} for x, r in lm.items()],
            "lm_verdict": -1 if max(lm_signs) > 0 else 1 if max(lm_signs) < 0 else 0, "kvm_lm": kvm_lm, "signs": signs,
            "extra": lm[kvm_lm["fixed"]]["parameters"] - lm["mha"]["parameters"], "schedule": [alone["sqrt"], alone["fixed"]],
            "verdict": (max(signs) > 0 and min(signs) >= 0) - (min(signs) < 0 and max(signs) <= 0), "d1": DECODE_RUNS[0], "contexts": contexts,
            "exponent": exponent, "shape": exponent["kvm-fixed"] < RULES["exponent_flat"] and exponent["kvm-sqrt"] < RULES["exponent_sqrt"],
            "much_faster": all(t["value"] > RULES["much_faster"] for t in targets), "speed_file": "kvm_speed.json", "decode_files": DECODE_RUNS,
            "targets": [t | {"values": [x["value"] for x in targets if x["label"] == t["label"]],
                             "met": sum(x["met"] for x in targets if x["label"] == t["label"])} for t in load(DECODE_RUNS[0])["targets"] if t in targets],
            "prefill": load("kvm_speed.json")["results"][-1], "backward": load("kvm_speed_backward.json")["results"][-1]}


def bounded() -> dict[str, Any]:
    """KVM on SmolLM2 against the bounded-memory targets: state size, healed perplexity, retrieval beside streaming, decode."""
    convert = load("convert_kvm_smollm2.json")
    niah = {r["source"]: next(iter(r["per_length"].values()))["score"] for r in load("niah_kvm_smollm2.json")["rows"]}

    def state(row: dict[str, Any]) -> float:  # the cache at the target's context over the original's (1: a full cache)
        return next((c["ratio"] for c in row["cache_bytes"] or [] if c["context"] == RULES["state_context"]), 1.0)

    states = [r for r in convert["rows"] if (r["method"] or "").split(":")[0].split("@")[0] in ("kvm", "mla-kvm")]
    streaming = sorted((r for r in convert["rows"] if (r["method"] or "").startswith("streaming") and r["label"] in niah), key=state)
    fair = {r["label"]: [s["label"] for s in streaming if state(s) <= state(r) + 1e-9][-1:] for r in states if r["label"] in niah}
    decode = []
    for name, d in ((name, load(name)) for name in ("decode_kvm_smollm2_1thread.json", "decode_mla_kvm_smollm2_1thread.json")):
        last = {r["model"]: r["tokens_per_s"] for r in d["rows"] if r["dtype"] == "float32" and r["context"] == d["settings"]["contexts"][-1]}
        decode += [{"label": m.removeprefix("slimkv "), "file": name, "speed": tps / last[TRANSFORMERS], "vs_exact": tps / last[EXACT_COPY],
                    "flat": len({r["cache_bytes"] for r in d["rows"] if r["model"] == m}) == 1} for m, tps in last.items() if "kvm" in m]
    small = [state(r) <= RULES["state_target"] for r in states]
    healed = [{"label": r["label"], "minutes": r["healing"]["train_seconds"] / 60, "missed": missed(
        {t: v["ppl_vs_original"] for t, v in r["texts"].items()}, BOUNDED_TARGET, r["healing"]["train_seconds"] / 60)} for r in states if r.get("healing")]
    retrieval = [{"label": x, "base": base, "score": niah[x], "base_score": niah[base], "gap": niah[x] - niah[base]}
                 for x, bases in fair.items() for base in bases]
    scored = [r | {"state": state(r), "score": niah.get("smollm2" if r["label"] == "original" else r["label"])} for r in convert["rows"]]
    return {"convert": convert, "target": BOUNDED_TARGET, "rows": scored,
            "small": all(small) - (not any(small)), "flat": [r["label"] for r in states if len({c["bytes"] for c in r["cache_bytes"]}) == 1],
            "healed": healed, "ppl_met": any(not h["missed"] for h in healed), "retrieval": retrieval,
            "niah_met": any(r["gap"] >= RULES["niah_margin"] for r in retrieval),
            "decode": decode, "decode_met": any(d["speed"] >= RULES["decode_target"] and d["flat"] for d in decode)}


def latentllm() -> dict[str, Any]:
    """LatentLLM against SVD, ASVD and RootCov at each ratio, and the measured prefill speed-up against the ideal."""
    sweep, prefill = load("compress_sweep_smollm2.json"), load("compress_prefill_latentllm03.json")
    methods, texts = ["svd", "asvd", "rootcov", "latentllm"], list(sweep["dense"]["ppl_by_text"])
    ppl = {(r["method"], r["ratio"]): r["ppl_by_text"] for r in sweep["rows"]}
    best = {ratio: {t: min(ppl[(m, ratio)][t] for m in methods[:-1]) for t in texts} for _, ratio in sorted(ppl, key=lambda k: k[1])}
    rows = [{"ratio": ratio, "cells": [ppl[(m, ratio)][t] for t in texts for m in methods], "sign": ppl_verdict(ppl[("latentllm", ratio)], b),
             "changes": [ppl[("latentllm", ratio)][t] / b[t] - 1 for t in texts]} for ratio, b in best.items()]
    dense, row = prefill["dense"], prefill["rows"][0]
    return {"sweep": sweep, "methods": methods, "rows": rows, "beats_at": [r["ratio"] for r in rows if r["sign"] < 0],
            "level_at": [r["ratio"] for r in rows if r["sign"] >= 0], "claim": any(r["sign"] < 0 for r in rows),
            "worst": min(ppl[(m, r)][t] / sweep["dense"]["ppl_by_text"][t] for m, r in ppl if m in methods[:2] for t in texts),
            "prefill": row, "flops": row["flops_per_token"] / dense["flops_per_token"], "file": "compress_prefill_latentllm03.json",
            "ideal": dense["flops_per_token"] / row["flops_per_token"], "of_ideal": row["speedup"] * row["flops_per_token"] / dense["flops_per_token"],
            "apart": max(row["latency"]["samples_s"]) < min(row["dense_latency"]["samples_s"])}


def speed() -> dict[str, Any]:
    """Decode layers per variant on 1 and 2 threads, the native kernel against the torch path, SmolLM2 decode."""
    d1, d2, smollm2 = load(DECODE_RUNS[0]), load(DECODE_RUNS[1]), load("decode_smollm2_1thread.json")
    native_files, contexts = ["decode_native_1thread.json", "decode_native_2thread.json"], smollm2["settings"]["contexts"]

    def at_last(d: dict[str, Any], label: str) -> dict[str, Any]:
        return next(r for r in d["rows"] if r["label"] == label and r["context"] == d["settings"]["contexts"][-1])

    return {"d1": DECODE_RUNS[0], "d2": DECODE_RUNS[1], "threads": [d1["machine"]["threads"], d2["machine"]["threads"]], "settings": d1["settings"],
            "last": d1["settings"]["contexts"][-1], "contexts": contexts,
            "layers": [{"label": v["label"], "cache": at_last(d1, v["label"])["cache_ratio_to_mha"],
                        "read": at_last(d1, v["label"])["cache_bytes"] / at_last(d1, v["label"])["median_s"] / d1["copy_bandwidth"]["bytes_per_s"],
                        "timing": [x for d in (d1, d2) for x in (at_last(d, v["label"])["median_s"] * 1e3,
                                                                 at_last(d, v["label"])["median_s"] / at_last(d, "mha")["median_s"])]}
                       for v in d1["variants"]],
            "native_files": native_files, "native_settings": load(native_files[0])["settings"], "smollm2": "decode_smollm2_1thread.json",
            "native": [r | {"file": name, "mib": r["cache_bytes"] / 2**20} for name in native_files for r in load(name)["rows"]
                       if r["context"] == load(name)["settings"]["contexts"][-1]],
            "models": [{"model": m, "tps": [r["tokens_per_s"] for c in contexts for r in smollm2["rows"] if r["model"] == m and r["context"] == c]}
                       for m in smollm2["settings"]["models"]]}


def budget() -> dict[str, Any]:
    """The planner's conversions, run in bfloat16 (the bytes a bfloat16 deployment keeps), on every RULER task and length
    whose original score interval lies above ``task_solved``: their score over the original's, and their intervals against
    every alternative cache of the original (kvpress presses, quantized caches) with at least their measured bytes (the rows of ``budget_smollm2.ruler_rows``, which renders ruler/budget_comparison.md)."""
    from budget_smollm2 import ruler_rows  # benchmarks/, beside claims.py

    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in ruler_rows():
        cells.setdefault((row["task"], row["length"]), []).append(row)
    rows = []
    for _, cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        original = next((r for r in cell if r["method"] == "original"), None)
        if original is None or original["low"] < RULES["task_solved"]:
            continue
        others = [r for r in cell if r["method"].startswith("original, ") and r["option"] not in ("none", "bfloat16", "float16")]
        for plan in (r for r in cell if r["plan_budget"] in BUDGET_RETENTION and r["dtype"] == "bfloat16"):
            fair = [r for r in others if r["ratio"] >= plan["ratio"]]  # "equal cache": at least the plan's measured bytes
            side = {r["method"].removeprefix("original, "): 1 if r["high"] < plan["low"] else -1 if r["low"] > plan["high"] else 0 for r in fair}
            retention = plan["score"] / original["score"]
            rows.append(plan | {"label": plan["method"].removesuffix(", bfloat16 model"), "original": original["score"], "retention": retention,
                                "met": retention >= BUDGET_RETENTION[plan["plan_budget"]], "above_all": bool(side) and min(side.values()) > 0,
                                **{name: [k for k, v in side.items() if v == sign] for name, sign in (("above", 1), ("level", 0), ("below", -1))}})
    by_plan: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_plan.setdefault(row["label"], []).append(row)
    plans = [{"label": label, "target": BUDGET_RETENTION[group[0]["plan_budget"]], "cells": len(group), "met": sum(r["met"] for r in group),
              "above_all": sum(r["above_all"] for r in group)} for label, group in by_plan.items()]
    return {"rows": rows, "plans": plans}
