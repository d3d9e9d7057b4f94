"""distributed/uneven.py's planning, in one process: the size buckets that bound its programs,
and how the ranks' exchanged rows decide the path (the programs run in
tests/test_distributed_xla.py, 2 processes)."""

import numpy as np
import pytest
import torch

from torchtpu.distributed import uneven
from torchtpu.distributed.protocol import CollectiveMismatchError


def test_buckets_are_exact_when_small_and_at_most_an_eighth_larger():
    assert [uneven.bucket(n) for n in (0, 1, 7, 16, 17, 33, 100, 1000)] == \
        [1, 1, 7, 16, 18, 36, 104, 1024]
    for n in range(1, 5000):
        assert n <= uneven.bucket(n) <= n * 9 / 8
    # A training run's varying token counts reuse a few programs.
    assert len({uneven.bucket(n) for n in range(900, 1100)}) <= 4


def _rows(*ranks):
    """Each rank's row: (input rows, its input splits, its output splits), 3 values a row."""
    return np.stack([uneven.row(torch.empty(sum(o), 3), torch.empty(sum(i), 3), o, i, len(i))
                     for i, o in ranks])


def test_agree_picks_the_even_program_the_padded_one_or_the_host():
    assert uneven.agree(_rows(([2, 2], [2, 2]), ([2, 2], [2, 2])), 0, "g") == uneven.EVEN
    assert uneven.agree(_rows(([0, 2], [0, 3]), ([3, 0], [2, 0])), 0, "g") == uneven.UNEVEN
    # Splits that do not sum to the input's rows: the host path names the problem.
    bad = uneven.row(torch.empty(4, 3), torch.empty(5, 3), [2, 2], [2, 2], 2)
    assert bad[0] == uneven.HOST
    # Other trailing dims on another rank: the host path too.
    other = uneven.row(torch.empty(4, 2), torch.empty(4, 2), [2, 2], [2, 2], 2)
    assert uneven.agree(np.stack([_rows(([2, 2], [2, 2]))[0], other]), 0, "g") == uneven.HOST


def test_splits_that_do_not_pair_up_raise_on_every_rank():
    rows = _rows(([2, 0], [1, 1]), ([1, 1], [1, 1]))
    for rank in (0, 1):
        with pytest.raises(CollectiveMismatchError, match="the split sizes do not pair up"):
            uneven.agree(rows, rank, "g")
