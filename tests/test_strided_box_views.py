"""Views that are strided boxes of their storage (the q, k and v of one fused qkv projection, a
step along the last dim, a slice of a transposed matrix) read and write with slices, not with a
gather of computed int64 indices (which a TPU runs element by element and emulates the index math
of: a TinyGPT step's bytes accessed on v5e fell 20x when this path took them), bit-equal to
torch's own strided views on CPU."""

import jax
import numpy as np
import pytest
import torch

from torchtpu.device import views

_STORAGE = 4 * 6 * 12 + 5


def _geometry(size, stride, offset):
    f32 = np.dtype(np.float32)
    return views.Geometry((_STORAGE,), f32, tuple(size), tuple(stride), offset, f32)


BOXES = [
    ((4, 2, 6, 2), (72, 2, 12, 1), 0),   # q of a (B=4, T=6, 3C=12) qkv, per head, transposed
    ((4, 2, 6, 2), (72, 2, 12, 1), 8),   # v: the last columns
    ((4, 6, 6), (72, 12, 2), 1),         # a step of 2 along the last dim
    ((6, 4), (12, 72), 3),               # a slice of a transposed matrix
    ((4, 6, 4), (72, 12, 1), 10),        # a box whose last row ends past the storage
]


@pytest.mark.parametrize("size,stride,offset", BOXES)
def test_strided_box_reads_and_writes_like_torch_without_a_gather(size, stride, offset):
    base = np.arange(_STORAGE, dtype=np.float32)
    g = _geometry(size, stride, offset)
    want = torch.as_strided(torch.from_numpy(base.copy()), size, stride, offset)
    lowered = jax.jit(lambda a: views.read_view(a, g)).lower(base).as_text()
    assert "gather" not in lowered and "i64" not in lowered
    np.testing.assert_array_equal(np.asarray(views.read_view(base, g)), want.numpy())

    value = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    expected = torch.from_numpy(base.copy())
    torch.as_strided(expected, size, stride, offset).copy_(torch.from_numpy(value))
    lowered = jax.jit(lambda a, v: views.write_view(a, v, g)).lower(base, value).as_text()
    assert "scatter" not in lowered
    np.testing.assert_array_equal(np.asarray(views.write_view(base, value, g)), expected.numpy())


def test_overlapping_view_still_gathers_like_torch():
    base = np.arange(_STORAGE, dtype=np.float32)
    g = _geometry((3, 3), (2, 1), 0)  # rows overlap: no box
    assert "gather" in jax.jit(lambda a: views.read_view(a, g)).lower(base).as_text()
    want = torch.as_strided(torch.from_numpy(base.copy()), (3, 3), (2, 1), 0)
    np.testing.assert_array_equal(np.asarray(views.read_view(base, g)), want.numpy())


def test_the_split_of_a_fused_projection_on_tpu_matches_cpu():
    qkv = torch.randn(4, 6, 12)
    got = [t.transpose(1, 2).cpu() for t in qkv.to("tpu").view(4, 6, 6, 2).split(2, 2)]
    want = [t.transpose(1, 2) for t in qkv.view(4, 6, 6, 2).split(2, 2)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
