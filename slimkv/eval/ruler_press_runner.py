"""A kvpress press cell of ``slimkv eval ruler``, run with kvpress's own python (docs/ruler.md).

    .venv-kvpress/bin/python slimkv/eval/ruler_press_runner.py REQUEST.json REPLY.json

``slimkv eval ruler`` (``slimkv.eval.ruler``) writes the request and reads the reply; this file
never imports slimkv (transformers < 5.3 here), only its standard-library neighbour
``ruler_press.py``. Two modes:

- ``cell``: one ``lm_eval.simple_evaluate`` of a RULER task and length, as slimkv's own cells do,
  with an ``HFLM`` whose generation runs kvpress's way (its pipeline's): the prompt's last line
  (RULER's question and lm-eval's answer prefix) is the question; the context before it is
  prefilled with the press active, which prunes it; the kept entries are stored in bfloat16; the
  question is then fed uncompressed at its true positions and the answer decoded greedily.
  lm-eval's results and samples files are written into the cell folder by its tracker.
- ``probe``: the planner's cost of one prompt per (press, length) on random token ids.

Equal bytes: for each prompt the press's ratio is set so that the kept context entries plus the
uncompressed question tail, in bfloat16, come to ``budget`` of the bfloat16 original's cache of the
same prompt. Bytes are read off the cache's tensors after the prompt; for the presses that kvpress
only masks (AdaKV, KVzip, DuoAttention keep every entry in memory and hide the pruned keys from
attention), the entries still attended are counted from the masks too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # slimkv/eval/ holds modules (cache.py, models.py) that must not shadow installed ones
_SPEC = importlib.util.spec_from_file_location("slimkv_ruler_press", Path(__file__).resolve().with_name("ruler_press.py"))
ruler_press = sys.modules["slimkv_ruler_press"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ruler_press)

import torch  # noqa: E402

VERSION_PACKAGES = ("torch", "transformers", "numpy", "lm_eval", "kvpress", "datasets", "accelerate")
STORE = getattr(torch, ruler_press.STORE_DTYPE)
PROBE_TAIL_TOKENS = 32  # random ids hold no line break: the probe's question tail is its last tokens
PROBE_DECODE_TOKENS = 8


def versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape a press cell's numbers."""
    found: dict[str, str | None] = {}
    for name in VERSION_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def austen_chapters(tokenizer: Any, tokens_each: int) -> list[str]:
    """The chapters of Austen's six novels in slimkv's text cache, each cut to ``tokens_each`` tokens."""
    folder = Path(os.environ.get("SLIMKV_CACHE") or Path.home() / ".cache" / "slimkv").expanduser() / "texts" / ruler_press.DUO_TEXTS
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise SystemExit(f"--caches press:duo_attention: its on-the-fly pattern is computed on {ruler_press.DUO_TEXTS} chapters, not found in {folder} "
                         "(kvpress's own choice, BookSum, is on the hub); fetch them with slimkv's text cache (`slimkv eval ppl --text austen` "
                         "fetches them) or pick another press")
    chapters = []
    for path in files:
        parts = re.split(r"^(?:CHAPTER|Chapter) [0-9IVXLC]+\.?[ \t]*$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
        chapters += [p.strip() for p in parts[1:] if p.strip()]
    return [tokenizer.decode(tokenizer(c, add_special_tokens=False)["input_ids"][:tokens_each]) for c in chapters]


def cache_duo_pattern(duo_attention_press: Any, patterns_dir: Path) -> None:
    """Keep kvpress's on-the-fly DuoAttention head scores in ``patterns_dir/duo_attention.json``
    (JSON), so that the cells of one results folder compute them once."""
    compute = duo_attention_press.duo_attention_on_the_fly

    def cached(model: Any, num_samples: int = 50, q_len: int = 500) -> Any:
        import numpy

        weights = Path(model.config.name_or_path) / "model.safetensors"
        stat = weights.stat() if weights.is_file() else None
        key = {"model_dir": str(model.config.name_or_path), "weights_bytes": stat.st_size if stat else None, "weights_mtime_ns": stat.st_mtime_ns if stat else None,
               "texts": ruler_press.DUO_TEXTS, "tokens_each": ruler_press.DUO_TEXT_TOKENS, "num_samples": num_samples, "q_len": q_len,
               "kvpress": versions()["kvpress"]}
        path = patterns_dir / "duo_attention.json"
        if path.is_file():
            kept = json.loads(path.read_text(encoding="utf-8"))
            if kept.get("key") == key:
                return numpy.array(kept["head_scores"])
        scores = compute(model, num_samples, q_len)
        patterns_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "head_scores": scores.tolist()}), encoding="utf-8")
        return scores
    duo_attention_press.duo_attention_on_the_fly = cached


