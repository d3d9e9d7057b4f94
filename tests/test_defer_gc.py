"""DeferAndFuse and Python's garbage collector (``eager/frozen.py``): a loop's first reuse of a
program it built collects once and freezes what is alive, so full collections walk only what later
steps make; leaving the mode unfreezes; a freeze made by another (vLLM's, after its start-up) is
left as it is. Results equal CPU's."""

import gc
import sys

import pytest
import torch

from torchtpu import metrics
from torchtpu.eager import frozen
from torchtpu.eager.defer import RECORDER

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


@pytest.fixture
def short_programs_freeze(monkeypatch):
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")
    monkeypatch.setattr(frozen, "MIN_OPS", 8)
    # (another test's freeze, seen and believed for a while, is gone)
    monkeypatch.setattr(RECORDER.freezer, "others_believed", 0)


def _step(x: torch.Tensor) -> float:
    for _ in range(6):
        x = x * 1.5 + 1  # 12 recorded calls, then the sum and the read's flush
    return x.sum().item()


def _freezes() -> int:
    return metrics.snapshot().get("gc_freezes", 0)


def test_a_loop_reusing_its_program_is_frozen_until_the_mode_ends(short_programs_freeze):
    a = torch.randn(7, 13)  # a program no other test builds: its first step builds it
    x, before = a.to("tpu"), _freezes()
    with torch.tpu.set_eager_mode(DEFER):
        got = [_step(x)]  # builds the program
        assert gc.get_freeze_count() == 0
        got.append(_step(x))  # its first reuse: the steady state
        assert gc.get_freeze_count() > 0 and _freezes() == before + 1
        got.append(_step(x))
        assert _freezes() == before + 1
    assert gc.get_freeze_count() == 0
    assert got == pytest.approx([_step(a)] * 3, rel=1e-6)


def test_another_freeze_is_left_as_it_is(short_programs_freeze):
    x, before = torch.randn(9, 9).to("tpu"), _freezes()  # a program of its own
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with torch.tpu.set_eager_mode(DEFER):
            for _ in range(3):
                _step(x)
        # Neither frozen again nor unfrozen (frozen objects freed meanwhile leave the count).
        assert 0 < gc.get_freeze_count() <= count and _freezes() == before
    finally:
        gc.unfreeze()


def test_another_freeze_is_looked_for_once_in_recheck_entries(short_programs_freeze,
                                                               monkeypatch):
    """A loop that leaves and re-enters the mode every step walks the frozen heap once, not at
    every entry; after ``RECHECK`` entries it looks again, and freezes once the other's is gone."""
    # (the shape of another test's program: a fourth shape at _step's lines would take eager
    # buckets)
    x, before = torch.randn(9, 9).to("tpu"), _freezes()
    monkeypatch.setattr(frozen, "RECHECK", 3)
    looks, count = [], gc.get_freeze_count
    monkeypatch.setattr(frozen.gc, "get_freeze_count", lambda: looks.append(1) or count())
    got = []
    gc.freeze()
    try:
        for _ in range(4):  # an entry that looks, three that believe it
            with torch.tpu.set_eager_mode(DEFER):
                got += [_step(x), _step(x)]
        assert len(looks) == 1 and _freezes() == before
    finally:
        gc.unfreeze()
    with torch.tpu.set_eager_mode(DEFER):  # looks again: none left, so it freezes
        got += [_step(x), _step(x)]
        assert len(looks) == 2 and _freezes() == before + 1
    assert got == pytest.approx([_step(x.cpu())] * 10, rel=1e-6)


def test_young_collections_are_spaced_out_while_frozen(short_programs_freeze):
    x = torch.randn(5, 11).to("tpu")  # a program of its own
    before = gc.get_threshold()
    assert before[0] < frozen.YOUNG_THRESHOLD
    with torch.tpu.set_eager_mode(DEFER):
        _step(x)
        _step(x)  # the steady state: frozen, and young collections spaced out
        assert gc.get_threshold() == (frozen.YOUNG_THRESHOLD, *before[1:])
        collected = []

        def observe(phase, info):
            if phase == "stop":
                collected.append(info["generation"])

        # (the young count left by what ran since the freeze is not what this measures, nor
        # what other threads make meanwhile: the count is the process's, and the cache writer's
        # records, written late on a loaded machine, made a collection here in stop 53's suite;
        # so no other thread runs until the containers are made: ~1 ms)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(30.0)
        try:
            gc.collect(0)
            gc.callbacks.append(observe)
            made = [[i] for i in range(frozen.YOUNG_THRESHOLD // 2)]  # containers: counted
        finally:
            gc.callbacks.remove(observe)
            sys.setswitchinterval(switch)
        assert collected == [] and len(made) == frozen.YOUNG_THRESHOLD // 2
    assert gc.get_threshold() == before


def test_thresholds_set_meanwhile_stand(short_programs_freeze):
    x = torch.randn(5, 11).to("tpu")  # (a fourth shape at _step's lines would take eager buckets)
    before = gc.get_threshold()
    try:
        with torch.tpu.set_eager_mode(DEFER):
            _step(x)
            _step(x)
            assert gc.get_threshold()[0] == frozen.YOUNG_THRESHOLD
            gc.set_threshold(1234, 5, 6)
        assert gc.get_threshold() == (1234, 5, 6)
    finally:
        gc.set_threshold(*before)
