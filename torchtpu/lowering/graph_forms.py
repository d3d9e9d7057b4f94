"""Graph forms: JAX forms of the ATen ops that eager serves with device kernels, not lowerings.

Eager runs views (``view``, ``permute``, ``slice``...), copies and allocation as kernels that
touch tensor metadata or storages (``device/kernels.py``), so they have no entry in the lowering
table. A compiled graph holds values, not storages: there a view is just the reshaped, transposed
or sliced value, and an allocation is zeros. Only ops of that kind belong here, each declared
with ``@graph_form`` (``registry.GRAPH_FORMS``); every op with math in it has a lowering.
"""

from __future__ import annotations

import operator
import sys

import jax.numpy as jnp
import numpy as np
import torch
import torch.fx as fx
from jax import core, lax

from torchtpu.device import dtypes
from torchtpu.device.views import Geometry, read_view, write_view
from torchtpu.lowering import padding
from torchtpu.lowering.padding import first, from_end, symbolic, val
from torchtpu.lowering.registry import graph_form, padding_rule, size_arguments

aten = torch.ops.aten

def _dim(d: int, ndim: int) -> int:
    return d + max(ndim, 1) if d < 0 else d


@graph_form(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
           aten._reshape_alias.default)
def view(x, size, *_):
    return jnp.reshape(x, tuple(size))


@graph_form(aten.alias.default, aten.detach.default, aten.clone.default,
           aten.lift_fresh.default)
def alias(x, *_, **__):
    return x


@graph_form(aten.permute.default)
def permute(x, dims):
    return jnp.transpose(x, [_dim(d, x.ndim) for d in dims])


@graph_form(aten.transpose.int)
def transpose(x, d0, d1):
    return jnp.swapaxes(x, _dim(d0, x.ndim), _dim(d1, x.ndim)) if x.ndim else x


@graph_form(aten.t.default)
def t(x):
    return x.T


@graph_form(aten.expand.default)
def expand(x, size, implicit=False):
    lead = len(size) - x.ndim
    shape = [x.shape[i - lead] if n == -1 else n for i, n in enumerate(size)]
    return jnp.broadcast_to(x, tuple(shape))


@graph_form(aten.unsqueeze.default)
def unsqueeze(x, d):
    return jnp.expand_dims(x, _dim(d, x.ndim + 1))


@graph_form(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze(x, dims=None):
    if dims is None:
        dims = range(x.ndim)
    elif isinstance(dims, int):
        dims = [dims]
    axes = tuple(a for a in (_dim(d, x.ndim) for d in dims) if a < x.ndim and x.shape[a] == 1)
    return jnp.squeeze(x, axes) if axes else x


def _slice_bounds(start, end, step: int, n) -> tuple:
    """``slice(start, end, step).indices(n)``'s start and end (end >= start), also where n or a
    bound is a symbolic size (an exported program's dynamic dimension): then clamped with
    JAX's symbolic min/max, as Python clamps integers."""
    if all(type(v) is int for v in (start, end, n) if v is not None):
        start, end, _ = slice(start, end, step).indices(n)
        return start, max(end, start)

    def clamp(v, default):
        if v is None or (type(v) is int and v >= sys.maxsize):
            return default
        if type(v) is int and v < 0:
            v = n + v
        return core.max_dim(core.min_dim(v, n), 0)

    start = clamp(start, 0)
    return start, core.max_dim(clamp(end, n), start)


@graph_form(aten.slice.Tensor)
def slice_(x, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, x.ndim)
    start, end = _slice_bounds(start, end, step, x.shape[dim])
    return lax.slice_in_dim(x, start, end, step, axis=dim)


size_arguments(aten.slice.Tensor, 3)  # dynamic shapes: a symbolic end only sets the size


@padding_rule(aten.slice.Tensor)
def _slice_padding(node: fx.Node, layouts: dict) -> list:
    # Dynamic shapes: a slice of a padded dim is exact from its start (x[:, :1], as Dynamo
    # guards) or, counted from the end (x[:, -3:]), once the real end is rolled to the end.
    lay, op = first(node, layouts), node.target
    dim, start, end = (list(node.args[1:4]) + [0, None, None])[:3]
    n = val(node.args[0]).shape[dim]
    if not symbolic(n) or ((start or 0) == 0 and (end is None or val(end) is n or (
            isinstance(end, int) and end >= 2**62))):
        return []
    start = start or 0
    if isinstance(start, int) and isinstance(end, int) and 0 <= start <= end \
            and not symbolic(val(node).shape[dim]):
        return []  # a fixed block from the start (x[:, :1]): real positions, as guarded
    if isinstance(start, int) and start < 0 and (end is None or (
            isinstance(end, int) and end >= 2**62)):
        return from_end(node, lay, dim)  # the last positions (x[:, -3:])
    raise padding.Refused(f"{op} cuts a symbolic dim")


@graph_form(aten.select.int)
def select(x, dim, index):
    dim = _dim(dim, x.ndim)
    return lax.index_in_dim(x, index % x.shape[dim], axis=dim, keepdims=False)


_select_along = padding.along(1)


@padding_rule(aten.select.int)
def _select_padding(node: fx.Node, layouts: dict) -> list:
    # A position counted from the start is real (Dynamo guards that it is below the size); one
    # counted from the end (x[:, -1]) reads the real end once that is moved to the end.
    if isinstance(node.args[2], int):
        return [] if node.args[2] >= 0 else from_end(node, first(node, layouts), node.args[1])
    return _select_along(node, layouts)


@graph_form(aten.split.Tensor, aten.split_with_sizes.default)
def split(x, sizes, dim=0):
    dim = _dim(dim, x.ndim)
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)] or [0]
    bounds = np.cumsum([0, *sizes])
    return tuple(lax.slice_in_dim(x, int(a), int(b), axis=dim)
                 for a, b in zip(bounds[:-1], bounds[1:], strict=True))


