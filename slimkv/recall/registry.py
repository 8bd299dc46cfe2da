"""The recall tasks by name: what ``slimkv eval recall --task`` may name and what the ``"task"``
of a recorded ``to_dict()`` (run folders, reports) is read back as.

The names are part of the result files (``recall_run.json``, ``report.json``): ``mqar`` and
``needles`` (the prose needles) stay as they are so that finished runs keep being reused.
"""

from __future__ import annotations

from typing import Any

from slimkv.recall.mqar import MQARTask
from slimkv.recall.prose_needles import ProseNeedleTask
from slimkv.recall.task import RecallTask

TASKS: dict[str, type[RecallTask]] = {task.name: task for task in (MQARTask, ProseNeedleTask)}


def task_from_dict(data: dict[str, Any]) -> RecallTask:
    """A recall task from its ``to_dict()`` (ValueError naming the allowed tasks); no "task" = MQAR
    (records made before there was a second task)."""
    values = dict(data)
    name = values.pop("task", MQARTask.name)
    if name not in TASKS:
        raise ValueError(f"task={name!r} is not allowed; allowed values: {', '.join(TASKS)}")
    layout = values.pop("layout", None)
    if layout is not None and layout != getattr(TASKS[name], "layout", None):
        raise ValueError(f"task {name!r} with layout {layout} was made by another version of slimkv "
                         f"(this one writes layout {getattr(TASKS[name], 'layout', None)})")
    return TASKS[name](**values)
