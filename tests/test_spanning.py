"""eager/spanning.py's planning, in one process: which recorded collectives of a captured
sharded step run merged and where (HSDP's gradients go through two collectives each, with a
buffer copy between), and which groups one captured program may span (``join``, ``mesh_of``).
The programs themselves run in tests/test_compiled_fsdp.py (2 and 4 processes)."""

from types import SimpleNamespace

import numpy as np
import pytest

from torchtpu.device import tensors
from torchtpu.eager import spanning


class _Collective:
    """A recorded collective as the planner sees it: its merge key and bytes."""

    def __init__(self, key: str) -> None:
        self.merge_key, self.nbytes = key, 64


def _op(*_):
    return None


def _nodes(spec: dict, n: int) -> tuple:
    """n recorded calls: spec[i] = (fn, positions read); others compute from nothing."""
    return tuple((spec.get(i, (_op, []))[0], None,
                  tuple((r, 0) for r in spec.get(i, (_op, []))[1])) for i in range(n))


def _hsdp_backward() -> tuple:
    """The shape of simple_fsdp's HSDP backward as recorded (the 4-process test's step): each
    replicated parameter's gradient all-reduced across slices (AR_r), copied, all-reduced
    within the slice (AR_s); each sharded one all-reduced across slices, then reduce-scattered
    (RS); the clipping norm (node 12) reads all four."""
    ar_r, ar_s, rs = _Collective("ar_r"), _Collective("ar_s"), _Collective("rs")
    spec = {1: (ar_r, [0]), 2: (tensors.copy_buffer, [1]), 3: (ar_s, [2]),
            4: (_op, []), 5: (ar_r, [4]), 6: (tensors.copy_buffer, [5]), 7: (ar_s, [6]),
            8: (_op, []), 9: (ar_r, [8]), 10: (rs, [9]),
            11: (ar_r, [8]), 12: (rs, [11]), 13: (_op, [3, 7, 10, 12])}
    return _nodes(spec, 14), ((13, 0),)


def test_chained_collectives_merge_into_one_per_kind_producers_first():
    nodes, wanted = spanning._without_copies(*_hsdp_backward())[:2]
    # One across-slice all-reduce of every gradient, then the within-slice all-reduce and
    # reduce-scatter reading it, all just before the clipping norm.
    assert spanning._buckets(nodes, wanted) == {13: [[1, 5, 9, 11], [3, 7], [10, 12]]}


def test_copies_are_read_through_and_not_run():
    nodes, wanted, copies = spanning._without_copies(*_hsdp_backward())
    assert copies == {2, 6}
    assert nodes[3][2] == ((1, 0),) and nodes[7][2] == ((5, 0),)
    assert nodes[2][2] == () and wanted == ((13, 0),)


def test_a_chain_ending_in_a_lone_collective_keeps_a_runnable_order():
    # a0 -> b1 (the only call of its kind: runs where it stands) -> used at 4; a3's result is
    # used at 5. Looking through b1 would run a0 after b1: the plan falls back to merging a0
    # and a3 before b1, their first use without looking through.
    a, b = _Collective("a"), _Collective("b")
    nodes = _nodes({0: (a, []), 1: (b, [0]), 3: (a, [2]), 4: (_op, [1]), 5: (_op, [3])}, 6)
    assert spanning._buckets(nodes, ((4, 0), (5, 0))) is not None
    # a3 reads node 2, computed from the step's arguments after b1's position: run early, so
    # a0 and a3 merge before b1.
    assert spanning._buckets(nodes, ((4, 0), (5, 0))) == {1: [[0, 3]]}
    # node 2 reads b1's result: a3's input is not ready before b1 runs, nothing merges.
    nodes = _nodes({0: (a, []), 1: (b, [0]), 2: (_op, [1]), 3: (a, [2]), 4: (_op, [1]),
                    5: (_op, [3])}, 6)
    assert spanning._buckets(nodes, ((4, 0), (5, 0))) == {}
    nodes = _nodes({0: (a, []), 1: (b, [0]), 3: (a, []), 4: (_op, [1]), 5: (_op, [3])}, 6)
    assert spanning._buckets(nodes, ((4, 0), (5, 0))) == {1: [[0, 3]]}


