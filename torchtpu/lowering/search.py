"""Searches and segments: searchsorted and bucketize, repeat_interleave, segment_reduce and
its backward, a jagged tensor's rows padded to a dense one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from torchtpu.lowering.checks import below_zero, first_bad, fixed, outside
from torchtpu.lowering.registry import check, lowers

aten = torch.ops.aten


def _searchsorted(boundaries, values, right: bool, sorter=None):
    side = "right" if right else "left"
    if sorter is not None:
        boundaries = jnp.take_along_axis(boundaries, sorter, axis=-1)
    if boundaries.ndim <= 1:
        return jnp.searchsorted(boundaries, values, side=side)
    search = jax.vmap(lambda b, v: jnp.searchsorted(b, v, side=side))
    lead = boundaries.shape[:-1]
    flat = search(boundaries.reshape((-1, boundaries.shape[-1])),
                  values.reshape((-1, values.shape[-1])))
    return flat.reshape(lead + values.shape[-1:])


@lowers(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, x, out_int32=False, right=False, side=None, sorter=None):
    right = side == "right" if side is not None else right
    return _searchsorted(sorted_sequence, jnp.asarray(x), right, sorter)


@check(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted_check(sorted_sequence, self, out_int32=False, right=False, side=None,
                        sorter=None):
    size = sorted_sequence.shape[-1] if sorted_sequence.ndim else 1
    return first_bad(sorter, outside(0, size),
                     fixed(RuntimeError, "torch.searchsorted(): sorter index out of range"))


@lowers(aten.repeat_interleave.Tensor,
        data_dependent_shape=lambda repeats, output_size=None: output_size is None)
def repeat_interleave(repeats, output_size=None):
    """``[0]*r0 + [1]*r1 + ...``: output i is the first j whose running total passes i."""
    size = int(repeats.sum()) if output_size is None else output_size  # concrete without it
    return jnp.searchsorted(jnp.cumsum(repeats), jnp.arange(size), side="right").astype(
        jnp.int64)


@check(aten.repeat_interleave.Tensor)
def _repeat_interleave_check(repeats, output_size=None):
    return first_bad(repeats, below_zero, fixed(RuntimeError, "repeats can not be negative"))


@lowers(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(x, boundaries, out_int32=False, right=False):
    return _searchsorted(boundaries, jnp.asarray(x), right)


# ----------------------------------------------------------------------------- segment_reduce

def _segments(data, lengths, offsets, axis: int):
    """(data with dims before axis flattened to one batch dim and axis next, segment id of each
    element along axis (num_segments where no segment covers it), lengths, number of segments)."""
    if offsets is not None:
        lengths = offsets[..., 1:] - offsets[..., :-1]
    lead = data.shape[:axis]
    count = lengths.shape[-1]
    flat_data = data.reshape((math.prod(lead),) + data.shape[axis:])
    flat_lengths = lengths.reshape(math.prod(lead), count)
    ends = jnp.cumsum(flat_lengths, -1)
    position = jnp.arange(data.shape[axis])
    ids = (ends[:, None, :] <= position[None, :, None]).sum(-1)
    return flat_data, ids, flat_lengths, count


_SEGMENT_OPS = {"sum": jax.ops.segment_sum, "mean": jax.ops.segment_sum,
                "prod": jax.ops.segment_prod, "max": jax.ops.segment_max,
                "min": jax.ops.segment_min}


@lowers(aten.segment_reduce.default)
def segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                   initial=None):
    axis = axis % data.ndim
    flat, ids, counts, n = _segments(data, lengths, offsets, axis)
    op = _SEGMENT_OPS[reduce]
    out = jax.vmap(lambda d, i: op(d, i, num_segments=n))(flat, ids)
    counts = counts.reshape(counts.shape + (1,) * (flat.ndim - 2)).astype(data.dtype)
    if initial is not None:
        combine = {"sum": jnp.add, "mean": jnp.add, "prod": jnp.multiply, "max": jnp.maximum,
                   "min": jnp.minimum}[reduce]
        out = combine(out, jnp.asarray(initial, data.dtype))
    if reduce == "mean":
        empty = jnp.asarray(jnp.nan if initial is None else 0, data.dtype) + out
        out = jnp.where(counts > 0, out / jnp.where(counts > 0, counts, 1), empty)
    return out.reshape(data.shape[:axis] + out.shape[1:])


@lowers(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, lengths=None, offsets=None, axis=0,
                            initial=None):
    # PyTorch's formulas: max/min share the gradient among the tied elements, prod divides
    # the product by the element unless it is zero.
    axis = axis % data.ndim
    flat, ids, counts, n = _segments(data, lengths, offsets, axis)
    tail = (1,) * (flat.ndim - 2)

    def per_element(seg_values):  # (batch, n, ...) -> value of each element's segment
        padded = jnp.concatenate([seg_values, jnp.zeros_like(seg_values[:, :1])], 1)
        return jnp.take_along_axis(padded, ids.reshape(ids.shape + tail), 1)

    g = grad.reshape((flat.shape[0], n) + flat.shape[2:])
    out = output.reshape(g.shape)
    covered = (ids < n).reshape(ids.shape + tail)
    segment_sum = jax.vmap(lambda d, i: jax.ops.segment_sum(d, i, num_segments=n))
    if reduce == "sum":
        result = per_element(g)
    elif reduce == "mean":
        safe = jnp.maximum(counts, 1).reshape(counts.shape + tail).astype(g.dtype)
        result = per_element(g / safe)
    elif reduce in ("max", "min"):
        hit = (flat == per_element(out)) | jnp.isnan(flat)
        ties = segment_sum(hit.astype(g.dtype), ids)
        result = jnp.where(hit, per_element(g / jnp.where(ties == 0, 1, ties)), 0)
    else:  # prod
        zero = flat == 0
        start = jnp.asarray(1 if initial is None else initial, flat.dtype)
        nonzero_prod = jax.vmap(lambda d, i: jax.ops.segment_prod(d, i, num_segments=n))(
            jnp.where(zero, 1, flat), ids) * start
        zeros = segment_sum(zero.astype(g.dtype), ids)
        others = jnp.where(per_element(zeros) == 1, per_element(nonzero_prod), 0)
        result = per_element(g) * jnp.where(zero, others,
                                            per_element(out) / jnp.where(zero, 1, flat))
    return jnp.where(covered, result, 0).reshape(data.shape)


# ----------------------------------------------------------------------------- jagged to dense

@lowers(aten._jagged_to_padded_dense_forward.default)
def jagged_to_padded_dense(values, offsets, max_lengths, padding_value=0.0):
    # One jagged dim, as PyTorch's kernels take: row b is values[offsets[b]:offsets[b + 1]],
    # cut or padded to max_lengths[0]. A gather at each row's start plus a position, where
    # positions past the row's end read the padding: the shape is static, the offsets data.
    (offset,), (length,) = offsets, max_lengths
    index = offset[:-1, None] + jnp.arange(length, dtype=offset.dtype)
    inside = (index < offset[1:, None]).reshape(index.shape + (1,) * (values.ndim - 1))
    if values.shape[0] == 0:  # no values (JAX refuses to gather from an empty axis)
        return jnp.full(index.shape + values.shape[1:], padding_value, values.dtype)
    # (positions past the last row read nothing: take's "fill", masked below like the rest)
    rows = jnp.take(values, index, axis=0, mode="fill", fill_value=0)
    return jnp.where(inside, rows, jnp.asarray(padding_value, values.dtype))
