"""``slimkv.common.workers``: every call runs once, in spawned processes of one torch thread, and
a call's exception reaches the caller."""

from __future__ import annotations

import math

import pytest

from slimkv.common.workers import check_workers, run_each


def _threads_and_square(x: int) -> tuple[int, int]:
    import torch

    return torch.get_num_threads(), x * x


def test_serial_calls_run_in_order_in_this_process():
    assert list(run_each(math.factorial, [(3,), (4,), (0,)], 1)) == [(0, 6), (1, 24), (2, 1)]
    assert list(run_each(math.factorial, [], 2)) == []


def test_worker_calls_each_run_once_on_one_torch_thread():
    results = dict(run_each(_threads_and_square, [(2,), (3,), (4,)], 2))
    assert results == {0: (1, 4), 1: (1, 9), 2: (1, 16)}


def test_a_worker_exception_reaches_the_caller():
    with pytest.raises(ValueError, match="factorial"):
        list(run_each(math.factorial, [(2,), (-1,)], 2))


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_bad_worker_counts_are_refused_by_name(workers):
    with pytest.raises(ValueError, match=r"--workers must be an integer >= 1"):
        check_workers(workers, "--workers")
    with pytest.raises(ValueError, match=r"workers must be an integer >= 1"):
        list(run_each(math.factorial, [(2,)], workers))
