"""Reads and writes along one dim at given indices: gather, scatter, scatter_reduce,
index_select/add/copy/fill/reduce, put and take, embedding and its backward.

Index values are checked as CPU's kernels check them (``@check``): XLA would clamp an
out-of-range index where CPU refuses it.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import torch
import torch.fx as fx
from jax import lax

from torchtpu.lowering import padding
from torchtpu.lowering.checks import along, first_bad, out_of_bounds, outside
from torchtpu.lowering.index import add_at, set_at
from torchtpu.lowering.padding import Mask, Refused, first, padded, same
from torchtpu.lowering.registry import check, lowers, padding_rule

aten = torch.ops.aten


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


@check(aten.gather.default, aten.scatter, aten.scatter_add.default, aten.scatter_reduce.two)
def _gather_scatter_check(self, dim, index, *rest):
    d, size = along(self, dim)
    return out_of_bounds(index, size, d, negative=False, kind=RuntimeError)


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
    return set_at(x, _along(x, dim, index), _src(src, index, x.dtype))


@lowers(aten.scatter.reduce, aten.scatter.value_reduce)
@_at_least_1d
def scatter_with_reduce(x, dim, index, src, reduce):
    ref = x.at[_along(x, dim, index)]
    return getattr(ref, _SCATTER_REDUCE[reduce])(_src(src, index, x.dtype))


@lowers(aten.scatter_add.default)
@_at_least_1d
def scatter_add(x, dim, index, src):
    return add_at(x.at[_along(x, dim, index)], _src(src, index, x.dtype))


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
    return (add_at(ref, src) if accumulate else ref.set(src)).reshape(x.shape)


@check(aten.put.default)
def _put_check(self, index, source, accumulate=False):
    if not accumulate:
        # CPU's put_ alerts in deterministic mode (which of a repeated index's writes lands is
        # not defined): it raises, or warns under warn_only.
        torch._prims_common.alert_not_deterministic("put_")
    return out_of_bounds(index, int(np.prod(self.shape)), 0, negative=True)


# take has no lowering (its decomposition's pieces have), but CPU checks its indices.
@check(aten.take.default)
def _take_check(self, index):
    return out_of_bounds(index, int(np.prod(self.shape)), 0, negative=True)


def _along_dim(x, dim: int):
    return (slice(None),) * (dim % x.ndim)


@lowers(aten.index_select.default)
def index_select(x, dim, index):
    if x.ndim == 0:  # the only valid index is 0, and PyTorch's result stays 0-dim
        return x
    return jnp.take(x, index.reshape(-1), axis=dim)


@check(aten.index_select.default)
def _index_select_check(self, dim, index):
    d, size = along(self, dim)
    return out_of_bounds(index, size, d, negative=False)


@lowers(aten.index_add.default)
def index_add(x, dim, index, source, alpha=1):
    src = source.astype(x.dtype) * jnp.asarray(alpha).astype(x.dtype)
    if x.ndim == 0:
        return x + src.sum(dtype=x.dtype) if index.size else x
    return add_at(x.at[_along_dim(x, dim) + (index.reshape(-1),)], src)


@check(aten.index_add.default)
def _index_add_check(self, dim, index, source, alpha=1):
    d, size = along(self, dim)
    expected = [n for i, n in enumerate(self.shape) if i != d]
    got = [n for i, n in enumerate(source.shape) if i != along(source, dim)[0]]
    if source.ndim and self.ndim and expected != got:
        return RuntimeError("index_add_(): source tensor shape must match self tensor shape, "
                            "excluding the specified dimension")
    return out_of_bounds(index, size, d, negative=False, kind=RuntimeError)


@lowers(aten.index_copy.default)
def index_copy(x, dim, index, source):
    if x.ndim == 0:
        return source.reshape(()).astype(x.dtype)
    return set_at(x, _along_dim(x, dim) + (index.reshape(-1),), source.astype(x.dtype))


@check(aten.index_copy.default)
def _index_copy_check(self, dim, index, source):
    d, size = along(self, dim)
    return first_bad(index, outside(0, size), functools.partial(_index_copy_error, d, size))


def _index_copy_error(dim: int, size: int, value: int) -> IndexError:
    return IndexError(f"index_copy_(): index {value} is out of bounds for dimension {dim} with "
                      f"size {size}")


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, dim, index, value):
    value = jnp.asarray(value).astype(x.dtype)
    if x.ndim == 0:
        return jnp.where(index.size > 0, value, x)
    return x.at[_along_dim(x, dim) + (index.reshape(-1),)].set(value)


@check(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def _index_fill_check(self, dim, index, value):
    # The device would cast a complex fill value to a real dtype and drop its imaginary part.
    if isinstance(value, complex) and not self.dtype.is_complex:
        return RuntimeError("torchtpu.check: index_fill_(): Converting complex Scalar to "
                            "non-complex type is not supported")
    d, size = along(self, dim)
    return out_of_bounds(index, size, d, negative=True)


@lowers(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@check(aten.embedding.default)
def _embedding_check(weight, indices, *rest):
    return out_of_bounds(indices, weight.shape[0], 0, negative=False)


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

