"""Histograms: ``histc``, ``histogram``, ``histogramdd`` and ``bincount``, with CPU's rules.

CPU semantics: a point counts if every coordinate lies in [first edge, last edge] (NaN never
does); the last bin is closed on the right. histc and histogram with a bin count place points
by linear interpolation between the outer edges in the input dtype (histogram then corrects by
comparing with the neighbouring edges); explicit bin tensors are searched. density divides by
the total, then by each dimension's bin widths in turn.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch

from torchtpu import errors
from torchtpu.lowering.registry import check, lowers, meta_kernel

aten = torch.ops.aten
_INDEX = jnp.int64


def _linspace_edges(left, right, bins: int, dtype):
    """PyTorch's linspace(left, right, bins + 1) in dtype: the first half counted up from left,
    the rest down from right."""
    left, right = jnp.asarray(left).astype(dtype), jnp.asarray(right).astype(dtype)
    step = (right - left) / bins
    i = jnp.arange(bins + 1)
    up = left + step * i.astype(dtype)
    down = right - step * (bins - i).astype(dtype)
    return jnp.where(i < (bins + 1) // 2, up, down)


def _outer_edges(points, range_):
    """Outer edges per dimension (float64): the range, else the data's extent; an empty range
    is widened by 0.5 on each side."""
    d = points.shape[-1]
    if range_ is not None:
        left = jnp.asarray(range_[0::2], jnp.float64)
        right = jnp.asarray(range_[1::2], jnp.float64)
    elif points.shape[0] == 0:
        left = right = jnp.zeros((d,), jnp.float64)
    else:
        left = jnp.min(points, 0).astype(jnp.float64)
        right = jnp.max(points, 0).astype(jnp.float64)
    same = left == right
    return jnp.where(same, left - 0.5, left), jnp.where(same, right + 0.5, right)


def _bin_edges(points, bins, range_):
    left, right = _outer_edges(points, range_)
    return [_linspace_edges(left[i], right[i], b, points.dtype) for i, b in enumerate(bins)]


def _bin_of(x, edges, how: str):
    """Bin index of each x among sorted edges, and whether x falls in the histogram at all."""
    n = edges.shape[0] - 1
    left, right = edges[0], edges[-1]
    if how == "search":
        pos = jnp.sum(edges[None, :] <= x[:, None], -1) - 1
    else:
        pos = jnp.clip(((x - left) * n / (right - left)).astype(_INDEX), 0, n)
        if how == "local":  # upper_bound over edges[pos - 1 : pos + 2]
            lo = jnp.maximum(pos - 1, 0)
            cand = lo[:, None] + jnp.arange(3)
            inside = cand <= n
            below = inside & (edges[jnp.minimum(cand, n)] <= x[:, None])
            pos = lo + jnp.sum(below, -1) - 1
    pos = jnp.where(pos == n, n - 1, pos)
    return pos, (x >= left) & (x <= right)


def _histogramdd(points, edges, weight, density: bool, how: str):
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros((points.shape[0],), _INDEX)
    valid = jnp.ones((points.shape[0],), bool)
    for i, e in enumerate(edges):
        pos, ok = _bin_of(points[:, i], e, how)
        flat, valid = flat * shape[i] + pos, valid & ok
    w = jnp.ones((points.shape[0],), points.dtype) if weight is None else weight.reshape(-1)
    hist = jnp.zeros((math.prod(shape),), points.dtype).at[jnp.where(valid, flat, 0)].add(
        jnp.where(valid, w, 0).astype(points.dtype))
    hist = hist.reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for i, e in enumerate(edges):
            hist = hist / jnp.diff(e).reshape([-1 if j == i else 1 for j in range(len(edges))])
    return hist


def _points(x):
    return x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)


@lowers(aten.histc.default)
def histc(x, bins=100, min=0, max=0):
    # min == max selects the data's extent; an empty range is widened by 1 on each side.
    lo, hi = jnp.asarray(min, jnp.float64), jnp.asarray(max, jnp.float64)
    if x.size:
        use_data = lo == hi
        lo = jnp.where(use_data, jnp.min(x).astype(jnp.float64), lo)
        hi = jnp.where(use_data, jnp.max(x).astype(jnp.float64), hi)
    same = lo == hi
    edges = _linspace_edges(jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi), bins, x.dtype)
    return _histogramdd(x.reshape(-1, 1), [edges], None, False, "linear")


@lowers(aten.histogram.bin_ct)
def histogram_bin_ct(x, bins=100, range=None, weight=None, density=False):
    points = x.reshape(-1, 1)
    edges = _bin_edges(points, [bins], range)
    return _histogramdd(points, edges, weight, density, "local"), edges[0]


@lowers(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, weight=None, density=False):
    return _histogramdd(x.reshape(-1, 1), [bins], weight, density, "search"), bins


@lowers(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(x, bins, range=None, weight=None, density=False):
    return _bin_edges(_points(x), bins, range)


@lowers(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(x, bins, range=None, weight=None, density=False):
    points = _points(x)
    return _histogramdd(points, _bin_edges(points, bins, range), weight, density, "local")


@lowers(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(x, bins, weight=None, density=False):
    return _histogramdd(_points(x), list(bins), weight, density, "search")


@check(aten._histogramdd_bin_edges.default, aten._histogramdd_from_bin_cts.default,
       aten._histogramdd_from_bin_tensors.default)
def _histogramdd_check(self, bins, *rest):
    if self.ndim and len(bins) != self.shape[-1]:
        return RuntimeError("histogramdd: The size of bins must be equal to the innermost "
                            "dimension of the input.")
    return None


@lowers(aten.bincount.default, data_dependent_shape=True)
def bincount(x, weights=None, minlength=0):
    # The length depends on the largest value: this runs on concrete arrays (a host read).
    if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer) or (x.size and x.min() < 0):
        raise RuntimeError(errors.message(
            "argument", "bincount only supports 1-d non-negative integral inputs."))
    if weights is not None and (weights.ndim != 1 or weights.shape[0] != x.shape[0]):
        raise RuntimeError(errors.message(
            "argument", "weights should be 1-d and have the same length as input"))
    if minlength < 0:
        raise RuntimeError(errors.message("argument", "minlength should be >= 0"))
    length = max(int(x.max()) + 1 if x.size else 0, minlength)
    if weights is None or x.size == 0:  # CPU counts an empty input in int64, weighed or not
        return jnp.zeros((length,), _INDEX).at[x].add(1)
    # CPU sums float32 weights in float32 and every other dtype in float64.
    dtype = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64
    return jnp.zeros((length,), dtype).at[x].add(weights.astype(dtype))


# PyTorch has no meta kernels for these, and result shapes come from meta kernels.
def _meta_hist(x, bins) -> torch.Tensor:
    return x.new_empty(tuple(bins))


meta_kernel(aten.histogram.bin_ct)(lambda x, bins=100, **_: (
    _meta_hist(x, [bins]), x.new_empty(bins + 1)))
meta_kernel(aten.histogram.bins_tensor)(lambda x, bins, **_: (
    _meta_hist(x, [bins.numel() - 1]), x.new_empty(bins.shape)))
meta_kernel(aten._histogramdd_bin_edges.default)(lambda x, bins, **_: [
    x.new_empty(b + 1) for b in bins])
meta_kernel(aten._histogramdd_from_bin_cts.default)(lambda x, bins, **_: _meta_hist(x, bins))
meta_kernel(aten._histogramdd_from_bin_tensors.default)(lambda x, bins, **_: _meta_hist(
    x, [b.numel() - 1 for b in bins]))
