"""Tokamax's kernels on tpu tensors (torchtpu/kernels/tokamax.py) against PyTorch on CPU, forward
and backward, eager and compiled. Needs the extra: pip install -e '.[tokamax]'."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tokamax", reason="Tokamax is not installed: pip install -e '.[tokamax]'")

from torchtpu.kernels import tokamax as tk  # noqa: E402
from torchtpu.testing.compare import assert_same, to_device  # noqa: E402


def _value_and_grads(fn, inputs, device):
    leaves = to_device(inputs, device)
    out = fn(*leaves)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(device)
    (out * weight).sum().backward()
    return [out, *[t.grad for t in leaves if t.requires_grad]]


def _check(tpu_fn, cpu_fn, inputs, atol=2e-5):
    assert_same(_value_and_grads(tpu_fn, inputs, "tpu"), _value_and_grads(cpu_fn, inputs, "cpu"),
                atol=atol)


def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def test_dot_product_attention():
    q, k, v = _leaf(1, 6, 2, 4), _leaf(1, 6, 2, 4), _leaf(1, 6, 2, 4)  # (batch, length, heads, d)

    def reference(q, k, v):
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             is_causal=True)
        return out.transpose(1, 2)

    _check(lambda q, k, v: tk.dot_product_attention(q, k, v, is_causal=True), reference,
           [q, k, v])


def test_ragged_dot():
    sizes = torch.tensor([3, 0, 5], dtype=torch.int32)

    def reference(lhs, rhs):
        out, start = [], 0
        for g, count in enumerate(sizes.tolist()):
            out.append(lhs[start:start + count] @ rhs[g])
            start += count
        return torch.cat(out + [torch.zeros(lhs.shape[0] - start, rhs.shape[2])])

    tpu_sizes = sizes.to("tpu")
    _check(lambda lhs, rhs: tk.ragged_dot(lhs, rhs, tpu_sizes), reference,
           [_leaf(10, 4), _leaf(3, 4, 5)])


def test_layer_norm():
    _check(lambda x, w, b: tk.layer_norm(x, w, b, 1e-5),
           lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5),
           [_leaf(3, 8), _leaf(8), _leaf(8)])


def test_gated_linear_unit():
    _check(lambda x, w: tk.gated_linear_unit(x, w, "silu"),
           lambda x, w: F.silu(x @ w[:, 0]) * (x @ w[:, 1]),
           [_leaf(5, 4), _leaf(4, 2, 6)])


def test_linear_softmax_cross_entropy_loss_compiled(fresh_dynamo):
    labels = torch.tensor([0, 3, 6, 1, 2])
    tpu_labels = labels.to("tpu")
    fn = torch.compile(lambda x, w: tk.linear_softmax_cross_entropy_loss(x, tpu_labels, w),
                       backend="tpu")
    _check(fn, lambda x, w: F.cross_entropy(x @ w, labels, reduction="sum"),
           [_leaf(5, 4), _leaf(4, 7)], atol=1e-4)
