"""The per-call paths of a compiled graph: reading inputs, writing mutations back, wrapping outputs.

Graph inputs that are their storage's whole array take a short path; views, reinterpreted
dtypes, CPU scalars and shared arrays take the general one. Each case against CPU eager.
"""

import pytest
import torch

from torchtpu.testing.compare import assert_same

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _compiled(fn):
    return torch.compile(fn, backend="tpu", fullgraph=True)


def test_inputs_that_are_views_read_their_own_values():
    def f(a, b, c, d):
        return a * 2 + b, c.float() + d.sum()

    base = torch.randn(6, 8)
    args = (base.t()[:4, :5],  # transposed: not contiguous
            base[1:5, 2:7],  # offset into a larger storage
            torch.arange(20, dtype=torch.int32).reshape(4, 5),
            base)  # the whole storage
    expected = f(*args)
    dev_base = base.to("tpu")
    dev_args = (dev_base.t()[:4, :5], dev_base[1:5, 2:7], args[2].to("tpu"), dev_base)
    assert_same(_compiled(f)(*dev_args), expected)


def test_input_read_through_a_reinterpreting_view():
    def f(bits):
        return bits + 1

    x = torch.randn(3, 4)
    dev = x.to("tpu")
    # Same storage, same shape, other dtype: the storage's array is not the tensor's value.
    assert_same(_compiled(f)(dev.view(torch.int32)), f(x.view(torch.int32)))


def test_mutations_write_back_to_whole_tensors_views_and_cpu_scalars():
    def f(w, part, step):
        step += 1
        w.mul_(step)
        part.add_(w[:2])

    w, base, step = torch.randn(4, 3), torch.randn(5, 3), torch.tensor(1.0)
    dev_w, dev_base, dev_step = w.to("tpu"), base.to("tpu"), step.clone()
    g = _compiled(f)
    for _ in range(2):
        f(w, base[1:3], step)
        g(dev_w, dev_base[1:3], dev_step)
    assert_same(dev_w, w)
    assert_same(dev_base, base)  # rows outside the view keep their values
    assert dev_step.device.type == "cpu"
    assert_same(dev_step, step)


def test_a_mutation_taking_an_input_value_gets_its_own_storage():
    def f(a, b):
        b.copy_(a)
        return a.sin()

    a, b = torch.randn(4), torch.zeros(4)
    dev_a, dev_b = a.to("tpu"), b.to("tpu")
    out = _compiled(f)(dev_a, dev_b)
    expected = f(a, b)
    dev_a.add_(1)  # must not show through b, whatever array the program handed back
    a.add_(1)
    assert_same((out, dev_a, dev_b), (expected, a, b))


def test_outputs_of_one_value_own_separate_storages():
    def f(x):
        y = x * 3
        return y, y.view(-1), y + 0

    x = torch.randn(2, 3)
    outs = _compiled(f)(x.to("tpu"))
    assert_same(outs, f(x))
    outs[2].zero_()
    assert_same(outs[0], x * 3)


def test_inputs_saved_for_backward_are_handed_back_not_copied(monkeypatch):
    from torchtpu.compile import backend

    graphs = []
    original = backend.CompiledGraph.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        graphs.append(self)

    monkeypatch.setattr(backend.CompiledGraph, "__init__", spy)

    def f(w, x):
        return (x @ w).tanh().sum()

    w, x = torch.randn(3, 2, requires_grad=True), torch.randn(4, 3)
    dev_w = w.detach().to("tpu").requires_grad_()
    loss = torch.compile(f, backend="tpu")(dev_w, x.to("tpu"))
    loss.backward()
    f(w, x).backward()
    assert_same(dev_w.grad, w.grad)
    forward = next(g for g in graphs if g.kind == "forward")
    assert forward.forwarded  # x (and w) saved for backward: outputs the program does not copy
