"""GQA + RoPE -> KVM (slimkv ``kvm`` layers): bounded-memory decoding for a pretrained model.

A KVM layer keeps an exact window and folds older tokens into a fixed (or slowly growing) set of
rows whose keys have lost their rotary channels (docs/kvm.md). A pretrained Llama rotates every
channel, so the conversion first decides which RoPE pairs keep their rotation (the same
frequencies in every head of a layer, since a slimkv layer rotates the same leading channels of
each head), exactly as the MLA conversion prices them (``convert.mla``):

1. **Which pairs rotate.** Losing the rotation of pair i costs head h about its query energy
   times its key energy times 1 - |rho[h, i]|^2, where rho = E[exp(1j delta w_i)] over the
   distances the head attends to (``pairs.rotation_expectation``). The ``rope_pairs`` frequencies
   with the highest cost summed over heads keep their rotation; they become the leading channels.
2. **The rest lose their rotation**: head h's query pair is multiplied by rho[h, i] (the best
   fixed replacement of the rotation), keys are kept. The layer is then a GQA layer with partial
   RoPE (method ``rope-partial``: what this step costs before any state is involved).
3. **KVM's own parameters**: the merge gate starts at g = 1 (zero weights), the temperatures at 1,
   LN_s's gain at the typical spread of a key's channels (so a state row's key keeps about the
   scale of the keys it summarises) and its bias at 0. ``convert.transfer`` then fits them (and
   optionally more) to the original attention's outputs on long calibration windows.

``mla-kvm`` (``fit_latent_layer``) takes the ``mla`` conversion instead of steps 1-2 and runs KVM
over its latent rows (``slimkv.attention.mla_kvm``): a state key keeps the whole unrotated key of
every head (its content part), not only the pairs left without rotation.

Options (``--to kvm:NAME=VALUE,...``): ``METHOD_OPTIONS`` below; ``mla-kvm`` takes the same less
``rope_pairs`` (``LATENT_OPTIONS``) and a ``--cache-ratio`` for its latent rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slimkv.common.checks import check_choice, check_float, check_int
from slimkv.convert import mla
from slimkv.convert.context import LayerContext, LayerFit, linear_state, output_state, partial_rope_options
from slimkv.convert.pairs import from_complex, pair_energy, rotation_expectation, to_complex
from slimkv.convert.source import Shape, Source
from slimkv.convert.transfer import DEFAULT_LR, MAX_LR, PARAMETER_SETS, TransferConfig, capture_attention, transfer_model
from slimkv.data.texts import calibration_ids, calibration_sources
from slimkv.ops.kvm import KVMSettings
from slimkv.ops.kvm.settings import DEFAULT_MIN_ROWS

# --to kvm:NAME=VALUE options and their defaults: the KVM layer's own settings, named and defaulted
# as on the layer (min_rows None: the schedule's default, 256 rows for fixed and sqrt), the rotated
# pairs and the attention transfer (convert.transfer); docs/conversion.md gives the measured choices
# (the runs there spell chunk_size=128,sink_len=4, the defaults before vocabulary 2: slimkv.common.vocabulary).
KVM_LAYER_OPTIONS = {"chunk_size": 256, "window_chunks": 2, "schedule": "fixed", "min_rows": None, "sqrt_coef": None,
                     "saturating_rows": None, "max_rows": None, "sink_len": 1}
ROPE_OPTIONS = {"rope_pairs": 16}
TRANSFER_OPTIONS = {"transfer_steps": 100, "transfer_lr": None, "transfer_seq_len": 2048, "transfer_windows": 8,
                    "transfer_params": "kvm"}  # transfer_lr None: DEFAULT_LR of the parameter set
METHOD_OPTIONS = {**KVM_LAYER_OPTIONS, **ROPE_OPTIONS, **TRANSFER_OPTIONS}
LATENT_OPTIONS = {**KVM_LAYER_OPTIONS, **TRANSFER_OPTIONS}


def check_rope_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None = None, *, method: str = "rope-partial") -> None:
    """At least one rotated pair and at least one left without rotation (the state's keys); errors name ``--to METHOD``."""
    pairs = options["rope_pairs"]
    why = "KVM's state keys keep only the pairs left without rotation" if method == "kvm" else "at least one pair must keep its rotation and one lose it"
    if isinstance(pairs, bool) or not isinstance(pairs, int) or not 1 <= pairs < shape.head_dim // 2:
        raise ValueError(f"--to {method}: rope_pairs={pairs!r} must be an integer from 1 to {shape.head_dim // 2 - 1}: the model's heads have "
                         f"{shape.head_dim // 2} RoPE pairs and {why}")


def check_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None = None) -> None:
    """Every ``--to kvm`` option, before any work: ValueError naming the option."""
    check_rope_options(shape, options, method="kvm")
    check_state_options(shape, options, heal_seq_len, method="kvm")


