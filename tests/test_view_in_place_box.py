"""A strided box of an n-d storage array (q, k and v of one fused qkv projection) reads and
writes as a slice of the array reshaped, never through a 1-d copy of it: on a TPU a 1-d array
has other tiles than an n-d one, so the round trip copied the storage twice per view (TinyGPT's
forward on v5e accessed 37.2 MB, 23.7 MB without it; the JAX port 24.1 MB). Bit-equal to torch's
own strided views on CPU."""

import jax
import numpy as np
import pytest
import torch

from torchtpu.device import views

B, T, H, D = 2, 6, 2, 4
C = H * D
SHAPE = (B * T, 3 * C)  # the qkv matmul's output, as its storage array holds it
FLAT = f"tensor<{B * T * 3 * C}x"


def _geometry(size, stride, offset, dtype=np.float32):
    return views.Geometry(SHAPE, np.dtype(dtype), tuple(size), tuple(stride), offset,
                          np.dtype(dtype))


# q, k and v viewed per head and transposed (B, H, T, D), and a step of 2 along the last dim.
BOXES = [((B, H, T, D), (T * 3 * C, D, 3 * C, 1), offset) for offset in (0, C, 2 * C)] + [
    ((B, T, C), (T * 3 * C, 3 * C, 2), 1)]


@pytest.mark.parametrize("size,stride,offset", BOXES)
def test_box_of_an_nd_storage_is_a_slice_of_it(size, stride, offset):
    base = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    g = _geometry(size, stride, offset)
    want = torch.as_strided(torch.from_numpy(base.copy()), size, stride, offset)
    lowered = jax.jit(lambda a: views.read_view(a, g)).lower(base).as_text()
    assert FLAT not in lowered and "gather" not in lowered
    np.testing.assert_array_equal(np.asarray(views.read_view(base, g)), want.numpy())

    value = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    lowered = jax.jit(lambda a, v: views.write_view(a, v, g)).lower(base, value).as_text()
    assert FLAT not in lowered and "scatter" not in lowered
    expect = torch.from_numpy(base.copy())
    torch.as_strided(expect, size, stride, offset).copy_(torch.from_numpy(value))
    np.testing.assert_array_equal(np.asarray(views.write_view(base, value, g)), expect.numpy())


def test_box_the_offset_does_not_fit_reads_through_the_flat_array():
    # Rows of 2C starting C + 1 into a row of 3C reach into the next row: no slice of the
    # reshaped array holds them, so they read (correctly) the old way.
    size, stride, offset = (B, T - 1, 2 * C), (T * 3 * C, 3 * C, 1), C + 1
    base = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    g = _geometry(size, stride, offset)
    want = torch.as_strided(torch.from_numpy(base.copy()), size, stride, offset)
    np.testing.assert_array_equal(np.asarray(views.read_view(base, g)), want.numpy())
    assert FLAT in jax.jit(lambda a: views.read_view(a, g)).lower(base).as_text()