padding_rule(aten.split.Tensor, aten.split_with_sizes.default)(padding.along(2))


@graph_form(aten.unbind.int)
def unbind(x, dim=0):
    dim = _dim(dim, x.ndim)
    return tuple(lax.index_in_dim(x, i, axis=dim, keepdims=False) for i in range(x.shape[dim]))


@graph_form(aten.diagonal.default)
def diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, _dim(dim1, x.ndim), _dim(dim2, x.ndim))


@graph_form(aten.as_strided.default)
def as_strided(x, size, stride, storage_offset=None):
    # The argument is a graph value, read as a C-contiguous storage of its own shape.
    g = Geometry(tuple(x.shape), x.dtype, tuple(size), tuple(stride), storage_offset or 0,
                 x.dtype)
    return read_view(x, g)


@graph_form(aten.as_strided_scatter.default)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    # AOTAutograd's form of a mutation through an aliased input; x is read as in as_strided.
    g = Geometry(tuple(x.shape), x.dtype, tuple(size), tuple(stride), storage_offset or 0,
                 x.dtype)
    return write_view(x, src.astype(x.dtype), g)


@graph_form(aten.view.dtype)
def view_dtype(x, dtype):
    target = dtypes.to_jax(dtype)
    if np.dtype(target).itemsize != x.dtype.itemsize:
        raise NotImplementedError(
            f"torchtpu.compile: view(dtype) from {x.dtype} to {dtype} changes the element size"
        )
    return lax.bitcast_convert_type(x, target)


@graph_form(aten.view_as_complex.default)
def view_as_complex(x):
    # (..., 2) pairs to complex values; a float16 pair computes as complex64 (device/dtypes.py).
    if x.dtype == jnp.float16:
        x = x.astype(jnp.float32)
    return lax.complex(x[..., 0], x[..., 1])


@graph_form(aten.view_as_real.default)
def view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@graph_form(aten._conj.default)
def conj_view(x):
    # A view with the conjugate bit set in eager; as a value, the conjugate.
    return jnp.conj(x)


@graph_form(aten.copy.default)
def copy(x, src, non_blocking=False):
    return jnp.broadcast_to(src, x.shape)


# How a graph writes into one of its inputs (AOTAutograd keeps it in an inference graph): as a
# value, ``copy``'s form, whose result the caller writes into the input tensor.
INPUT_WRITE = aten.copy_.default


@graph_form(aten._to_copy.default, torch.ops.prims.convert_element_type.default)
def to_copy(x, *_, **__):
    return x  # the result dtype comes from the node's meta and is applied by the caller


# Allocations: the caller casts every result to the node's dtype, so float zeros suffice.
@graph_form(aten.empty.memory_format, aten.empty_strided.default)
def empty(size, *_, **__):
    return jnp.zeros(tuple(size))


@graph_form(aten.new_empty.default, aten.new_empty_strided.default)
def new_empty(x, size, *_, **__):
    return jnp.zeros(tuple(size))


@graph_form(aten.empty_like.default)
def empty_like(x, *_, **__):
    return jnp.zeros(x.shape)


@graph_form(aten.full_like.default)
def full_like(x, fill_value, *_, **__):
    return jnp.full(x.shape, fill_value)


@graph_form(aten._assert_tensor_metadata.default, aten.sym_constrain_range_for_size.default)
def no_op(*_, **__):
    return None


# Size arithmetic of graphs with symbolic sizes (dynamic=True): plain Python ints in the trace.
SIZE_ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
                   operator.truediv, operator.pow, operator.neg)
for _fn in SIZE_ARITHMETIC:
    graph_form(_fn)(_fn)


@graph_form(aten.sym_size.int)
def sym_size(x, dim):
    return x.shape[dim]


# Ops that read sizes, never values: they take no symbolic size as a number (``dynamic.py``).
SIZE_READS = {aten.sym_size.int, operator.getitem, *SIZE_ARITHMETIC}
# Ops whose output keeps its input's elements in order under a new shape: under padding their
# layouts follow, keeping symbolic factors whole, which ``dynamic.py`` checks.
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# Dynamic shapes: views, copies and allocations are position-wise (``padding.py``).
padding_rule(
    aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.expand.default, aten.empty.memory_format, aten.full_like.default,
    aten.empty_like.default, aten.copy.default, *SIZE_READS, *RESHAPES,
)(padding.positionwise)
