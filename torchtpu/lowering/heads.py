"""aten.mm in attention's heads: the forms a recorded program gives a product read as heads, and
a product reading them.

A lowering sees its arguments' values, never its result's readers, so ``mm`` is a 2-D (tokens,
features) product. Next to attention the TPU compiler then copies between that layout and the
kernel's (batch, heads, tokens, head_dim) (bench/RESULTS.md, whole7-10). A recorded program
(``eager/read_forms.py``) knows its readers, and asks the ``read_form`` declared here: a
product whose result is read as heads (q, k and v's forward products, o's input gradient) is
written as that view, (batch, tokens, heads, head_dim): the table's values; half precision
only, other products keep the table's form. A product that reads heads, the (batch, tokens,
heads, head_dim) array attention's kernel gives (o's weight gradient, q/k/v's input and weight
gradients), is contracted with the tokens at their (batch, tokens) rank
(``view_form``): written over (batch * tokens) rows, the compiler copied the kernel's (b, h, t, d)
result to (b, t, h, d) before each such product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.device.views import Geometry
from torchtpu.lowering.linalg import HALF, half_product, matmul, weight_gradient
from torchtpu.lowering.registry import read_form, view_form

aten = torch.ops.aten


@read_form(aten.mm.default)
def _read_as_heads(g) -> functools.partial | None:
    # A projection into attention's heads: its (tokens, features) result read as (batch,
    # length, heads, head_dim) (then transposed to the kernel's (b, h, t, d)). Written 2-D, the
    # TPU compiler tiles it by tokens and copies it to the heads' tiling before any transpose;
    # written as that view, it folds the view into the product (a block's forward and backward:
    # 5.8-6.2 M estimated cycles on v5e -> 4.0-4.2; bench/RESULTS.md, whole8). Only the view says
    # where the batch splits the rows (blocks of 1024 at 4 x 2048 were slower than 2-D), and
    # only its reader says the result is read as heads: a projection out of them (o's forward,
    # q/k/v's input gradients) has the same shapes and lost 1.9 M cycles so written.
    if len(g.array_shape) != 2 or g.dtype != g.array_dtype:
        return None
    (m, n), dims = g.array_shape, [(s, k) for k, s in zip(g.size, g.stride) if k != 1]
    rows = [k for s, k in dims if s == n]
    lanes = [s for s, _ in dims if 1 < s < n and n % s == 0]
    if len(rows) != 1 or len(set(lanes)) != 1 or not 1 < rows[0] < m or m % rows[0]:
        return None
    return _heads(rows[0], lanes[0])


@functools.cache  # one function per form: the recorded program's key and caches see one object
def _heads(rows: int, lanes: int) -> functools.partial:
    return functools.partial(heads_product, rows=rows, lanes=lanes)


def heads_product(x: jax.Array, y: jax.Array, *, rows: int, lanes: int) -> jax.Array:
    """mm(x, y) computed as (m / rows, rows, n / lanes, lanes) and returned as (m, n): the same
    values, laid out as a view of that split reads them (``_read_as_heads``)."""
    (m, k), n = x.shape, y.shape[-1]
    if (x.ndim != 2 or x.dtype != y.dtype or x.dtype not in HALF or m % rows or n % lanes
            or weight_gradient(x, y)):
        return matmul(x, y)
    out = lax.dot_general(x.reshape(m // rows, rows, k), y.reshape(k, n // lanes, lanes),
                          (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(x.dtype).reshape(m, n)


@view_form(aten.mm.default)
def _reads_heads(reads: tuple) -> functools.partial | None:
    # A product over attention's heads: an argument read as a plain (b * t, h * d) reshape of a
    # (b, t, h, d) array (q/k/v's gradients), or as its transpose (a weight gradient's). The
    # kernel's arrays are (b, h, t, d); to (b, t, h, d) and then (b * t, n) the TPU compiler
    # copies them (0.18 M estimated cycles on v5e a copy at 8 x 1024). Contracted at (b, t, n)
    # rank the product reads (b, n, t), one transpose within each head of the kernel's array,
    # as the JAX twin's autodiff contracts (bench/RESULTS.md, whole14). Not a forward
    # projection x @ w.t() (its weight read through a view: o's): its result meets the
    # residual add at rows rank (``elementwise.add``), and at (b, t, n) the TPU compiler took
    # the add out of the product's fusion (2 blocks at 8 x 1024: +0.8 M cycles, not -0.4).
    if len(reads) != 2:
        return None
    (a, a_t), (b, b_t) = (_tokens(r) for r in reads)
    if a is not None and not a_t:
        return _form(rows_product, a) if reads[1] is None else None
    tokens = a if a is not None else b if b is not None and not b_t else None
    return None if tokens is None else _form(contracted_product, tokens)


def _tokens(read) -> tuple:
    """((batch, tokens), transposed) of a view reading a rank-4 (b, t, ...) array as its plain
    2-D (b * t, rest) or that transposed; else (None, None)."""
    if type(read) is not Geometry or len(read.array_shape) != 4 or read.offset \
            or read.dtype != read.array_dtype:
        return None, None
    (b, t, *heads), size, stride = read.array_shape, read.size, read.stride
    n = heads[0] * heads[1]
    if size == (b * t, n) and stride == (n, 1):
        return (b, t), False
    if size == (n, b * t) and stride == (1, n):
        return (b, t), True
    return None, None


@functools.cache  # one function per form: the recorded program's key and caches see one object
def _form(fn, tokens: tuple) -> functools.partial:
    return functools.partial(fn, batch=tokens[0], length=tokens[1])


def rows_product(x: jax.Array, y: jax.Array, *, batch: int, length: int) -> jax.Array:
    """mm(x, y) with x's rows contracted as (batch, length, k): the same values
    (``_reads_heads``)."""
    m, k = x.shape
    if x.ndim != 2 or x.dtype != y.dtype or x.dtype not in HALF or m != batch * length:
        return matmul(x, y)
    out = lax.dot_general(x.reshape(batch, length, k), y, (((2,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
    return out.astype(x.dtype).reshape(m, y.shape[1])


def contracted_product(x: jax.Array, y: jax.Array, *, batch: int, length: int) -> jax.Array:
    """mm(x, y) contracting (batch, length) for x's columns and y's rows: a weight gradient's
    values (``_reads_heads``). TPU only: XLA:CPU has no half-precision product over two
    contracted dims (``linalg._rows_in_blocks``)."""
    if (x.ndim != 2 or x.dtype != y.dtype or x.dtype not in HALF
            or x.shape[1] != batch * length):
        return matmul(x, y)
    return lax.platform_dependent(x, y, tpu=functools.partial(
        _over_tokens, batch=batch, length=length), default=half_product)


def _over_tokens(x: jax.Array, y: jax.Array, *, batch: int, length: int) -> jax.Array:
    out = lax.dot_general(x.T.reshape(batch, length, x.shape[0]),
                          y.reshape(batch, length, y.shape[1]), (((0, 1), (0, 1)), ((), ())),
                          preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
