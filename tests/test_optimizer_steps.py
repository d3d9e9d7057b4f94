"""Strict runs an optimizer step over tpu parameters as one program (compile/optimizer_steps.py):
values as CPU's, one execution a step, no compile once steady (a changing lr included)."""

import pytest
import torch

from torchtpu import metrics
from torchtpu.compile import optimizer_steps
from torchtpu.eager import executor

# Shapes of a bias, a weight and a 3-d tensor: AdamW's lists hold all three.
SHAPES = ((5,), (7, 3), (2, 3, 4))


def _params(device: str) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(device).requires_grad_() for s in SHAPES]


def _train(device: str, steps: int, make=torch.optim.AdamW, **kw):
    """(params after each step, executions and compiles of each step's optimizer call)."""
    params = _params(device)
    opt = make(params, lr=0.1, weight_decay=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]
    values, counts = [], []
    for i in range(steps):
        for p, gr in zip(params, grads[i]):
            p.grad = gr.to(device)
        opt.param_groups[0]["lr"] = 0.1 / (i + 1)  # a scheduler's new lr each step
        before = metrics.snapshot()
        opt.step()
        after = metrics.snapshot()
        counts.append((after["executions"] - before["executions"],
                       after["executable_compiles"] + after["persistent_cache_hits"]
                       - before["executable_compiles"] - before["persistent_cache_hits"]))
        opt.zero_grad(set_to_none=True)
        values.append([p.detach().cpu().clone() for p in params])
    return values, counts


def _assert_same(got: list, want: list) -> None:
    for step_got, step_want in zip(got, want, strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_foreach_adamw_step_is_one_program_as_cpu():
    want, _ = _train("cpu", 4)
    got, counts = _train("tpu", 4)
    _assert_same(got, want)
    # One program a step, compiled at the first, whose state (AdamW's moments) is made before
    # it, eagerly: from the second step on no compile, though lr and the bias corrections change
    # every step (the state made inside the first program, or read by it uncommitted, made the
    # second step compile the steady program once more).
    assert [n for n, _ in counts[1:]] == [1, 1, 1], counts
    assert [c for _, c in counts[1:]] == [0, 0, 0], counts
    assert type(executor.current()) is executor.Strict


def test_turned_off_steps_run_op_by_op():
    optimizer_steps.set_enabled(False)
    try:
        got, counts = _train("tpu", 2)
    finally:
        optimizer_steps.set_enabled(True)
    _assert_same(got, _train("cpu", 2)[0])
    assert all(n >= 6 for n, _ in counts), counts  # AdamW's _foreach_* calls, each its own


class _Reading(torch.optim.SGD):
    """SGD whose step reads a device value on the host halfway."""

    def step(self, closure=None):
        with torch.no_grad():
            p = self.param_groups[0]["params"][0]
            scale = 1.0 + 0.0 * float(p.grad.abs().sum())
            for q in self.param_groups[0]["params"]:
                q.grad.mul_(scale)
        return super().step(closure)


class _Raising(torch.optim.SGD):
    fail = True

    def step(self, closure=None):
        out = super().step(closure)
        if self.fail:
            raise RuntimeError("boom")
        return out


def test_host_read_and_raise_inside_a_step():
    got, counts = _train("tpu", 2, _Reading, momentum=0.9)
    _assert_same(got, _train("cpu", 2, _Reading, momentum=0.9)[0])
    assert all(n == 2 for n, _ in counts), counts  # cut once, at the read

    params = _params("tpu")
    opt = _Raising(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    # The raised step's update is pending, not lost; the next step's start runs it.
    _Raising.fail = False
    before = metrics.snapshot()["executions"]
    try:
        opt.step()
    finally:
        _Raising.fail = True
    assert metrics.snapshot()["executions"] - before == 2  # the raised step's, then its own
    assert type(executor.current()) is executor.Strict
    for p, q in zip(params, _params("cpu")):
        torch.testing.assert_close(p.detach().cpu(), q.detach() - 0.2)


def test_debug_mode_steps_op_by_op():
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        _, counts = _train("tpu", 1)
    assert counts[0][0] >= 6, counts


class _Subclassed(torch.optim.SGD):
    def step(self, closure=None):
        with torch.no_grad():
            for q in self.param_groups[0]["params"]:
                q.grad.mul_(0.5)
        return super().step(closure)


def test_a_subclass_step_calling_its_base_step_is_one_region():
    """Once a plain SGD exists, PyTorch has wrapped SGD.step with the global step hooks too: a
    subclass's step that calls super().step() runs them nested. One region, one program (the
    inner hooks closed and reopened it: 2 programs where 1, seen after test_eager_threads)."""
    torch.optim.SGD(_params("tpu"), lr=0.1)  # wraps SGD.step as well
    got, counts = _train("tpu", 2, _Subclassed, momentum=0.9)
    _assert_same(got, _train("cpu", 2, _Subclassed, momentum=0.9)[0])
    assert all(n == 1 for n, _ in counts), counts
