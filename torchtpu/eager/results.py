"""Result descriptions and their memory layouts: what ``meta.describe`` says of an op's results
((shape, dtype) leaves, or (shape, dtype, layout) where the result is laid out otherwise than
row-major: a memory format, or the strides of a dense layout in another order; in tuples as the
op returns them), and tensors laid out as CPU lays them (channels-last results of elementwise
ops, batch norm, pooling, convolutions; SDPA's output in its query's order).

The device's arrays are row-major; a result CPU gives in channels-last becomes a tensor of that
memory format by one transposing copy (``lay_out``), as CUDA's kernels write channels-last. A
pointwise op's program computes its result in memory order itself (``Stored``, its spec's
``order``): no copy.
"""

from __future__ import annotations

import functools

import torch
from jax._src.array import ArrayImpl

from torchtpu import errors
from torchtpu.device import dtypes, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.device.views import Geometry, check_in_bounds, dense_order
from torchtpu.eager.lazy_casts import Converted


class Stored(tuple):
    """A result's strides, where its program returns it in memory order already (its spec's
    ``order``): the array is the storage's as it comes, and the tensor is made around it."""


def is_leaf(d) -> bool:
    """Whether d describes one result: (shape, dtype) or (shape, dtype, memory format)."""
    return isinstance(d, tuple) and len(d) in (2, 3) and isinstance(d[1], torch.dtype)


def wrapped(arrays, d, op=None):
    """The tensors of an op's computed arrays, as the description d of its results says; ``op``
    (the call's, where the caller knows it) is named where an array is not of d's shape."""
    if d is None or arrays is None:
        return None
    if type(d) is int:
        return d
    if is_leaf(d):
        if len(d) == 3 and type(d[2]) is Stored:
            return tensors.wrap_strided(arrays, d[1], d[0], d[2])
        check_shape(arrays, d[0], op)
        out = tensors.wrap(arrays, d[1])
        return lay_out(out, d[2]) if len(d) == 3 else out
    return tuple(wrapped(a, r, op) for a, r in zip(arrays, d))


def check_shape(array, shape: tuple, op=None) -> None:
    """Refuse a program's result array of another shape than its description's (PyTorch's meta
    kernel's). A first call's tensor takes its array's shape (``tensors.wrap``), a repeated
    call's the description's (``wrapper``, made once): a lowering that disagreed with meta gave
    repeats tensors reaching past their arrays (``_embedding_bag``'s bag sizes, one per bag
    where meta has one per offset), found only by a later reader, far from the op."""
    have = array.aval.shape if type(array) is ArrayImpl else tuple(array.shape)
    if have != shape:
        raise RuntimeError(errors.message(
            "unsupported", f"{op or 'an op'}'s tpu lowering returned a result of shape "
            f"{list(have)} where PyTorch's meta kernel says {list(shape)}; a torchtpu bug: "
            "please file an issue with the call"))


def wrapper(d):
    """``wrapped`` for arrays described by d, made once for calls that repeat d (``seen_calls``):
    one plain result's tensor made as ``tensors.wrapper`` makes it, one in memory order
    (``Stored``) so too, a float one laid out otherwise by ``_laid_wrapper``; a tuple of
    results (``_foreach_norm``'s, one a parameter; SDPA's) by a maker each."""
    if is_leaf(d):
        if len(d) == 2:
            return tensors.wrapper(tuple(d[0]), d[1])
        if type(d[2]) is Stored:
            return tensors.wrapper(tuple(d[0]), d[1], tuple(d[2]))
        if d[1] in _FLOATS:
            return _laid_wrapper(d)
    elif type(d) is tuple and d and all(r is None or type(r) is int or is_leaf(r) for r in d):
        # (make, what ``wrapped`` gives without one: None, or a number result as it is)
        parts = [(None, r) if r is None or type(r) is int else (wrapper(r), None) for r in d]
        return lambda arrays: None if arrays is None else tuple(
            [fixed if make is None else None if a is None else make(a)
             for (make, fixed), a in zip(parts, arrays)])
    return functools.partial(wrapped, d=d)


def stored_order(d) -> tuple | None:
    """For a one-result description d laid out otherwise than row-major: (its dims in memory
    order, d with the array in that order, ``Stored``); else None."""
    if not (is_leaf(d) and len(d) == 3):
        return None
    strides = strides_of(d)
    order = dense_order(tuple(d[0]), strides)
    return None if order is None else (order, (d[0], d[1], Stored(strides)))


def laid_out(d, fmt):
    """Result description d with its results of fmt's rank in memory format fmt (all of them
    contiguous for torch.contiguous_format)."""
    if fmt is None or d is None or type(d) is int:
        return d
    if is_leaf(d):
        if fmt is torch.contiguous_format:
            return d[:2]
        rank = 4 if fmt is torch.channels_last else 5
        return (d[0], d[1], fmt) if len(d[0]) == rank else d
    return tuple(laid_out(x, fmt) for x in d)


def _laid_wrapper(d):
    """``wrapped`` for one float result laid out otherwise than row-major (d's third part: SDPA's
    output and gradients, 48 calls of a 12-layer Llama step), made once: while Strict's lazy
    casts are on, an array of d's shape and dtype is read through the permutation
    (``_laid_lazily``'s value) by a tensor made at once, the view found once; anything else
    takes ``wrapped``'s path."""
    shape, dtype = tuple(d[0]), d[1]
    stride = strides_of(d)
    view = _layout_view(shape, dtype, _memory_order(stride))
    make = tensors.wrapper(shape, dtype, stride)
    want = view.array_dtype

    def wrap_laid(array):
        if HOOKS.lazy_cast is None or type(array) is not ArrayImpl:
            return wrapped(array, d)
        aval = array.aval
        if aval.dtype != want or aval.shape != shape:
            return wrapped(array, d)
        return make(Converted(array, want, view.size, view=view))

    return wrap_laid


