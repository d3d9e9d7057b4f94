"""SDPA's kernel choice on tpu (torchtpu/eager/sdpa_routing.py): ``sdpa_kernel`` honoured as on
CUDA, and SDPA on DTensors (tensor-parallel attention) through the fused op's sharding rules
(torchtpu/distributed/dtensor_sdpa.py), against CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtpu.testing.threaded import run_threads

FUSED = "ScaledDotProductFusedAttentionOverrideableBackward"


def _qkv(*shape):
    return [torch.randn(*shape, requires_grad=True) for _ in range(3)]


def _value_and_grads(fn, inputs, device):
    xs = [x.detach().to(device).requires_grad_() for x in inputs]
    out = fn(*xs)
    out.square().sum().backward()
    return out, [x.grad for x in xs]


@pytest.mark.parametrize("backends, fused", [
    ([SDPBackend.MATH], False),
    ([SDPBackend.OVERRIDEABLE], True),
    ([SDPBackend.MATH, SDPBackend.OVERRIDEABLE], True),
])
def test_sdpa_kernel_picks_the_backend(backends, fused):
    inputs = _qkv(2, 3, 8, 4)
    with sdpa_kernel(backends):
        out, grads = _value_and_grads(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), inputs,
            "tpu")
    assert (FUSED in type(out.grad_fn).__name__) == fused
    ref, ref_grads = _value_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), inputs, "cpu")
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.cpu(), r, atol=2e-5, rtol=1e-5)


def test_sdpa_kernel_math_holds_in_compiled_graphs(fresh_dynamo):
    codes = []
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend="tpu",
                       options={"debug_callback": lambda gm, _: codes.append(gm.code)})
    q = torch.randn(1, 2, 8, 4, device="tpu")
    with sdpa_kernel(SDPBackend.MATH):
        out = fn(q, q, q)
    assert codes and "overrideable" not in codes[0] and "bmm" in codes[0]
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(*[q.cpu()] * 3))


def test_no_enabled_backend_raises_clearly():
    q = torch.randn(1, 2, 8, 4, device="tpu")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with pytest.raises(RuntimeError, match="torchtpu.unsupported: .*no available kernel on "
                                               "tpu: .*OVERRIDEABLE.*MATH.*both disabled"):
            F.scaled_dot_product_attention(q, q, q)
    # Enabled, but the fused kernel cannot take float64, and MATH is off.
    with sdpa_kernel(SDPBackend.OVERRIDEABLE):
        with pytest.raises(RuntimeError, match="fused kernel .* cannot serve this call"):
            F.scaled_dot_product_attention(*[q.double()] * 3)


def _tensor_parallel_attention(rank, world, q, k, v, mask):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("tpu", (world,))
    heads = [distribute_tensor(x.detach().to("tpu"), mesh, [Shard(1)]).requires_grad_()
             for x in (q, k, v)]
    m = distribute_tensor(mask.detach().to("tpu"), mesh, [Replicate()]).requires_grad_()
    out = F.scaled_dot_product_attention(*heads, attn_mask=m)
    assert out.placements == (Shard(1),), out.placements  # no gather: heads stay sharded
    fused = FUSED in type(out.grad_fn).__name__
    out.square().sum().backward()
    grads = [x.grad.full_tensor().cpu() for x in (*heads, m)]
    return out.full_tensor().cpu(), grads, fused


@pytest.mark.parametrize("backends, fused", [
    ([SDPBackend.OVERRIDEABLE, SDPBackend.MATH], True), ([SDPBackend.MATH], False)])
def test_tensor_parallel_attention_on_dtensors(backends, fused):
    # 4 heads over 2 ranks; a float mask broadcast over the heads (replicated, its gradient a
    # partial sum across the ranks).
    q, k, v = _qkv(2, 4, 8, 4)
    mask = torch.randn(2, 1, 8, 8, requires_grad=True)
    with sdpa_kernel(backends):  # the flags are process-wide: set once, around both ranks
        results = run_threads(_tensor_parallel_attention, 2, args=(q, k, v, mask))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref.square().sum().backward()
    for out, grads, was_fused in results:
        assert was_fused == fused
        torch.testing.assert_close(out, ref.detach(), atol=2e-5, rtol=1e-5)
        for g, r in zip(grads, (q.grad, k.grad, v.grad, mask.grad)):
            torch.testing.assert_close(g, r, atol=5e-5, rtol=1e-5)


def _heads_first(x):
    return x.transpose(1, 2)  # (batch, seq, heads, dim) -> (batch, heads, seq, dim), a view


def test_result_strides_are_cpus_for_transposed_inputs():
    # As CPU's kernel and PyTorch's meta kernel: the output is laid out as the query (here
    # seq-major), the gradients as q, k, v. A contiguous output made the usual
    # `out.transpose(1, 2).contiguous().view(b, s, -1)` wrong under DTensor (issue 37).
    xs = [torch.randn(2, 8, 4, 16, requires_grad=True) for _ in range(3)]

    def run(device):
        leaves = [x.detach().to(device).requires_grad_() for x in xs]
        out = F.scaled_dot_product_attention(*map(_heads_first, leaves), is_causal=True)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        return out, grads

    (out, grads), (ref, ref_grads) = run("tpu"), run("cpu")
    assert FUSED in type(out.grad_fn).__name__
    assert out.stride() == ref.stride() == (512, 16, 64, 1)
    assert [g.stride() for g in grads] == [g.stride() for g in ref_grads]
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.transpose(1, 2).contiguous().view(2, 8, -1).cpu(),
                               ref.transpose(1, 2).contiguous().view(2, 8, -1),
                               atol=2e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.cpu(), r, atol=5e-5, rtol=1e-5)


def _tensor_parallel_attention_block(rank, world, x):
    # pytorch/examples' Llama attention under ColwiseParallel(use_local_output=False): heads
    # sharded, views and transposes of DTensors, then the view that failed on ranks 2 and 3 of
    # fsdp_tp_example.py.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("tpu", (world,))
    b, s, h, d = x.shape
    heads = distribute_tensor(x.detach().reshape(b, s, h * d).to("tpu"), mesh, [Shard(2)])
    q = heads.view(b, s, h, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, q * 0.5, q * 2, is_causal=True)
    out = out.transpose(1, 2).contiguous()
    assert out.to_local().is_contiguous() == out.is_contiguous(), (
        out.stride(), out.to_local().stride())
    return out.view(b, s, -1).full_tensor().cpu()


def test_tensor_parallel_attention_block_views_as_on_cpu():
    x = torch.randn(2, 8, 4, 16)
    q = _heads_first(x)
    ref = F.scaled_dot_product_attention(q, q * 0.5, q * 2, is_causal=True)
    ref = ref.transpose(1, 2).contiguous().view(2, 8, -1)
    for out in run_threads(_tensor_parallel_attention_block, 2, args=(x,)):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
