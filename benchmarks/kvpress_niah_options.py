"""The pure-Python parts of ``kvpress_niah.py`` (standard library only, like the script): the
options and their checks, the prompts and generations files, labels and budgets. Split out so
that the script stays short; ``kvpress_niah.py`` imports them from beside it."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPTS_FORMAT = "slimkv-niah-prompts/1"
GENERATIONS_FORMAT = "slimkv-niah-generations/1"
ENV_HINT = "run `make bench-kvpress-env` and use .venv-kvpress/bin/python (or `make bench-kvpress PROMPTS=... OUT=...`)"


@dataclass(frozen=True)
class PressSpec:
    """A kvpress press: its class and the options it takes besides ``compression_ratio``."""

    class_name: str
    options: dict[str, Any] = field(default_factory=dict)
    uses: str = ""


PRESSES: dict[str, PressSpec | None] = {
    "none": None,
    "streaming_llm": PressSpec("StreamingLLMPress", {"n_sink": 4}, "position only: n_sink first tokens + the most recent context tokens"),
    "snapkv": PressSpec("SnapKVPress", {"window_size": 64, "kernel_size": 5},
                        "attention of the context's last window_size tokens (kept), pooled over kernel_size"),
    "expected_attention": PressSpec("ExpectedAttentionPress", {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0},
                                    "expected attention of future queries (context query mean/covariance, RoPE averaged over n_future_positions), x value norm"),
    "knorm": PressSpec("KnormPress", {}, "keeps the keys of smallest L2 norm"),
    "tova": PressSpec("TOVAPress", {}, "attention of the last context token (head-averaged)"),
    "random": PressSpec("RandomPress", {"seed": 0}, "random (control)"),
}
DEFAULT_PRESSES = "streaming_llm,snapkv,expected_attention,knorm"
DEFAULT_BUDGETS = "0.5,0.25"


def default_model_dir() -> Path:
    """The SmolLM2 folder ``slimkv models fetch smollm2`` writes: ``$SLIMKV_CACHE/models/smollm2``."""
    return Path(os.environ.get("SLIMKV_CACHE") or Path.home() / ".cache" / "slimkv").expanduser() / "models" / "smollm2"


# ---------------------------------------------------------------- options (pure python, tested in the main venv)


def parse_presses(text: str) -> list[str]:
    """``"snapkv,knorm"`` -> press names, ``none`` first (always run, once), each once, in order given."""
    names = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = [n for n in names if n not in PRESSES]
    if bad or not names:
        raise ValueError(f"--presses: unknown press {', '.join(map(repr, bad)) or '(none given)'}; allowed: {', '.join(PRESSES)}")
    return ["none"] + [n for i, n in enumerate(names) if n != "none" and n not in names[:i]]


def parse_budgets(text: str) -> list[float]:
    """``"0.5,0.25"`` -> fractions of the context's cache kept, each in (0, 1], distinct."""
    budgets = []
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--budgets: {part!r} is not a number; give fractions in (0, 1] like 0.5,0.25") from None
        if not 0.0 < value <= 1.0:
            raise ValueError(f"--budgets: {part} is outside (0, 1]; a budget is the fraction of the context's KV cache kept")
        budgets.append(value)
    if not budgets or len(set(budgets)) != len(budgets):
        raise ValueError(f"--budgets must list distinct fractions in (0, 1], got {text!r}")
    return budgets


def prompt_length(prompt: dict[str, Any]) -> int:
    """A prompt's length in tokens (context and question): the length it was exported at."""
    return len(prompt["context_ids"]) + len(prompt["question_ids"])


def select_lengths(prompts: list[dict[str, Any]], text: str | None, path: str | Path) -> list[dict[str, Any]]:
    """The prompts whose length is in ``text`` (``"1024,8128"``; ``2k`` = 2048), in file order; all
    of them when ``text`` is None. A length the file does not hold is an error naming those it does."""
    if text is None:
        return prompts
    wanted = []
    for part in (p.strip().lower() for p in str(text).split(",") if p.strip()):
        try:
            value = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        except ValueError:
            raise ValueError(f"--lengths: {part!r} is not a token count (like 2048 or 2k)") from None
        wanted.append(value)
    if not wanted or len(set(wanted)) != len(wanted):
        raise ValueError(f"--lengths must list distinct token counts, got {text!r}")
    held = sorted({prompt_length(p) for p in prompts})
    missing = [n for n in wanted if n not in held]
    if missing:
        raise ValueError(f"--lengths {', '.join(map(str, missing))}: {path} holds no prompts of that length; "
                         f"its lengths are {', '.join(map(str, held))}")
    return [p for p in prompts if prompt_length(p) in wanted]


def compression_ratio(budget: float) -> float:
    """kvpress's ``compression_ratio`` (fraction of the prefilled entries removed) for a cache budget
    (fraction kept): ``1 - budget``, rounded so that 0.25 gives 0.75, not 0.7500000000000001."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"cache budget {budget} is outside (0, 1]")
    return round(1.0 - budget, 12)


def _coerce(raw: str, default: Any, where: str) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"{where}: {raw!r} is not true/false")
    kind = int if isinstance(default, int) or default is None else type(default)
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{where}: {raw!r} is not {({int: 'an integer', float: 'a number'}).get(kind, 'a ' + kind.__name__)}") from None


def parse_press_options(items: list[str] | None, presses: list[str]) -> dict[str, dict[str, Any]]:
    """Each press's options: its defaults, overridden by ``--press-option PRESS.KEY=VALUE`` items."""
    options = {name: dict(PRESSES[name].options) for name in presses if PRESSES[name] is not None}
    for item in items or []:
        where = f"--press-option {item!r}"
        target, eq, raw = item.partition("=")
        name, dot, key = target.partition(".")
        if not eq or not dot or not key:
            raise ValueError(f"{where}: expected PRESS.KEY=VALUE, like snapkv.window_size=32")
        if name not in options:
            raise ValueError(f"{where}: press {name!r} is not among --presses with options ({', '.join(options) or 'none'})")
        if key not in options[name]:
            raise ValueError(f"{where}: {name} takes {', '.join(options[name]) or 'no options'} (besides the budget)")
        options[name][key] = _coerce(raw.strip(), PRESSES[name].options[key], where)
    for name, values in options.items():
        for key in ("n_sink", "window_size", "kernel_size", "n_future_positions"):
            if key in values and values[key] < (1 if key != "n_sink" else 0):
                raise ValueError(f"--press-option {name}.{key}={values[key]} must be positive")
    return options


