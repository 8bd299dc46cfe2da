"""GrowableBuffer's reserve/commit (rows written by a native step straight into the storage) against append."""

from __future__ import annotations

import pytest
import torch

from slimkv.common.buffer import MIN_CAPACITY, GrowableBuffer


def test_rows_written_into_reserved_room_equal_appended_rows_across_growth_and_trims():
    rows = torch.randn(1, 2, 3 * MIN_CAPACITY, 4)
    appended, written = (GrowableBuffer(1, 2, 4, dtype=torch.float32, device="cpu") for _ in range(2))
    for t in range(rows.shape[2]):
        appended.append(rows[:, :, t:t + 1])
        storage, first, free = written.reserve(1)
        assert free - first == len(written) and storage.shape[2] > free
        storage[:, :, free] = rows[:, :, t]
        written.commit(1)
        if t == MIN_CAPACITY + 5:  # a trim: the next growth compacts into the dropped slots
            appended.keep_last(20)
            written.keep_last(20)
        assert torch.equal(written.view(), appended.view())


def test_nothing_counts_until_commit_and_commit_checks_the_room():
    buffer = GrowableBuffer(1, 1, 2, dtype=torch.float32, device="cpu")
    buffer.append(torch.ones(1, 1, 3, 2))
    storage, first, free = buffer.reserve(1)
    storage[:, :, free] = 7.0
    assert len(buffer) == 3 and buffer.view().sum() == 6  # reserved, written, not counted
    with pytest.raises(ValueError, match="reserved past the live ones"):
        buffer.commit(buffer.capacity)
    buffer.commit(1)
    assert len(buffer) == 4 and buffer.view()[0, 0, -1].tolist() == [7.0, 7.0]
