"""Indexing: index, index_put, gather, scatter, scatter_reduce, index_select/add/copy/fill,
masked_scatter/select, nonzero, unique, embedding and its backward, searchsorted/bucketize,
repeat_interleave.

Ops whose result shape depends on values (nonzero, masked_select, unique) are registered with
``data_dependent_shape`` and run on concrete arrays. Boolean masks in ``index_put`` are handled
in-graph with a running count of the mask, so ``x[mask] = v`` compiles once per shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
import torch.fx as fx
from jax import lax

from torchtpu.lowering import padding
from torchtpu.lowering.padding import Mask, Refused, first, padded, same, val
from torchtpu.lowering.registry import lowers, padding_rule

aten = torch.ops.aten


def _is_mask(i) -> bool:
    # uint8 indices are PyTorch's legacy byte masks.
    return i is not None and i.dtype in (jnp.bool_, jnp.uint8)


def _advanced(indices: list) -> tuple:
    return tuple(slice(None) if i is None else i for i in indices)


@lowers(aten._unsafe_index.Tensor)
def unsafe_index(x, indices):
    # PyTorch's advanced indexing (None gaps, broadcast index tensors, non-adjacent index tensors
    # moving to the front) is NumPy's, which jnp follows.
    return x[_advanced(indices)]


_index = jax.jit(unsafe_index)


def _masks_select(x, indices) -> bool:
    if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return True
    return False


def _selects(x, mask) -> bool:
    return True


@lowers(aten.index.Tensor, data_dependent_shape=_masks_select)
def index(x, indices):
    # ``x[mask]`` arrives with the boolean mask itself; its true positions decide the shape, so
    # masks become their nonzero indices here, and the gather runs as one jitted program.
    expanded = []
    for i in indices:
        expanded.extend(jnp.nonzero(i.astype(jnp.bool_)) if _is_mask(i) else [i])
    return _index(x, expanded)


@padding_rule(aten.index.Tensor)
def _index_padding(node: fx.Node, layouts: dict) -> list:
    # Dynamic shapes: integer index tensors read real positions only (padded index positions
    # give padded outputs), but a negative index counts from the end: along a padded dim it is
    # made to count from the real end. Boolean masks are data-dependent.
    lay, indices, op = first(node, layouts), node.args[1], node.target
    if any(isinstance(i, fx.Node) and val(i).dtype == torch.bool for i in indices):
        raise Refused(f"{op} with a boolean mask")
    wrapped = [j for j, i in enumerate(indices) if isinstance(i, fx.Node) and padded(lay, [j])]
    if any(len(lay[j]) > 1 for j in wrapped):
        raise Refused(f"{op} indexes a merged dim")
    if len({indices[j] for j in wrapped}) < len(wrapped):
        raise Refused(f"{op} indexes two padded dims with one tensor")
    return [Mask((1, j), (j,), "wrap") for j in wrapped]


def _mask_values(x, indices: list, values):
    """(mask broadcast over x, values placed at x's positions) for ``x[mask] = values``.

    The k mask dims at position d stand for one dim of length nnz in the indexed shape; the
    value for the j-th true position is row j of values along that dim (or its only row).
    """
    d = next(k for k, i in enumerate(indices) if i is not None)
    mask = indices[d].astype(jnp.bool_)
    k = mask.ndim
    out_ndim = x.ndim - k + 1
    values = values.reshape((1,) * (out_ndim - values.ndim) + values.shape)
    rank = jnp.cumsum(mask.reshape(-1)) - 1
    rank = jnp.clip(rank, 0, values.shape[d] - 1).reshape(mask.shape)
    placed = jnp.broadcast_to(jnp.take(values, rank, axis=d), x.shape)
    mask = mask.reshape((1,) * d + mask.shape + (1,) * (x.ndim - d - k))
    return jnp.broadcast_to(mask, x.shape), placed


@lowers(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(x, indices, values, accumulate=False):
    values = values.astype(x.dtype)
    present = [i for i in indices if i is not None]
    if any(_is_mask(i) for i in present):
        if len(present) > 1:
            raise NotImplementedError(
                "torchtpu.unsupported: index_put with a boolean mask and other index tensors; "
                "index with "
                "mask.nonzero() instead"
            )
        if values.size == 0:
            return x  # an empty value tensor can only go to an all-false mask
        mask, placed = _mask_values(x, indices, values)
        if accumulate:
            return x + jnp.where(mask, placed, jnp.zeros((), x.dtype))
        return jnp.where(mask, placed, x)
    where = _advanced(indices)
    return _add(x.at[where], values) if accumulate else _set(x, where, values)


def _set(x, where, values):
    """``x.at[where].set(values)``; on the CPU platform a 16-bit float x is written as its bits.

    XLA:CPU computes a bf16 or f16 scatter in f32, converting the whole operand to f32 and back
    around it: a vLLM step writing a few rows of a 512 MiB bf16 KV cache converted all of it
    twice, 1.7 s a step (bench/RESULTS.md, "rlserve"). A set copies bits, so scattering them as
    uint16 is exact and touches the written rows only; other platforms scatter 16-bit floats
    natively and keep the plain form.
    """
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return x.at[where].set(values)

    def as_bits():
        bits = lax.bitcast_convert_type(values, jnp.uint16)
        return lax.bitcast_convert_type(
            lax.bitcast_convert_type(x, jnp.uint16).at[where].set(bits), x.dtype)

    return lax.platform_dependent(cpu=as_bits, default=lambda: x.at[where].set(values))


def _add(ref, values):
    """A scatter-add, as CPU accumulates: for bool, a logical or (XLA has no bool add)."""
    return ref.max(values) if values.dtype == jnp.bool_ else ref.add(values)


@lowers(aten._index_put_impl.default)
def index_put_impl(x, indices, values, accumulate=False, unsafe=False):
    return index_put(x, indices, values, accumulate)


def _along(x, dim: int, index):
    """The full index tuple addressing x at ``index`` along dim and at the same position
    elsewhere (index may be smaller than x in every dim, as gather and scatter allow)."""
    return tuple(
        index if d == dim else lax.broadcasted_iota(jnp.int64, index.shape, d)
        for d in range(index.ndim)
    )


def _at_least_1d(fn):
    # gather/scatter on 0-d tensors act as on one-element 1-d tensors.
    def run(x, dim, index, *rest):
        if x.ndim:
            return fn(x, dim % x.ndim, index.reshape(index.shape or (1,)), *rest)
        out = fn(x.reshape(1), 0, index.reshape(1), *[_1d(r) for r in rest])
        return out.reshape(())

    run.__name__ = fn.__name__
    return run


def _1d(v):
    return v.reshape(1) if hasattr(v, "ndim") and v.ndim == 0 else v


@_at_least_1d
def _gather(x, dim, index):
    return x[_along(x, dim, index)]


@lowers(aten.gather.default)
def gather(x, dim, index, sparse_grad=False):
    # The result has the index's shape also where x or the index is 0-d (and the other is not).
    return _gather(x, dim, index).reshape(index.shape)


@padding_rule(aten.gather.default)
def _gather_padding(node: fx.Node, layouts: dict) -> list:
    # Dynamic shapes: each output position reads where its index points, so padded index
    # positions give padded outputs and real indices point at real input positions.
    lay, args = first(node, layouts), node.args
    dim, index = args[1] % max(len(lay), 1), layouts[args[2]]
    others = [d for d in range(len(lay)) if d != dim]
    if padded(lay, others) or padded(index, others):
        same([tuple(lay[d] for d in others), tuple(index[d] for d in others)],
             f"{node.target} reads")
    return []


def _src(src, index, dtype):
    if getattr(src, "ndim", 0) == 0:
        return jnp.asarray(src).astype(dtype)
    return src[tuple(slice(0, n) for n in index.shape)].astype(dtype)


_SCATTER_REDUCE = {"add": "add", "multiply": "mul", "sum": "add", "prod": "mul",
                   "amax": "max", "amin": "min", "mean": "add"}


@lowers(aten.scatter.src, aten.scatter.value)
@_at_least_1d
def scatter(x, dim, index, src):
    return _set(x, _along(x, dim, index), _src(src, index, x.dtype))


@lowers(aten.scatter.reduce, aten.scatter.value_reduce)
@_at_least_1d
def scatter_with_reduce(x, dim, index, src, reduce):
    ref = x.at[_along(x, dim, index)]
    return getattr(ref, _SCATTER_REDUCE[reduce])(_src(src, index, x.dtype))


@lowers(aten.scatter_add.default)
@_at_least_1d
def scatter_add(x, dim, index, src):
    return _add(x.at[_along(x, dim, index)], _src(src, index, x.dtype))


def _identity(reduce: str, dtype):
    """The value a position takes before the first scattered element when include_self=False."""
    if reduce in ("sum", "mean", "prod"):
        return jnp.asarray(reduce == "prod", dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(reduce == "amin", dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        low, high = -jnp.inf, jnp.inf
    else:
        low, high = jnp.iinfo(dtype).min, jnp.iinfo(dtype).max
    return jnp.asarray(low if reduce == "amax" else high, dtype)


@lowers(aten.scatter_reduce.two)
@_at_least_1d
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    where = _along(x, dim, index)
    src = _src(src, index, x.dtype)
    hit = jnp.zeros(x.shape, jnp.int64).at[where].add(1)
    base = x if include_self else jnp.where(hit > 0, _identity(reduce, x.dtype), x)
    out = getattr(base.at[where], _SCATTER_REDUCE[reduce])(src)
    if reduce != "mean":
        return out
    count = hit + (1 if include_self else 0)
    safe = jnp.maximum(count, 1).astype(x.dtype)
    mean = out // safe if jnp.issubdtype(x.dtype, jnp.integer) else out / safe
    return jnp.where(count > 0, mean, x)


@lowers(aten.index_reduce.default)
def index_reduce(x, dim, index, source, reduce, include_self=True):
    # scatter_reduce with index spread over source's shape along dim.
    if x.ndim == 0:
        return scatter_reduce(x, 0, index, source, reduce, include_self)
    dim = dim % x.ndim
    spread = index.reshape((1,) * dim + (-1,) + (1,) * (source.ndim - dim - 1))
    return scatter_reduce(x, dim, jnp.broadcast_to(spread, source.shape), source, reduce,
                          include_self)


@lowers(aten.put.default)
def put(x, index, source, accumulate=False):
    ref = x.reshape(-1).at[index.reshape(-1)]
    src = source.reshape(-1).astype(x.dtype)
    return (_add(ref, src) if accumulate else ref.set(src)).reshape(x.shape)


def _along_dim(x, dim: int):
    return (slice(None),) * (dim % x.ndim)


@lowers(aten.index_select.default)
def index_select(x, dim, index):
    if x.ndim == 0:  # the only valid index is 0, and PyTorch's result stays 0-dim
        return x
    return jnp.take(x, index.reshape(-1), axis=dim)


@lowers(aten.index_add.default)
def index_add(x, dim, index, source, alpha=1):
    src = source.astype(x.dtype) * jnp.asarray(alpha).astype(x.dtype)
    if x.ndim == 0:
        return x + src.sum(dtype=x.dtype) if index.size else x
    return _add(x.at[_along_dim(x, dim) + (index.reshape(-1),)], src)


@lowers(aten.index_copy.default)
def index_copy(x, dim, index, source):
    if x.ndim == 0:
        return source.reshape(()).astype(x.dtype)
    return _set(x, _along_dim(x, dim) + (index.reshape(-1),), source.astype(x.dtype))


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, dim, index, value):
    value = jnp.asarray(value).astype(x.dtype)
    if x.ndim == 0:
        return jnp.where(index.size > 0, value, x)
    return x.at[_along_dim(x, dim) + (index.reshape(-1),)].set(value)


@lowers(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    mask = jnp.broadcast_to(mask, x.shape)
    if source.size == 0:  # nothing to place (PyTorch rejects a true mask position then)
        return x
    rank = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, max(source.size - 1, 0))
    placed = source.reshape(-1)[rank].reshape(x.shape).astype(x.dtype)
    return jnp.where(mask, placed, x)


@lowers(aten.masked_select.default, data_dependent_shape=_selects)
def masked_select(x, mask):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    return jnp.broadcast_to(x, shape)[jnp.broadcast_to(mask, shape)]


@lowers(aten.nonzero.default, data_dependent_shape=True)
def nonzero(x):
    return jnp.argwhere(x).astype(jnp.int64)


@lowers(aten.nonzero_static.default)
def nonzero_static(x, size, fill_value=-1):
    if x.ndim == 0:  # one row per hit, zero coordinates each
        return jnp.zeros((size, 0), jnp.int64)
    found = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(found, 1).astype(jnp.int64)


@lowers(aten.unique_consecutive.default, data_dependent_shape=True)
def unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    rows = x.reshape(-1, 1) if dim is None else jnp.moveaxis(x, dim, 0).reshape(x.shape[dim], -1)
    change = jnp.concatenate([jnp.ones(min(rows.shape[0], 1), bool),
                              (rows[1:] != rows[:-1]).any(1)])
    starts = jnp.nonzero(change)[0]
    inverse = (jnp.cumsum(change) - 1).astype(jnp.int64)
    counts = jnp.diff(jnp.append(starts, rows.shape[0])).astype(jnp.int64)
    if dim is not None:  # along a dim, PyTorch returns inverse and counts unasked
        values = jnp.moveaxis(jnp.take(jnp.moveaxis(x, dim, 0), starts, 0), 0, dim)
        return values, inverse, counts
    empty = jnp.zeros((0,), jnp.int64)
    return (x.reshape(-1)[starts], inverse.reshape(x.shape) if return_inverse else empty,
            counts if return_counts else empty)


@lowers(aten._unique2.default, data_dependent_shape=True)
def unique(x, sorted=True, return_inverse=False, return_counts=False):
    # PyTorch always sorts on CPU; unrequested results are empty tensors.
    values, inverse, counts = jnp.unique(x.reshape(-1), return_inverse=True, return_counts=True)
    inverse = inverse.reshape(x.shape) if return_inverse else jnp.zeros((0,), jnp.int64)
    counts = counts if return_counts else jnp.zeros((0,), jnp.int64)
    return values, inverse.astype(jnp.int64), counts.astype(jnp.int64)


@lowers(aten._unique.default, data_dependent_shape=True)
def unique_legacy(x, sorted=True, return_inverse=False):
    values, inverse, _ = unique(x, sorted, return_inverse)
    return values, inverse


@lowers(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


padding_rule(aten.embedding.default)(padding.positionwise)  # dynamic shapes


@lowers(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat = indices.reshape(-1)
    rows = grad.reshape(flat.shape[0], -1)
    if padding_idx >= 0:
        rows = jnp.where((flat == padding_idx)[:, None], jnp.zeros((), rows.dtype), rows)
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, rows.dtype).at[flat].add(1)
        rows = rows / counts[flat][:, None]
    out = jnp.zeros((num_weights, rows.shape[1]), rows.dtype).at[flat].add(rows)
    return out.reshape((num_weights,) + grad.shape[indices.ndim:])


@padding_rule(aten.embedding_dense_backward.default)
def _embedding_backward_padding(node: fx.Node, layouts: dict) -> list:
    lay, args = first(node, layouts), node.args
    ind = layouts[args[1]]
    if args[4]:
        raise Refused(f"{node.target} scales by frequency")
    same([lay[:len(ind)], ind], f"{node.target} scatters")
    dims = padded(ind, range(len(ind)))
    return [Mask(0, dims, "zero"), Mask(1, dims, max(args[3], 0))] if dims else []


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


@lowers(aten.repeat_interleave.Tensor,
        data_dependent_shape=lambda repeats, output_size=None: output_size is None)
def repeat_interleave(repeats, output_size=None):
    """``[0]*r0 + [1]*r1 + ...``: output i is the first j whose running total passes i."""
    size = int(repeats.sum()) if output_size is None else output_size  # concrete without it
    return jnp.searchsorted(jnp.cumsum(repeats), jnp.arange(size), side="right").astype(
        jnp.int64)


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
