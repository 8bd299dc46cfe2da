"""kvpress presses as cache options of ``slimkv eval ruler`` (``--caches press:kvzip@0.25``; docs/ruler.md).

kvpress 0.5.5 needs transformers < 5.3 and slimkv 5.24, so a press never runs in slimkv's
process: each press cell is run by ``ruler_press_runner.py`` with the python of kvpress's own
virtualenv (``.venv-kvpress``, ``make bench-kvpress-env``, which also holds lm-eval), and hands
back lm-eval's files and the bytes it measured. This module is the part both sides share: the
presses, the parsing and checks of an option, the calls into that environment, and which of a
task's prompts a cell runs and the task manager it builds them with (``prompt_selection``,
``task_manager_args``, for slimkv's own cells too). It imports
only the standard library, so the runner can load it without slimkv's dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "press:"
REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().with_name("ruler_press_runner.py")
ENV_TARGET = "make bench-kvpress-env"
ENV_VARIABLE = "SLIMKV_KVPRESS_PYTHON"
ENV_MODULES = ("kvpress", "lm_eval", "wonderwords", "nltk")
STORE_DTYPE = "bfloat16"  # the kept entries, the question tail and the generated tokens are stored in bfloat16
# DuoAttention's on-the-fly pattern (kvpress's duo_attention_on_the_fly) scores heads on 50 BookSum
# chapters downloaded from the hub; offline, the same code runs on 50 chapters of Austen's novels
# from slimkv's text cache (`slimkv data fetch`), each cut to this many tokens.
DUO_TEXTS = "austen"
DUO_TEXT_TOKENS = 1024
# slimkv's local-haystack RULER tasks (lm-eval's essay tasks over a local text: ruler_tasks/handbook_niah.py)
LOCAL_TASKS_DIR = Path(__file__).resolve().with_name("ruler_tasks")
LOCAL_TASK_SUFFIX = "_handbook"


@dataclass(frozen=True)
class PressSpec:
    """A kvpress press: its class, the options it is built with, whether kvpress only masks the
    pruned keys (the tensors keep every entry), and what it scores."""

    class_name: str
    options: dict[str, Any] = field(default_factory=dict)
    masked: bool = False
    uses: str = ""
    inner: str | None = None  # AdaKV's scorer press


PRESSES: dict[str, PressSpec] = {
    "streaming_llm": PressSpec("StreamingLLMPress", {"n_sink": 4}, uses="position only: n_sink first tokens and the most recent ones"),
    "snapkv": PressSpec("SnapKVPress", {"window_size": 64, "kernel_size": 5}, uses="attention of the context's last window_size tokens, pooled over kernel_size"),
    "expected_attention": PressSpec("ExpectedAttentionPress", {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0},
                                    uses="expected attention of future queries (statistics of the context's queries) times the value norm"),
    "knorm": PressSpec("KnormPress", {}, uses="keeps the keys of smallest L2 norm"),
    "tova": PressSpec("TOVAPress", {}, uses="attention of the context's last token, averaged over heads"),
    "pyramidkv": PressSpec("PyramidKVPress", {"window_size": 64, "kernel_size": 5, "beta": 20}, uses="SnapKV's score, budgets decreasing with depth"),
    "adakv_snapkv": PressSpec("AdaKVPress", {"alpha_safeguard": 0.2}, masked=True, inner="snapkv",
                              uses="SnapKV's score, entries pruned across the heads of a layer (each head keeps at least alpha_safeguard of its share)"),
    "adakv_expected_attention": PressSpec("AdaKVPress", {"alpha_safeguard": 0.2}, masked=True, inner="expected_attention",
                                          uses="ExpectedAttention's score, pruned across the heads of a layer"),
    "kvzip": PressSpec("KVzipPress", {"layerwise": False, "n_sink": 4, "chunk_size": 2048}, masked=True,
                       uses="attention while the model repeats the context (a second pass over it), pruned across heads and layers"),
    "duo_attention": PressSpec("DuoAttentionPress", {"on_the_fly_scoring": True}, masked=True,
                               uses=f"streaming heads keep 128 sink + 256 recent tokens; heads chosen by kvpress's on-the-fly pattern, computed on "
                                    f"{DUO_TEXTS} chapters (BookSum is on the hub)"),
}
DUO_KEPT = 128 + 256  # what a DuoAttention streaming head keeps (kvpress's on-the-fly sink_size + recent_size)
HUB_ONLY = {"duo_attention_patterns": "DuoAttention's pre-computed patterns are downloaded from the DuoAttention repository (and exist only for "
                                      "six 7-8B checkpoints, not SmolLM2); this machine works offline: use press:duo_attention (the on-the-fly pattern)"}



def prompt_selection(task: str, first: int, limit: int) -> dict[str, Any]:
    """``simple_evaluate``'s arguments for prompts ``first`` to ``limit - 1`` of ``task``: its ``limit``
    from the first prompt (lm-eval's first ``limit`` documents), its ``samples`` (those indices) after."""
    return {"limit": limit, "samples": None} if first == 0 else {"limit": None, "samples": {task: list(range(first, limit))}}


def is_local_task(task: str) -> bool:
    """Whether ``task`` is one of slimkv's local-haystack RULER tasks (``ruler_tasks/``)."""
    return task.endswith(LOCAL_TASK_SUFFIX)


def task_manager_args(task: str, length: int, tokenizer_dir: str, haystack_file: str | None) -> dict[str, Any]:
    """``lm_eval.tasks.TaskManager``'s arguments for a cell of ``task`` at ``length``: RULER's metadata
    (the lengths, the tokenizer folder) and, for slimkv's local-haystack tasks, their folder and
    the haystack file (ValueError when that is missing)."""
    metadata: dict[str, Any] = {"max_seq_lengths": [length], "tokenizer": tokenizer_dir}
    if not is_local_task(task):
        return {"metadata": metadata}
    if not haystack_file:
        raise ValueError(f"task {task} hides its needles in a local haystack: its file must be given (haystack_file)")
    return {"include_path": str(LOCAL_TASKS_DIR), "metadata": {**metadata, "haystack_file": haystack_file}}


def is_press(option: str) -> bool:
    """Whether a ``--caches`` entry names a kvpress press (``press:NAME@BUDGET``)."""
    return str(option).startswith((PREFIX, "kvpress:"))


def parse_option(option: str) -> tuple[str, float]:
    """``"press:kvzip@0.25"`` -> (``"kvzip"``, 0.25); ValueError naming --caches and the allowed presses."""
    text = str(option).strip()
    body = text.split(":", 1)[1] if ":" in text else ""
    name, _, budget_text = body.partition("@")
    allowed = f"allowed presses: {', '.join(PRESSES)}"
    if name in HUB_ONLY:
        raise ValueError(f"--caches {text}: {HUB_ONLY[name]}")
    if name not in PRESSES:
        raise ValueError(f"--caches {text}: unknown press {name!r}; write press:NAME@BUDGET (e.g. press:kvzip@0.25), {allowed}")
    try:
        budget = float(budget_text)
    except ValueError:
        raise ValueError(f"--caches {text}: the budget after @ must be a number in (0, 1) (the cache's bytes as a fraction of the bfloat16 "
                         f"original's), e.g. press:{name}@0.25") from None
    if not 0.0 < budget < 1.0:
        raise ValueError(f"--caches {text}: budget {budget_text} is outside (0, 1); it is the cache's bytes as a fraction of the bfloat16 original's")
    return name, budget


def canonical(option: str) -> str:
    """The option's one spelling (``press:kvzip@0.25``), used for cell folders and resume."""
    name, budget = parse_option(option)
    return f"{PREFIX}{name}@{budget:g}"


def check_budget(option: str, length: int) -> None:
    """A press must be able to reach its budget at ``length``: DuoAttention's streaming heads keep
    ``DUO_KEPT`` tokens each, so below that share of the prompt no head choice reaches the budget."""
    name, budget = parse_option(option)
    if name == "duo_attention" and budget * length <= DUO_KEPT:
        raise ValueError(f"--caches {option} at --lengths {length}: DuoAttention's streaming heads keep {DUO_KEPT} tokens (128 sink + 256 recent), "
                         f"more than {budget:g} of {length}; its smallest budget at this length is about {DUO_KEPT / length:.2f} (give a larger budget "
                         "or a longer length)")


def settings(option: str) -> dict[str, Any]:
    """What a press option stands for, recorded in every cell (and compared when a run resumes)."""
    name, budget = parse_option(option)
    spec = PRESSES[name]
    record = {"name": name, "class": spec.class_name, "options": spec.options, "budget_of_bf16_original": budget, "masked": spec.masked,
              "store_dtype": STORE_DTYPE, "question_tail": "the prompt's last line (RULER's question and answer prefix), not compressed"}
    if spec.inner:
        record["scorer"] = {"class": PRESSES[spec.inner].class_name, "options": PRESSES[spec.inner].options}
    if name == "duo_attention":
        record["pattern_texts"] = {"corpus": DUO_TEXTS, "samples": 50, "tokens_each": DUO_TEXT_TOKENS}
    return {"press": record}


def env_python() -> Path:
    """The python of kvpress's virtualenv: ``$SLIMKV_KVPRESS_PYTHON`` or the checkout's ``.venv-kvpress``."""
    return Path(os.environ.get(ENV_VARIABLE) or REPO / ".venv-kvpress" / "bin" / "python")


def env_problem() -> str | None:
    """Why kvpress's environment cannot run a press cell (None when it can)."""
    python = env_python()
    if not python.is_file():
        return f"{python} does not exist"
    probe = ("import importlib.util,sys; missing=[m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]; "
             "print(', '.join(missing), file=sys.stderr); sys.exit(1 if missing else 0)")
    try:
        done = subprocess.run([str(python), "-c", probe, *ENV_MODULES], capture_output=True, text=True, timeout=120, cwd=RUNNER.parent)
    except (OSError, subprocess.SubprocessError) as err:
        return f"{python} does not run ({err})"
    if done.returncode != 0:
        return f"{python} lacks {done.stderr.strip() or 'its packages'}"
    return None


def check_env(options: list[str]) -> None:
    """ImportError naming ``make bench-kvpress-env`` when a press option is asked for and kvpress's
    environment (kvpress, lm-eval, wonderwords, nltk) is missing; before any work."""
    presses = [o for o in options if is_press(o)]
    if not presses:
        return
    problem = env_problem()
    if problem:
        raise ImportError(f"--caches {presses[0]}: kvpress presses run in kvpress's own virtualenv (kvpress 0.5.5 with lm-eval 0.4.13, "
                          f"transformers < 5.3), and {problem}; run `{ENV_TARGET}` (or set {ENV_VARIABLE} to such a python)")


def exit_with_parent(poll_s: float = 2.0) -> None:
    """End this process when the one that started it is gone (the runner calls it first): a SIGTERM
    or SIGKILL to ``slimkv eval ruler`` ends it without running its clean-up, and the press runner
    would go on computing a cell nobody reads (Ctrl-C in a terminal reaches both already)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def call_runner(request: dict[str, Any], log_path: Path | None = None, timeout_s: float | None = None,
                on_log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``ruler_press_runner.py`` with kvpress's python on ``request`` and return its JSON reply;
    its output goes to ``log_path`` (a temporary file without one), and each second what it has
    added is handed to ``on_log`` (lm-eval's progress, for a bar). subprocess.TimeoutExpired past
    ``timeout_s`` (the runner stopped); RuntimeError with the log's last lines when it fails."""
    with tempfile.TemporaryDirectory(prefix="slimkv-press-") as folder:
        request_path, reply_path = Path(folder) / "request.json", Path(folder) / "reply.json"
        log_path = Path(log_path) if log_path is not None else Path(folder) / "runner.log"
        request_path.write_text(json.dumps(request), encoding="utf-8")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        command = [str(env_python()), str(RUNNER), str(request_path), str(reply_path)]
        started, read = time.monotonic(), 0
        with open(log_path, "w", encoding="utf-8") as log, subprocess.Popen(command, env=env, cwd=RUNNER.parent, stdout=log,
                                                                           stderr=subprocess.STDOUT) as runner:
            while True:
                try:
                    returncode = runner.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    returncode = None
                if on_log is not None:
                    with open(log_path, encoding="utf-8", errors="replace") as out:
                        out.seek(read)
                        added = out.read()
                        read = out.tell()
                    if added:
                        on_log(added)
                if returncode is not None:
                    break
                if timeout_s is not None and time.monotonic() - started > timeout_s:
                    runner.kill()
                    runner.wait()
                    raise subprocess.TimeoutExpired(command, timeout_s)
        if returncode != 0 or not reply_path.is_file():
            tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-15:])
            raise RuntimeError(f"the kvpress runner ({env_python()}) failed (exit code {returncode}) on its {request.get('mode')} of "
                               f"{request.get('option') or request.get('pairs')}; the end of {log_path}:\n{tail}")
        return json.loads(reply_path.read_text(encoding="utf-8"))
