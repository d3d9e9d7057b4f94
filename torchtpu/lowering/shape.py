"""Shape and layout ops that produce new buffers.

cat, padding (constant, reflect, replicate), flip, roll, repeat, tril/triu, masked_fill, and the
functional view writes (slice/select/diagonal_scatter) that backward passes use. Pure view ops
(view, transpose, select, slice, expand...) are PyTorch's own metadata kernels and never come here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.fx as fx
from jax import lax

from torchtpu.lowering import padding
from torchtpu.lowering.padding import Refused, first
from torchtpu.lowering.registry import channels_last_of, lowers, padding_rule

aten = torch.ops.aten


@lowers(aten.cat.default, held=True)
def cat(tensors, dim=0):
    """Held by Strict until its reader computes it (the rotary halves' of every attention
    layer: one launch each of the 24 a 12-layer step made)."""
    # PyTorch still accepts 1-d empty tensors next to tensors of any rank and skips them.
    ndim = max(t.ndim for t in tensors)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0 and ndim != 1)]
    if not kept:
        return tensors[0]
    dtype = jnp.result_type(*kept)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=dim % ndim)


padding_rule(aten.cat.default)(padding.along(1, of_list=True))  # dynamic shapes


@lowers(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0):
    # pad lists (before, after) pairs from the last dim backwards; negative pads crop.
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        config[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(x, jnp.asarray(value).astype(x.dtype), config)


def _pad_last_dims(x, pad, mode: str):
    widths = [(0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        widths[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    if min(pad, default=0) >= 0:
        return jnp.pad(x, widths, mode=mode)
    # A negative pad crops that side, and the reflected or repeated edge is still the input's
    # (so a reflection may reach into the cropped part): output j reads input j - before,
    # folded back into range.
    for d, (before, after) in enumerate(widths):
        if before or after:
            k = jnp.arange(x.shape[d] + before + after) - before
            last = x.shape[d] - 1
            k = jnp.abs(k) if mode == "reflect" else jnp.clip(k, 0, last)
            x = jnp.take(x, jnp.where(k > last, 2 * last - k, k), axis=d)
    return x


# CPU's padding kernels (and their backwards) keep the input's channels-last layout; the meta
# kernels give contiguous results.
def _input_layout(x, *_) -> torch.memory_format | None:
    return channels_last_of(x)


def _grad_input_layout(grad, x, *_) -> torch.memory_format | None:
    return channels_last_of(x)


@lowers(aten.reflection_pad1d.default, aten.reflection_pad2d.default,
        aten.reflection_pad3d.default, layout=_input_layout)
def reflection_pad(x, padding):
    return _pad_last_dims(x, padding, "reflect")


@lowers(aten.replication_pad1d.default, aten.replication_pad2d.default,
        aten.replication_pad3d.default, layout=_input_layout)
def replication_pad(x, padding):
    return _pad_last_dims(x, padding, "edge")


def _pad_backward(grad, x, padding, mode: str):
    _, vjp = jax.vjp(lambda a: _pad_last_dims(a, padding, mode), x)
    return vjp(grad.astype(x.dtype))[0]


# PyTorch's decomposition of the reflection backwards does not accept the out= form the autograd
# kernels call, and the replication backwards have none.
@lowers(aten.reflection_pad1d_backward.default, aten.reflection_pad2d_backward.default,
        aten.reflection_pad3d_backward.default, layout=_grad_input_layout)
def reflection_pad_backward(grad, x, padding):
    return _pad_backward(grad, x, padding, "reflect")


@lowers(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
        aten.replication_pad3d_backward.default, layout=_grad_input_layout)
def replication_pad_backward(grad, x, padding):
    return _pad_backward(grad, x, padding, "edge")


@lowers(aten.flip.default)
def flip(x, dims):
    return jnp.flip(x, [d % x.ndim for d in dims]) if x.ndim else x


@lowers(aten.roll.default)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(dims))


@lowers(aten.repeat.default)
def repeat(x, repeats):
    x = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, tuple(repeats))


@lowers(aten.tril.default)
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowers(aten.triu.default)
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@padding_rule(aten.tril.default, aten.triu.default)
def _triangle_padding(node: fx.Node, layouts: dict) -> list:
    # Dynamic shapes: position-wise for leading-block layouts.
    if any(len(first(node, layouts)[d]) > 1 for d in (-2, -1)):
        raise Refused(f"{node.target} on a merged dim")
    return []


@lowers(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(x.dtype), x)


@lowers(aten.lift_fresh_copy.default)
def lift_fresh_copy(x):
    return x


@lowers(aten.narrow_copy.default)
def narrow_copy(x, dim: int, start: int, length: int):
    # A lowering rather than PyTorch's composite kernel (narrow + clone), whose argument errors
    # differ from CPU's own kernel's.
    start = start + x.shape[dim] if start < 0 else start
    return lax.slice_in_dim(x, start, start + length, axis=dim)


@lowers(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    where = [slice(None)] * x.ndim
    where[dim] = slice(start, end, step)
    return x.at[tuple(where)].set(src.astype(x.dtype))


@lowers(aten.slice_backward.default, held=True)
def slice_backward(grad, input_sizes, dim: int, start: int, end: int, step: int):
    """The gradient of a slice: grad in place in zeros of the input's shape, one pad (its
    composite kernel made the zeros and then wrote the slice into them: two programs, which the
    rotary halves of every attention layer's backward ran four times); held until its reader
    (the sum of the halves' gradients) computes it in its own program."""
    dim %= len(input_sizes)
    size, n = input_sizes[dim], grad.shape[dim]
    start = min(max(start + size if start < 0 else start, 0), size)
    if n == 0:
        return jnp.zeros(tuple(input_sizes), grad.dtype)
    config = [(0, 0, 0)] * grad.ndim
    config[dim] = (start, size - start - (n - 1) * step - 1, step - 1)
    return lax.pad(grad, jnp.zeros((), grad.dtype), config)


@lowers(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    return x.at[(slice(None),) * (dim % x.ndim) + (index,)].set(src.astype(x.dtype))


@lowers(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    # The diagonal of dims (dim1, dim2) is the last dim of src, as in ``diagonal``.
    dim1, dim2 = dim1 % x.ndim, dim2 % x.ndim
    n = src.shape[-1]
    i = jnp.arange(n)
    rows, cols = (i, i + offset) if offset >= 0 else (i - offset, i)
    moved = jnp.moveaxis(x, (dim1, dim2), (-2, -1))
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))
