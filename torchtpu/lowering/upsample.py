"""Upsampling (nearest, nearest-exact, linear, cubic and the antialiased filters), forward where
PyTorch has no decomposition and backward: each a separable linear map, one constant matrix per
spatial dim, applied with conv.py's ``_apply_per_dim``. PyTorch's decompositions cover the other
forwards.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.lowering.conv import _apply_per_dim, _transpose_per_dim
from torchtpu.lowering.registry import check, lowers

aten = torch.ops.aten

def _scale(size: int, out: int, scale, align_corners: bool, kind=np.float32) -> np.floating:
    """PyTorch's source-index scale (area_pixel_compute_scale), in float32 like the CPU (kind
    float64 for the kernels that compute a float64 input in float64)."""
    if align_corners:
        return kind((size - 1) / (out - 1)) if out > 1 else kind(0)
    return kind(1.0 / scale) if scale else kind(size / out)


def _nearest_matrix(size: int, out: int, scale, exact: bool = False) -> np.ndarray:
    # nearest-exact samples at pixel centers: floor((dst + 0.5) * scale).
    dst = np.arange(out, dtype=np.float32) + np.float32(0.5 if exact else 0)
    src = np.floor(dst * _scale(size, out, scale, False))
    m = np.zeros((out, size), np.float32)
    m[np.arange(out), np.minimum(src.astype(np.int64), size - 1)] = 1.0
    return m


def _linear_matrix(size: int, out: int, scale, align_corners: bool) -> np.ndarray:
    s = _scale(size, out, scale, align_corners)
    dst = np.arange(out, dtype=np.float32)
    src = s * dst if align_corners else np.maximum(s * (dst + np.float32(0.5)) - 0.5, 0)
    i0 = src.astype(np.int64)
    i1 = np.minimum(i0 + 1, size - 1)
    frac = (src - i0).astype(np.float32)
    m = np.zeros((out, size), np.float32)
    np.add.at(m, (np.arange(out), i0), 1 - frac)
    np.add.at(m, (np.arange(out), i1), frac)
    return m


def _cubic_matrix(size: int, out: int, scale, align_corners: bool) -> np.ndarray:
    # Keys' cubic convolution with A = -0.75 on the 4 nearest inputs, clamped at the borders.
    a = -0.75
    s = _scale(size, out, scale, align_corners)
    dst = np.arange(out, dtype=np.float32)
    src = s * dst if align_corners else s * (dst + np.float32(0.5)) - np.float32(0.5)
    base = np.floor(src)
    t = (src - base).astype(np.float64)

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    m = np.zeros((out, size), np.float64)
    for k, w in enumerate((far(t + 1), near(t), near(1 - t), far(2 - t))):
        np.add.at(m, (np.arange(out), np.clip(base.astype(np.int64) - 1 + k, 0, size - 1)), w)
    return m


def _aa_triangle(x):
    return np.maximum(0, 1 - np.abs(x))


def _aa_cubic(x):
    # Keys' cubic convolution with A = -0.5 (PIL's, which PyTorch's antialias follows; the
    # plain bicubic upsampling uses -0.75).
    a, x = -0.5, np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


# interpolation size (taps at scale 1) and filter of each antialiased mode
_AA_FILTERS = {"bilinear": (2, _aa_triangle), "bicubic": (4, _aa_cubic)}


def _antialias_matrix(size: int, out: int, scale, align_corners: bool, mode: str,
                      dtype) -> np.ndarray:
    # The mode's filter widened by the downscaling factor, weights normalized per output, as
    # PyTorch's separable antialiased kernels compute them (_compute_indices_min_size_weights_aa,
    # in float64 for a float64 input).
    taps, filt = _AA_FILTERS[mode]
    kind = np.float64 if dtype == np.float64 else np.float32
    s = float(_scale(size, out, scale, align_corners, kind))
    support, stretch = (taps / 2 * s, 1 / s) if s >= 1 else (taps / 2, 1.0)
    m = np.zeros((out, size), np.float64)
    for i in range(out):
        center = s * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size)
        w = filt((np.arange(lo, hi) - center + 0.5) * stretch)
        if w.sum():
            m[i, lo:hi] = w / w.sum()
    return m


def _upsample_aa(x, output_size, align_corners, scales, mode):
    sizes = zip(x.shape[-2:], output_size, scales, strict=True)
    matrices = [_antialias_matrix(n, o, s, align_corners, mode, x.dtype) for n, o, s in sizes]
    if not jnp.issubdtype(x.dtype, jnp.integer):
        return _apply_per_dim(x, matrices)
    # uint8 as CPU computes it (PIL's way): the width pass, then the height pass, each rounded
    # half up and clamped to the dtype's range (a bicubic pass overshoots it).
    bounds = jnp.iinfo(x.dtype)
    y = x.astype(jnp.float32)
    for axis in (-1, -2):
        y = jnp.moveaxis(jnp.tensordot(y, jnp.asarray(matrices[axis], jnp.float32),
                                       ((axis,), (1,))), -1, axis)
        y = jnp.clip(jnp.floor(y + 0.5), bounds.min, bounds.max)
    return y.astype(x.dtype)


# CPU's upsampling kernels take floating inputs, and uint8 but in linear 1-d and trilinear 3-d;
# the meta kernels and the decompositions take any dtype.
def _upsample_refused(x, uint8: bool) -> NotImplementedError | None:
    if x.dtype.is_floating_point or x.dtype.is_complex or (uint8 and x.dtype == torch.uint8):
        return None
    return NotImplementedError(f"torchtpu.lowering: upsampling is not implemented for {x.dtype} "
                               f"inputs (as on CPU): use a floating dtype")


@check(aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
       aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d,
       aten._upsample_nearest_exact3d, aten.upsample_bilinear2d, aten.upsample_bicubic2d,
       aten._upsample_bilinear2d_aa, aten._upsample_bicubic2d_aa)
def _upsample_check(x, *rest):
    return _upsample_refused(x, uint8=True)


@check(aten.upsample_linear1d, aten.upsample_trilinear3d)
def _upsample_no_uint8_check(x, *rest):
    return _upsample_refused(x, uint8=False)


@lowers(aten._upsample_bilinear2d_aa.default)
def upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(x, output_size, align_corners, (scales_h, scales_w), "bilinear")


@lowers(aten._upsample_bicubic2d_aa.default)
def upsample_bicubic2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(x, output_size, align_corners, (scales_h, scales_w), "bicubic")


@lowers(aten._upsample_bilinear2d_aa_backward.default)
def upsample_bilinear2d_aa_backward(grad, output_size, input_size, align_corners, *scales):
    return _upsample_backward(grad, output_size, input_size, scales,
                              lambda n, o, s: _antialias_matrix(n, o, s, align_corners, "bilinear",
                                                                grad.dtype))


@lowers(aten._upsample_bicubic2d_aa_backward.default)
def upsample_bicubic2d_aa_backward(grad, output_size, input_size, align_corners, *scales):
    return _upsample_backward(grad, output_size, input_size, scales,
                              lambda n, o, s: _antialias_matrix(n, o, s, align_corners, "bicubic",
                                                                grad.dtype))


@lowers(aten.upsample_bicubic2d_backward.default)
def upsample_bicubic2d_backward(grad, output_size, input_size, align_corners, *scales):
    return _upsample_backward(grad, output_size, input_size, scales,
                              lambda n, o, s: _cubic_matrix(n, o, s, align_corners))


def _upsample_backward(grad, output_size, input_size, scales, make_matrix):
    nd = len(output_size)
    scales = list(scales) + [None] * (nd - len(scales))
    sizes = zip(input_size[-nd:], output_size, scales, strict=True)
    return _transpose_per_dim(grad, [make_matrix(n, o, s) for n, o, s in sizes])


@lowers(aten.upsample_nearest1d_backward.default, aten.upsample_nearest2d_backward.default,
        aten.upsample_nearest3d_backward.default)
def upsample_nearest_backward(grad, output_size, input_size, *scales):
    return _upsample_backward(grad, output_size, input_size, scales, _nearest_matrix)


@lowers(aten._upsample_nearest_exact1d_backward.default,
        aten._upsample_nearest_exact2d_backward.default,
        aten._upsample_nearest_exact3d_backward.default)
def upsample_nearest_exact_backward(grad, output_size, input_size, *scales):
    return _upsample_backward(grad, output_size, input_size, scales,
                              lambda n, o, s: _nearest_matrix(n, o, s, exact=True))


@lowers(aten.upsample_linear1d_backward.default, aten.upsample_bilinear2d_backward.default,
        aten.upsample_trilinear3d_backward.default)
def upsample_linear_backward(grad, output_size, input_size, align_corners, *scales):
    return _upsample_backward(grad, output_size, input_size, scales,
                              lambda n, o, s: _linear_matrix(n, o, s, align_corners))