def check_latent_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None = None) -> None:
    """Every ``--to mla-kvm`` option, before any work (the rotated pairs are MLA's rule)."""
    check_state_options(shape, options, heal_seq_len, method="mla-kvm")


def check_state_options(shape: Shape, options: dict[str, Any], heal_seq_len: int | None, *, method: str) -> None:
    """The KVM state and attention-transfer options (``KVM_LAYER_OPTIONS``, ``TRANSFER_OPTIONS``)
    and the healing window; errors name ``--to METHOD``."""
    if options["min_rows"] is not None:
        check_int(f"--to {method}: min_rows", options["min_rows"], 1)
    check_int(f"--to {method}: chunk_size", options["chunk_size"], 1)
    chunk, rows = options["chunk_size"], state_rows(options)
    if rows < chunk and (options["min_rows"] is not None or options["schedule"] in ("fixed", "sqrt")):  # saturating's default floor is 1 row, as on the layer
        raise ValueError(f"--to {method}: min_rows={rows}{'' if options['min_rows'] is not None else ' (the default)'} is below chunk_size={chunk}: "
                         f"the state keeps every row of the first chunk, so it holds at least {chunk} rows; give min_rows >= {chunk} (or a smaller chunk_size)")
    if options["max_rows"] is not None and (isinstance(options["max_rows"], bool) or not isinstance(options["max_rows"], int)
                                            or options["max_rows"] < rows):
        raise ValueError(f"--to {method}: max_rows={options['max_rows']!r} must be an integer >= min_rows={rows} "
                         "(the cap on the state's rows cannot be below its size)")
    try:
        KVMSettings(**{name: options[name] for name in ("chunk_size", "window_chunks", "schedule", "min_rows", "sqrt_coef", "saturating_rows", "max_rows", "sink_len")})
    except ValueError as err:
        raise ValueError(f"--to {method}: {err}") from None
    window = options["chunk_size"] * options["window_chunks"]
    positions = shape.max_position_embeddings
    if window >= positions:
        raise ValueError(f"--to {method}: the window (chunk_size x window_chunks = {window} tokens) must be shorter than the model's "
                         f"{positions} positions, or the state would never be used")
    check_int(f"--to {method}: transfer_steps", options["transfer_steps"], 0)
    check_int(f"--to {method}: transfer_windows", options["transfer_windows"], 1)
    check_choice(f"--to {method}: transfer_params", options["transfer_params"], PARAMETER_SETS)
    if options["transfer_lr"] is not None:
        check_float(f"--to {method}: transfer_lr", options["transfer_lr"], 0.0, MAX_LR, open_low=True)
    check_int(f"--to {method}: transfer_seq_len", options["transfer_seq_len"], 2 * window, positions)
    if heal_seq_len is not None and heal_seq_len <= window + options["chunk_size"]:
        raise ValueError(f"--heal-seq-len {heal_seq_len}: healing windows must be longer than the KVM window plus a chunk "
                         f"({window} + {options['chunk_size']} tokens), or healing never trains the compressed state")


def state_rows(options: dict[str, Any]) -> int:
    """The state's floor of rows: ``min_rows``, or the schedule's default (``DEFAULT_MIN_ROWS``, the layer's)."""
    return DEFAULT_MIN_ROWS.get(options["schedule"], 1) if options["min_rows"] is None else options["min_rows"]


def transfer_demand(options: dict[str, Any]) -> tuple[int, int]:
    """(tokens, window length) the attention transfer samples from the calibration text."""
    return options["transfer_windows"] * options["transfer_seq_len"], options["transfer_seq_len"]


def layer_options(shape: Shape, options: dict[str, Any]) -> dict[str, Any]:
    """The kvm layer options every layer shares (rotation and per-layer frequencies come from the fit)."""
    return {"n_kv_heads": shape.n_kv_heads, **state_layer_options(options)}


def state_layer_options(options: dict[str, Any]) -> dict[str, Any]:
    """The KVM settings of a converted layer from the method options (``KVM_LAYER_OPTIONS``)."""
    schedule = options["schedule"]
    layer = {"chunk_size": options["chunk_size"], "window_chunks": options["window_chunks"], "schedule": schedule, "min_rows": options["min_rows"],
             "sink_len": options["sink_len"], "max_rows": options["max_rows"]}
    if schedule == "sqrt":
        layer["sqrt_coef"] = options["sqrt_coef"]
    if schedule == "saturating":
        layer["saturating_rows"] = options["saturating_rows"]
    return layer


