"""Strict's remembered results (``results.wrapper``): a repeated call's result tensors made by a
maker found once for its description, as the full path makes them: a result in memory order
(``Stored``: a pointwise op over transposed operands) by one ``set_`` of its strides, a float
result laid out otherwise (SDPA's output and gradients in their inputs' order) read through
its permutation, a tuple of results with Nones and numbers (SDPA's forward) a part each.
Values, strides and storage sizes as CPU's; the full path's makers not called on repeats."""

import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

from torchtpu.device import tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import results


def _spy(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_a_result_in_memory_order_repeats_as_cpu_lays_it(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, 4, generator=g), torch.randn(5, 3, 4, generator=g)
    x, y = a.to("tpu").permute(2, 0, 1), b.to("tpu").permute(2, 0, 1)
    want = a.permute(2, 0, 1) + b.permute(2, 0, 1) * 2.0
    made = _spy(monkeypatch, tensors, "new_tensor")
    for round in range(4):
        del made[:]
        got = x + y * 2.0
        assert got.stride() == want.stride() == (1, 12, 4)
        assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()
        assert tuple(tensors.stored_array(got.untyped_storage()).shape) == (5, 3, 4)
        torch.testing.assert_close(got.cpu(), want)
        if round >= 2:  # remembered: made by one set_ of its strides, not new_tensor's steps
            assert made == [], round
    # A view of it reads the stored array through its strides, as CPU's does.
    torch.testing.assert_close(got[1:3, :, 2].cpu(), want[1:3, :, 2])


def _attention(device: str, q, k, v) -> list:
    leaves = [t.to(device).detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    (out * out).sum().backward()
    return [out, *(x.grad for x in leaves)]


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy_casts", "no_lazy_casts"])
def test_attention_results_repeat_in_their_inputs_layout(lazy, monkeypatch):
    """SDPA's output and gradients (the heads' transposed projections' layout) repeat as CPU
    lays them out; with Strict's lazy casts on, without ``lay_out``'s steps once remembered;
    with them off, through ``lay_out`` (its copy) as the full path does."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 2, 16, generator=g).transpose(1, 2) for _ in range(3))
    want = _attention("cpu", q, k, v)
    laid = _spy(monkeypatch, results, "lay_out")
    if not lazy:
        monkeypatch.setattr(HOOKS, "lazy_cast", None)
    for round in range(4):
        del laid[:]
        got = _attention("tpu", q, k, v)
        for t, w in zip(got, want):
            assert t.stride() == w.stride(), round
            torch.testing.assert_close(t.cpu(), w, rtol=1e-4, atol=1e-5)
        if round >= 2:
            # (out, dq, dk, dv: four laid-out results a step)
            assert laid == ([] if lazy else ["lay_out"] * 4), (round, laid)


def test_a_cast_of_a_leading_part_of_a_storage_reads_that_part():
    """A contiguous tensor at its storage's start that is not all of it (``big[:4]``) is cast
    from its own elements (the lazy cast's size check), values as CPU's."""
    a = torch.randn(6, 5)
    big = a.to("tpu")
    for _ in range(3):
        part = big[:2]
        got = part.to(torch.bfloat16) * 2
        torch.testing.assert_close(got.cpu(), a[:2].to(torch.bfloat16) * 2)
        torch.testing.assert_close(part.double().cpu(), a[:2].double())


def test_a_result_of_another_shape_than_described_is_refused():
    """A program's result array of another shape than its meta description is refused where the
    first call wraps it: a repeat makes its tensor in the described shape (``results.wrapper``),
    which that array could not fill."""
    array = jnp.zeros(4, jnp.int64)  # bag sizes, one per bag, where meta has one per offset
    with pytest.raises(RuntimeError, match=r"aten\._embedding_bag\.default's tpu lowering "
                       r"returned a result of shape \[4\] where PyTorch's meta kernel says \[5\]"):
        results.wrapped((array,), (((5,), torch.int64),), torch.ops.aten._embedding_bag.default)
    assert results.wrapped((array,), (((4,), torch.int64),))[0].shape == (4,)