def build_press(kvpress: Any, name: str, tokenizer: Any, patterns_dir: Path | None = None) -> Any:
    """A press of ``name`` with slimkv's recorded options (its ratio is set per prompt)."""
    spec = ruler_press.PRESSES[name]
    cls = getattr(kvpress, spec.class_name)
    if spec.inner:
        inner = ruler_press.PRESSES[spec.inner]
        return cls(press=getattr(kvpress, inner.class_name)(**inner.options), **spec.options)
    if name == "kvzip":
        class RawPromptKVzip(cls):
            """KVzip for prompts without a chat template: kvpress skips the template's prefix
            tokens when it replays the context; lm-eval's RULER prompts have none, so none is skipped."""

            def _perform_kvzip_compression(self, model: Any, tokenizer: Any) -> None:
                self.prefix_length = 0
                super()._perform_kvzip_compression(model, tokenizer)
        return RawPromptKVzip(**spec.options)
    if name == "duo_attention":
        import pandas
        from kvpress.presses import duo_attention_press

        chapters = austen_chapters(tokenizer, ruler_press.DUO_TEXT_TOKENS)

        class LocalChapters:
            """Stands in for ``load_dataset("kmfoda/booksum")`` in kvpress's on-the-fly pattern: a table of chapters."""

            def to_pandas(self) -> Any:
                return pandas.DataFrame({"chapter": chapters})
        duo_attention_press.load_dataset = lambda *args, **kwargs: LocalChapters()
        if patterns_dir is not None:
            cache_duo_pattern(duo_attention_press, patterns_dir)
    return cls(**spec.options)


def set_budget(press: Any, name: str, budget: float, context: int, tail: int, heads: int) -> float:
    """Set the press's ratio for this prompt so that kept context entries plus the ``tail`` question
    tokens come to ``budget`` of the prompt's entries; returns the context fraction aimed at."""
    fraction = (budget * (context + tail) - tail) / context
    if fraction <= 0:
        raise SystemExit(f"--caches press:{name}@{budget:g}: the question alone ({tail} of {context + tail} tokens) is more than the budget")
    fraction = min(fraction, 1.0)
    if name == "duo_attention":
        floor = min(ruler_press.DUO_KEPT / context, 1.0)
        streaming = round(heads * (1 - fraction) / (1 - floor)) if floor < 1 else 0
        press.head_compression_ratio = min(max(streaming, 0), heads) / heads
    else:
        press.compression_ratio = round(1.0 - fraction, 12)
    return fraction


def make_cache(layers: int) -> Any:
    """A transformers cache of layers that store in float32 during the press's prefill (the press
    scores the exact entries) and in bfloat16 from the question on (``store(cache)``)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class CastAfterPrefillLayer(DynamicLayer):
        store_dtype: torch.dtype | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self.store_dtype is None:
                return super().update(key_states, value_states, *args, **kwargs)
            keys, values = super().update(key_states.to(self.store_dtype), value_states.to(self.store_dtype), *args, **kwargs)
            return keys.to(key_states.dtype), values.to(value_states.dtype)

    return Cache(layers=[CastAfterPrefillLayer() for _ in range(layers)])


def store(cache: Any) -> None:
    """From now on the cache holds its entries in ``STORE`` (bfloat16)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.to(STORE), layer.values.to(STORE)
        layer.store_dtype = STORE


def measure(model: Any, cache: Any) -> dict[str, float]:
    """Live bytes of the cache's tensors, the entries per layer and the bytes of the entries still
    attended (a masked key's entry, key and value, is not)."""
    live = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    entry = cache.layers[0].keys.shape[-1] * cache.layers[0].keys.element_size() * 2
    masked = sum(len(indices[0]) for layer in model.model.layers if (indices := getattr(layer.self_attn, "masked_key_indices", None)) is not None)
    entries = [layer.keys.shape[-2] for layer in cache.layers]
    return {"live_bytes": live, "kept_bytes": live - masked * entry, "masked_entries": masked, "entries_per_layer_mean": sum(entries) / len(entries)}


