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

from torchtpu.device import tensors
from torchtpu.device.views import dense_order


class Stored(tuple):
    """A result's strides, where its program returns it in memory order already (its spec's
    ``order``): the array is the storage's as it comes, and the tensor is made around it."""


def is_leaf(d) -> bool:
    """Whether d describes one result: (shape, dtype) or (shape, dtype, memory format)."""
    return isinstance(d, tuple) and len(d) in (2, 3) and isinstance(d[1], torch.dtype)


def wrapped(arrays, d):
    """The tensors of an op's computed arrays, as the description d of its results says."""
    if d is None or arrays is None:
        return None
    if type(d) is int:
        return d
    if is_leaf(d):
        if len(d) == 3 and type(d[2]) is Stored:
            return tensors.wrap_strided(arrays, d[1], d[0], d[2])
        out = tensors.wrap(arrays, d[1])
        return lay_out(out, d[2]) if len(d) == 3 else out
    return tuple(wrapped(a, r) for a, r in zip(arrays, d))


def wrapper(d):
    """``wrapped`` for arrays described by d, made once for calls that repeat d (``seen_calls``):
    one plain result's tensor made as ``tensors.wrapper`` makes it."""
    if is_leaf(d) and len(d) == 2:
        return tensors.wrapper(tuple(d[0]), d[1])
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


def lay_out(t: torch.Tensor, fmt: torch.memory_format | tuple) -> torch.Tensor:
    """t in layout fmt (a memory format, or strides): CPU's strides, as CUDA's kernels write
    channels-last. The storage is t's dims in fmt's order made contiguous (``clone`` of a
    permuted view: an op call, which a growing loop runs padded at its size buckets as any
    other, where a copy into an ``empty_strided`` tensor compiled per length), viewed back."""
    fmt = strides_of((t.shape, t.dtype, fmt))
    order = sorted(range(t.dim()), key=lambda d: (-fmt[d], d))
    return t.permute(order).contiguous().as_strided(t.shape, fmt)


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
