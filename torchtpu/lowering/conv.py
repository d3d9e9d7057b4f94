"""Convolution (1-3d, grouped, dilated, transposed) and pooling, forward and backward.

Backward lowerings are the ``jax.vjp`` of the forward lowering here, so each case (stride,
padding, groups, transposition...) is derived once. PyTorch's decompositions cover
``max_pool2d_with_indices``, ``max_pool3d_with_indices`` and ``_adaptive_avg_pool2d``.
Upsampling is in ``upsample.py``, grid sampling in ``sampling.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.lowering.checks import first_bad, outside
from torchtpu.lowering.registry import channels_last_of, check, lowers, meta_kernel

aten = torch.ops.aten


def _dimension_numbers(nd: int) -> tuple:
    spatial = "DHW"[3 - nd:] if nd <= 3 else "".join(chr(ord("a") + i) for i in range(nd))
    return ("NC" + spatial, "OI" + spatial, "NC" + spatial)


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    if transposed:
        # The gradient of a convolution with respect to its input: dilate the input by the
        # stride, pad by the dilated kernel extent minus padding, and use the flipped kernel
        # with in/out channels swapped within each group.
        cin, cout_g = w.shape[:2]
        k = w.shape[2:]
        w = w.reshape((groups, cin // groups, cout_g) + k)
        w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
        w = jnp.flip(w, tuple(range(2, 2 + nd)))
        pads = [(d * (n - 1) - p, d * (n - 1) - p + op)
                for n, p, d, op in zip(k, padding, dilation, output_padding, strict=True)]
        return lax.conv_general_dilated(
            x, w, (1,) * nd, pads, lhs_dilation=tuple(stride), rhs_dilation=tuple(dilation),
            dimension_numbers=_dimension_numbers(nd), feature_group_count=groups)
    return lax.conv_general_dilated(
        x, w, tuple(stride), [(p, p) for p in padding], rhs_dilation=tuple(dilation),
        dimension_numbers=_dimension_numbers(nd), feature_group_count=groups)


# Result layouts as CPU's convolutions give them (the meta kernels say contiguous): oneDNN's
# and the slow 2-d kernels write channels-last results, the input and weight gradients
# included, when the input or the weight is channels-last; the slow 3-d kernel (float64)
# writes contiguous ones (where the backward's meta kernel says channels-last).
def _layout(x, w) -> torch.memory_format:
    fmt = channels_last_of(x) or channels_last_of(w)
    if fmt is None or (fmt is torch.channels_last_3d and x.dtype == torch.float64):
        return torch.contiguous_format
    return fmt


def _forward_layout(x, w, *_) -> torch.memory_format:
    return _layout(x, w)


def _backward_layout(grad, x, w, *_) -> torch.memory_format:
    return _layout(x, w)


@lowers(aten.convolution.default, aten.convolution_overrideable.default, promote="result",
        layout=_forward_layout)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * (out.ndim - 2))
    return out


def _conv_backward(grad, x, w, stride, padding, dilation, transposed, output_padding, groups,
                   mask):
    _, vjp = jax.vjp(
        lambda a, b: _conv(a, b, stride, padding, dilation, transposed, output_padding, groups),
        x, w)
    gx, gw = vjp(grad)
    gb = grad.sum([0] + list(range(2, grad.ndim))) if mask[2] else None
    return gx if mask[0] else None, gw if mask[1] else None, gb


@lowers(aten.convolution_backward.default, promote="result", layout=_backward_layout)
def convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    return _conv_backward(grad, x, w, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask)


@lowers(aten.convolution_backward_overrideable.default, promote="result",
        layout=_backward_layout)
def convolution_backward_overrideable(grad, x, w, stride, padding, dilation, transposed,
                                      output_padding, groups, output_mask):
    return _conv_backward(grad, x, w, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask)


# ----------------------------------------------------------------------------- average pooling

def _pool_geometry(size: int, k: int, s: int, p: int, ceil_mode: bool) -> tuple[int, int]:
    """(output length, extra high padding that ceil_mode windows reach into)."""
    span = size + 2 * p - k
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1  # the last window would start inside the right padding
    return out, max(0, (out - 1) * s + k - (size + 2 * p))


def _tuple(v, nd: int) -> tuple:
    """An int[N] schema argument, which may arrive as an int or a one-element list."""
    v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
    return v * nd if len(v) == 1 else v


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    nd = x.ndim - 2 if len(kernel_size) == 1 else len(kernel_size)
    kernel_size, padding = _tuple(kernel_size, nd), _tuple(padding, nd)
    stride = _tuple(stride, nd) if stride else kernel_size
    spatial = x.shape[-nd:]
    geometry = [_pool_geometry(n, k, s, p, ceil_mode)
                for n, k, s, p in zip(spatial, kernel_size, stride, padding, strict=True)]
    pads = [(p, p + extra) for p, (_, extra) in zip(padding, geometry, strict=True)]
    lead = x.ndim - nd
    window = (1,) * lead + tuple(kernel_size)
    strides = (1,) * lead + stride
    total = lax.reduce_window(x, np.array(0, x.dtype), lax.add, window, strides,
                              [(0, 0)] * lead + pads)
    if divisor_override:
        return total / divisor_override
    # How many elements each window averages over: padding counts unless excluded, the ceil_mode
    # overhang never does. Computed from static shapes, so it folds into a constant.
    if count_include_pad:
        ones = np.ones([n + 2 * p for n, p in zip(spatial, padding, strict=True)], np.float32)
        count_pads = [(0, extra) for _, extra in geometry]
    else:
        ones, count_pads = np.ones(spatial, np.float32), pads
    count = lax.reduce_window(jnp.asarray(ones), 0.0, lax.add, tuple(kernel_size), stride,
                              count_pads)
    return total / count.astype(x.dtype)


@lowers(aten.avg_pool2d.default, aten.avg_pool3d.default)
def avg_pool(x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
             divisor_override=None):
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


@lowers(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                      divisor_override):
    _, vjp = jax.vjp(lambda a: _avg_pool(a, kernel_size, stride, padding, ceil_mode,
                                         count_include_pad, divisor_override), x)
    return vjp(grad.astype(x.dtype))[0]


# ----------------------------------------------------------------------------- max pooling

@lowers(aten.max_pool2d_with_indices_backward.default,
        aten.max_pool3d_with_indices_backward.default)
def max_pool_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_to_planes(grad, x, len(kernel_size), indices)



# max_unpool has no lowering (its decomposition's pieces have); CPU checks the indices it gets.
@check(aten.max_unpool2d.default, aten.max_unpool3d.default)
def _max_unpool_check(self, indices, output_size, *rest):
    volume = int(np.prod(output_size))
    return first_bad(indices, outside(0, volume),
                     functools.partial(_unpool_error, "x".join(map(str, output_size))))


def _unpool_error(sizes: str, value: int) -> RuntimeError:
    return RuntimeError(f"Found an invalid max index: {value} (output volumes are of size "
                        f"{sizes})")

def _scatter_to_planes(grad, x, nd: int, indices):
    """Scatter-add grad to x's shape at indices, flat positions within each (batch, channel)
    plane of nd spatial dims: the backward of every pooling that returns indices."""
    lead = x.shape[:-nd]
    rows = math.prod(lead)
    flat_grad = grad.reshape(rows, -1)
    flat_idx = indices.reshape(rows, -1)
    out = jnp.zeros((rows, math.prod(x.shape[-nd:])), grad.dtype)
    out = out.at[jnp.arange(rows)[:, None], flat_idx].add(flat_grad)
    return out.reshape(x.shape)


def _adaptive_windows(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """Per output position, the input positions of its window padded to the longest window
    (repeating the start), and which of them are real."""
    starts = [(i * size) // out for i in range(out)]
    ends = [-(-((i + 1) * size) // out) for i in range(out)]
    width = max(e - b for b, e in zip(starts, ends, strict=True))
    offsets = np.arange(width)
    valid = offsets[None, :] < np.array(ends)[:, None] - np.array(starts)[:, None]
    where = np.where(valid, np.array(starts)[:, None] + offsets[None, :],
                     np.array(starts)[:, None])
    return where, valid


def _adaptive_max_pool(x, output_size):
    # Gather every (padded) window, then one argmax over the window's flattened positions:
    # ties go to the first position in row-major order and NaN wins, as on CPU.
    nd = len(output_size)
    spatial = x.shape[-nd:]
    windows = [_adaptive_windows(n, o) for n, o in zip(spatial, output_size, strict=True)]
    lead = x.ndim - nd
    # Output dims o_1..o_nd followed by window dims k_1..k_nd.
    grids = []
    valid = np.ones((), bool)
    for i, (where, ok) in enumerate(windows):
        shape = [1] * (2 * nd)
        shape[i], shape[nd + i] = where.shape
        grids.append(where.reshape(shape))
        valid = valid & ok.reshape(shape)
    flat_pos = sum(g * math.prod(spatial[i + 1:]) for i, g in enumerate(grids))
    patches = x[(Ellipsis, *grids)]
    fill = -jnp.inf if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.iinfo(x.dtype).min
    patches = jnp.where(valid, patches, jnp.asarray(fill, x.dtype))
    patches = patches.reshape(x.shape[:lead] + tuple(output_size) + (-1,))
    best = jnp.argmax(patches, axis=-1)
    values = jnp.take_along_axis(patches, best[..., None], -1)[..., 0]
    positions = jnp.broadcast_to(flat_pos, valid.shape).reshape(tuple(output_size) + (-1,))
    indices = jnp.take_along_axis(jnp.broadcast_to(positions, best.shape + positions.shape[-1:]),
                                  best[..., None], -1)[..., 0]
    return values, indices.astype(jnp.int64)


@lowers(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(x, output_size):
    return _adaptive_max_pool(x, output_size)


@lowers(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad, x, indices):
    return _scatter_to_planes(grad, x, 2, indices)


@lowers(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad, x, indices):
    return _scatter_to_planes(grad, x, 3, indices)


# ----------------------------------------------------------------------------- adaptive pooling
# and upsampling (upsample.py): separable linear maps, one constant matrix per spatial dim

def _apply_per_dim(x, matrices):
    """Apply one (out, in) matrix along each of the trailing len(matrices) dims of x."""
    nd = len(matrices)
    for i, m in enumerate(matrices):
        axis = x.ndim - nd + i
        x = jnp.moveaxis(jnp.tensordot(x, jnp.asarray(m, x.dtype), ((axis,), (1,))), -1, axis)
    return x


def _transpose_per_dim(grad, matrices):
    return _apply_per_dim(grad, [m.T for m in matrices])


def _adaptive_avg_matrix(size: int, out: int) -> np.ndarray:
    m = np.zeros((out, size), np.float64)
    for i in range(out):
        start, end = (i * size) // out, -(-((i + 1) * size) // out)
        m[i, start:end] = 1.0 / (end - start)
    return m


def _adaptive_matrices(in_shape, out_shape):
    return [_adaptive_avg_matrix(n, o) for n, o in zip(in_shape, out_shape, strict=True)]


@lowers(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(x, output_size):
    return _apply_per_dim(x, _adaptive_matrices(x.shape[-3:], output_size))


def _adaptive_avg_pool_backward(grad, x, nd: int):
    return _transpose_per_dim(grad, _adaptive_matrices(x.shape[-nd:], grad.shape[-nd:]))


@lowers(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad, x):
    return _adaptive_avg_pool_backward(grad, x, 2)


@lowers(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad, x):
    return _adaptive_avg_pool_backward(grad, x, 3)


# ----------------------------------------------------------------------------- fractional pooling

def _fractional_starts(sample, size: int, out: int, k: int):
    """Each output position's window start along one axis, from the plane's sample in [0, 1)
    (CPU's generate_intervals, in the sample's dtype): (N, C) samples -> (N, C, out)."""
    if out == 0:
        return jnp.zeros(sample.shape + (0,), jnp.int32)
    last = jnp.full(sample.shape + (1,), size - k, jnp.int32)
    if out == 1:
        return last
    alpha = jnp.asarray(size - k, sample.dtype) / jnp.asarray(out - 1, sample.dtype)
    i = jnp.arange(out - 1, dtype=sample.dtype)
    # C++'s int cast truncates toward zero; every value here is >= 0, so floor is the same.
    starts = (jnp.floor((i + sample[..., None]) * alpha).astype(jnp.int32)
              - jnp.floor(sample * alpha).astype(jnp.int32)[..., None])
    return jnp.concatenate([starts, last], -1)


def _fractional_max_pool(x, kernel_size, output_size, samples):
    nd = len(kernel_size)
    batched = x.ndim == nd + 2
    if not batched:
        x = x[None]
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    # The samples' last axis runs (w, h) in 2-d and (t, h, w) in 3-d, as CPU reads them.
    order = (1, 0) if nd == 2 else (0, 1, 2)
    samples = samples[:n]
    # Window positions per axis, as (N, C, o_1..o_nd, k_1..k_nd) flat offsets in a plane.
    flat = 0
    for axis in range(nd):
        starts = _fractional_starts(samples[..., order[axis]], spatial[axis],
                                    output_size[axis], kernel_size[axis])
        shape = [n, c] + [1] * (2 * nd)
        shape[2 + axis], shape[2 + nd + axis] = output_size[axis], kernel_size[axis]
        pos = starts[..., :, None] + jnp.arange(kernel_size[axis], dtype=jnp.int32)
        flat = flat * spatial[axis] + pos.reshape(shape)
    flat = jnp.broadcast_to(flat, (n, c, *output_size, *kernel_size))
    windows = flat.reshape(n, c, *output_size, -1)
    patches = jnp.take_along_axis(x.reshape(n, c, -1), windows.reshape(n, c, -1), 2)
    patches = patches.reshape(windows.shape)
    # CPU keeps the first maximum, but a NaN replaces it, the last NaN of the window winning.
    nan = jnp.isnan(patches)
    last_nan = patches.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], -1)
    best = jnp.where(nan.any(-1), last_nan, jnp.argmax(patches, -1))
    values = jnp.take_along_axis(patches, best[..., None], -1)[..., 0]
    indices = jnp.take_along_axis(windows, best[..., None], -1)[..., 0].astype(jnp.int64)
    return (values, indices) if batched else (values[0], indices[0])


@lowers(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def fractional_max_pool(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples)


@lowers(aten.fractional_max_pool2d_backward.default, aten.fractional_max_pool3d_backward.default)
def fractional_max_pool_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_to_planes(grad, x, len(kernel_size), indices)


# PyTorch has no meta kernel for this backward, and result shapes come from meta kernels: the
# gradient has the forward input's shape.
meta_kernel(aten.fractional_max_pool3d_backward.default)(
    lambda grad, x, *args: torch.empty_like(x))
