"""3-d grid sampling, fractional max pooling (2-d and 3-d) and RReLU against CPU, forward and
backward (found missing by PyTorch's own test_nn device tests)."""

import math

import pytest
import torch
import torch.nn.functional as F

from torchtpu.testing.compare import assert_same, to_device

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _fwd_bwd(fn, *args):
    """fn's result and its inputs' gradients (those requiring grad) under a weighted sum."""
    out = fn(*args)
    values = out if isinstance(out, tuple) else (out,)
    weight = torch.linspace(-1, 2, values[0].numel()).reshape(values[0].shape)
    loss = (values[0] * weight.to(values[0].device)).sum()
    grads = torch.autograd.grad(loss, [a for a in args if a.requires_grad])
    return values, grads


def _check(fn, *args):
    expected = _fwd_bwd(fn, *args)
    actual = _fwd_bwd(fn, *to_device(args))
    assert_same(actual, expected, **TOL)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_grid_sample_3d(mode, padding):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5, 6, requires_grad=True)
    # Out of [-1, 1] in places, so every padding mode has work; (D, H, W) = (3, 4, 2) outputs
    # of unequal sizes catch a swapped axis.
    grid = (torch.rand(2, 3, 4, 2, 3) * 2.6 - 1.3).requires_grad_(mode == "bilinear")
    for align in (False, True):
        _check(lambda a, g, c=align: F.grid_sample(a, g, mode=mode, padding_mode=padding,
                                                   align_corners=c), x, grid)


def _samples(n, c, nd, seed=0):
    return torch.rand(n, c, nd, generator=torch.Generator().manual_seed(seed), dtype=torch.double)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fractional_max_pool2d(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 11, dtype=dtype, requires_grad=True)
    s = _samples(2, 3, 2).to(dtype)
    # Unequal kernel and output sizes per axis catch which sample drives which axis.
    for kernel, out in [((2, 3), (5, 4)), ((3, 2), (1, 6)), ((2, 2), (8, 10))]:
        _check(lambda a, r, k=kernel, o=out: F.fractional_max_pool2d(
            a, k, output_size=o, return_indices=True, _random_samples=r), x, s)
    unbatched = torch.randn(3, 7, 6, dtype=dtype, requires_grad=True)
    _check(lambda a, r: F.fractional_max_pool2d(a, 2, output_size=(4, 3), return_indices=True,
                                                _random_samples=r), unbatched, s[:1])


def test_fractional_max_pool3d():
    torch.manual_seed(0)
    x = torch.randn(2, 2, 7, 8, 9, requires_grad=True)
    s = _samples(2, 2, 3, seed=1).float()
    for kernel, out in [((2, 3, 2), (4, 3, 5)), ((1, 2, 3), (6, 1, 4))]:
        _check(lambda a, r, k=kernel, o=out: F.fractional_max_pool3d(
            a, k, output_size=o, return_indices=True, _random_samples=r), x, s)
    unbatched = x[0].detach().clone().requires_grad_()
    _check(lambda a, r: F.fractional_max_pool3d(a, 2, output_size=3, return_indices=True,
                                                _random_samples=r), unbatched, s[:1])


def test_fractional_max_pool_ties_and_nan_pick_cpu_positions():
    x = torch.zeros(1, 1, 6, 6)
    x[0, 0, 1, 1] = x[0, 0, 2, 2] = math.nan
    s = torch.full((1, 1, 2), 0.3)
    expected = F.fractional_max_pool2d(x, 3, output_size=2, return_indices=True,
                                       _random_samples=s)
    actual = F.fractional_max_pool2d(x.to("tpu"), 3, output_size=2, return_indices=True,
                                     _random_samples=s.to("tpu"))
    assert_same(actual, expected)  # NaN equals NaN here


def test_rrelu_eval_and_in_place_match_cpu():
    x = torch.randn(4, 5, requires_grad=True)
    _check(lambda a: F.rrelu(a, 0.1, 0.3, training=False), x)
    y = torch.randn(4, 5)
    expected = F.rrelu(y.clone(), training=False, inplace=True)
    assert_same(F.rrelu(y.to("tpu"), training=False, inplace=True), expected)


def test_rrelu_training_draws_slopes_and_backward_reads_them():
    torch.manual_seed(0)
    x = torch.randn(64, 33)
    xd = x.to("tpu").requires_grad_()
    noise = torch.empty_like(xd)
    lower, upper = 0.1, 0.3
    out = torch.ops.aten.rrelu_with_noise(xd, noise, lower, upper, True)
    (grad,) = torch.autograd.grad(out, xd, torch.ones_like(out))
    slopes = noise.cpu()
    negative = x <= 0
    # noise records the slopes: 1 where x > 0, in [lower, upper] elsewhere, and not constant.
    assert torch.equal(slopes[~negative], torch.ones(int((~negative).sum())))
    drawn = slopes[negative]
    assert drawn.min() >= lower and drawn.max() <= upper and drawn.std() > 0.03
    assert_same(out, x * slopes)
    # The gradient is CPU's backward formula on the recorded noise.
    expected = torch.ops.aten.rrelu_with_noise_backward(torch.ones_like(x), x, slopes, lower,
                                                        upper, True, False)
    assert_same(grad, expected)
    # F.rrelu in training (and its in-place form) is the same op through a fresh noise tensor.
    for inplace in (False, True):
        y = F.rrelu(x.to("tpu"), lower, upper, training=True, inplace=inplace).cpu()
        ratio = y[negative & (x < -0.1)] / x[negative & (x < -0.1)]
        assert ratio.min() >= lower - 1e-6 and ratio.max() <= upper + 1e-6
        assert torch.equal(y[~negative], x[~negative])
