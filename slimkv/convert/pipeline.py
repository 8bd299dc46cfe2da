"""``convert_pretrained``: a pretrained Llama-family model -> a slimkv model with a smaller KV
cache, saved as a transformers folder with a manifest.

Steps: check everything that can be checked before any work (the method and the ratio it can
represent, the destination, the calibration text, the architecture); load the source; one
calibration pass of the original model (``slimkv.convert.calibrate``); the method plans per-layer
sizes that meet the cache ratio and fits every layer; the non-attention weights are copied
exactly; the cache each layer will hold is measured from a live cache; the folder is published
(``slimkv.common.output_folder.OutputFolder``: nothing the user wrote there is deleted; a new conversion
replaces an earlier one there, its healing run included, so no healing of another conversion can
be resumed on it).

``cache_ratio`` R is the kept fraction of the original model's KV-cache elements per token
(summed over layers): 0.5 keeps half. ``cache_storage`` (``full``, ``int8``, ``int4[:group=G,residual=R,block=B]``;
``slimkv.ops.quantize``) is how the converted model holds those elements by default: the bytes then
shrink again (int4 in groups of 32 with bfloat16 scales: 0.3125 of the bfloat16 bytes), and the
manifest's cache table is measured on live caches.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from slimkv.common.checks import check_choice, check_float, check_int
from slimkv.common.files import sha256_file, write_json
from slimkv.common.output_folder import OutputFolder
from slimkv.common.quiet import quiet_transformers
from slimkv.common.version import VERSION
from slimkv.common.vocabulary import VOCABULARY
from slimkv.convert import hybrid, sensitivity
from slimkv.convert.budget import WEIGHED, BudgetPlan, plan_budget, weighed
from slimkv.convert.cache_bytes import cache_bytes_table
from slimkv.convert.calibrate import layer_statistics
from slimkv.convert.deepseek import EXPORT_FOLDER, export_deepseek
from slimkv.convert.heal import CONVERSION_KEY, HEAL_CONFIG, HEAL_DIR, HealConfig, check_heal_text, check_resumable, heal
from slimkv.convert.manifest import read_manifest
from slimkv.convert.methods import Conversion, LayerContext, parse_method, sets_option, with_setting
from slimkv.convert.roles import SCORES as ROLE_SCORES
from slimkv.convert.roles import copy_accuracy, plot_head_roles
from slimkv.convert.source import Shape, Source, check_convertible, copy_shared_weights, exact_copy, slimkv_config
from slimkv.data.texts import (
    MIXED_CALIBRATION,
    calibration_ids,
    calibration_sources,
    calibration_text_sha256,
    check_calibration_size,
)
from slimkv.model import SlimKVForCausalLM, load_model_folder
from slimkv.model.config import STATEFUL_KINDS
from slimkv.ops.quantize import parse_storage
from slimkv.pretrained import load_pretrained, resolve_model_path, weights_fingerprint
from slimkv.pretrained.loading import CONVERTED_MANIFEST, read_config, resolve_original

CONVERTED_FOLDER = OutputFolder(CONVERTED_MANIFEST, "slimkv conversion folder", runs={HEAL_DIR: HEAL_CONFIG})
# names a conversion folder always gets (the tokenizer's files vary with the tokenizer)
OUTPUT_NAMES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json", CONVERTED_MANIFEST)
FORMAT = "slimkv-converted"
FORMAT_VERSION = 1
EXPORTS = ("deepseek",)
HEAD_ROLES_PLOT = "head_roles.png"  # the measured roles as a layer x KV head heatmap, beside a model whose method measured them


@dataclass
class ConvertOptions:
    """What decides a conversion (stored in the manifest)."""

    method: str  # --to NAME[:KEY=VALUE,...]
    cache_ratio: float | None = None  # required by methods sized by a ratio, refused by the others (kvm)
    calib: str = MIXED_CALIBRATION  # every calibration source in equal shares, as compress (slimkv.data.texts)
    calib_tokens: int = 8192
    calib_seq_len: int = 1024
    seed: int = 0
    export: str | None = None  # "deepseek": also write the model as transformers' DeepseekV3ForCausalLM (mla-prefix only)
    cache_storage: str | None = None  # how the converted model's cache holds its rows (slimkv.ops.quantize): full (default), int8, int4[:group=G,residual=R,block=B]; with cache_budget also "weighed"
    cache_budget: float | None = None  # a fraction of the bfloat16 original's bytes at the method's `at` tokens: plans --to hybrid (slimkv.convert.budget)
    budget_windows: list[int] | None = None  # with cache_budget: the windows the plan may give the bounded heads (default: the method's window)

    def validate(self) -> None:
        """ValueError naming the command-line option of a bad field."""
        method, _ = parse_method(self.method)
        if self.cache_budget is not None:
            if method.name != "hybrid":
                raise ValueError(f"--cache-budget plans --to hybrid (the per-head cache roles and their storage); --to {method.name} is sized by --cache-ratio")
            if self.cache_ratio is not None:
                raise ValueError("--cache-budget and --cache-ratio both size the cache: give one (the budget is in bytes, the ratio in elements)")
            check_float("--cache-budget", self.cache_budget, 0.0, 1.0, open_low=True)
        elif method.sized_by_ratio:
            if self.cache_ratio is None:
                raise ValueError(f"--to {method.name} needs --cache-ratio R (the kept fraction of the original cache, in (0, 1))")
            check_float("--cache-ratio", self.cache_ratio, 0.0, 1.0, open_low=True, open_high=True)
        elif self.cache_ratio is not None:
            raise ValueError(f"--to {method.name} takes no --cache-ratio: its cache is set by its own options "
                             f"({', '.join(method.settings)}; `--to {method.name}:NAME=VALUE,...`)")
        if self.budget_windows is not None:
            if self.cache_budget is None:
                raise ValueError("--budget-windows gives the windows a --cache-budget plan chooses from: give --cache-budget B too")
            if not self.budget_windows:
                raise ValueError("--budget-windows needs at least one window")
            for window in self.budget_windows:
                check_int("--budget-windows", window, 1)
            if sets_option(self.method, "window"):
                raise ValueError(f"--budget-windows and --to {self.method} both set window: give it once")
        check_int("--calib-tokens", self.calib_tokens, 1)
        check_int("--calib-seq-len", self.calib_seq_len, 2)
        if self.export is not None:
            check_choice("--export", self.export, EXPORTS)
            if self.method != "mla-prefix":
                raise ValueError(f"--export deepseek needs --to mla-prefix (one RoPE ladder in every layer), not --to {self.method}")
        check_int("--seed", self.seed, 0)
        if self.cache_storage == WEIGHED:  # a choice among full, int8 and int4, made by the budget's plan (hybrid layers take each)
            if self.cache_budget is None:
                raise ValueError(f"--cache-storage {WEIGHED} weighs the storages a --cache-budget allows: give --cache-budget B, or a storage "
                                 "(full, int8, int4[:group=G,residual=R,block=B])")
        elif parse_storage(self.cache_storage or "full", "--cache-storage").bits is not None and method.kind in STATEFUL_KINDS:
            raise ValueError(f"--cache-storage {self.cache_storage}: --to {method.name} makes {method.kind} layers, which update their memory in place "
                             "and take full storage only")


def check_before_work(model: str, options: ConvertOptions, out_dir: str | Path | None, heal_cfg: HealConfig | None = None) -> None:
    """Every check that needs no weights: ValueError naming the problem, before anything is loaded
    (the options, the destination and the names it will get, the architecture, and that the
    calibration and healing texts hold enough tokens of the model's tokenizer)."""
    options.validate()
    if heal_cfg is not None:
        heal_cfg.validate()
    if out_dir is not None:
        names = OUTPUT_NAMES + ((EXPORT_FOLDER,) if options.export else ()) + ((HEAL_DIR,) if heal_cfg is not None else ())
        CONVERTED_FOLDER.check(out_dir, names)
    path = resolve_model_path(model)
    shape = read_shape(model)
    check_window("--calib-seq-len", options.calib_seq_len, shape.max_position_embeddings)
    if heal_cfg is not None:
        check_window("--heal-seq-len", heal_cfg.seq_len, shape.max_position_embeddings)
    if options.export == "deepseek" and shape.qkv_bias:
        raise ValueError("--export deepseek cannot express this model: DeepSeek-V3's q_proj has no bias, and its queries have one (Qwen2)")
    method, settings = parse_method(options.method)
    for window in (options.budget_windows or [None]) if method.check is not None else ():  # every window a plan may choose, as the method's own
        try:
            method.check(shape, settings if window is None else {**settings, "window": window}, heal_cfg.seq_len if heal_cfg is not None else None)
        except ValueError as error:
            if window is None:
                raise
            raise ValueError(f"--budget-windows {window}: {error}") from None
    options, _ = sized_by_budget(options, shape)
    method, settings = parse_method(options.method)  # with the window a plan chose
    minimum = method.ratio_floor(shape, settings) if method.ratio_floor is not None else method.min_ratio(shape)
    if method.sized_by_ratio and options.cache_ratio < minimum:
        raise ValueError(f"--cache-ratio {options.cache_ratio} is below what --to {options.method} can represent for this model: "
                         f"the minimum is {minimum:.4f} ({method.description})")
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    sources = calibration_sources(options.calib)
    check_calibration_size(tokenizer, sources, options.calib_tokens, options.calib_seq_len)
    if method.text_demand is not None:
        check_calibration_size(tokenizer, sources, *method.text_demand(settings, shape))
    if heal_cfg is not None:
        check_heal_text(tokenizer, heal_cfg)


def read_shape(model: str) -> Shape:
    """The source model's shape from its config.json alone (no weights), refusing what cannot convert."""
    return check_convertible(AutoConfig.from_pretrained(resolve_model_path(model), trust_remote_code=False))


def sized_by_budget(options: ConvertOptions, shape: Shape) -> tuple[ConvertOptions, BudgetPlan | None]:
    """``options`` with ``--cache-budget`` turned into the ratio, storage and (with ``--budget-windows``)
    window its plan chose (``slimkv.convert.budget``), and that plan; options without a budget as they
    are, and None. A plan still to be weighed keeps the method's window until ``weighed`` decides."""
    if options.cache_budget is None:
        return options, None
    plan = budget_plan(options, shape)
    return apply_plan(options, plan), plan


def apply_plan(options: ConvertOptions, plan: BudgetPlan) -> ConvertOptions:
    """``options`` sized as ``plan`` says: its ratio, storage and, where windows were planned, its window."""
    method = options.method
    if options.budget_windows and not plan.to_weigh:
        method = with_setting(method, "window", plan.window, "--budget-windows")
    return replace(options, method=method, cache_ratio=plan.cache_ratio, cache_storage=plan.storage)


def budget_plan(options: ConvertOptions, shape: Shape) -> BudgetPlan:
    """The plan of a ``--cache-budget`` conversion (before any weights load)."""
    _, settings = parse_method(options.method)
    windows = tuple(options.budget_windows) if options.budget_windows else settings["window"]
    return plan_budget(shape, options.cache_budget, hybrid.budget_length(shape, settings), window=windows, sink_len=settings["sink_len"],
                       storage=options.cache_storage)


def weigh_candidates(source: Source, method: Conversion, layers: list[LayerContext], settings: dict[str, Any], budget: BudgetPlan,
                   options: ConvertOptions, progress: bool) -> BudgetPlan:
    """The budget's fitting candidates weighed (``slimkv.convert.budget.weighed``): each one's conversion, built
    from the measured roles (ranked once, with the method's window), copies the spans of calibration copy
    contexts through a cache of that storage and window."""
    contexts = hybrid.weighing_contexts(source, settings, calib=options.calib, seed=options.seed)
    accuracy = {}
    for candidate in budget.fitting():
        plan, _ = method.plan(layers, candidate["cache_ratio"], **{**settings, "window": candidate["window"]})
        model, _, _ = build_converted(source, method, layers, plan, candidate["storage"])
        accuracy[candidate["name"]] = copy_accuracy(model, contexts, storage=candidate["storage"], progress=progress)["mean"]
    return weighed(budget, accuracy, {"contexts": len(contexts), "length": len(contexts[0].ids), "formats": sorted({c.format for c in contexts})})


def check_window(option: str, length: int, positions: int) -> None:
    """A calibration or healing window fits the model's positions (past them the original's own
    outputs, which the conversion and healing are fitted to, are not meaningful)."""
    if length > positions:
        raise ValueError(f"{option} {length} is longer than the model's {positions} positions (max_position_embeddings); use at most {positions}")


def build_converted(source: Source, method: Conversion, layers: list[LayerContext], plan: list[dict[str, Any]], cache_storage: str = "full"
                    ) -> tuple[SlimKVForCausalLM, list[dict[str, Any]], list[str]]:
    """Fit every layer with its planned options and build the converted model (attention fitted,
    everything else copied exactly); returns the model, per-layer facts and the changed parameters."""
    fits, layer_info, changed = [], [], []
    for layer, planned in zip(layers, plan):
        fit = method.fit(layer, planned)
        fits.append((fit.options if fit.options is not None else planned, {k: v.to(torch.float32) for k, v in fit.state.items()}))
        changed += [f"model.layers.{layer.index}.attn.{name}" for name in fit.changed]
        layer_info.append({"layer": layer.index, "options": fits[-1][0], **fit.info})
    fields = {"attention": method.kind, "attention_options": method.options(source.shape), "per_layer_options": [options for options, _ in fits],
              "cache_storage": parse_storage(cache_storage).name}
    model = SlimKVForCausalLM(slimkv_config(source.shape, fields)).eval()
    copy_shared_weights(source, model)
    for block, (_, state) in zip(model.model.layers, fits):
        block.attn.load_state_dict(state)
    return model, layer_info, changed


def convert_loaded(source: Source, options: ConvertOptions, *, progress: bool = True) -> tuple[SlimKVForCausalLM, dict[str, Any]]:
    """The converted model and its manifest body (nothing written)."""
    started = time.perf_counter()
    shape = source.shape
    asked = options
    options, budget = sized_by_budget(options, shape)
    method, settings = parse_method(options.method)
    sources = calibration_sources(options.calib)
    windows = calibration_ids(source.loaded.tokenizer, sources, options.calib_tokens, options.calib_seq_len, options.seed)
    stats = layer_statistics(source, windows, distances=method.distances, progress=progress) if method.statistics else [None] * shape.n_layers
    calibrated = time.perf_counter()
    inv_freq = source.rotary_inv_freq()
    layers = [LayerContext(i, shape, source.attention(i), stats[i], inv_freq) for i in range(shape.n_layers)]
    measured_sensitivity = measure_sensitivity(source, method, layers, options.cache_ratio, settings, windows, progress)
    roles = method.measure(source, settings, calib=options.calib, seed=options.seed, progress=progress) if method.measure is not None else None
    for layer in layers if roles is not None else ():
        layer.roles = {name: roles[name][layer.index] for name in ROLE_SCORES}
    if budget is not None and budget.to_weigh:
        budget = weigh_candidates(source, method, layers, settings, budget, options, progress)
        options = apply_plan(options, budget)
        settings = {**settings, "window": budget.window}
    plan, allocation = method.plan(layers, options.cache_ratio, **settings)
    planned = time.perf_counter()
    model, layer_info, changed = build_converted(source, method, layers, plan, options.cache_storage)
    fitted = time.perf_counter()
    refined = method.refine(model, source, settings, calib=options.calib, seed=options.seed, progress=progress) if method.refine else None
    finished = time.perf_counter()
    before = [float(shape.cache_elements)] * shape.n_layers
    per_token = method.sized_by_ratio and model.cache_is_per_token()  # mla-kvm: the ratio sizes its rows, its cache is bounded
    after = model.cache_elements_per_token() if per_token else []
    manifest = {
        "vocabulary": VOCABULARY,  # the spelling of method and method_options (slimkv.common.vocabulary)
        "method": method.name,
        "method_options": settings,
        "kind": method.kind,
        "cache_ratio": options.cache_ratio,
        "achieved_cache_ratio": sum(after) / sum(before) if per_token else None,
        "cache_elements_per_token_per_layer": {"before": before, "after": after} if per_token else None,
        "cache_bytes": cache_bytes_table(model, shape, progress=progress),
        "cache_storage": model.config.cache_storage,
        "budget_plan": budget.to_dict() if budget is not None else None,
        "refinement": refined,
        "allocation": allocation,
        "sensitivity": measured_sensitivity,
        "head_roles": roles,
        "layers": layer_info,
        "changed_parameters": changed,
        "calibration": {
            "source": options.calib,
            "text_sha256": calibration_text_sha256(sources),
            "tokens_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest(),
            "sequences": windows.shape[0],
            "seq_len": windows.shape[1],
            "tokens": windows.numel(),
            "seed": options.seed,
            "statistics": ("one pass of the original model: attention-input second moment and mean"
                           + (", attention mass per distance" if method.distances else "") + ", per layer") if method.statistics
                          else "none (the method reads no calibration statistics)",
        },
        "options": asdict(asked),
        "seconds": {"calibration": calibrated - started, "plan": planned - calibrated, "fit": fitted - planned, "refine": finished - fitted,
                    "total": finished - started},
        "threads": torch.get_num_threads(),
        "healing": None,
    }
    return model, manifest


def measure_sensitivity(source: Source, method: Conversion, layers: list[LayerContext], ratio: float | None, settings: dict[str, Any],
                        windows: torch.Tensor, progress: bool) -> dict[str, Any] | None:
    """When the method's settings ask for it (``Conversion.probe_plans``): build each probe plan's
    model in turn, measure every layer's KL alone (``slimkv.convert.sensitivity``) into
    ``LayerContext.sensitivity``, and return what the manifest records; otherwise None."""
    probes = method.probe_plans(layers, ratio, **settings) if method.probe_plans is not None else None
    if probes is None:
        return None
    started = time.perf_counter()
    exact = exact_copy(source)
    measured = []  # (plan, layer) -> KL
    for probe in probes:
        converted, _, _ = build_converted(source, method, layers, probe)
        measured.append(sensitivity.layer_sensitivity(exact, converted, windows, progress=progress))
        del converted
    for i, layer in enumerate(layers):
        layer.sensitivity = [values[i] for values in measured]
    return {"measure": "KL(original || original with this layer alone converted as the probe plan says), nats per token",
            "probe_plans": probes, "tokens": int(windows[:sensitivity.WINDOWS, :sensitivity.SEQ_LEN].numel()), "kl_per_plan_and_layer": measured,
            "seconds": time.perf_counter() - started}


def save_converted(model: SlimKVForCausalLM, tokenizer: Any, manifest: dict[str, Any], out_dir: str | Path, *, keep: tuple[str, ...] = ()
                   ) -> dict[str, Any]:
    """Publish ``out_dir``: the slimkv model (config + safetensors), the tokenizer, the manifest,
    and the DeepSeek-V3 form of the model in ``deepseek_v3/`` when the options ask for it; returns
    the manifest as published (with the export's facts). A one-shot conversion gets its
    fingerprint, ``conversion_sha256`` (``model_fingerprint``: its weights and config), which a healed one keeps;
    ``keep``: names of the earlier folder to carry over (the healing run of this conversion)."""
    out_dir = Path(out_dir).expanduser()
    with CONVERTED_FOLDER.publish(out_dir, keep=keep) as folder, quiet_transformers():
        model.save_pretrained(folder)
        if not manifest.get(CONVERSION_KEY):
            manifest = {**manifest, CONVERSION_KEY: model_fingerprint(folder)}
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if manifest.get("head_roles"):
            plot_head_roles(manifest["head_roles"], folder / HEAD_ROLES_PLOT)
        if manifest["options"].get("export") == "deepseek":
            manifest = {**manifest, "export": export_deepseek(model, tokenizer, folder / EXPORT_FOLDER)}
        write_json(folder / CONVERTED_MANIFEST, {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, **CONVERTED_FOLDER.file_record(folder)})
    return manifest


def convert_pretrained(model: str, options: ConvertOptions, out_dir: str | Path | None, *, heal_cfg: HealConfig | None = None,
                       progress: bool = True) -> tuple[SlimKVForCausalLM, dict[str, Any]]:
    """Check, load, convert and (if ``out_dir``) save, then heal if ``heal_cfg`` is given (which
    needs ``out_dir``: the healing run lives there); returns the model and the full manifest."""
    if heal_cfg is not None and out_dir is None:
        raise ValueError("healing needs an output folder (--out): its checkpoints live there")
    if out_dir is None:
        return _convert_and_heal(model, options, None, heal_cfg, progress)
    CONVERTED_FOLDER.check(out_dir)
    with CONVERTED_FOLDER.lock(out_dir):  # from before the first publish until healing's last write: no other run writes there between
        return _convert_and_heal(model, options, out_dir, heal_cfg, progress)


def _convert_and_heal(model: str, options: ConvertOptions, out_dir: str | Path | None, heal_cfg: HealConfig | None, progress: bool
                      ) -> tuple[SlimKVForCausalLM, dict[str, Any]]:
    check_before_work(model, options, out_dir, heal_cfg)
    loaded = load_pretrained(model)
    source = Source(loaded)
    converted, body = convert_loaded(source, options, progress=progress)
    identity = dict(loaded.identity)
    identity["weights_sha256"] = weights_fingerprint(Path(identity["path"]))
    manifest = {"library_version": VERSION, "base_model": identity, **body}
    if out_dir is not None:
        manifest = save_converted(converted, loaded.tokenizer, manifest, out_dir)
    if heal_cfg is not None:
        del loaded, source
        manifest = heal_converted(out_dir, heal_cfg, progress=progress)
        converted = load_model_folder(out_dir)
    return converted, manifest


def model_fingerprint(folder: Path) -> str:
    """sha256 over a saved model's weights (``weights_fingerprint``) and its config.json: conversions
    that keep the original's weights but differ in their layers (``hybrid`` plans, whose head roles and
    cache storage live in the config) get fingerprints of their own."""
    return hashlib.sha256(f"{weights_fingerprint(folder)} {sha256_file(Path(folder) / 'config.json')}".encode()).hexdigest()


def conversion_fingerprint(out_dir: Path, manifest: dict[str, Any]) -> str:
    """The fingerprint of the conversion in ``out_dir``: the manifest's, or (a manifest written before
    fingerprints, not healed yet) the sha256 of the one-shot weights there."""
    return manifest.get(CONVERSION_KEY) or weights_fingerprint(out_dir)


def heal_converted(out_dir: str | Path, cfg: HealConfig | None, *, resume: bool = False, progress: bool = True, stop_after: int | None = None
                   ) -> dict[str, Any]:
    """Heal the converted model in ``out_dir`` by distillation from its original
    (``slimkv.convert.heal``) and publish the healed weights there; returns the updated manifest.
    ``resume``: continue the healing run there, which must belong to this conversion (``cfg``
    None: with the options it was started with). Everything is checked before a model is loaded.
    ``stop_after``: stop after this many steps, as a killed run would (tests)."""
    out_dir = Path(out_dir).expanduser()
    CONVERTED_FOLDER.check(out_dir)
    with CONVERTED_FOLDER.lock(out_dir):  # nothing else publishes there while this run reads the model and heals it
        return _heal_locked(out_dir, cfg, resume, progress, stop_after)


def _heal_locked(out_dir: Path, cfg: HealConfig | None, resume: bool, progress: bool, stop_after: int | None) -> dict[str, Any]:
    manifest = read_manifest(out_dir)
    conversion = conversion_fingerprint(out_dir, manifest)
    if resume:
        healed = manifest.get("healing") or {}
        if healed.get("status") == "finished":
            raise ValueError(f"--resume: the healing of the conversion in {out_dir} finished ({healed.get('step')} steps) and is published; "
                             "there is nothing to resume (to heal for longer, convert again with a larger --heal-tokens)")
        cfg = check_resumable(out_dir / HEAL_DIR, cfg, conversion)
    elif cfg is None:
        raise ValueError("healing needs its options (--heal-tokens and the other --heal-* options)")
    check_window("--heal-seq-len", cfg.seq_len, read_config(out_dir).max_position_embeddings)
    base = resolve_original(manifest, out_dir / CONVERTED_MANIFEST)
    tokenizer = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=False)
    check_heal_text(tokenizer, cfg)
    student = load_model_folder(out_dir)
    teacher = load_pretrained(base).model
    summary = heal(student, teacher, tokenizer, cfg, out_dir, manifest["changed_parameters"], conversion=conversion, resume=resume,
                   progress=progress, stop_after=stop_after)
    body = {k: v for k, v in manifest.items() if k not in ("format", "format_version", "files", "file_sha256")}
    body[CONVERSION_KEY] = conversion
    body["healing"] = summary
    if summary.get("status") == "finished":  # a stopped run leaves its checkpoint in OUT/healing, the published model unhealed
        body = save_converted(student, tokenizer, body, out_dir, keep=(HEAL_DIR,))
    return body
