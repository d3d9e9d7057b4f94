"""Strict runs an optimizer step over tpu parameters as one program (compile/optimizer_steps.py):
values as CPU's, one execution a step, no compile once steady (a changing lr included)."""

import math

import pytest
import torch

from torchtpu import metrics
from torchtpu.compile import optimizer_steps
from torchtpu.eager import executor
from torchtpu.testing.step_census import census

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


def _clipped(device: str, steps: int, read_norm: bool = False) -> tuple:
    """AdamW steps after clip_grad_norm_ (a parameter generator, as a loop passes it): (params
    and the clip's norm after each step, launches of each steady clip-and-step)."""
    params = _params(device)
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    values, launches = [], []
    for _ in range(steps):
        for p in params:
            p.grad = (3 * torch.randn(p.shape, generator=g)).to(device)
        with census(dots=False) as c:
            norm = torch.nn.utils.clip_grad_norm_((p for p in params), 1.0)
            read = norm.item() if read_norm else None
            opt.step()
        launches.append(c.launch_count)
        opt.zero_grad(set_to_none=True)
        values.append([p.detach().cpu().clone() for p in params] + [norm.cpu()])
        assert read is None or read == pytest.approx(float(norm))
    return values, launches


def test_a_clip_and_the_step_after_it_are_one_program_as_cpu():
    """clip_grad_norm_ opens the step's region: its norms, their norm and the gradients'
    multiply run in AdamW's program (four programs, each a pass over the gradients, before)."""
    want, _ = _clipped("cpu", 3)
    got, launches = _clipped("tpu", 3)
    _assert_same(got, want)
    assert launches[1:] == [1, 1], launches
    assert type(executor.current()) is executor.Strict
    # The norm read between the clip and the step (a logging .item()): the clip runs at the read.
    got, launches = _clipped("tpu", 3, read_norm=True)
    _assert_same(got, want)
    assert launches[1:] == [2, 2], launches


def test_a_clip_whose_step_never_comes_ends_its_region():
    """A clip to log the norm, with no optimizer step after it: the region runs what the clip
    recorded at the next clip, or after CLIP_SLACK op calls; the loop stays Strict's."""
    params = _params("tpu")
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert isinstance(executor.current(), optimizer_steps.StepRegion)
    again = torch.nn.utils.clip_grad_norm_(params, 1.0)  # the first region ran at this call
    x = torch.ones(3, device="tpu")
    for _ in range(optimizer_steps.CLIP_SLACK + 1):
        x = x + 1
    assert type(executor.current()) is executor.Strict
    n = sum(math.prod(s) for s in SHAPES)
    torch.testing.assert_close(norm.cpu(), torch.tensor(2.0 * n ** 0.5))
    torch.testing.assert_close(again.cpu(), torch.tensor(1.0), rtol=1e-5, atol=1e-5)
    for p in params:
        torch.testing.assert_close(p.grad.cpu(), torch.full(p.shape, 1 / n ** 0.5),
                                   rtol=1e-5, atol=1e-5)
    assert float(x[0]) == optimizer_steps.CLIP_SLACK + 2
