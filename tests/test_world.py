"""The test worlds themselves: a rank that dies fails its test at once, and the next test gets
a fresh world."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

EXIT_CODE = 3


def _rank_one_exits() -> None:
    if dist.get_rank() == 1:
        os._exit(EXIT_CODE)
    dist.barrier()  # rank 0 waits for a partner that is gone


def _world_size() -> int:
    return dist.get_world_size()


def test_a_rank_that_dies_fails_the_test_and_the_world_is_replaced(worlds):
    # The failure names the dead process, noticed while waiting for the results.
    with pytest.raises(AssertionError, match=f"rank 1 exited with code {EXIT_CODE}"):
        worlds.run(2, _rank_one_exits)
    assert worlds.run(2, _world_size) == [2, 2]
