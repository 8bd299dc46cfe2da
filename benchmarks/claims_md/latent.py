"""The RoPE price of a latent cache: ``mla`` against ``latent`` (exact RoPE) at the same cache ratio."""

from __future__ import annotations

from typing import Any

from .rules import ppl_verdict, word
from .text import join_words, link, pct, pct1, ppl, table, times, when

ONE_SHOT_TARGET = 1.15  # the conversion target at R = 0.5 one-shot: perplexity / the original's on every text
ONE_SHOT_VARIANTS = ("latent:allocation=sensitivity",)  # per-layer plans the one-shot target is also checked for
# healed targets per cache ratio: (in domain (the first text), out of domain (the others)), minutes of healing allowed
HEALED_TARGETS = {0.5: ((1.03, 1.08), 30), 0.25: ((1.3, 1.3), 60)}
# per-layer plans compared with the uniform one in the same file: (title, method, its uniform baseline)
VARIANTS = (
    ("Allocation by the spectra", "latent:allocation=spectrum", "latent"),
    ("Allocation by measured sensitivity (each layer's KL alone at the uniform latent, spread by its spectrum)", "latent:allocation=sensitivity", "latent"),
    ("Rotated pairs per layer by measurement (of five counts at the same cache, the one whose layer alone moves the model least)",
     "mla:pairs=measured", "mla"),
    ("The price of `lrkv`'s structure (shared key and value plus per-group residuals, against one free latent of the same cache)",
     "lrkv", "latent"),
    ("`lrkv`'s key/value split per layer by measurement (of five splits of the same residual width, the one whose layer alone moves the model least)",
     "lrkv:split=measured", "lrkv"),
)


def _healing(row: dict[str, Any]) -> str:
    """``one-shot``, or the healing's tokens, minutes and parameter set."""
    h = row.get("healing")
    if not h:
        return "one-shot"
    load = row.get("load_average_1min")
    taken = f" (load {load['before']:.1f} at the start, {load['after']:.1f} at the end)" if load else ""
    return f"healed: {h['tokens_seen']:,} tokens, {h['train_seconds'] / 60:.0f} min{taken}, `{h['heal_config']['params']}`, lr {h['heal_config']['lr']:g}"


