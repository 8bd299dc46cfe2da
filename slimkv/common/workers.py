"""Independent runs (one small model per entry and seed) in worker processes.

A small model gains little from a second torch thread, so two processes of one thread each train
two models in about the time one takes on two threads. ``run_each`` calls a function once per
argument tuple: in this process, in order, with ``workers=1``; otherwise in ``workers`` spawned
processes on one torch thread each, yielding results as they finish. A run depends only on its
arguments (its seed included), so the results are those of the serial run.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

import torch

from slimkv.common.checks import check_int

Result = TypeVar("Result")


def check_workers(workers: Any, option: str = "workers") -> None:
    """``workers`` must be an integer >= 1 (ValueError naming ``option``)."""
    check_int(option, workers, 1)


def workers_note(workers: int) -> str:
    """The line a runner prints before handing its runs to ``workers`` processes."""
    return f"training in {workers} worker processes of one torch thread each: a line as each run starts and ends, no progress bars"


def _one_torch_thread() -> None:
    torch.set_num_threads(1)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` spawned processes on one torch thread each (the processes ``run_each`` trains in)."""
    check_workers(workers)
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_one_torch_thread)


def run_each(function: Callable[..., Result], calls: Sequence[tuple[Any, ...]], workers: int) -> Iterator[tuple[int, Result]]:
    """(index into ``calls``, ``function(*calls[index])``) for every call, as each finishes.

    ``workers=1``: in this process, in order. More: in that many spawned processes (at most one per
    call), each on one torch thread; ``function`` and its arguments must be picklable (a module-level
    function). The first exception a call raises is raised here; calls not yet started are dropped."""
    check_workers(workers)
    if workers == 1:
        for index, arguments in enumerate(calls):
            yield index, function(*arguments)
        return
    if not calls:
        return
    with worker_pool(min(workers, len(calls))) as pool:
        futures = {pool.submit(function, *arguments): index for index, arguments in enumerate(calls)}
        try:
            for future in as_completed(futures):
                yield futures[future], future.result()
        finally:
            for future in futures:
                future.cancel()
