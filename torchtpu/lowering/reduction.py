"""Reductions: sum, mean, prod, min/max, arg-reductions, var/std, norms, any/all, cumulative ops,
sort/topk/kthvalue/median, hash_tensor (histograms: ``histogram``).

Result dtypes come from PyTorch's meta kernels (sum of int is int64, any of uint8 is uint8...).
Half-precision inputs accumulate in float32, as PyTorch's CPU kernels do. Semantics follow CPU:
NaN propagates through max/min and wins arg-reductions (first occurrence), ties in argmax/argmin
go to the first index and in cummax/cummin to the last, sorts are stable with NaN last ascending
and first descending, and -0.0 sorts equal to 0.0. Indices are int64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.device import dtypes
from torchtpu.lowering import padding
from torchtpu.lowering.checks import along, same_dtype
from torchtpu.lowering.registry import check, lowers, padded_mean, padding_rule

aten = torch.ops.aten
_INDEX = jnp.int64


def _axes(x, dim) -> tuple:
    """Reduced axes; None or an empty list means all of them, as in PyTorch."""
    if x.ndim == 0:
        return ()
    if dim is None:
        return tuple(range(x.ndim))
    if isinstance(dim, int):
        dim = (dim,)
    if not dim:
        return tuple(range(x.ndim))
    return tuple(sorted(d % x.ndim for d in dim))


def _acc(x):
    """Half precision accumulates in float32."""
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


def _over_dim(fn: Callable) -> Callable:
    """fn(x, dim, *rest) with dim normalized; a 0-dim x is treated as a 1-element vector."""

    def lowering(x, dim, *rest):
        if x.ndim == 0:
            out = fn(x.reshape(1), 0, *rest)
            return tuple(o.reshape(()) for o in out) if isinstance(out, tuple) else out.reshape(())
        return fn(x, dim % x.ndim, *rest)

    return lowering


# ----------------------------------------------------------------------------- sums and products

def _sum(x, dim=None, keepdim=False):
    return jnp.sum(_acc(x), _axes(x, dim), keepdims=keepdim)


def _prod(x, dim=None, keepdim=False):
    return jnp.prod(_acc(x), _axes(x, dim), keepdims=keepdim)


def _mean(x, dim=None, keepdim=False):
    return jnp.mean(_acc(x), _axes(x, dim), keepdims=keepdim)


def _nansum(x, dim=None, keepdim=False):
    return jnp.nansum(_acc(x), _axes(x, dim), keepdims=keepdim)


# The trailing `dtype` argument is already applied: promote="result" casts the input to it.
lowers(aten.sum.default, promote="result")(lambda x, dtype=None: _sum(x))
lowers(aten.sum.dim_IntList, promote="result")(
    lambda x, dim, keepdim=False, dtype=None: _sum(x, dim, keepdim))
lowers(aten.nansum.default, promote="result")(
    lambda x, dim=None, keepdim=False, dtype=None: _nansum(x, dim, keepdim))
lowers(aten.mean.default, promote="result")(lambda x, dtype=None: _mean(x))
# Held (``eager/lazy_casts.py``): a norm's mean is computed inside the program that reads it.
lowers(aten.mean.dim, promote="result", held=True)(
    lambda x, dim, keepdim=False, dtype=None: _mean(x, dim, keepdim))
lowers(aten.prod.default, promote="result")(lambda x, dtype=None: _prod(x))
lowers(aten.prod.dim_int, promote="result")(
    lambda x, dim, keepdim=False, dtype=None: _prod(x, dim, keepdim))


@lowers(aten.logsumexp.default, promote="result")
def logsumexp(x, dim, keepdim=False):
    axes = _axes(x, dim)
    x = _acc(x)
    top = jnp.max(x, axes, keepdims=True)
    # An infinite max would give inf - inf; shifting by 0 instead keeps +-inf results exact.
    top = lax.stop_gradient(jnp.where(jnp.isinf(top), 0, top))
    out = jnp.log(jnp.sum(jnp.exp(x - top), axes, keepdims=True)) + top
    return out if keepdim else jnp.squeeze(out, axes)


# ----------------------------------------------------------------------------- extremes

lowers(aten.amax.default)(
    lambda x, dim=(), keepdim=False: jnp.max(x, _axes(x, dim), keepdims=keepdim))
lowers(aten.amin.default)(
    lambda x, dim=(), keepdim=False: jnp.min(x, _axes(x, dim), keepdims=keepdim))
lowers(aten.max.default)(jnp.max)
lowers(aten.min.default)(jnp.min)


# aminmax has no lowering (its decomposition's pieces have); CPU refuses an empty reduced dim.
@check(aten.aminmax.default)
def _aminmax_check(self, dim=None, keepdim=False):
    if dim is not None and self.ndim and self.shape[along(self, dim)[0]] == 0:
        return IndexError(f"aminmax(): Expected reduction dim {dim} to have non-zero size.")
    return None


@check(aten.aminmax.out)
def _aminmax_out_check(self, dim=None, keepdim=False, min=None, max=None):
    for out in (min, max):
        if out.dtype != self.dtype:
            return RuntimeError(f"Expected out tensor to have dtype {self.dtype}, but got "
                                f"{out.dtype} instead")
    return _aminmax_check(self, dim, keepdim)


# Dynamic shapes (``padding.py``): padding along a reduced dim replaced by the identity.
padding_rule(aten.sum.default)(padding.reduction(None, "zero"))
padding_rule(aten.sum.dim_IntList)(padding.reduction(1, "zero"))
padding_rule(aten.mean.default)(padding.reduction(None, "zero"))
padding_rule(aten.mean.dim)(padding.reduction(1, "zero"))
padded_mean(aten.mean.default, None)  # the masked sum over the real count
padded_mean(aten.mean.dim, 1)
padding_rule(aten.prod.dim_int)(padding.reduction(1, "one"))
padding_rule(aten.logsumexp.default)(padding.reduction(1, "lowest"))
padding_rule(aten.amax.default)(padding.reduction(1, "lowest"))
padding_rule(aten.amin.default)(padding.reduction(1, "highest"))


def _arg(fn: Callable) -> Callable:
    def lowering(x, dim=None, keepdim=False):
        if dim is None:
            out = fn(x.reshape(-1))
            return out.reshape((1,) * x.ndim) if keepdim else out
        return _over_dim(lambda x, d: fn(x, axis=d, keepdims=keepdim))(x, dim)

    return lowering


lowers(aten.argmax.default)(_arg(jnp.argmax))
lowers(aten.argmin.default)(_arg(jnp.argmin))


def _value_index(reduce: Callable, arg: Callable) -> Callable:
    # jnp's max/min propagate NaN and argmax/argmin pick the first NaN, so the two agree.
    def lowering(x, dim, keepdim=False):
        return _over_dim(lambda x, d: (reduce(x, d, keepdims=keepdim),
                                       arg(x, axis=d, keepdims=keepdim)))(x, dim)

    return lowering


lowers(aten.max.dim)(_value_index(jnp.max, jnp.argmax))
lowers(aten.min.dim)(_value_index(jnp.min, jnp.argmin))


# ----------------------------------------------------------------------------- variance

def _var_mean(x, dim, correction, keepdim):
    axes = _axes(x, dim)
    x = _acc(x)
    n = math.prod(x.shape[a] for a in axes)
    mean = jnp.mean(x, axes, keepdims=True)
    d = x - mean
    sq = (d * jnp.conj(d)).real if jnp.iscomplexobj(d) else d * d
    correction = 1 if correction is None else correction
    var = jnp.sum(sq, axes, keepdims=keepdim) / jnp.maximum(n - correction, 0)
    return var, mean if keepdim else jnp.squeeze(mean, axes)


@lowers(aten.var.correction)
def var(x, dim=None, correction=None, keepdim=False):
    return _var_mean(x, dim, correction, keepdim)[0]


@lowers(aten.std.correction)
def std(x, dim=None, correction=None, keepdim=False):
    return jnp.sqrt(_var_mean(x, dim, correction, keepdim)[0])


@lowers(aten.var_mean.correction)
def var_mean(x, dim=None, correction=None, keepdim=False):
    return _var_mean(x, dim, correction, keepdim)


@lowers(aten.std_mean.correction)
def std_mean(x, dim=None, correction=None, keepdim=False):
    v, m = _var_mean(x, dim, correction, keepdim)
    return jnp.sqrt(v), m


# ----------------------------------------------------------------------------- norms, any/all

@lowers(aten.linalg_vector_norm.default, static_scalars=True)
def vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.astype(dtypes.to_jax(dtype))
    a = jnp.abs(_acc(x))
    axes = _axes(x, dim)
    if ord == math.inf:
        return jnp.max(a, axes, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(a, axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((a != 0).astype(a.dtype), axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(a, axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axes, keepdims=keepdim))
    return jnp.sum(a ** ord, axes, keepdims=keepdim) ** (1.0 / ord)


def _truth_reduce(fn: Callable) -> Callable:
    def lowering(x, dim=None, keepdim=False):
        return fn(x != 0, _axes(x, dim), keepdims=keepdim)

    return lowering


lowers(aten.any.default, aten.any.dim, aten.any.dims)(_truth_reduce(jnp.any))
lowers(aten.all.default, aten.all.dim, aten.all.dims)(_truth_reduce(jnp.all))


padding_rule(aten.any.dim, aten.any.dims)(padding.reduction(1, "false"))
padding_rule(aten.all.dim, aten.all.dims)(padding.reduction(1, "true"))


@lowers(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(x, dim=None):
    return jnp.sum(x != 0, _axes(x, dim), dtype=_INDEX)


# ----------------------------------------------------------------------------- cumulative

lowers(aten.cumsum.default, promote="result")(
    _over_dim(lambda x, d, dtype=None: jnp.cumsum(_acc(x), axis=d)))
lowers(aten.cumprod.default, promote="result")(
    _over_dim(lambda x, d, dtype=None: jnp.cumprod(_acc(x), axis=d)))


def _logcumsumexp(x, d):
    # CPU accumulates float32 in float64 (its acc_type). The difference is one float32 rounding
    # per partial sum, but logcumsumexp's backward (exp(lcse(log|g| - y) + x)) cancels values of
    # size |x|, so for |x| ~ 1e4 those roundings become 0.1% errors in the gradient.
    wide = jnp.float64 if x.dtype == jnp.float32 else _acc(x).dtype
    return lax.cumlogsumexp(x.astype(wide), axis=d)


lowers(aten.logcumsumexp.default)(_over_dim(_logcumsumexp))


# These out= kernels want their outputs' dtypes exactly; their meta kernels cast.
@check(aten.logcumsumexp.out)
def _logcumsumexp_out_check(self, dim, out=None):
    return same_dtype(self.dtype, out)


def _cum_extreme(beats: Callable) -> Callable:
    def scan(x, d):
        def combine(a, b):
            # b comes later: it wins ties (CPU keeps the last index) and any NaN wins.
            take = jnp.isnan(b[0]) | (~jnp.isnan(a[0]) & beats(b[0], a[0]))
            return jnp.where(take, b[0], a[0]), jnp.where(take, b[1], a[1])

        idx = lax.broadcasted_iota(_INDEX, x.shape, d)
        return lax.associative_scan(combine, (x, idx), axis=d)

    return _over_dim(scan)


lowers(aten.cummax.default)(_cum_extreme(jnp.greater_equal))
lowers(aten.cummin.default)(_cum_extreme(jnp.less_equal))


@check(aten.cummax.out, aten.cummin.out)
def _cumulative_extreme_out_check(self, dim, values=None, indices=None):
    return same_dtype(self.dtype, values) or same_dtype(torch.int64, indices)


# ----------------------------------------------------------------------------- sorting

def _sort_last(x, descending: bool):
    """Stable sort along the last axis: (values, int64 indices)."""
    n = x.shape[-1]
    if descending:
        # Stable descending = reversed stable ascending of the reversed input.
        x = jnp.flip(x, -1)
    key = jnp.where(x == 0, jnp.zeros_like(x), x) if jnp.issubdtype(x.dtype, jnp.floating) else x
    iota = lax.broadcasted_iota(_INDEX, x.shape, x.ndim - 1)
    _, values, idx = lax.sort((key, x, iota), dimension=x.ndim - 1, is_stable=True, num_keys=1)
    if descending:
        values, idx = jnp.flip(values, -1), n - 1 - jnp.flip(idx, -1)
    return values, idx


def _sorted_along(x, d: int, descending: bool):
    values, idx = _sort_last(jnp.moveaxis(x, d, -1), descending)
    return values, idx


def _back(arrays, d: int):
    return tuple(jnp.moveaxis(a, -1, d) for a in arrays)


@lowers(aten.sort.default)
def sort(x, dim=-1, descending=False):
    return _over_dim(lambda x, d: _back(_sorted_along(x, d, descending), d))(x, dim)


@lowers(aten.sort.stable)
def sort_stable(x, stable=None, dim=-1, descending=False):
    return sort(x, dim, descending)


@lowers(aten.topk.default)
def topk(x, k, dim=-1, largest=True, sorted=True):
    def top(x, d):
        values, idx = _sorted_along(x, d, largest)
        return _back((values[..., :k], idx[..., :k]), d)

    return _over_dim(top)(x, dim)


def _pick(x, d: int, keepdim: bool, position: Callable):
    """Sort along d and take, per row, the element at position(sorted values)."""
    values, idx = _sorted_along(x, d, False)
    pos = position(values)[..., None]
    out = (jnp.take_along_axis(values, pos, -1), jnp.take_along_axis(idx, pos, -1))
    return _back(out, d) if keepdim else tuple(o[..., 0] for o in out)


@lowers(aten.kthvalue.default)
def kthvalue(x, k, dim=-1, keepdim=False):
    def at_k(values):
        return jnp.full(values.shape[:-1], k - 1, _INDEX)

    return _over_dim(lambda x, d: _pick(x, d, keepdim, at_k))(x, dim)


@check(aten.kthvalue.default)
def _kthvalue_check(self, k, dim=-1, keepdim=False):
    if not 1 <= k <= along(self, dim)[1]:
        return IndexError(f"kthvalue(): selected number k out of range for dimension {dim}")
    return None


def _median_position(ignore_nan: bool) -> Callable:
    def position(values):
        # NaNs sort last; count the others per row.
        count = jnp.sum(~jnp.isnan(values), -1, dtype=_INDEX)
        if ignore_nan:
            return jnp.maximum(count - 1, 0) // 2
        n = values.shape[-1]
        return jnp.where(count < n, count, (n - 1) // 2)

    return position


def _median(ignore_nan: bool):
    def dim_lowering(x, dim=-1, keepdim=False):
        return _over_dim(lambda x, d: _pick(x, d, keepdim, _median_position(ignore_nan)))(x, dim)

    def all_lowering(x):
        return dim_lowering(x.reshape(-1), 0)[0]

    return all_lowering, dim_lowering


lowers(aten.median.default)(_median(False)[0])
lowers(aten.median.dim)(_median(False)[1])
lowers(aten.nanmedian.default)(_median(True)[0])
lowers(aten.nanmedian.dim)(_median(True)[1])


@lowers(aten.mode.default)
def mode(x, dim=-1, keepdim=False):
    def most_common(x, d):
        values, idx = _sorted_along(x, d, False)
        n = values.shape[-1]
        pos = lax.broadcasted_iota(_INDEX, values.shape, values.ndim - 1)
        # Runs of equal values in the sorted row (NaN != NaN: each NaN is its own run).
        new_run = jnp.concatenate([jnp.ones_like(values[..., :1], bool),
                                   values[..., 1:] != values[..., :-1]], -1)
        ends_run = jnp.concatenate([new_run[..., 1:], jnp.ones_like(new_run[..., :1])], -1)
        start = lax.cummax(jnp.where(new_run, pos, 0), axis=values.ndim - 1)
        end = lax.cummin(jnp.where(ends_run, pos, n), axis=values.ndim - 1, reverse=True)
        # The longest run, the smallest value among equally long ones; CPU reports the last
        # index holding that value.
        best = jnp.argmax(end - start, axis=-1, keepdims=True)
        last = jnp.take_along_axis(end, best, -1)
        out = (jnp.take_along_axis(values, best, -1), jnp.take_along_axis(idx, last, -1))
        return _back(out, d) if keepdim else tuple(o[..., 0] for o in out)

    return _over_dim(most_common)(x, dim)


# ----------------------------------------------------------------------------- hashing

# (unsigned type of the same width, mantissa bits, exponent bias) of the floats widened from bits.
_FORMATS = {jnp.dtype(jnp.float32): (jnp.uint32, 23, 127),
            jnp.dtype(jnp.float16): (jnp.uint16, 10, 15),
            jnp.dtype(jnp.bfloat16): (jnp.uint16, 7, 127)}


def _float64_words(x):
    """The (high, low) 32-bit words of x's values widened to float64, for floats of at most 32
    bits, from their own bits with 32-bit integer ops. A TPU keeps float64 as a pair of float32s,
    whose bitcast is not IEEE's pattern (hash_tensor on a v5e chip was 1e-2 off), and its float
    conversions make every NaN the canonical one, where CPU keeps a NaN's sign and payload."""
    u32 = jnp.uint32
    unsigned, bits, bias = _FORMATS[x.dtype]
    width = 8 * jnp.dtype(unsigned).itemsize
    b = lax.bitcast_convert_type(x, unsigned).astype(u32)
    mask = u32((1 << bits) - 1)
    top_exp = (1 << (width - 1 - bits)) - 1
    exp, man = (b >> bits) & u32(top_exp), b & mask
    # A subnormal is a normal float64: its leading one becomes the implicit bit.
    lead = u32(31) - lax.clz(man)                       # the leading one's position (man != 0)
    sub_man = (man << (u32(bits) - lead)) & mask
    sub_exp = lead + u32(1024 - bias - bits)            # (lead - (bias + bits - 1)) + 1023
    subnormal = (exp == 0) & (man != 0)
    # A NaN keeps its sign and payload and comes out quiet, as CPU's conversion makes it.
    nan = (exp == top_exp) & (man != 0)
    m = jnp.where(subnormal, sub_man, jnp.where(nan, man | u32(1 << (bits - 1)), man))
    e = jnp.where(subnormal, sub_exp, jnp.where(
        exp == 0, u32(0), jnp.where(exp == top_exp, u32(0x7FF), exp + u32(1023 - bias))))
    sign = (b >> (width - 1)) << 31
    shift = 52 - bits                                   # the mantissa's place in float64's
    if shift >= 32:
        return sign | (e << 20) | (m << (shift - 32)), jnp.zeros_like(m)
    return sign | (e << 20) | (m >> (32 - shift)), m << shift


@lowers(aten.hash_tensor.default)
def hash_tensor(x, dim=(), keepdim=False, mode=0):
    # mode 0 (the only one) xors the 64-bit patterns of the values widened to float64 / int64.
    axes = _axes(x, dim)
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float64:
        high, low = (lax.reduce(w, jnp.uint32(0), lax.bitwise_xor, axes)
                     for w in _float64_words(x))
        out = (high.astype(jnp.uint64) << 32) | low.astype(jnp.uint64)
    else:
        wide = x.astype(jnp.float64 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int64)
        bits = lax.bitcast_convert_type(wide, jnp.uint64)
        out = lax.reduce(bits, jnp.uint64(0), lax.bitwise_xor, axes)
    return jnp.expand_dims(out, axes) if keepdim else out