def kvm_parameters(spread: torch.Tensor, d_model: int, n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """Step 3 of the module docstring: LN_s gain ``spread`` (per channel) and bias 0, merge gate
    g = 1 (zero weights), temperatures 1."""
    return {
        "ln_s.weight": spread.to(torch.float64),
        "ln_s.bias": torch.zeros_like(spread, dtype=torch.float64),
        "gate_proj.weight": torch.zeros(n_kv_heads, d_model, dtype=torch.float64),
        "tau_state": torch.ones(n_heads, dtype=torch.float64),
        "tau_window": torch.ones(n_heads, dtype=torch.float64),
    }


def key_spread(layer: LayerContext, key_rows: torch.Tensor, rot_dim: int) -> float:
    """The typical channel spread of a state key: key_rows (K, width, d + 1) map x' = [x; 1] to
    keys whose first ``rot_dim`` channels are zeroed before LN_s centres the key over its width;
    the root of E ||centred key||^2 / width over the calibration tokens, averaged over the K keys."""
    width = key_rows.shape[1]
    centre = torch.eye(width, dtype=torch.float64) - 1.0 / width
    prepared = centre[:, rot_dim:] @ key_rows[:, rot_dim:]  # (K, width, d')
    cov = layer.stats.augmented_cov()  # E[x' x'^T]: what affine() would rebuild the whole layer for
    return math.sqrt(float(sum(torch.trace(p @ cov @ p.T) for p in prepared)) / (key_rows.shape[0] * width))


def fit_rope(layer: LayerContext, pairs: int) -> tuple[dict[str, torch.Tensor], list[float], dict[str, Any], torch.Tensor]:
    """Steps 1-2 of the module docstring: q/k/v/o state of a GQA layer that rotates ``pairs``
    leading pairs per head (the chosen frequencies, in their original order), the other pairs
    unrotated with the rotation's expectation folded into the queries; its frequencies; facts; and
    the new key rows as maps of x' = [x; 1] (G, d_h, d + 1)."""
    s, a = layer.shape, layer.affine()
    group_of = layer.head_group
    q = to_complex(a.q)  # (H, F, d')
    k = to_complex(a.k)  # (G, F, d')
    rho = rotation_expectation(layer.stats.distance, layer.inv_freq)  # (H, F)
    cost = pair_energy(q, a.cov) * pair_energy(k, a.cov)[group_of] * (1 - rho.abs() ** 2)  # (H, F)
    kept = torch.sort(torch.argsort(cost.sum(0), descending=True, stable=True)[:pairs]).values
    chosen = set(kept.tolist())
    rest = torch.tensor([i for i in range(q.shape[1]) if i not in chosen], dtype=torch.long)
    order = torch.cat((kept, rest))
    k_rows = from_complex(k[:, order])
    q_new = torch.cat((q[:, kept], rho[:, rest, None] * q[:, rest]), dim=1)
    state = {
        **linear_state("q_proj", from_complex(q_new).flatten(0, 1), s.qkv_bias),
        **linear_state("k_proj", k_rows.flatten(0, 1), s.qkv_bias),
        **linear_state("v_proj", a.v.flatten(0, 1), s.qkv_bias),
        **output_state(a.o, s.qkv_bias),
    }
    total = cost.sum()
    info = {"rope_pairs_kept": kept.tolist(), "rotation_cost_dropped": float(cost[:, rest].sum() / total) if total > 0 else 0.0}
    return state, [float(layer.inv_freq[i]) for i in kept], info, k_rows


def fit_rope_layer(layer: LayerContext, options: dict[str, Any]) -> LayerFit:
    """``rope-partial``: a GQA layer with the KVM conversion's RoPE treatment and its full cache."""
    state, frequencies, info, _ = fit_rope(layer, options["rope_pairs"])
    layer_opts = {"n_kv_heads": layer.shape.n_kv_heads, **partial_rope_options(layer.shape, options["rope_pairs"]), "rope_frequencies": frequencies}
    return LayerFit(state, ["q_proj.weight", "k_proj.weight"], info, layer_opts)


def fit_layer(layer: LayerContext, options: dict[str, Any]) -> LayerFit:
    """The kvm layer of the module docstring (before attention transfer)."""
    s = layer.shape
    pairs = options["rope_pairs"]
    state, frequencies, info, k_rows = fit_rope(layer, pairs)
    spread = key_spread(layer, k_rows, 2 * pairs)
    state.update(kvm_parameters(torch.full((s.head_dim,), spread, dtype=torch.float64), s.d_model, s.n_heads, s.n_kv_heads))
    layer_opts = {**layer_options(s, options), **partial_rope_options(s, pairs), "rope_frequencies": frequencies}
    info["ln_s_gain"] = spread
    return LayerFit(state, [name for name in state if not name.startswith(("v_proj", "o_proj"))], info, layer_opts)


def fit_latent_layer(layer: LayerContext, options: dict[str, Any]) -> LayerFit:
    """``mla-kvm``: the ``mla`` conversion of the layer (its kv_rank and rope_dim from the plan),
    then KVM over its latent rows (``slimkv.attention.mla_kvm``): LN_s over a row [k_pe | c] with
    gain 0 on the rotary channels (a state key carries no position) and the typical spread of a
    latent elsewhere, gate 1, temperatures 1."""
    s = layer.shape
    rope_dim, rank = options["rope_dim"], options["kv_rank"]
    fit = mla.fit_layer(layer, {"kv_rank": rank, "rope_dim": rope_dim})
    down = fit.state["kv_down.weight"]
    bias = fit.state.get("kv_down.bias", down.new_zeros(down.shape[0]))
    rows = torch.cat((down, bias[:, None]), dim=1)  # (rope_dim + kv_rank, d'): the latent row as a map of x'
    spread = key_spread(layer, rows[None], rope_dim)
    gain = torch.cat((torch.zeros(rope_dim, dtype=torch.float64), torch.full((rank,), spread, dtype=torch.float64)))
    state = {**fit.state, **kvm_parameters(gain, s.d_model, s.n_heads, 1)}
    changed = [*fit.changed, *(name for name in state if name not in fit.state)]
    return LayerFit(state, changed, {**fit.info, "ln_s_gain": spread}, {**fit.options, **state_layer_options(options)})


def plan(layers: list[LayerContext], ratio: float | None, **options: Any) -> tuple[list[dict[str, Any]], str]:
    """The same options in every layer (the state's size is set by them, not by a cache ratio)."""
    window = options["chunk_size"] * options["window_chunks"]
    return [dict(options) for _ in layers], (
        f"every layer: {options['rope_pairs']} rotated pairs per head (chosen by the cost of their loss), a window of {window} tokens "
        f"({options['window_chunks']} chunks of {options['chunk_size']}), {options['schedule']} state of {state_rows(options)} rows, "
        f"{options['sink_len']} sink rows")


def plan_latent(layers: list[LayerContext], ratio: float, **options: Any) -> tuple[list[dict[str, Any]], str]:
    """``mla-kvm``: the ``mla`` plan for the latent rows (sized by the cache ratio) and the same
    KVM options in every layer."""
    plans, text = mla.plan_uniform(layers, ratio)
    window = options["chunk_size"] * options["window_chunks"]
    return [{**plan, **options} for plan in plans], (
        f"latent rows: {text}; KVM over them: a window of {window} tokens ({options['window_chunks']} chunks of {options['chunk_size']}), "
        f"{options['schedule']} state of {state_rows(options)} rows shared by all heads, {options['sink_len']} sink rows")


def plan_rope(layers: list[LayerContext], ratio: float | None, **options: Any) -> tuple[list[dict[str, Any]], str]:
    """``rope-partial``: the same rotated pair count in every layer."""
    return [dict(options) for _ in layers], f"every layer: {options['rope_pairs']} rotated pairs per head, the rest unrotated; full cache"


def attention_transfer(model: Any, source: Source, options: dict[str, Any], *, calib: str, seed: int, progress: bool = True) -> dict[str, Any]:
    """Fit every converted layer's KVM parameters to the original attention's outputs
    (``convert.transfer``) on ``transfer_windows`` windows of ``transfer_seq_len`` tokens of the
    calibration text ``calib`` (sampled with seed + 1: other windows than the statistics');
    returns the facts for the manifest."""
    steps = options["transfer_steps"]
    if steps == 0:
        return {"steps": 0, "note": "no attention transfer (transfer_steps=0): the one-shot fit"}
    tokens, length = transfer_demand(options)
    windows = calibration_ids(source.loaded.tokenizer, calibration_sources(calib), tokens, length, seed + 1)
    targets = capture_attention(source.model, windows, progress=progress)
    first = options["chunk_size"] * options["window_chunks"]
    lr = DEFAULT_LR[options["transfer_params"]] if options["transfer_lr"] is None else options["transfer_lr"]
    cfg = TransferConfig(steps=steps, lr=lr, params=options["transfer_params"], first_position=first, seed=seed)
    layers = transfer_model(list(model.attention_layers), targets, cfg, progress=progress)
    return {"steps": steps, "lr": cfg.lr, "params": cfg.params, "layers_kept_one_shot": [f["layer"] for f in layers if f["kept"] == "one-shot"], "windows": windows.shape[0], "seq_len": length, "first_position": first,
            "objective": "per layer, MSE of the layer's output against the original attention's on its inputs, relative to the output's mean square",
            "layers": layers}
