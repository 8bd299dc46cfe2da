"""Which RULER tasks ``slimkv eval ruler`` runs offline (docs/ruler.md): lm-eval's tasks that build
their data on the machine, slimkv's local-haystack versions of its essay tasks (``ruler_tasks/``),
the tasks refused and why, each task's default ``max_gen_toks``, and the local haystack's file."""

from __future__ import annotations

from slimkv.common.checks import check_choice, check_int
from slimkv.common.files import write_text
from slimkv.common.paths import cache_dir
from slimkv.data.texts import evaluation_text, text_sha256
from slimkv.eval import ruler_press

# Offline tasks: haystack, the generated tokens RULER leaves room for in each prompt, and the
# default max_gen_toks (what the answer needs with SmolLM2's tokenizer, which splits digits:
# " 8284194." is 9 tokens, a UUID 32; vt, cwe and fwe keep lm-eval's own).
OFFLINE_TASKS = {
    "niah_single_1": ("repeated sentences, one 7-digit number", 128, 16),
    "niah_multikey_2": ("needle-shaped distractors, one 7-digit number", 128, 16),
    "niah_multikey_3": ("needle-shaped distractors, one UUID", 128, 48),
    "ruler_vt": ("variable tracking", 30, 30),
    "ruler_cwe": ("common words", 120, 120),
    "ruler_fwe": ("frequent words", 50, 50),
    # slimkv's own tasks (ruler_tasks/): lm-eval's essay tasks with a local haystack, named apart from lm-eval's
    "niah_single_2_handbook": ("local prose (handbook-val), one 7-digit number", 128, 16),
    "niah_single_3_handbook": ("local prose (handbook-val), one UUID", 128, 48),
    "niah_multikey_1_handbook": ("local prose (handbook-val), four keys, one asked", 128, 16),
    "niah_multivalue_handbook": ("local prose (handbook-val), one key, its four numbers", 128, 64),
    "niah_multiquery_handbook": ("local prose (handbook-val), four keys, all asked", 128, 64),
}
# The local tasks' haystack: the Debian handbook's held-out pages (modern English prose, never calibration text)
LOCAL_HAYSTACK = "handbook-val"
HUB_TASKS = {**{name: "its haystack is Paul Graham's essays, which lm-eval downloads from the Hugging Face hub" + (
                    f" (slimkv's {name}{ruler_press.LOCAL_TASK_SUFFIX} runs it on a local haystack)" if name != "ruler" else "")
                for name in ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery", "niah_multivalue", "ruler")},
             **dict.fromkeys(("ruler_qa_squad", "ruler_qa_hotpot"), "its documents are SQuAD / HotpotQA, which lm-eval downloads from the Hugging Face hub")}


def parse_tasks(text: str) -> list[str]:
    """``"niah_single_1,ruler_vt"`` -> offline task names; a hub task is refused, naming it and why."""
    tasks = [t.strip() for t in str(text).split(",") if t.strip()]
    for task in tasks:
        if task in HUB_TASKS:
            raise ValueError(f"--tasks {task}: {HUB_TASKS[task]}, and this machine works offline; offline tasks: {', '.join(OFFLINE_TASKS)}")
        check_choice("--tasks", task, OFFLINE_TASKS)
    if not tasks or len(set(tasks)) != len(tasks):
        raise ValueError(f"--tasks must list distinct tasks among {', '.join(OFFLINE_TASKS)}, got {text!r}")
    return tasks


def haystack_file() -> tuple[str, str]:
    """The local-haystack tasks' text file (``LOCAL_HAYSTACK``, written once into slimkv's cache
    folder under its sha256, so runs side by side share it unchanged) and that sha256."""
    text = evaluation_text(LOCAL_HAYSTACK)
    digest = text_sha256(text)
    path = cache_dir() / "ruler" / f"haystack-{LOCAL_HAYSTACK}-{digest[:16]}.txt"
    if not path.is_file():
        write_text(path, text)
    return str(path), digest


def gen_tokens(tasks: list[str], override: int | None) -> dict[str, int]:
    """max_gen_toks per task: the task's default, or ``override`` (at most the room RULER leaves)."""
    if override is None:
        return {t: OFFLINE_TASKS[t][2] for t in tasks}
    for task in tasks:
        check_int(f"--max-gen-toks (for {task}, whose prompts leave room for {OFFLINE_TASKS[task][1]})", override, 1, OFFLINE_TASKS[task][1])
    return dict.fromkeys(tasks, override)