def read_prompts(path: str | Path) -> dict[str, Any]:
    """The prompts file written by slimkv, checked: format, and per prompt a unique ``id``,
    non-empty ``context_ids``/``question_ids`` (token ids), ``max_new_tokens`` >= 1."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompts: {path} does not exist (write it with `slimkv eval niah --model ... --export-prompts`)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--prompts: {path} is not a JSON file ({error})") from None
    if not isinstance(data, dict) or data.get("format") != PROMPTS_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"--prompts: {path} is not a slimkv prompts file (format {found!r}, expected {PROMPTS_FORMAT!r})")
    prompts = data.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"--prompts: {path} holds no prompts (expected a non-empty list under 'prompts')")
    seen = set()
    for index, prompt in enumerate(prompts):
        where = f"--prompts: {path}, prompt {index}"
        if not isinstance(prompt, dict):
            raise ValueError(f"{where} is not an object")
        pid = prompt.get("id")
        if not isinstance(pid, str) or not pid:
            raise ValueError(f"{where} has no string 'id'")
        if pid in seen:
            raise ValueError(f"{where}: id {pid!r} repeats")
        seen.add(pid)
        for key in ("context_ids", "question_ids"):
            ids = prompt.get(key)
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"{where} ({pid}): {key!r} must be a non-empty list of token ids")
        new = prompt.get("max_new_tokens")
        if not isinstance(new, int) or isinstance(new, bool) or new < 1:
            raise ValueError(f"{where} ({pid}): 'max_new_tokens' must be an integer >= 1, got {new!r}")
    return data


def prompts_digest(prompts: list[dict[str, Any]]) -> str:
    """Fingerprint of what the model sees (ids, tokens, max_new_tokens): a results file of other prompts is refused."""
    keys = ("id", "context_ids", "question_ids", "max_new_tokens")
    text = json.dumps([{k: p[k] for k in keys} for p in prompts], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def min_context_tokens(press: str, options: dict[str, Any]) -> int:
    """The shortest context a press accepts (kvpress asserts): SnapKV needs more than its window,
    the sink presses more than their sinks; a ScorerPress keeps at least one entry anyway."""
    if press == "snapkv":
        return options["window_size"] + 1
    if "n_sink" in options:
        return options["n_sink"] + 1
    return 2 if press != "none" else 1


def check_model_dir(path: str | Path) -> Path:
    """A local transformers folder: config.json and safetensors weights (never a hub id)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"--model-dir: {path} is not a folder (a local transformers model; run `slimkv models fetch smollm2` for SmolLM2)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model-dir: {path} has no config.json (not a transformers model folder)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"--model-dir: {path} has no *.safetensors weights (only safetensors are loaded)")
    return path


def result_name(press: str, budget: float | None, compress_question: bool = False) -> str:
    """``none.json``, ``snapkv_budget0.5.json`` (``_qctx`` when the question was compressed too)."""
    stem = "none" if press == "none" else f"{press}_budget{budget:g}"
    return stem + ("_qctx" if compress_question and press != "none" else "") + ".json"


def label(press: str, budget: float | None, compress_question: bool = False) -> str:
    if press == "none":
        return "kvpress none (uncompressed)"
    return f"kvpress {press} budget {budget:g}" + (" (question compressed)" if compress_question else "")


def budget_note(press: str, compress_question: bool) -> str:
    if press == "none":
        return "no press: the whole context, question and generated tokens stay in the cache (budget 1)."
    what = "context and question" if compress_question else "context"
    return (f"The press prunes each layer's cache once, at the prefill of the {what}, to int(budget x its tokens) entries per kv head "
            f"(kvpress compression_ratio = 1 - budget); {'generated' if compress_question else 'question and generated'} tokens are appended "
            "uncompressed after it, so the cache kept after generation is a bit above budget x the tokens processed. "
            "Kept keys carry their original RoPE positions; later tokens are placed at their true positions.")


def atomic_write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(payload, stream, indent=1)
            stream.write("\n")
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def previous_generations(path: Path, header: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]:
    """(generations already written, their seconds, complete?) of a results file of the same run;
    nothing when there is no file; refuses a file of another press, budget, model or prompts."""
    if not path.is_file():
        return [], 0.0, False
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise ValueError(f"{path} exists but is not JSON; move it away to run this press again") from None
    same = ("format", "press", "press_options", "cache_budget", "compress_question", "prompts_digest", "model_config_digest")
    differ = [k for k in same if data.get(k) != header.get(k)]
    if differ:
        raise ValueError(f"{path} holds another run ({', '.join(differ)} differ); give another --out, or move that file away to start over")
    return list(data.get("generations", [])), float(data.get("seconds", 0.0)), bool(data.get("complete"))
