"""Strict's training loop and Python's garbage collector (``eager/frozen.py``'s ``SteadyLoop``):
after ``STEADY_STEPS`` optimizer steps in a row that made no program, what is alive is frozen
(nothing collected first), so full collections walk only what later steps make; a step that
makes a program unfreezes, and the freeze is made again every ``REFREEZE_STEPS`` steps after a
full collection, so a cycle that died meanwhile lives no longer than that; young collections are
spaced out while frozen, as in DeferAndFuse's freeze. Losses equal CPU's."""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import pytest
import torch

from torchtpu import metrics
from torchtpu.eager import frozen


@pytest.fixture
def loop(monkeypatch):
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")
    fresh = frozen.SteadyLoop()
    monkeypatch.setattr(frozen, "STRICT_LOOP", fresh)
    yield fresh
    fresh.reset()


def _trainer(device: str, features: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(features, 3).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> float:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _steps_until_frozen(step, x, bound: int = 12) -> list:
    """Steps run until the loop froze (at most ``bound``); each one's (loss, made a program)."""
    out = []
    for _ in range(bound):
        made = metrics.programs_made()
        out.append((step(x), metrics.programs_made() != made))
        if gc.get_freeze_count():
            return out
    raise AssertionError(f"not frozen after {bound} steps: {out}")


def test_a_steady_loop_is_frozen_until_a_step_makes_a_program(loop):
    a, b = torch.randn(4, 7), torch.randn(4, 9)
    step, thresholds = _trainer("tpu", 7), gc.get_threshold()
    full = []

    def observe(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(info)

    gc.collect()  # (so that no full collection of the collector's own comes in a few steps)
    gc.callbacks.append(observe)
    try:
        done = _steps_until_frozen(step, a.to("tpu"))
    finally:
        gc.callbacks.remove(observe)
    # Freezing collected nothing first: a benchmark's few timed steps after its warm-up would
    # take that full collection.
    assert full == []
    # Frozen at the end of the third step in a row that made no program, not before.
    made = [m for _, m in done]
    assert made[-frozen.STEADY_STEPS:] == [False] * frozen.STEADY_STEPS
    assert len(made) == frozen.STEADY_STEPS or made[-frozen.STEADY_STEPS - 1]
    losses = [loss for loss, _ in done]
    losses.append(step(a.to("tpu")))
    assert gc.get_freeze_count() and gc.get_threshold()[0] == frozen.YOUNG_THRESHOLD
    cpu = _trainer("cpu", 7)
    assert losses == pytest.approx([cpu(a) for _ in losses], rel=1e-5)
    # Another model (a shape no step ran): its first step makes programs and unfreezes.
    other = _trainer("tpu", 9)
    made = metrics.programs_made()
    other(b.to("tpu"))
    assert metrics.programs_made() != made and gc.get_freeze_count() == 0
    assert gc.get_threshold() == thresholds


def test_a_cycle_dropped_while_frozen_lives_at_most_the_refreeze_steps(loop, monkeypatch):
    monkeypatch.setattr(frozen, "REFREEZE_STEPS", 5)
    x = torch.randn(4, 5).to("tpu")
    step = _trainer("tpu", 5)
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    _steps_until_frozen(step, x)
    del cycle
    gc.collect()
    assert gone() is not None  # frozen: what a freeze costs
    # The freeze is made anew at the fifth steady step (after STEADY_STEPS, two more).
    for _ in range(frozen.REFREEZE_STEPS - frozen.STEADY_STEPS - 1):
        step(x)
        gc.collect()
        assert gone() is not None
    step(x)
    assert gone() is None and gc.get_freeze_count()


def test_empty_cache_collects_a_cycle_dropped_while_frozen(loop):
    # CUDA's idiom for freeing a dropped model's memory: del, gc.collect(), empty_cache().
    x = torch.randn(4, 5).to("tpu")
    step = _trainer("tpu", 5)
    cycle = _Cycle()
    cycle.held = torch.randn(64, 64).to("tpu")  # device memory a cycle holds
    gone = weakref.ref(cycle)
    _steps_until_frozen(step, x)
    del cycle
    gc.collect()
    assert gone() is not None
    torch.tpu.empty_cache()
    assert gone() is None and gc.get_freeze_count() == 0
    # The loop freezes again once steady.
    _steps_until_frozen(step, x)


def test_a_loop_without_optimizer_steps_never_freezes(loop):
    x = torch.randn(3, 6).to("tpu")
    for _ in range(frozen.STEADY_STEPS + 2):
        (x * 2).sum().item()
    assert gc.get_freeze_count() == 0


def test_turned_off_it_never_freezes(monkeypatch):
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")
    off = frozen.SteadyLoop(enabled=False)
    monkeypatch.setattr(frozen, "STRICT_LOOP", off)
    step, x = _trainer("tpu", 6), torch.randn(2, 6).to("tpu")
    for _ in range(frozen.STEADY_STEPS + 3):
        step(x)
    assert gc.get_freeze_count() == 0


def test_a_program_made_counts_across_a_metrics_reset():
    # (A loop resetting the metrics each step and building a program each step is not steady.)
    before = metrics.programs_made()
    torch.randn(3, 17).to("tpu").cumsum(0).cpu()  # a program no other test builds
    metrics.reset()
    assert metrics.programs_made() > before


def test_a_program_made_by_torchtpus_background_thread_is_not_the_loops(loop):
    # (Loading ahead and TPU targets compile on such threads: a steady loop stays frozen.)
    def compile_on(name: str) -> int:
        made = metrics.programs_made()
        fn = jax.jit(lambda v, n=name: v * len(n) + 1)  # a new program each call
        worker = threading.Thread(target=lambda: fn(jnp.ones(3)).block_until_ready(), name=name)
        worker.start()
        worker.join(60)
        return metrics.programs_made() - made

    assert compile_on(metrics.BACKGROUND_THREADS + "test") == 0
    assert compile_on("a user's thread") == 1
