"""Strict's lazy pointwise calls (``lazy_casts.lazy_op``): a pointwise op of one tensor computed
inside the program of the op that reads it, one launch less, every reader seeing the value as
CPU computes it."""

import pytest
import torch

from torchtpu.eager import executor, lazy_casts
from torchtpu.testing.llama import LlamaConfig, seeded_step
from torchtpu.testing.step_census import census

CONFIG = LlamaConfig(vocab=128, dim=32, layers=2, heads=2, hidden=64, seq=16)


def _lazy(t: torch.Tensor) -> bool:
    held = t.untyped_storage()._tpu_array
    return type(held) is lazy_casts.Converted and held.source is not None


@pytest.fixture
def lazy_ops_off():
    def turn(on: bool) -> None:
        executor.Strict.lazy_ops = on

    yield turn
    executor.Strict.lazy_ops = True


def test_a_norms_chain_runs_in_its_reduction_as_cpu(lazy_ops_off):
    x = torch.randn(4, 6, 32)
    d = x.to("tpu")
    norm = lambda v: torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)  # noqa: E731
    norm(d).cpu()  # compiled once
    with census(dots=False) as c:
        squares = d.pow(2)
        got = norm(d)
        assert _lazy(squares)
        got = got.cpu()
    # pow held for mean, rsqrt held until read: mean, the add of the traced eps, the read
    assert c.launch_count == 3, c.launches
    lazy_ops_off(False)
    # What each op launched gives, but for the order a reduction fused with its producer sums
    # in (an ulp)
    torch.testing.assert_close(got, norm(d).cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got, norm(x))


READS = {
    "cpu": lambda y: y.cpu(),
    "a view": lambda y: (y[1:3] * 2).cpu(),
    "a transposed product": lambda y: (y.t() @ y).cpu(),
    "twice in one program": lambda y: (y * y).cpu(),
    "in a list": lambda y: torch._foreach_norm([y, y[0]])[1].cpu(),
    "written in place": lambda y: y.mul_(3).cpu(),
    "negated in place": lambda y: y.neg_().cpu(),
    "a row negated in place": lambda y: (y[1].neg_(), y.cpu())[1],
    "a view written": lambda y: (y[0].fill_(7.0), y.cpu())[1],
    "copied into": lambda y: torch.zeros(4, 4, device="tpu").copy_(y).cpu(),
    "copied from": lambda y: y.copy_(torch.ones(4, 4)).cpu(),
    "item": lambda y: torch.tensor(y[1, 2].item()),
}


@pytest.mark.parametrize("name", READS)
def test_every_reader_of_a_held_call_sees_it_as_cpu(name):
    x = torch.randn(4, 4)
    y = torch.sigmoid(x.to("tpu"))
    assert _lazy(y)
    torch.testing.assert_close(READS[name](y), READS[name](torch.sigmoid(x)))


def test_a_call_repeated_over_other_held_calls_reads_each_as_its_own():
    # The short path (``seen_calls``) repeats a call's reads: a held call of another op, the
    # same shape and dtype, is another read.
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    d, e = x.to("tpu"), w.to("tpu")
    for _ in range(3):
        for f in (torch.neg, torch.sigmoid, torch.neg, torch.exp):
            y = f(d)
            assert _lazy(y)
            assert torch.equal((y + e).cpu(), f(x) + w), f


def test_its_source_written_afterwards_leaves_the_value_as_it_was():
    x = torch.randn(4, 4)
    d = x.to("tpu")
    y = d.neg()
    d[1].fill_(5)   # a view write: the lent source is not given away
    d.add_(1)       # in place, whole
    assert _lazy(y)
    assert torch.equal(y.cpu(), -x)


def test_an_in_place_call_writes_its_value():
    x = torch.randn(4, 4)
    d = x.to("tpu")
    d[1].neg_()     # through a view: the write needs the value
    d[:, 2].sigmoid_()
    d.mul_(2)       # whole
    x[1].neg_()
    x[:, 2].sigmoid_()
    assert torch.equal(d.cpu(), x * 2)


def test_a_call_smaller_than_its_source_is_settled_by_its_first_reader():
    # The rotary half's negation reads a slice of a larger array: kept, so the array is let go
    # once the concatenation has read it.
    x = torch.randn(2, 8)
    d = x.to("tpu")
    turned = -d[..., 4:]
    assert _lazy(turned) and turned.untyped_storage()._tpu_array.keep
    got = torch.cat((turned, d[..., :4]), dim=-1)
    assert not _lazy(turned) and not lazy_casts._kept
    assert torch.equal(got.cpu(), torch.cat((-x[..., 4:], x[..., :4]), dim=-1))
    assert torch.equal(turned.cpu(), -x[..., 4:])


def test_what_is_not_held():
    d = torch.randn(3, 1, device="tpu")
    assert not _lazy(d.expand(3, 1000) * 2)  # larger than its source: runs where it is asked
    assert not _lazy(d + d)                   # two tensors
    assert not _lazy(d * 0.3)                 # a traced number
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert not _lazy(d * 2)               # Debug checks each op's result
    y = d * 2
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        assert not _lazy(y)                   # computed when Strict stops being the executor
        assert torch.equal((y + 1).cpu(), d.cpu() * 2 + 1)


def _losses(device: str, steps: int = 3):
    model, step, x, y = seeded_step(CONFIG, device)
    losses = [step(x, y).item() for _ in range(steps)]
    with census(dots=False) as c:
        step(x, y)
    return losses, [p.detach().cpu() for p in model.parameters()], c.launch_count


def test_an_autocast_llama_step_computes_as_before_with_fewer_launches(lazy_ops_off):
    losses, params, launches = _losses("tpu")
    lazy_ops_off(False)
    each, each_params, each_launches = _losses("tpu")
    # Within an ulp or so: a reduction fused with its producer sums in another order.
    torch.testing.assert_close(losses, each, rtol=1e-6, atol=0)
    for p, q in zip(params, each_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # Per layer: the norms' squares, rsqrt and the backward's multiplies by numbers, the
    # rotary negations, silu and its backward's sigmoid (see bench/RESULTS.md, strict4).
    assert each_launches - launches == 15 * CONFIG.layers + 6, (each_launches, launches)
    cpu, _, _ = _losses("cpu")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu), atol=2e-3, rtol=2e-3)