def _memory_order(stride: tuple) -> list:
    """The dims of a dense layout of these strides, outermost first."""
    return sorted(range(len(stride)), key=lambda d: (-stride[d], d))


def _layout_view(shape: tuple, dtype: torch.dtype, order: list) -> Geometry:
    """The view reading a row-major array of shape (of dtype's) as its dims in order."""
    rows = tensors.contiguous_strides(shape)
    view = Geometry(shape, dtypes.to_jax(dtype), tuple(shape[d] for d in order),
                    tuple(rows[d] for d in order), 0, dtypes.layout(dtype))
    check_in_bounds(view)
    return view


def lay_out(t: torch.Tensor, fmt: torch.memory_format | tuple) -> torch.Tensor:
    """t in layout fmt (a memory format, or strides): CPU's strides, as CUDA's kernels write
    channels-last. The storage is t's dims in fmt's order made contiguous (``clone`` of a
    permuted view: an op call, which a growing loop runs padded at its size buckets as any
    other, where a copy into an ``empty_strided`` tensor compiled per length), viewed back."""
    fmt = strides_of((t.shape, t.dtype, fmt))
    order = _memory_order(fmt)
    laid = _laid_lazily(t, order, fmt)
    if laid is None:
        laid = _laid_deferred(t, order, fmt)
    return t.permute(order).contiguous().as_strided(t.shape, fmt) if laid is None else laid


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _laid_lazily(t: torch.Tensor, order: list, stride: tuple) -> torch.Tensor | None:
    """``lay_out``'s tensor without its three dispatched calls (~40 us of host a call: SDPA's
    output and gradients, 48 of a 12-layer step), for a float tensor that is its storage's array
    whole while Strict's lazy casts are on: its storage holds the array read through the
    permutation, the value the copy of that view holds (``lazy_casts._lazy_view``: each reader's
    program reads it so); else None."""
    array = t.untyped_storage()._tpu_array
    if (HOOKS.lazy_cast is None or type(array) is not ArrayImpl or t.dtype not in _FLOATS
            or t.storage_offset() or not t.is_contiguous() or t.is_neg()
            or array.aval.dtype != dtypes.to_jax(t.dtype) or array.aval.shape != t.shape):
        return None
    shape = tuple(t.shape)
    view = _layout_view(shape, t.dtype, order)
    return tensors.wrap_strided(Converted(array, array.dtype, view.size, view=view), t.dtype,
                                shape, stride)


def _laid_deferred(t: torch.Tensor, order: list, stride: tuple) -> torch.Tensor | None:
    """``lay_out``'s tensor while DeferAndFuse records, for a tensor that is its storage's
    value whole, pending: the value in memory order by one recorded call, the
    tensor made around it. The three dispatched calls it replaces (a view, the copy's op path,
    a view back) cost ~0.4-0.8 ms of host a call in a recording (SDPA's output and gradients, 48
    calls of a 12-layer Llama step); the storage then holds what the copy held, the value
    transposed by ``order``. Else None (a capture, a padded or lazy value, a view, a computed
    value: a growing loop's bucketed call leaves its result computed at its exact length, where
    the copy's op path runs padded at the bucket and a recorded transpose would make a program
    per length)."""
    if HOOKS.deferrer is None or HOOKS.capture is not None or t.storage_offset() \
            or not t.is_contiguous() or t.is_neg() or t.is_conj():
        return None
    st = t.untyped_storage()
    value = getattr(st, "_tpu_array", None)
    if not getattr(type(value), "whole_is_itself", False) or tuple(value.shape) != tuple(t.shape) \
            or value.dtype != dtypes.to_jax(t.dtype) or st.nbytes() != t.numel() * t.element_size():
        return None
    return tensors.wrap_strided(tensors.in_order(value, order), t.dtype, tuple(t.shape), stride)


def strides_of(d) -> tuple:
    """The strides of the result leaf d describes."""
    fmt = d[2] if len(d) == 3 else torch.contiguous_format
    if isinstance(fmt, tuple):
        return fmt
    return torch.empty(d[0], device="meta", memory_format=fmt).stride()


def _in_layout(t: torch.Tensor, fmt: torch.memory_format | tuple) -> bool:
    return t.stride() == fmt if isinstance(fmt, tuple) else t.is_contiguous(memory_format=fmt)


def relaid(out, d):
    """A decomposition's results out in the layouts the description d names."""
    if is_leaf(d):
        if len(d) == 3 and isinstance(out, torch.Tensor) and not _in_layout(out, d[2]):
            return lay_out(out, d[2])
        return out
    if isinstance(d, tuple) and isinstance(out, (tuple, list)):
        laid = [relaid(o, x) for o, x in zip(out, d)]
        return laid if isinstance(out, list) else tuple(laid)
    return out


def laid_operand(args) -> bool:
    """Whether a 4-d / 5-d tensor among args is not contiguous (may be channels-last)."""
    return any(isinstance(a, torch.Tensor) and a.dim() in (4, 5) and not a.is_contiguous()
               for a in args)


def formatted(d) -> bool:
    """Whether a result description names a memory format anywhere (channels-last results)."""
    if is_leaf(d):
        return len(d) == 3
    return isinstance(d, tuple) and any(formatted(x) for x in d)


def map_described(d, fn):
    """fn of every result d describes, in d's structure (None for untyped results)."""
    if d is None or type(d) is int:  # an int result has no dtype (see meta.describe)
        return None
    if is_leaf(d):
        return fn(d)
    return tuple(map_described(x, fn) for x in d)
