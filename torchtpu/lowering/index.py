"""Advanced indexing and masks: index, index_put, masked_scatter/select, nonzero, unique.

Ops whose result shape depends on values (nonzero, masked_select, unique, ``x[mask]``) are
registered with ``data_dependent_shape`` and run on concrete arrays. Boolean masks in
``index_put`` are handled in-graph with a running count of the mask, so ``x[mask] = v`` compiles
once per shape. Reads and writes along one dim (gather, scatter, index_select...) are
``scatter.py``'s; searches and segments ``search.py``'s.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx as fx
from jax import lax

from torchtpu.cache import warm_dispatch
from torchtpu.lowering.checks import out_of_bounds
from torchtpu.lowering.padding import Mask, Refused, first, padded, val
from torchtpu.lowering.registry import check, lowers, padding_rule

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


def _true_counts_of(masks: list) -> list:
    return [jnp.count_nonzero(m) for m in masks]


# These programs run on concrete arrays outside any executor's program, so they are keyed
# (``warm_dispatch``): a new process loads them by key instead of tracing each (a colocated GRPO
# step's first step traced 5, ~18% of its host time: bench/RESULTS.md, rl7).
_true_counts = warm_dispatch.keyed(jax.jit(_true_counts_of), "mask_counts")


def _counts(masks: list) -> list[int]:
    """How many elements of each concrete mask are true (nonzero): one program, one host read.
    Their sizes are static in the program that follows, which is then one program too: JAX's
    own ``nonzero`` without a size runs each of its ~12 steps as a program of its own."""
    return [int(n) for n in jax.device_get(_true_counts(masks))]


@functools.lru_cache(maxsize=1024)
def _gather_at(sizes: tuple) -> Callable:
    """The program taking ``x[indices]`` whose masks have these counts of true elements."""
    return warm_dispatch.keyed(jax.jit(functools.partial(_gather, sizes)), "mask_gather", sizes)


def _gather(sizes: tuple, x, indices: list):
    # sizes: each mask's count of true elements (None for other indices)
    expanded = []
    for i, n in zip(indices, sizes):
        expanded.extend([i] if n is None else jnp.nonzero(i.astype(jnp.bool_), size=n))
    return unsafe_index(x, expanded)


def _masks_select(x, indices) -> bool:
    if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return True
    return False


def _selects(x, mask) -> bool:
    return True


@lowers(aten.index.Tensor, data_dependent_shape=_masks_select)
def index(x, indices):
    # ``x[mask]`` arrives with the boolean mask itself; its true positions decide the shape, so
    # masks become their nonzero indices here, counted first, and the gather runs as one program.
    counts = iter(_counts([i for i in indices if _is_mask(i)]))
    return _gather_at(tuple(next(counts) if _is_mask(i) else None for i in indices))(x, indices)


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
    return add_at(x.at[where], values) if accumulate else set_at(x, where, values)


def set_at(x, where, values):
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


def add_at(ref, values):
    """A scatter-add, as CPU accumulates: for bool, a logical or (XLA has no bool add)."""
    return ref.max(values) if values.dtype == jnp.bool_ else ref.add(values)


@lowers(aten._index_put_impl.default)
def index_put_impl(x, indices, values, accumulate=False, unsafe=False):
    return index_put(x, indices, values, accumulate)


def _mask_mismatch(self, d: int, mask) -> IndexError | None:
    indexed = tuple(self.shape[d:d + mask.ndim])
    if indexed != mask.shape:
        return IndexError(f"The shape of the mask {list(mask.shape)} at index {d} does not match "
                          f"the shape of the indexed tensor {list(self.shape)} at index {d}")
    return None


@check(aten.index.Tensor, aten.index_put.default, aten._index_put_impl.default)
def _index_check(self, indices, values=None, *rest):
    d = 0  # the dimension the next index applies to (a mask covers one per dimension of its own)
    for index in indices:
        if index is not None and index.dtype == torch.uint8:
            # What CPU warns, once per byte mask of each call.
            warnings.warn("torchtpu.check: indexing with dtype torch.uint8 is now deprecated, "
                          "please use a dtype torch.bool instead.", UserWarning, stacklevel=2)
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            err = _mask_mismatch(self, d, index)
            if err is not None:
                return err
            if values is not None and len(indices) == 1:
                err = _masked_values_mismatch(self, index, values)
                if err is not None:
                    return err
            d += index.ndim
            continue
        err = out_of_bounds(index, self.shape[d], d, negative=True) if d < self.ndim else None
        if err is not None:
            return err
        d += 1
    return None


def _masked_values_mismatch(self, mask, values) -> RuntimeError | None:
    ones = mask.values()
    if ones is None:
        return None
    selected = (int(ones.sum()), *self.shape[mask.ndim:])
    try:
        fits = np.broadcast_shapes(values.shape, selected) == selected
    except ValueError:
        fits = False
    if fits:
        return None
    return RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be "
                        f"broadcast to indexing result of shape {list(selected)}")


@lowers(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    mask = jnp.broadcast_to(mask, x.shape)
    if source.size == 0:  # nothing to place (PyTorch rejects a true mask position then)
        return x
    rank = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, max(source.size - 1, 0))
    placed = source.reshape(-1)[rank].reshape(x.shape).astype(x.dtype)
    return jnp.where(mask, placed, x)


@check(aten.masked_scatter.default)
def _masked_scatter_check(self, mask, source):
    if mask.dtype != torch.bool:
        return RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with "
                            f"dtype {mask.dtype}")
    available = int(np.prod(source.shape))
    # the mask counts as broadcast with self: a (5, 1, 5) mask over a (5, 0, 5) self has no ones
    shape = tuple(np.broadcast_shapes(self.shape, mask.shape))
    ones = mask.values()
    if ones is None:
        mask.check_on_device(_more_ones_than(available, shape),
                             functools.partial(_source_too_small, available=available))
    elif int(np.broadcast_to(ones, shape).sum()) > available:
        return _source_too_small(int(np.broadcast_to(ones, shape).sum()), available)
    return None


def _source_too_small(needed: int, available: int) -> RuntimeError:
    return RuntimeError("masked_scatter: expected source to have at least as many elements as "
                        f"ones in mask ({needed}), got {available}")


@functools.lru_cache(maxsize=512)
def _more_ones_than(available: int, shape: tuple) -> Callable:
    def find(mask):
        ones = jnp.broadcast_to(mask, shape).sum(dtype=jnp.int64)
        return jnp.stack([ones > available, ones]).astype(jnp.int64)

    return find


@lowers(aten.masked_select.default, data_dependent_shape=_selects)
def masked_select(x, mask):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    # broadcasting repeats each element of the mask the same number of times
    repeats = math.prod(shape) // mask.size if mask.size else 0
    return _select_at(_counts([mask])[0] * repeats, shape)(x, mask)


@functools.lru_cache(maxsize=1024)
def _select_at(size: int, shape: tuple) -> Callable:
    return warm_dispatch.keyed(jax.jit(functools.partial(_select, size, shape)), "mask_select",
                               size, shape)


def _select(size: int, shape: tuple, x, mask):
    # in flat order: a 0-d pair too gives PyTorch's 1-d result
    return _gather((size,), jnp.broadcast_to(x, shape).ravel(),
                   [jnp.broadcast_to(mask, shape).ravel()])


@check(aten.masked_select.default)
def _masked_select_check(self, mask):
    if mask.dtype != torch.bool:
        return RuntimeError("masked_select: expected BoolTensor for mask")
    return None


@lowers(aten.nonzero.default, data_dependent_shape=True)
def nonzero(x):
    return _argwhere(_counts([x])[0])(x)


@functools.lru_cache(maxsize=1024)
def _argwhere(size: int) -> Callable:
    return warm_dispatch.keyed(jax.jit(functools.partial(_argwhere_of, size=size)),
                               "mask_argwhere", size)


def _argwhere_of(x, size: int):
    return jnp.argwhere(x, size=size).astype(jnp.int64)


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

