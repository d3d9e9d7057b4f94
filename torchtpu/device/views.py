"""Pure JAX readers and writers of a strided view over a storage's bytes.

A storage array is C-contiguous and its bytes are the storage's bytes. A tensor is a view
(size, stride, offset, dtype) over them. ``read_view`` gathers the view out of the array and
``write_view`` returns the array with the view replaced. Both are pure functions of arrays and a
static ``Geometry``, so every executor can use them: eager jits one reader and one writer per
geometry, and a fused or compiled program inlines them.

Strided boxes (contiguous blocks and permutations of them, the result of slicing, ``view``,
``transpose``, ``permute``, ``split`` along the last dim, steps: ``_box_plan``) lower to
slice/reshape/transpose; other views (diagonals, overlapping windows: ``unfold``, ``as_strided``)
to one gather or scatter with indices computed in-graph from iotas, so no index constant grows
with the tensor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu import errors
from torchtpu.device.dtypes import COMPLEX32, value_dtype


class Geometry(NamedTuple):
    """Everything static about reading one tensor out of one storage array."""

    array_shape: tuple
    array_dtype: np.dtype
    size: tuple
    stride: tuple
    offset: int
    dtype: np.dtype


def _as_bits(dtype: np.dtype) -> np.dtype:
    # bool has no bitcast in XLA; it is one byte, so it travels as uint8.
    return np.dtype(np.uint8) if dtype == np.bool_ else dtype


def _bitcast_flat(flat, dtype: np.dtype):
    """Reinterpret a 1-d array's bytes as another dtype, still 1-d."""
    src = flat.dtype
    if src == dtype:
        return flat
    if dtype == COMPLEX32:  # float16 (real, imag) pairs, computed on as complex64
        pairs = _bitcast_flat(flat, np.dtype(np.float16)).reshape(-1, 2).astype(np.float32)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    # XLA cannot bitcast complex values; their bytes are (real, imag) pairs of floats.
    if np.issubdtype(src, np.complexfloating):
        return _bitcast_flat(jnp.stack([flat.real, flat.imag], -1).reshape(-1), dtype)
    if np.issubdtype(dtype, np.complexfloating):
        part = np.dtype(np.float32 if dtype == np.complex64 else np.float64)
        pairs = _bitcast_flat(flat, part).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if src == np.bool_:
        flat = flat.astype(np.uint8)
    target = _as_bits(dtype)
    if flat.dtype != target:
        a, b = flat.dtype.itemsize, target.itemsize
        if a > b:
            flat = lax.bitcast_convert_type(flat, target).reshape(-1)
        elif a < b:
            flat = lax.bitcast_convert_type(flat.reshape(-1, b // a), target)
        else:
            flat = lax.bitcast_convert_type(flat, target)
    return flat != 0 if dtype == np.bool_ else flat


def complex32_pairs(value):
    """complex values as complex32 stores them: float16 (real, imag) pairs in a last dim of 2,
    each part rounded to nearest as PyTorch's CPU rounds."""
    return jnp.stack([value.real.astype(np.float16), value.imag.astype(np.float16)], -1)


def check_in_bounds(g: Geometry) -> None:
    """Raise if g reaches past the end of its storage array."""
    # A storage shrunk under its tensors (``untyped_storage().resize_(0)``, as FSDP2 frees
    # parameters) leaves views that reach past its end; say so rather than fail inside JAX.
    if 0 in g.size:
        return
    itemsize = np.dtype(g.dtype).itemsize
    end = (g.offset + 1 + sum((n - 1) * s for n, s in zip(g.size, g.stride))) * itemsize
    have = math.prod(g.array_shape) * np.dtype(g.array_dtype).itemsize
    if end > have:
        raise RuntimeError(errors.message(
            "argument", f"a tpu tensor of shape {list(g.size)} reaches byte {end} of its "
            f"storage, which holds {have} bytes (was the storage resized, e.g. freed by FSDP2 "
            f"outside forward/backward?); resize the storage back before using the tensor"))


def _box_plan(size: tuple, stride: tuple):
    """(box, taken, dim order) when the view is a strided box of the storage, else None.

    A strided box: the view's dims, ordered by stride, each stride a whole multiple of the next
    one's and at least that dim's extent, so the view is a corner of the storage's elements
    from the offset reshaped to ``box`` (``taken`` of each box dim kept; the last box dim is the
    innermost step, of which the first element is kept). A permuted contiguous block is the case
    where everything is kept; the columns of a fused projection's split (q, k and v of one
    qkv tensor, viewed per head and transposed) or a step along the last dim are the others.
    Such a view lowers to slices and a reshape instead of a gather of computed indices (which a
    TPU runs element by element, with int64 index math it emulates). Size-1 dims and stride-0
    (expanded) dims are left out; they come back by broadcast.
    """
    dims = [d for d in range(len(size)) if size[d] != 1 and stride[d] != 0]
    order = sorted(dims, key=lambda d: -stride[d])
    steps = [stride[d] for d in order] + [1]
    for i in range(len(order)):
        if steps[i] % steps[i + 1] or (i + 1 < len(order)
                                       and steps[i] < size[order[i + 1]] * steps[i + 1]):
            return None
    box = tuple([size[order[0]]] if order else []) + tuple(
        steps[i] // steps[i + 1] for i in range(len(order) - 1)) + (steps[-2] if order else 1,)
    taken = tuple(size[d] for d in order) + (1,)
    return box, taken, tuple(order)


def _box(flat, offset: int, box: tuple):
    """flat[offset:] reshaped to box (zeros past flat's end: the last row of a box may reach
    past it; only kept elements are ever read back) and the padded flat array."""
    end = offset + math.prod(box)
    extra = end - flat.shape[0]
    padded = lax.pad(flat, np.zeros((), flat.dtype), [(0, extra, 0)]) if extra > 0 else flat
    return lax.slice(padded, (offset,), (end,)).reshape(box), padded


def _in_place_box(g: Geometry, box: tuple, taken: tuple):
    """(shape, start, taken) when the box is a slice of the storage array reshaped to shape
    (the box with its first dim grown to the whole array, its innermost step dropped when it
    is 1), starting at the coordinates the offset lands on; else None.

    Read this way the array is never flattened: on a TPU a 1-d array is laid out in other
    tiles than an n-d one, so reshaping to 1-d and back copies the storage twice (a fused qkv
    projection's q, k and v each did).
    """
    if np.dtype(g.array_dtype) != np.dtype(g.dtype) or len(box) < 2:
        return None
    if box[-1] == 1:
        box, taken = box[:-1], taken[:-1]
    inner = math.prod(box[1:])
    n = math.prod(g.array_shape)
    if n % inner:
        return None
    shape = (n // inner, *box[1:])
    start, rest = [], g.offset
    for i in range(len(shape)):
        step = math.prod(shape[i + 1:])
        start.append(rest // step)
        rest %= step
    if any(s + t > d for s, t, d in zip(start, taken, shape)):
        return None
    return shape, tuple(start), taken


def dense_order(size: tuple, stride: tuple) -> tuple | None:
    """The view's dims in memory order (size-1 dims first) when its elements are a row-major
    block in another dim order (each stride the product of the sizes of the dims inside it: a
    transposed or channels-last tensor of its own), else None. Transposed by this order the
    view's value is an array whose row-major elements are the block's, in memory order."""
    if 0 in size:
        return None
    order = sorted((d for d, n in enumerate(size) if n != 1), key=lambda d: -stride[d])
    step = 1
    for d in reversed(order):
        if stride[d] != step:
            return None
        step *= size[d]
    return tuple(d for d, n in enumerate(size) if n == 1) + tuple(order)


def in_memory_order(value, order: tuple):
    """value (a ``dense_order`` view's) as its storage holds it: its dims in memory order."""
    return value.transpose(order)


def _iota_index(size: tuple, stride: tuple, offset: int):
    idx = jnp.asarray(offset, jnp.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        if n != 1 and s != 0:
            idx = idx + lax.broadcasted_iota(jnp.int64, size, d) * s
    return jnp.broadcast_to(idx, size)


def read_view(array, g: Geometry):
    """The tensor described by g, read out of the storage array."""
    if 0 in g.size:
        return jnp.zeros(g.size, value_dtype(g.dtype))
    plan = _box_plan(g.size, g.stride)
    in_place = plan and _in_place_box(g, *plan[:2])
    flat = None if in_place else _bitcast_flat(array.reshape(-1), g.dtype)
    if plan is not None:
        box, taken, order = plan
        if in_place:
            shape, start, kept_box = in_place
            part = lax.slice(array.reshape(shape), start,
                             tuple(s + t for s, t in zip(start, kept_box)))
        else:
            part = lax.slice(_box(flat, g.offset, box)[0], (0,) * len(box), taken)
        part = part.reshape(taken[:-1])
        # Put the block's dims where they belong, then broadcast over size-1 and expanded dims.
        kept = sorted(order)
        part = part.transpose([order.index(d) for d in kept])
        return lax.broadcast_in_dim(part, g.size, tuple(kept))
    return flat[_iota_index(g.size, g.stride, g.offset)]


def run_of(g: Geometry) -> Geometry | None:
    """g at offset 0 when its view is one run of consecutive elements along at most one dim (an
    element, a row, a stride-1 slice) in the storage's own dtype, else None. Such a view is
    written by ``write_run`` with the offset as an argument: a static offset made a loop that
    writes element by element (``out[i] = v``, as PyTorch's reference loops do) compile one
    program per element."""
    if np.dtype(g.array_dtype) != np.dtype(g.dtype) or g.dtype == COMPLEX32 or 0 in g.size:
        return None
    long = [s for n, s in zip(g.size, g.stride) if n != 1]
    if len(long) > 1 or (long and long[0] != 1):
        return None
    return g._replace(offset=0)


def rows_of(g: Geometry) -> int | None:
    """The first of the storage array's rows (along its last dim) that view g covers, when g is
    a contiguous block of whole rows in the storage's own dtype (one layer's weight, or a part
    of it, in a ``[layers, ...]`` stack), else None. Such a view is written by ``write_rows``
    with the row as an argument, in the array's own layout: a static offset compiled a writer
    per layer for every weight pushed into a stack."""
    if (np.dtype(g.array_dtype) != np.dtype(g.dtype) or g.dtype == COMPLEX32 or 0 in g.size
            or len(g.array_shape) < 2):
        return None
    step = 1
    for n, s in reversed(list(zip(g.size, g.stride))):
        if n != 1 and s != step:
            return None
        step *= n
    width = g.array_shape[-1]
    if step % width or g.offset % width:
        return None
    return g.offset // width


def write_rows(array, value, row):
    """The storage array with rows ``row`` on (``rows_of``) replaced by value's elements."""
    width = array.shape[-1]
    rows = lax.dynamic_update_slice(array.reshape(-1, width),
                                    value.reshape(-1, width).astype(array.dtype), (row, 0))
    return rows.reshape(array.shape)


def write_run(array, value, offset):
    """The storage array with the run of ``value.size`` elements at offset (a ``run_of`` view,
    checked in bounds by the caller) replaced by value."""
    flat = lax.dynamic_update_slice(array.reshape(-1), value.reshape(-1).astype(array.dtype),
                                    (offset,))
    return flat.reshape(array.shape)


def write_view(array, value, g: Geometry):
    """The storage array with the view g replaced by value (shape g.size, dtype g.dtype)."""
    if 0 in g.size:
        return array
    plan = _box_plan(g.size, g.stride)
    if plan is not None and all(s != 0 for n, s in zip(g.size, g.stride) if n != 1):
        box, taken, order = plan
        kept = sorted(order)
        squeezed = value.reshape([g.size[d] for d in kept]) if kept else value.reshape(())
        part = squeezed.transpose([kept.index(d) for d in order])
        in_place = _in_place_box(g, box, taken)
        if in_place:
            shape, start, kept_box = in_place
            region = array.reshape(shape)
            return lax.dynamic_update_slice(region, part.reshape(kept_box).astype(region.dtype),
                                            start).reshape(g.array_shape)
        flat = _bitcast_flat(array.reshape(-1), g.dtype)
        if box == taken:  # a contiguous block
            flat = lax.dynamic_update_slice(flat, part.reshape(-1), (g.offset,))
        else:
            region, padded = _box(flat, g.offset, box)
            region = lax.dynamic_update_slice(region, part.reshape(taken), (0,) * len(box))
            n = flat.shape[0]
            flat = lax.dynamic_update_slice(padded, region.reshape(-1), (g.offset,))[:n]
    else:
        flat = _bitcast_flat(array.reshape(-1), g.dtype)
        flat = flat.at[_iota_index(g.size, g.stride, g.offset).reshape(-1)].set(value.reshape(-1))
    if g.dtype == COMPLEX32:
        flat = complex32_pairs(flat).reshape(-1)
    return _bitcast_flat(flat, g.array_dtype).reshape(g.array_shape)
