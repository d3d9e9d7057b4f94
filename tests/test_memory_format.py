"""Channels-last results as CPU gives them: an op whose CPU kernel writes a channels-last result
(an elementwise op, batch norm or pooling of a channels-last input; a convolution whose input
or weight is channels-last, and each gradient in the layout of its operand) gives one on tpu,
with the same values. PyTorch's test_modules checks this layout for every module
(``test_memory_format``); torchvision-style code calls ``.view`` only where CPU can.
"""

import pytest
import torch
import torch.nn.functional as F

from torchtpu.testing.compare import assert_same

CL, CL3 = torch.channels_last, torch.channels_last_3d


def _layout(t: torch.Tensor) -> str:
    fmt = CL if t.dim() == 4 else CL3
    if t.is_contiguous():
        return "contiguous"
    return "channels_last" if t.is_contiguous(memory_format=fmt) else str(t.stride())


OPS = {
    "relu": torch.relu,
    "add": lambda t: t * 2 + 1,
    "batch_norm": lambda t: F.batch_norm(t, None, None, training=True),
    "adaptive_max_pool": lambda t: F.adaptive_max_pool2d(t, 3),
    "adaptive_avg_pool": lambda t: F.adaptive_avg_pool2d(t, 3),
    "max_pool": lambda t: F.max_pool2d(t, 2),
    "sum_over_channels": lambda t: t.sum(1, keepdim=True),
    "reflection_pad": lambda t: F.pad(t, (1, 2, 2, 1), mode="reflect"),
    "replication_pad": lambda t: F.pad(t, (1, 2, 2, 1), mode="replicate"),
}


@pytest.mark.parametrize("name", list(OPS))
def test_ops_of_a_channels_last_input_and_their_gradients_keep_cpus_layout(name):
    x0 = torch.randn(2, 3, 6, 6).to(memory_format=CL)
    results = []
    for device in ("cpu", "tpu"):
        x = x0.detach().to(device).requires_grad_()
        y = OPS[name](x)
        # The output gradient in the output's layout, as autograd makes it (test_modules too)
        grad = torch.empty_like(y).copy_(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        results.append((y, *torch.autograd.grad(y, x, grad)))
    for expected, got in zip(*results, strict=True):
        assert _layout(got) == _layout(expected)
        assert got.stride() == expected.stride()
        assert_same(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("indices", [False, True])
def test_a_decomposed_op_of_a_channels_last_3d_input_keeps_cpus_layout(indices):
    # max_pool3d runs as PyTorch's decomposition, which computes in contiguous tensors.
    x = torch.randn(2, 3, 4, 6, 6).to(memory_format=CL3)
    expected, got = (F.max_pool3d(t, 2, return_indices=indices) for t in (x, x.to("tpu")))
    for e, g in zip(*((r,) if not indices else r for r in (expected, got)), strict=True):
        assert _layout(g) == _layout(e) == "channels_last"
        assert_same(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank", [4, 5])
@pytest.mark.parametrize("laid", ["input", "weight", "both"])
def test_convolution_and_its_gradients_take_cpus_layouts(laid, rank, dtype):
    fmt = CL if rank == 4 else CL3
    conv = F.conv2d if rank == 4 else F.conv3d
    x0 = torch.randn((2, 3) + (5, 6, 6)[5 - rank:], dtype=dtype)
    w0 = torch.randn((4, 3) + (3,) * (rank - 2), dtype=dtype)
    if laid in ("input", "both"):
        x0 = x0.to(memory_format=fmt)
    if laid in ("weight", "both"):
        w0 = w0.to(memory_format=fmt)
    results = []
    for device in ("cpu", "tpu"):
        x, w = (t.detach().to(device).requires_grad_() for t in (x0, w0))
        y = conv(x, w)
        grad = torch.linspace(-1, 1, y.numel(), dtype=dtype).reshape(y.shape).to(device)
        # autograd.grad: .grad would be restrided to its leaf's layout by AccumulateGrad
        results.append((y, *torch.autograd.grad(y, (x, w), grad)))
    for expected, got in zip(*results, strict=True):
        assert _layout(got) == _layout(expected)
        assert_same(got, expected, atol=1e-4, rtol=1e-4)


def test_a_contiguous_call_after_a_channels_last_one_stays_contiguous():
    # Repeated calls skip planning by their signature, which does not tell layouts apart.
    x = torch.randn(2, 3, 6, 6)
    for _ in range(3):
        assert _layout(torch.relu(x.to(memory_format=CL).to("tpu"))) == "channels_last"
        out = torch.relu(x.to("tpu"))
        assert _layout(out) == "contiguous"
        assert_same(out, torch.relu(x))