class _Doubling(_Collective):
    """A collective whose result is twice its input, run merged or alone."""

    def __init__(self) -> None:
        super().__init__("ag")
        self.merged: list = []

    def __call__(self, x):
        return x * 2

    def merge(self, calls, values):
        self.merged.append(len(values))
        return [v * 2 for v in values]


def _fsdp2_step(ag) -> tuple:
    """FSDP2's forward and backward as recorded: each group's copy-in (a call on the sharded
    parameters, inputs 0-2) right before its all-gather, after the previous group's result
    is used; the backward gathers group 0 again."""
    import operator

    def plus(x):
        return x + 1

    recorded = [(plus, None, (0,)), (ag, None, ((0, 0),)),                # group 0
                (operator.mul, None, ((1, 0), 1)),                        # its use
                (plus, None, (2,)), (ag, None, ((3, 0),)),                # group 1
                (operator.mul, None, ((4, 0), (2, 0))),
                (plus, None, (0,)), (ag, None, ((6, 0),)),                # group 0 again
                (operator.mul, None, ((7, 0), (5, 0)))]
    return tuple(recorded), ((8, 0),)


def test_fsdp2s_copy_ins_run_early_so_its_all_gathers_merge():
    ag = _Doubling()
    nodes, wanted = _fsdp2_step(ag)
    # The three all-gathers as one, before the first use of group 0's result.
    assert spanning._buckets(nodes, wanted) == {2: [[1, 4, 7]]}
    x = [np.arange(3.0) + k for k in range(3)]
    (got,) = spanning.replay(nodes, wanted)(*x)
    assert ag.merged == [3]
    g0, g1 = (x[0] + 1) * 2, (x[2] + 1) * 2  # each group gathered (doubled here)
    np.testing.assert_array_equal(got, g0 * (g1 * (g0 * x[1])))


def _group(ranks: tuple, name: str):
    return SimpleNamespace(mesh=name, ranks=ranks)


def test_join_spans_two_dims_of_one_mesh_and_refuses_others():
    shard, replicate = _group((0, 1), "s01"), _group((0, 2), "r02")
    assert spanning.join(None, shard) is shard
    assert spanning.join(shard, _group((0, 1), "s01")) is shard
    joined = spanning.join(shard, replicate)
    # The outer dim first, whichever group the capture met first.
    assert joined.groups == (replicate, shard)
    assert spanning.join(spanning.join(replicate, shard), shard).groups == (replicate, shard)
    assert spanning.join(joined, _group((0, 3), "x03")) is None      # a third group
    assert spanning.join(shard, _group((0, 1, 2, 3), "world")) is None  # shares 2 ranks
    assert spanning.join(_group((0, 1), "a"), _group((0, 1), "b")) is None  # laid out alike


def test_groups_that_are_no_mesh_dims_raise_a_clear_error():
    def group(ids, ranks, rows=None):
        devices = np.array([SimpleNamespace(id=i) for i in ids], dtype=object)
        return SimpleNamespace(mesh=SimpleNamespace(devices=devices), ranks=ranks,
                               gather=lambda mine: np.array(rows), axes=((tuple(ids), "g"),))

    # This rank (device 0) sees shard group [0, 1] and replicate group [0, 2]; the replicate
    # group's other rank reports a shard group [1, 3] that holds device 1 again.
    outer = group([0, 2], (0, 2), rows=[[0, 1], [1, 3]])
    with pytest.raises(ValueError, match="not the dims of one mesh"):
        spanning.mesh_of(spanning.Joined((outer, group([0, 1], (0, 1)))))
