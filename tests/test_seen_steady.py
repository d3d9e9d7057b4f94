"""A remembered call's stages it skips (``eager/calls.run_seen``), each while the fact it
stands on holds: the size-bucket hook's steady answer (``HOOKS.growing`` answered ``STEADY``
at the hook's current epoch, by the same hook; or ``AUTOGRAD``, by the same hook, while
autograd's engine runs the call), and the executor's general run for a call
that launches its program and settles the kept casts it reads. Values equal CPU's."""

import pytest
import torch

from torchtpu.compile import call_sites, eager_buckets
from torchtpu.device.hooks import AUTOGRAD, HOOKS, STEADY
from torchtpu.eager import executor
from torchtpu.eager.lazy_casts import Converted


@pytest.fixture
def asked(monkeypatch):
    """The size-bucket hook on, behind a spy: how many calls asked it, and what it said."""
    torch.zeros(1, device="tpu")  # the device loaded (which sets the hook) first
    # No structure growing from earlier tests (sizes are abstracted out of a structure: an
    # earlier test's sums of any 2-d size count), and none left growing for later ones.
    call_sites.clear()
    eager_buckets._exact.clear()
    was = eager_buckets.enabled()
    eager_buckets.set_enabled(True)
    answers: list = []
    monkeypatch.setattr(HOOKS, "growing", _spy(answers))
    yield answers
    eager_buckets.set_enabled(was)
    call_sites.clear()


def _sums(x):
    return x.sum(0)  # one call site: its sizes are the family the hook watches


def test_a_steady_call_asks_the_hook_once_an_epoch(asked):
    a = torch.randn(6, 4)
    x = a.to("tpu")
    for _ in range(5):
        torch.testing.assert_close(_sums(x).cpu(), a.sum(0))
    # the full path's call (remembered exact), the first repeat (STEADY), then none
    assert asked[-1] is STEADY and len(asked) == 2
    HOOKS.growing_epoch += 1  # what the hook answers from changed: it is asked again, once
    for _ in range(3):
        torch.testing.assert_close(_sums(x).cpu(), a.sum(0))
    assert len(asked) == 3 and asked[-1] is STEADY


def test_another_hook_is_asked(asked, monkeypatch):
    x = torch.randn(6, 4, device="tpu")
    for _ in range(3):
        _sums(x)
    told = []

    def other(*args):
        told.append(args)
        return None

    monkeypatch.setattr(HOOKS, "growing", other)
    _sums(x)
    assert len(told) == 1


def test_a_site_that_grows_asks_again_for_its_steady_size(asked):
    """Sizes that start to vary at the call's site (a structure growing) move the epoch: the
    steady call of the first size is asked again, and its value is CPU's."""
    a = torch.randn(40, 4)
    first = a[:8].to("tpu")
    for _ in range(3):
        _sums(first)
    steady = len(asked)
    for n in range(9, 9 + call_sites.VARYING_VALUES + 1):  # new sizes: each asks, and varies
        torch.testing.assert_close(_sums(a[:n].to("tpu")).cpu(), a[:n].sum(0))
    grown = len(asked)
    assert grown == steady + call_sites.VARYING_VALUES + 1
    torch.testing.assert_close(_sums(first).cpu(), a[:8].sum(0))
    assert len(asked) == grown + 1 and asked[-1] is not STEADY  # routed as its site grows


def test_cleared_families_are_asked_again(asked):
    x = torch.randn(5, 3, device="tpu")
    for _ in range(3):
        _sums(x)
    call_sites.clear()
    eager_buckets._exact.clear()
    _sums(x)
    assert any(spec.shape == (3,) for spec, _ in eager_buckets._exact.values())


def _spy(answers: list):
    def spy(*args):
        out = eager_buckets.run(*args)
        answers.append(out)
        return out
    return spy


class _SumsInBackward(torch.autograd.Function):
    """Identity forward; its backward calls ``_sums`` of the incoming gradient (run by
    autograd's engine), the same signature as a forward ``_sums`` of a tensor of x's shape."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g + _sums(g)


def test_backward_calls_ask_the_hook_once_and_forward_calls_still_ask(asked, monkeypatch):
    """A remembered call that autograd's engine runs asks the hook once (``AUTOGRAD``), then
    not while autograd runs it; another hook is asked; a forward call of the same signature
    asks. Gradients as CPU's."""
    a, g = torch.randn(6, 4), torch.randn(6, 4)
    x, gy = a.to("tpu").requires_grad_(), g.to("tpu")

    def backward():
        x.grad = None
        _SumsInBackward.apply(x).backward(gy)
        torch.testing.assert_close(x.grad.cpu(), g + g.sum(0))

    backward()
    backward()  # the full path's calls, then their first repeats: each asked
    assert asked[-2:] == [AUTOGRAD, AUTOGRAD]  # the gradient's sum and the sum added to it
    first = len(asked)
    for _ in range(3):
        backward()
    assert len(asked) == first  # not asked again while autograd runs them
    torch.testing.assert_close(_sums(gy).cpu(), g.sum(0))  # the forward call of that signature
    assert len(asked) == first + 1 and asked[-1] is not AUTOGRAD
    told = []

    def other(*args):
        told.append(args)
        return None

    monkeypatch.setattr(HOOKS, "growing", other)
    backward()
    assert told  # another hook is asked


def test_a_product_over_kept_casts_launches_and_settles_them(monkeypatch):
    """A remembered product reading two lazy casts (autocast's, before a product) runs its
    program directly, not through the executor's general run, and settles both casts: their
    values are its program's after it; values as CPU's."""
    a, w = torch.randn(4, 8), torch.randn(8, 3)
    x, v = a.to("tpu"), w.to("tpu")
    general = []
    run = executor.Strict.run

    def spy(self, *args):
        general.append(args)
        return run(self, *args)

    for i in range(4):
        if i == 3:
            monkeypatch.setattr(executor.Strict, "run", spy)
        xb, vb = x.to(torch.bfloat16), v.to(torch.bfloat16)
        casts = [t.untyped_storage()._tpu_array for t in (xb, vb)]
        assert all(type(c) is Converted and c._value is None for c in casts)
        out = xb @ vb
        assert all(c._value is not None and c.source is None for c in casts)  # settled
        for got, want in ((out, a.bfloat16() @ w.bfloat16()), (xb, a.bfloat16()),
                          (vb, w.bfloat16())):
            assert torch.equal(got.cpu(), want)
    assert not general


def test_a_remembered_pointwise_call_is_held_directly_unless_lazy_ops_are_off(monkeypatch):
    """A remembered pointwise call of two tensors is held without the executor's general run;
    with Strict's held calls switched off (at any time) the same remembered call launches.
    Values as CPU's."""
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    x, y = a.to("tpu"), b.to("tpu")
    general = []
    run = executor.Strict.run

    def spy(self, *args):
        general.append(args)
        return run(self, *args)

    for _ in range(3):
        z = x * y
    monkeypatch.setattr(executor.Strict, "run", spy)
    z = x * y
    assert type(z.untyped_storage()._tpu_array) is Converted and not general
    torch.testing.assert_close((z.sum()).cpu(), (a * b).sum())
    monkeypatch.setattr(executor.Strict, "lazy_ops", False)
    z = x * y
    assert type(z.untyped_storage()._tpu_array) is not Converted  # launched
    torch.testing.assert_close(z.cpu(), a * b)
