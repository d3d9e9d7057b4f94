"""The Pallas kernels (RMSNorm, flash attention, interpreted on CPU) and torch.tpu.ops against
PyTorch on CPU, forward and backward, eager and compiled.

Interpreted Pallas programs are slow to compile on XLA:CPU, so the default run keeps one shape
per kernel, of more than one block with padding: for flash attention two query and two key
blocks (the online softmax's correction between key blocks), for RMSNorm two row blocks (the
weight gradient's sum over blocks); TORCHTPU_TESTS=full adds more (causal with unequal
lengths, several heads and batches, a one-block RMSNorm).
"""


import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from torchtpu.testing.compare import assert_same, to_device

ops = torch.tpu.ops
full_only = pytest.mark.full


def _value_and_grads(fn, inputs, device):
    leaves = to_device(inputs, device)
    out = fn(*leaves)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(device)
    (out * weight).sum().backward()
    return [out, *[t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]]


def _rms_inputs(shape):
    return [torch.randn(*shape, requires_grad=True),
            torch.randn(shape[-1], requires_grad=True)]


def _rms_reference(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


RMS_DEFAULT = (2, 150, 8)  # 300 rows: 2 blocks of 256, the last one padded


@pytest.mark.parametrize("shape", [RMS_DEFAULT, pytest.param((2, 3, 16), marks=full_only)])
def test_rms_norm_forward_and_backward(shape):
    inputs = _rms_inputs(shape)
    got = _value_and_grads(lambda x, w: ops.rms_norm(x, w, 1e-5), inputs, "tpu")
    assert_same(got, _value_and_grads(_rms_reference, inputs, "cpu"), atol=2e-5)


def test_rms_norm_compiled(fresh_dynamo):
    inputs = _rms_inputs(RMS_DEFAULT)
    fn = torch.compile(lambda x, w: ops.rms_norm(x * 2, w, 1e-5), backend="tpu")
    got = _value_and_grads(fn, inputs, "tpu")
    assert_same(got, _value_and_grads(lambda x, w: _rms_reference(x * 2, w), inputs, "cpu"),
                atol=2e-5)


def _qkv(n, h, L, S, e):
    return [torch.randn(n, h, length, e, requires_grad=True) for length in (L, S, S)]


FLASH_DEFAULT = (1, 1, 136, 136, 4)  # 2 x 2 blocks of 128, the last ones padded


@pytest.mark.parametrize("geometry,causal", [
    (FLASH_DEFAULT, True),
    pytest.param((1, 1, 200, 136, 8), True, marks=full_only),
    pytest.param((2, 1, 64, 300, 8), False, marks=full_only),
])
def test_flash_attention_forward_and_backward(geometry, causal):
    inputs = _qkv(*geometry)
    got = _value_and_grads(lambda q, k, v: ops.flash_attention(q, k, v, causal), inputs, "tpu")
    expected = _value_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), inputs, "cpu")
    assert_same(got, expected, atol=2e-5)


def test_sdpa_takes_the_flash_kernel_for_long_sequences_when_asked(fresh_dynamo):
    inputs = _qkv(*FLASH_DEFAULT)
    codes = []
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       backend="tpu",
                       options={"debug_callback": lambda gm, _: codes.append(gm.code)})
    ops.flash_sdpa(8)
    try:
        got = _value_and_grads(fn, inputs, "tpu")
    finally:
        ops.flash_sdpa(None)
    expected = _value_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), inputs, "cpu")
    assert_same(got, expected, atol=2e-5)
    assert "torchtpu.flash_attention" in codes[0]
    assert "flash_attention_vjp" in codes[1]
    with pytest.raises(ValueError, match="min_seq_len must be a positive int"):
        ops.flash_sdpa(0)


def test_sdpa_keeps_the_fused_op_below_the_threshold_and_with_masks():
    from torchtpu.eager import sdpa_routing

    ops.flash_sdpa(16)
    try:
        q = torch.zeros(1, 1, 8, 4)
        mask = torch.ones(8, 8, dtype=torch.bool)
        assert sdpa_routing._long_sequence_op(q, q, None, 0.0, False) is None
        long_q = torch.zeros(1, 1, 16, 4)
        long_op = sdpa_routing._long_sequence_op(long_q, long_q, None, 0.0, False)
        assert long_op is ops.flash_attention
        assert sdpa_routing._long_sequence_op(long_q, long_q, mask, 0.0, False) is None
        assert sdpa_routing._long_sequence_op(long_q, long_q, None, 0.1, False) is None
    finally:
        ops.flash_sdpa(None)


def test_optimization_barrier_passes_values_and_gradients():
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(2)
    got = _value_and_grads(lambda a, b: sum(t.sum() for t in ops.optimization_barrier([a * 2, b])),
                           [a, b], "tpu")
    expected = _value_and_grads(lambda a, b: (a * 2).sum() + b.sum(), [a, b], "cpu")
    assert_same(got, expected)
    with pytest.raises(TypeError, match="list or tuple of tensors"):
        ops.optimization_barrier(a.to("tpu"))


def test_optimization_barrier_compiled(fresh_dynamo):
    hlos = []
    fn = torch.compile(lambda a: ops.optimization_barrier((a + 1, a * 3)), backend="tpu",
                       options={"debug_callback": lambda gm, hlo: hlos.append(hlo)})
    a = torch.randn(5)
    x, y = fn(a.to("tpu"))
    assert_same([x, y], [a + 1, a * 3])
    assert "optimization_barrier" in hlos[0]


def _ragged_reference(lhs, rhs, sizes):
    out, start = [], 0
    for g, count in enumerate(sizes.tolist()):
        out.append(lhs[start:start + count] @ rhs[g])
        start += count
    out.append(lhs[start:] @ torch.zeros(rhs.shape[1:]))
    return torch.cat(out)


def test_ragged_dot_eager_and_compiled(fresh_dynamo):
    lhs, rhs = torch.randn(10, 4, requires_grad=True), torch.randn(3, 4, 5, requires_grad=True)
    sizes = torch.tensor([3, 0, 5], dtype=torch.int32)  # 2 rows past the groups: zeros
    expected = _value_and_grads(lambda a, b: _ragged_reference(a, b, sizes), [lhs, rhs], "cpu")
    tpu_sizes = sizes.to("tpu")
    eager = _value_and_grads(lambda a, b: ops.ragged_dot(a, b, tpu_sizes), [lhs, rhs], "tpu")
    compiled = torch.compile(lambda a, b, s: ops.ragged_dot(a, b, s), backend="tpu")
    graph = _value_and_grads(lambda a, b: compiled(a, b, tpu_sizes), [lhs, rhs], "tpu")
    assert_same(eager, expected, atol=1e-5)
    assert_same(graph, expected, atol=1e-5)
    with pytest.raises(ValueError, match=r"ragged_dot: lhs \(10, 4\).*do not fit"):
        ops.ragged_dot(lhs.detach().to("tpu"), rhs.detach()[:, :3].to("tpu"), tpu_sizes)
