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