def clear_masks(model: Any) -> None:
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


class PressGenerator:
    """kvpress's way of answering one prompt: prune the context under the press, then the question
    uncompressed at its true positions, then greedy decoding; with the bytes after the prompt."""

    def __init__(self, model: Any, tokenizer: Any, kvpress: Any, name: str, budget: float, patterns_dir: Path | None = None) -> None:
        self.model, self.tokenizer, self.name, self.budget = model, tokenizer, name, budget
        self.press = build_press(kvpress, name, tokenizer, patterns_dir)
        text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.layers, self.heads = text.num_hidden_layers, text.num_hidden_layers * text.num_key_value_heads
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        self.records: list[dict[str, Any]] = []

    def tail_start(self, ids: list[int]) -> int:
        """Index of the first token after the prompt's last line break: the question tail starts there."""
        for index in range(len(ids) - 1, 0, -1):
            if "\n" in self.tokenizer.decode([ids[index]]):
                if index + 1 >= len(ids):
                    break
                return index + 1
        raise SystemExit("a RULER prompt has no line break before its last token: the question tail cannot be told from the context")

    @torch.no_grad()
    def generate(self, ids: list[int], max_new_tokens: int, stop: list[str], tail: int | None = None) -> tuple[list[int], dict[str, Any]]:
        """Greedy tokens after ``ids`` and the record of this prompt (bytes, ratio, seconds)."""
        split = len(ids) - tail if tail is not None else self.tail_start(ids)
        context, question = ids[:split], ids[split:]
        fraction = set_budget(self.press, self.name, self.budget, len(context), len(question), self.heads)
        clear_masks(self.model)
        cache = make_cache(self.layers)
        started = time.perf_counter()
        with self.press(self.model):
            self.model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - started
        store(cache)
        position = len(ids)
        out = self.model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=torch.arange(split, position).unsqueeze(0),
                         use_cache=True, logits_to_keep=1)
        after_prompt = measure(self.model, cache)
        decode_started = time.perf_counter()
        new = [int(out.logits[0, -1].argmax())]
        while len(new) < max_new_tokens and new[-1] not in self.eos and not any(s and s in self.tokenizer.decode(new) for s in stop):
            out = self.model(input_ids=torch.tensor([[new[-1]]]), past_key_values=cache, position_ids=torch.tensor([[position]]), use_cache=True,
                             logits_to_keep=1)
            position += 1
            new.append(int(out.logits[0, -1].argmax()))
        decode_s = time.perf_counter() - decode_started
        after_decode = measure(self.model, cache)
        record = {"prompt_tokens": len(ids), "context_tokens": len(context), "tail_tokens": len(question), "context_fraction_aimed": fraction,
                  "compression_ratio": float(self.press.compression_ratio), "generated_tokens": len(new),
                  "bytes_per_token": after_prompt["live_bytes"] / len(ids), "bytes_per_token_kept": after_prompt["kept_bytes"] / len(ids),
                  "masked_entries": after_prompt["masked_entries"], "entries_per_layer_mean": after_prompt["entries_per_layer_mean"],
                  "bytes_per_token_after_decode": after_decode["live_bytes"] / (position if len(new) > 1 else len(ids)),
                  "bytes_per_token_kept_after_decode": after_decode["kept_bytes"] / (position if len(new) > 1 else len(ids)),
                  "prefill_s": prefill_s, "decode_s": decode_s, "seconds": time.perf_counter() - started}
        if self.name == "duo_attention":
            record["head_compression_ratio"] = self.press.head_compression_ratio
        return new, record


