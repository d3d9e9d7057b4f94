"""DeferAndFuse's laid-out results (``results._laid_deferred``): a result CPU lays out in
another order than row-major (SDPA's output in its query's order and its gradients in their
inputs', a channels-last convolution's) is the recorded value transposed to memory order by one
recorded call, with CPU's strides and values; a value that is not its storage's whole takes the
dispatched copy as before."""

import pytest
import torch
import torch.nn.functional as F

from torchtpu.device import tensors

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


@pytest.fixture
def orders(monkeypatch):
    """The memory orders ``tensors.in_order`` was called with."""
    seen = []
    real = tensors.in_order

    def counted(value, order):
        seen.append(tuple(order))
        return real(value, order)

    monkeypatch.setattr(tensors, "in_order", counted)
    return seen


def _heads(x):  # (b, t, h, d) -> (b, h, t, d): a transposed view, as a Llama's q, k and v
    return x.transpose(1, 2)


def test_sdpa_output_and_gradients_keep_cpus_strides_and_values(orders):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 3, 16) for _ in range(3))
    g = torch.randn(2, 3, 8, 16)
    cpu = [x.clone().requires_grad_() for x in (q, k, v)]
    dev = [x.to("tpu").requires_grad_() for x in (q, k, v)]

    def run(xs, grad):
        views = [_heads(x) for x in xs]
        for view in views:
            view.retain_grad()
        out = F.scaled_dot_product_attention(*views, is_causal=True)
        out.backward(grad)
        return out, views

    out, views = run(cpu, g)
    with torch.tpu.set_eager_mode(DEFER):
        dout, dviews = run(dev, g.to("tpu"))
        # The output and dq, dk, dv, each by one recorded transpose: (b, t, h, d)'s order.
        assert orders == [(0, 2, 1, 3)] * 4
        assert dout.stride() == out.stride()
        assert [d.grad.stride() for d in dviews] == [c.grad.stride() for c in views]
    torch.testing.assert_close(dout.cpu(), out, rtol=1e-4, atol=1e-4)
    for d, c in zip(dviews, views):
        torch.testing.assert_close(d.grad.cpu(), c.grad, rtol=1e-4, atol=1e-4)
    for d, c in zip(dev, cpu):
        torch.testing.assert_close(d.grad.cpu(), c.grad, rtol=1e-4, atol=1e-4)


def test_a_channels_last_convolution_keeps_cpus_layout(orders):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 6).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3)
    out = F.conv2d(x, w, padding=1)
    with torch.tpu.set_eager_mode(DEFER):
        dout = F.conv2d(x.to("tpu"), w.to("tpu"), padding=1)
        assert dout.stride() == out.stride()
        laid = len(orders)
    torch.testing.assert_close(dout.cpu(), out, rtol=1e-4, atol=1e-4)
    assert laid == 1 and orders[0] == (0, 2, 3, 1)


def test_a_result_that_is_not_its_storage_whole_takes_the_copy(orders):
    """A view's value is not its storage's (an offset, another shape over the same bytes):
    ``lay_out`` copies it through the dispatched calls, with CPU's values."""
    from torchtpu.eager import results

    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    strides = base.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2).stride()
    with torch.tpu.set_eager_mode(DEFER):
        part = base.to("tpu")[1:]  # an offset view of a pending storage
        laid = results.lay_out(part * 1, strides)  # a fresh value: laid out in one call
        sliced = results.lay_out(part, strides)  # not its storage's whole: copied
        flat = base.flatten().to("tpu") * 1  # a (120,) value read as (2, 3, 4, 5)
        reshaped = results.lay_out(flat.view(2, 3, 4, 5), strides)
        assert len(orders) == 1
        assert laid.stride() == sliced.stride() == reshaped.stride() == strides
    torch.testing.assert_close(laid.cpu(), base[1:])
    torch.testing.assert_close(sliced.cpu(), base[1:])
    torch.testing.assert_close(reshaped.cpu(), base)