def _first_showings(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(file, row) of every row of ``runs`` in order, a conversion folder measured again by a
    later file with the same perplexities (the same model, deterministic evaluation) kept only at
    its first showing."""
    seen, out = set(), []
    for d in runs:
        for r in d["rows"]:
            key = (r.get("folder"), tuple(sorted(r["ppl"].items())))
            if r.get("folder") is not None and key in seen:
                continue
            seen.add(key)
            out.append((d, r))
    return out


def _rows(runs: list[dict[str, Any]], texts: list[str]) -> list[list[str]]:
    rows = []
    for d, r in _first_showings(runs):
        rows.append([f"`{r['method']}`", f"{r['cache_ratio']}", f"{len(d['calib'].split(','))} texts", str(d.get("seed", 0)), _healing(r)]
                    + [f"{ppl(r['ppl'][t])} ({times(r['ppl_over_original'][t])})" for t in texts])
    return rows


def _versus(row: dict[str, Any], base: dict[str, Any], texts: list[str]) -> tuple[str, str]:
    """Row against base: the verdict's word (``rules.ppl_verdict``) and the change per text."""
    verdict = word(ppl_verdict(row["ppl"], base["ppl"]), "worse than", "better than", "level with")
    return verdict, ", ".join(f"{pct1(row['ppl'][t] / base['ppl'][t] - 1)} on {t}" for t in texts)


def _compare(d: dict[str, Any], method: str, other: str, texts: list[str], seen: set[tuple[str, str]] | None = None) -> list[str]:
    """One clause per cache ratio at which run file ``d`` holds one-shot rows of both methods:
    ``method`` against ``other``, the verdict (``rules.ppl_verdict``) and the change per text
    (with the calibration seed when not 0). ``seen``: the pairs of conversion folders already
    compared, skipped and extended."""
    found = {(r["method"], r["cache_ratio"]): r for r in d["rows"] if not r.get("healing")}
    clauses = []
    for (name, ratio), row in found.items():
        if name != method or (other, ratio) not in found:
            continue
        base = found[(other, ratio)]
        if seen is not None:
            pair = (str(row.get("folder")), str(base.get("folder")))
            if pair in seen:
                continue
            seen.add(pair)
        verdict, gaps = _versus(row, base, texts)
        seed = f" with calibration seed {d['seed']}" if d.get("seed") else ""
        clauses.append(f"at R = {ratio}{seed}, `{method}` is {verdict} `{other}` ({gaps})")
    return clauses


def _healed_target(healed: list[dict[str, Any]], texts: list[str]) -> str:
    """The healed target of every healed ``latent`` row (any plan) at a ratio of ``HEALED_TARGETS``: met or
    missed per text, and whether the healing took longer than the target allows."""
    out = []
    for d in healed:
        for r in d["rows"]:
            if r["method"].partition(":")[0] != "latent" or r["cache_ratio"] not in HEALED_TARGETS or not r.get("healing"):
                continue
            (inside, outside), minutes = HEALED_TARGETS[r["cache_ratio"]]
            limits = {t: inside if i == 0 else outside for i, t in enumerate(texts)}
            missed = [t for t in texts if r["ppl_over_original"][t] > limits[t]]
            took = r["healing"]["train_seconds"] / 60
            out.append(f" The healed target at R = {r['cache_ratio']} (at most {inside}x in domain and {outside}x out of domain, within "
                       f"{minutes} minutes of healing) is " + (f"**missed** on {join_words(missed)}" if missed else "**met** on every text")
                       + f" by `{r['method']}` healed on {r['healing']['tokens_seen']:,} tokens ({took:.0f} minutes"
                       + (", longer than allowed" if took > minutes else "") + f", {r['healing']['threads']} thread).")
    return "".join(out)


def _probed_kl(d: dict[str, Any], method: str, probed_by: str) -> list[float] | None:
    """Each layer's KL with that layer alone converted as ``method``'s one-shot row of run file
    ``d`` plans it: the probe plan of ``probed_by``'s measured sensitivity that agrees with the
    row's per-layer options on every key both have (``None`` when the file has no such pair)."""
    rows = {r["method"]: r for r in d["rows"] if not r.get("healing")}
    row, probed = rows.get(method), rows.get(probed_by)
    if row is None or probed is None or not probed.get("sensitivity") or not row.get("layer_options"):
        return None
    measured = probed["sensitivity"]
    for plan, values in zip(measured["probe_plans"], measured["kl_per_plan_and_layer"]):
        if all(all(options.get(k, v) == v for k, v in p.items()) for p, options in zip(plan, row["layer_options"])):
            return values
    return None


def _where_lost(runs: list[dict[str, Any]]) -> str:
    """Where ``lrkv`` loses against ``latent`` at the same cache, layer by layer, from the KLs the
    measured plans probed (``lrkv:split=measured`` probes lrkv's rule, ``latent:allocation=
    sensitivity`` the uniform latent)."""
    for d in runs:
        structured, free = _probed_kl(d, "lrkv", "lrkv:split=measured"), _probed_kl(d, "latent", "latent:allocation=sensitivity")
        if structured is None or free is None:
            continue
        excess = sorted(range(len(free)), key=lambda i: free[i] - structured[i])[:3]
        layers = ", ".join(f"{i} ({structured[i]:.3f} against {free[i]:.3f})" for i in excess)
        half = len(free) // 2
        late = sum(structured[half:]) - sum(free[half:])
        total = sum(structured) - sum(free)
        if total <= 0:
            return f"\n\nLayer by layer ({link(d['benchmark'] + '.json')}), `lrkv` loses nothing against `latent` in summed KL."
        return (f"\n\nWhere `lrkv` loses against `latent` ({link(d['benchmark'] + '.json')}, each layer converted alone into the original, "
                f"KL to it in nats per token on the calibration probe): summed over the layers {sum(structured):.3f} against "
                f"{sum(free):.3f}; the largest excesses are at layers {layers}; the later half of the layers holds {pct(late / total)} "
                "of the summed excess.")
    return ""


def _decoupled(runs: list[dict[str, Any]], texts: list[str]) -> str:
    """``lrkv:rope=decoupled`` (rotation in the shared key, exact factored decode) against ``lrkv``
    (full RoPE, keys rebuilt at every step) at R = 0.5: the one-shot rows by rotated pairs (read
    from each row's per-layer options), the best of them against ``lrkv``, and every healed row."""
    base, sweep, healed = None, [], []
    for d, r in _first_showings(runs):
        if r["cache_ratio"] != 0.5:
            continue
        if r["method"] == "lrkv" and not r.get("healing"):
            base = r
        elif r["method"].startswith("lrkv:rope=decoupled"):
            pairs = len(r["layer_options"][0]["rope_frequencies"]) if r.get("layer_options") else None
            (healed if r.get("healing") else sweep).append((pairs, d, r))
    if base is None or not sweep:
        return ""

    def ratios(r: dict[str, Any]) -> str:
        return " / ".join(times(r["ppl_over_original"][t]) for t in texts)

    ladder = "; ".join(f"{pairs}: {ratios(r)}" for pairs, _, r in sorted(sweep, key=lambda x: x[0] or 0))
    best_pairs, _, best = min(sweep, key=lambda x: sum(x[2]["ppl_over_original"].values()))
    verdict, gaps = _versus(best, base, texts)
    text = (f"\n\n`lrkv` with its rotation decoupled (`lrkv:rope=decoupled`: the shared key carries the rotated pairs, the residual keys none, "
            f"so decode reads the compact cache without rebuilding a key) at R = 0.5, one-shot, by rotated pairs ({' / '.join(texts)}): {ladder}. "
            f"The best, {best_pairs} pairs, is {verdict} `lrkv` with full RoPE ({ratios(base)}; {gaps})")
    for _, d, r in healed:
        text += f"; {_healing(r)} ({link(d['benchmark'] + '.json')}): {ratios(r)}"
    return text + "."


def _sentence(parts: list[str]) -> str:
    """Clauses joined by semicolons, the first letter capitalised (nothing else)."""
    text = "; ".join(parts) or "no cache ratio has both methods"
    return text[0].upper() + text[1:]


def latent_section(oneshot: dict[str, Any], others: list[dict[str, Any]] = ()) -> str:
    """The table of every run (``oneshot``, then ``others``: healed runs, other calibration seeds,
    the per-layer plans), ``latent`` against ``mla`` at each cache ratio of each file that has
    both, each of ``VARIANTS`` against its uniform plan, and the one-shot and healed targets."""
    texts = list(oneshot["original_ppl"])
    main = _compare(oneshot, "latent", "mla", texts)
    seeds = [f"with calibration seed {d.get('seed', 0)} on the {len(d['calib'].split(','))}-text mix, {clause}"
             for d in others for clause in _compare(d, "latent", "mla", texts)]
    variants = []  # (title, clauses): the per-layer allocations against the uniform plans
    for title, method, base in VARIANTS:
        seen: set[tuple[str, str]] = set()
        clauses = [clause for d in others for clause in _compare(d, method, base, texts, seen)]
        if clauses:
            variants.append(f"\n\n{title}: {_sentence(clauses)}.")
    at_half = {(r["method"], r["cache_ratio"]): r for r in oneshot["rows"]}.get(("latent", 0.5))
    target = ""
    if at_half is not None:
        missed = [t for t in texts if at_half["ppl_over_original"][t] > ONE_SHOT_TARGET]
        target = (f" The one-shot target at R = 0.5 (at most {ONE_SHOT_TARGET}x the original on every text) is "
                  + (f"**missed** by `latent` on {join_words(missed)}." if missed else "**met** by `latent` on every text."))
    for d, r in _first_showings(list(others)):
        if r["method"] in ONE_SHOT_VARIANTS and r["cache_ratio"] == 0.5 and not r.get("healing"):
            missed = [t for t in texts if r["ppl_over_original"][t] > ONE_SHOT_TARGET]
            target += (f" By `{r['method']}` ({link(d['benchmark'] + '.json')}) it is "
                       + (f"**missed** on {join_words(missed)}" if missed else "**met** on every text") + ".")
    runs = [oneshot, *others]
    sources = ", ".join(f"{link(d['benchmark'] + '.json')}: {when(d)}" for d in runs)
    header = ["method", "R", "calibration", "seed", "healing"] + [f"{t} (x original)" for t in texts]
    mixes = sorted({d["calib"] for d in runs}, key=len)
    originals = ", ".join(f"{t} {ppl(p)}" for t, p in oneshot["original_ppl"].items())
    return f"""## The RoPE price of a latent cache

`mla` caches a decoupled rotary key and lets the other key channels lose their rotation;
`latent` caches a latent of the same size and rebuilds every key before rotating it, so positions
are exact and its decode rebuilds every cached key per step. At the same cache ratio, the gap
between them is what `mla`'s treatment of RoPE costs. SmolLM2-135M, calibrated (and healed) on
{join_words([f"`{m}`" for m in mixes])} (the calibration column counts the texts), perplexity on {oneshot['eval_tokens']:,} tokens per text in
{oneshot['seq_len']}-token windows (the original: {originals}; {sources}):

{table(header, _rows(runs, texts), right={1, 3, *range(5, len(header))})}

{_sentence(main + seeds)}.{target}{_healed_target(list(others), texts)}{"".join(variants)}{_where_lost(runs)}{_decoupled(runs, texts)}"""