def load(request: dict[str, Any]) -> tuple[Any, Any, Any]:
    """kvpress (imported first: it patches transformers' attention functions), the model and tokenizer."""
    try:
        import kvpress
    except ImportError as err:
        raise SystemExit(f"kvpress is not importable in {sys.executable} ({err}); run `{ruler_press.ENV_TARGET}`") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(request["threads"])
    model = AutoModelForCausalLM.from_pretrained(request["model_dir"], dtype=getattr(torch, request["dtype"]), attn_implementation="sdpa",
                                                 use_safetensors=True, local_files_only=True, trust_remote_code=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(request["tokenizer_dir"], local_files_only=True, trust_remote_code=False)
    return kvpress, model, tokenizer


def run_probe(request: dict[str, Any]) -> dict[str, Any]:
    """One random prompt per (option, length): the press's prefill and decode seconds and its bytes."""
    kvpress, model, tokenizer = load(request)
    probes = {}
    for option, length in request["pairs"]:
        name, budget = ruler_press.parse_option(option)
        generator = PressGenerator(model, tokenizer, kvpress, name, budget, Path(request["patterns_dir"]) if request.get("patterns_dir") else None)
        ids = torch.randint(3, len(tokenizer), (1, length), generator=torch.Generator().manual_seed(length))[0].tolist()
        _, record = generator.generate(ids, PROBE_DECODE_TOKENS + 1, [], tail=PROBE_TAIL_TOKENS)
        probes[f"{option}/{length}"] = {
            "option": option, "cache_type": "press", "tokens": length, "bytes_per_token": record["bytes_per_token"],
            "bytes_per_token_kept": record["bytes_per_token_kept"], "decode_tokens": record["generated_tokens"] - 1,
            "bytes_per_token_after_decode": record["bytes_per_token_after_decode"], "prefill_s": record["prefill_s"],
            "decode_s_per_token": record["decode_s"] / max(record["generated_tokens"] - 1, 1), "threads": torch.get_num_threads(),
            "dtype": request["dtype"], "store_dtype": ruler_press.STORE_DTYPE, "runner_versions": versions(), **ruler_press.settings(option)}
    return {"probes": probes}


def run_cell(request: dict[str, Any]) -> dict[str, Any]:
    """One lm-eval evaluation of the task and length under the press; lm-eval's files in the cell folder."""
    kvpress, model, tokenizer = load(request)
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    name, budget = ruler_press.parse_option(request["option"])
    generator = PressGenerator(model, tokenizer, kvpress, name, budget, Path(request["patterns_dir"]) if request.get("patterns_dir") else None)

    class PressLM(HFLM):
        """HFLM answering every prompt through ``PressGenerator`` (greedy only), timing it."""

        generate_s = 0.0

        def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any) -> torch.Tensor:
            if generation_kwargs.get("do_sample") or generation_kwargs.get("temperature", 0.0) not in (0, 0.0, None):
                raise SystemExit(f"press cells decode greedily; lm-eval asked for sampling ({generation_kwargs})")
            if context.shape[0] != 1:
                raise SystemExit("press cells run one prompt at a time (batch_size 1)")
            t0 = time.perf_counter()
            ids = context[0].tolist()
            new, record = generator.generate(ids, max_length - len(ids), stop)
            generator.records.append(record)
            self.generate_s += time.perf_counter() - t0
            return torch.tensor([ids + new], dtype=context.dtype)

    cell_dir = Path(request["cell_dir"])
    lm = PressLM(pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=request["length"])
    tracker = EvaluationTracker(output_path=str(cell_dir / "lm_eval.json"))
    selection = ruler_press.prompt_selection(request["task"], request.get("first", 0), request["limit"])
    results = simple_evaluate(model=lm, tasks=[request["task"]], **selection, gen_kwargs={"max_gen_toks": request["max_gen_toks"]},
                              log_samples=True, evaluation_tracker=tracker, random_seed=request["seed"], verbosity="WARNING",
                              task_manager=TaskManager(**ruler_press.task_manager_args(request["task"], request["length"], request["tokenizer_dir"],
                                                                                       request.get("haystack_file"))))
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    tracker.save_results_samples(task_name=request["task"], samples=samples[request["task"]])
    written = sorted(cell_dir.glob("lm_eval_*.json")), sorted(cell_dir.glob("samples_*.jsonl"))
    if len(written[0]) != 1 or len(written[1]) != 1:
        raise SystemExit(f"lm-eval did not write one results JSON and one samples JSONL into {cell_dir}")
    return {"results": str(written[0][0]), "samples": str(written[1][0]), "generate_s": lm.generate_s, "prompts": generator.records,
            "runner_versions": versions(), "runner_python": sys.executable, "threads": torch.get_num_threads()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    ruler_press.exit_with_parent()
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    reply = run_cell(request) if request["mode"] == "cell" else run_probe(request)
    Path(argv[1]).write_text(json.dumps(reply), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
