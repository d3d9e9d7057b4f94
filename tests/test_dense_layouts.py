"""A tensor that is all of its storage in another dim order than row-major (a transposed or
channels-last tensor of its own: SDPA's gradients in their inputs' order, results laid out as CPU
lays them) is stored as a typed array in memory order, written by one transposing program. It
was written through its view into zero bytes and read back by bitcasts: on a v5e a product
reading such an operand accessed ~40x its bytes. Values compared with CPU's."""

import importlib.util

import jax
import numpy as np
import pytest
import torch

from torchtpu.device import dtypes, tensors, views
from torchtpu.device.hooks import HOOKS

# (shape, memory order of its dims): attention's (b, h, t, d) stored as (b, t, h, d), channels
# last, a transpose, leading size-1 dims (strides PyTorch picks freely), a batch of one.
LAYOUTS = [((2, 3, 4, 8), (0, 2, 1, 3)), ((2, 3, 4, 5), (0, 2, 3, 1)), ((6, 4), (1, 0)),
           ((1, 3, 1, 5), (0, 2, 3, 1)), ((1, 4, 6, 8), (0, 2, 1, 3))]


def _strided(shape, order, device, dtype=torch.float32):
    """An empty tensor of shape whose dims lie in memory in order (as CPU's permute gives)."""
    inverse = np.argsort(order).tolist()
    t = torch.empty([shape[d] for d in order], dtype=dtype).permute(inverse)
    return torch.empty_strided(shape, t.stride(), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,order", LAYOUTS)
def test_a_whole_storage_in_another_order_is_a_typed_array_in_memory_order(shape, order, dtype):
    src = torch.randn(shape).to(dtype)
    want = _strided(shape, order, "cpu", dtype).copy_(src)
    got = _strided(shape, order, "tpu", dtype)
    assert got.stride() == want.stride()
    got.copy_(src.to("tpu"))
    array = got.untyped_storage()._tpu_array
    found = views.dense_order(tuple(shape), got.stride())
    assert array.dtype == dtypes.to_jax(dtype)
    assert array.shape == tuple(shape[d] for d in found)
    # Its row-major elements are the storage's, as CPU's storage holds them.
    flat = torch.as_strided(want, (want.numel(),), (1,), 0)
    np.testing.assert_array_equal(np.asarray(array).reshape(-1).view(np.uint8),
                                  flat.view(torch.uint8).numpy())
    assert torch.equal(got.cpu(), want)
    # Views of it and writes into part of it, as CPU.
    got[..., :2].mul_(3)
    want[..., :2].mul_(3)
    got.add_(1)
    want.add_(1)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(torch.as_strided(got, (got.numel(),), (1,), 0).cpu(),
                       torch.as_strided(want, (want.numel(),), (1,), 0))
    assert torch.equal(got.permute(*found).contiguous().cpu(), want.permute(*found).contiguous())


def test_channels_last_weights_and_their_optimizer_state_are_typed_arrays():
    # model.to(memory_format=channels_last) and Adam's zeros_like(p, preserve_format): every
    # weight and moment of a channels-last model was a byte array, each step's update bitcasts.
    host = torch.randn(8, 4, 3, 3)
    w = host.to("tpu").contiguous(memory_format=torch.channels_last)
    m = torch.zeros_like(w, memory_format=torch.preserve_format)
    m.add_(w, alpha=0.5)
    want = torch.zeros_like(host.contiguous(memory_format=torch.channels_last)).add_(host,
                                                                                    alpha=0.5)
    for t in (w, m):
        array = t.untyped_storage()._tpu_array
        assert t.stride() == want.stride()
        assert (array.dtype, array.shape) == (np.float32, (8, 3, 3, 4))
    assert torch.equal(m.cpu(), want)


def test_a_strided_tensor_that_is_part_of_its_storage_keeps_the_view_writer():
    # An expanded or partial layout is no permuted block: written through its view, as before.
    src = torch.randn(3, 4)
    got = torch.empty_strided((3, 4), (1, 6), device="tpu").copy_(src.to("tpu"))
    want = torch.empty_strided((3, 4), (1, 6)).copy_(src)
    assert views.dense_order((3, 4), (1, 6)) is None
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_loaded_in_row_blocks_is_a_typed_array_of_its_shape(dtype):
    """vLLM loads a merged projection (qkv, gate-up) into ``torch.empty`` by ``narrow(0, ...)``
    copies: its storage must be the weight's typed array, not zero bytes written into (on the
    v5e every decode step re-tiled such byte arrays: ~250 of its 265 ms)."""
    parts = [torch.randn(6, 8).to(dtype), torch.randn(10, 8).to(dtype)]
    weight = torch.empty(16, 8, dtype=dtype, device="tpu")
    weight.narrow(0, 0, 6).copy_(parts[0].to("tpu"))
    weight.narrow(0, 6, 10).copy_(parts[1])
    bias = torch.empty(16, dtype=dtype, device="tpu")
    bias.narrow(0, 3, 5).copy_(parts[0][0, :5])
    for t, shape in ((weight, (16, 8)), (bias, (16,))):
        array = t.untyped_storage()._tpu_array
        assert (array.dtype, array.shape) == (dtypes.to_jax(dtype), shape)
    assert torch.equal(weight.cpu(), torch.cat(parts))
    want_bias = torch.zeros(16, dtype=dtype)
    want_bias[3:8] = parts[0][0, :5]
    assert torch.equal(bias.cpu(), want_bias)
    # A number (0-d) is its whole storage: read before any write, it is typed zeros too.
    assert tensors.storage_array(torch.empty((), dtype=dtype, device="tpu")).dtype == \
        dtypes.to_jax(dtype)
    # Rows that do not divide the storage, or a slice that is not whole rows: its bytes.
    odd = torch.empty(10, dtype=dtype, device="tpu").view(5, 2)[:, :1]
    odd.copy_(torch.ones(5, 1, dtype=dtype))
    assert odd.untyped_storage()._tpu_array.dtype == np.uint8
    assert torch.equal(odd.cpu(), torch.ones(5, 1, dtype=dtype))


def _product_of_a_transposed_gradient(b, t, h, d):
    """The mm program (its jitted function and arguments) of v's projection's weight gradient:
    the gradient laid out (b, t, h, d) as SDPA gives it, read as (b t, h d)."""
    torch.manual_seed(0)
    g = torch.randn(b, h, t, d, dtype=torch.bfloat16)
    x = torch.randn(b * t, h * d, dtype=torch.bfloat16)
    grad = _strided((b, h, t, d), (0, 2, 1, 3), "tpu", torch.bfloat16).copy_(g.to("tpu"))
    seen = []
    previous = HOOKS.launch_observer

    def observe(label, fn, args):
        seen.append((str(label), fn, args))
        return fn(*args)

    HOOKS.launch_observer = observe
    try:
        out = grad.transpose(1, 2).reshape(b * t, h * d).t() @ x.to("tpu")
    finally:
        HOOKS.launch_observer = previous
    want = g.transpose(1, 2).reshape(b * t, h * d).t().float() @ x.float()
    torch.testing.assert_close(out.cpu().float(), want, rtol=2e-2, atol=2e-1)
    (fn, args), = [(fn, args) for label, fn, args in seen if label == "aten.mm.default"]
    return fn, args


def test_a_product_reads_a_transposed_gradient_as_typed_values_not_bytes():
    fn, args = _product_of_a_transposed_gradient(2, 16, 2, 8)
    assert all(a.dtype != np.uint8 for a in jax.tree_util.tree_leaves(args))
    text = fn.lower(*args).as_text()
    assert "ui8" not in text and "bitcast_convert" not in text


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]')")
def test_on_v5e_that_product_moves_no_more_bytes_than_one_of_plain_arrays():
    from torchtpu.targets import tpu_target

    b, t, h, d = 2, 512, 8, 128  # eight heads: as many as a v5e tile of bf16 rows holds
    fn, args = _product_of_a_transposed_gradient(b, t, h, d)
    got = tpu_target.compile_function(fn, *args, target_name="v5e:1x1")
    plain = jax.ShapeDtypeStruct((b * t, h * d), np.dtype("bfloat16"))
    want = tpu_target.compile_function(lambda g, x: g.T @ x, plain, plain, target_name="v5e:1x1")
    # Read out of bytes it accessed ~40x (4.6 GB against 0.1 at the Llama's 8 x 1024 tokens).
    assert got.compiles and 0 < got.bytes_accessed <= 1.2 * want.bytes_accessed
