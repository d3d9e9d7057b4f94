"""Compiled graphs donate the old arrays of the inputs they overwrite, and only those nobody else
can see again: never a view's storage, an array passed twice, or one something else still holds.
Each case against CPU eager.
"""

import numpy as np
import pytest
import torch

import torchtpu
from torchtpu.compile import donation
from torchtpu.testing.compare import assert_same

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _compiled(fn):
    return torch.compile(fn, backend="tpu", fullgraph=True)


def _donated() -> int:
    return torchtpu.metrics.snapshot().get("compiled_donated_inputs", 0)


def _buffer(t: torch.Tensor) -> int:
    # The address only: holding the array itself would keep it from being donated.
    return t.untyped_storage()._tpu_array.unsafe_buffer_pointer()


def test_optimizer_step_updates_parameters_and_state_in_place():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x = torch.randn(4, 5)
    dev_model = torch.nn.Linear(5, 3).to("tpu")
    dev_model.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)
            for m in (model, dev_model)]

    def train(m, opt, x):
        m(x).square().sum().backward()
        opt.step()
        opt.zero_grad()

    # Dynamo's graphs (backward() breaks the graph), not the whole step as one captured program.
    step = torch.compile(train, backend="tpu", options={"whole_step": False})
    # The first step creates the optimizer state.
    train(model, opts[0], x)
    step(dev_model, opts[1], x.to("tpu"))
    for _ in range(2):
        train(model, opts[0], x)
        params = list(dev_model.parameters())
        state = [opts[1].state[p][k] for p in params if p in opts[1].state
                 for k in ("exp_avg", "exp_avg_sq")]
        before, count = [_buffer(t) for t in params + state], _donated()
        step(dev_model, opts[1], x.to("tpu"))
        # Each parameter and moment was donated and XLA wrote its new value over the old one.
        assert _donated() - count >= len(params) + len(state)
        # XLA pairs donated buffers with outputs of the same shape: the new values live in the
        # old buffers, not necessarily each in its own.
        assert sorted(_buffer(t) for t in params + state) == sorted(before)
    assert_same(list(dev_model.parameters()), list(model.parameters()))
    assert_same(opts[1].state[dev_model.weight]["exp_avg_sq"],
                opts[0].state[model.weight]["exp_avg_sq"])


def test_a_view_input_is_not_donated():
    def f(part):
        part.mul_(2)

    base = torch.randn(5, 3)
    dev_base = base.to("tpu")
    count = _donated()
    _compiled(f)(dev_base[1:3])
    f(base[1:3])
    assert _donated() == count
    assert_same(dev_base, base)  # rows outside the view keep their values


def test_an_array_passed_twice_is_not_donated():
    # Through torch.compile, aliased inputs that are mutated reach the graph as one input (Dynamo
    # and AOTAutograd merge them), so the guard is checked where the graph reads its inputs.
    w = torch.randn(3).to("tpu")
    assert donation.mutated([w.untyped_storage()._tpu_array], [(0, 0)], [w]) == (0,)
    assert donation.mutated([w.untyped_storage()._tpu_array] * 2, [(0, 0)], [w, w]) == ()


def test_one_tensor_passed_as_two_mutated_arguments():
    def f(a, b):
        a.add_(1)
        return b * 2

    x = torch.randn(4)
    dev_x = x.to("tpu")
    out = _compiled(f)(dev_x, dev_x)
    expected = f(x, x)
    assert_same((out, dev_x), (expected, x))


def test_an_array_held_elsewhere_is_not_donated():
    def f(w):
        w.sub_(0.5)

    w = torch.randn(3, 2)
    dev_w = w.to("tpu")
    old = dev_w.untyped_storage()._tpu_array
    count = _donated()
    _compiled(f)(dev_w)
    assert _donated() == count
    assert not old.is_deleted()
    assert_same(torch.from_numpy(np.array(old)), w)
    f(w)
    assert_same(dev_w, w)


def test_pending_inputs_under_defer_and_fuse_are_materialized_not_lost():
    def f(w, g):
        w.add_(g)
        return w * 3

    w, g = torch.randn(4), torch.randn(4)
    dev_w, dev_g = w.to("tpu"), g.to("tpu")
    step = _compiled(f)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        for _ in range(2):
            dev_w.mul_(0.5)  # pending when the compiled graph reads it
            w.mul_(0.5)
            out = step(dev_w, dev_g)
            expected = f(w, g)
    assert_same((out, dev_w), (expected, w))
