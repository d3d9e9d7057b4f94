"""Elementwise math: arithmetic, unary functions, comparisons, logic, bit operations, ``where``,
``fill``/``zero``, complex conjugation and ``_assert_async``.

PyTorch's meta kernels fix every result dtype; most lowerings here use ``promote="result"`` so the
math runs in that dtype (an int tensor passed to ``exp`` is computed in float32, as on CPU). Ops
whose result dtype is not their input's (``abs`` of complex, ``isnan``, logical ops) take their
inputs unconverted and rely on the final cast. Where PyTorch's CPU formula differs from the obvious
JAX one (floor division, ``lerp``, ``xlogy``, rounding to decimals) the lowering follows
PyTorch's. Special functions (gamma family, Bessel, Airy) live in ``special``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import jax.scipy.special as jsp
import torch
from jax import lax

from torchtpu.lowering.registry import check, lowers, lowers_each

aten = torch.ops.aten


def _is_int(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer) or jnp.result_type(x) == jnp.bool_


def _truth(x):
    return x if x.dtype == jnp.bool_ else x != 0


# ----------------------------------------------------------------------------- arithmetic

@lowers(aten.add.Tensor, aten.add.Scalar, promote="result")
def add(x, y, alpha=1):
    if _in_rows(x, y):
        # A residual add of (b, t, n) values whose addend is a (b * t, n) product read through
        # a view: in the products' rank the TPU compiler fuses it into the product's fusion and
        # keeps the stream, where at (b, t, n) it recomputed the stream from the deltas inside
        # the backward's readers (bench/RESULTS.md, whole13: a 2-block step at 4 x 2048, -5.6%
        # cost-model cycles; 8 x 1024 the same program). The same values.
        n = x.shape[-1]
        return (x.reshape(-1, n) + (y * alpha).reshape(-1, n)).reshape(x.shape)
    return x + y * alpha


def _in_rows(x, y) -> bool:
    """Both operands arrays of one shape of rank 3 or more (no broadcast), rows not empty."""
    shape = getattr(x, "shape", None)
    return (shape is not None and len(shape) >= 3 and shape[-1] > 0
            and getattr(y, "shape", None) == shape)


@lowers(aten.sub.Tensor, aten.sub.Scalar, promote="result")
def sub(x, y, alpha=1):
    return x - y * alpha


@lowers(aten.mul.Tensor, aten.mul.Scalar, promote="result")
def mul(x, y):
    return x * y


def signbit(x):
    """jnp.signbit, but float64's read as its bits' sign (a compare, not jnp.signbit's shift):
    libtpu 0.0.42 refuses a float64 bitcast followed by a shift ("shift-right-arithmetic with
    different element types: s32 and u32"; a TPU emulates float64), which every rounded
    float64 division and copysign made. On a v5e chip the compare gives numpy's signbit, -0.0
    and -NaN included."""
    if jnp.result_type(x) != jnp.float64:
        return jnp.signbit(x)
    return lax.bitcast_convert_type(x, jnp.int64) < 0


def copysign(x, y):
    """jnp.copysign through ``signbit``."""
    dtype = jnp.result_type(x, y)
    if dtype != jnp.float64:
        return jnp.copysign(x, y)
    x = jnp.abs(jnp.asarray(x, dtype))
    return jnp.where(signbit(jnp.asarray(y, dtype)), -x, x)


def _wide(x, y):
    """float32 operands as float64, else as they are. A TPU's float32 division is not correctly
    rounded, and its remainder comes from that division (fmod(3.5, -0.7) was 0.0 on a v5e chip,
    CPU's 5.96e-8): float64's division rounded back to float32 is float32's correctly rounded one
    (53 >= 2 * 24 + 2 bits), and float64's fmod of float32 values is exact."""
    dtype = jnp.result_type(x, y)
    if dtype != jnp.float32:
        return x, y
    # Python numbers as the float32 values CPU computes with, then widened.
    return jnp.asarray(x, dtype).astype(jnp.float64), jnp.asarray(y, dtype).astype(jnp.float64)


def _divide(x, y):
    """x / y correctly rounded (see ``_wide``)."""
    wide_x, wide_y = _wide(x, y)
    return _divide_float64(wide_x, wide_y).astype(jnp.result_type(x, y))


def _divide_float64(x, y):
    """x / y, by zero as IEEE says where the divisor is an array: a TPU's emulated float64
    division gives NaN there (-7.5 / -0.0 on a v5e chip), its inf only for a constant zero."""
    if jnp.result_type(x, y) != jnp.float64:
        return x / y
    x, y = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64)
    inf = jnp.where(signbit(x) != signbit(y), -jnp.inf, jnp.inf)
    by_zero = jnp.where((x == 0) | jnp.isnan(x), jnp.nan, inf)
    return jnp.where(y == 0, by_zero, x / y)


def _fmod(x, y):
    """C's fmod, exact (see ``_wide``). A TPU's float remainder by an infinity is NaN (seen on
    a v5e chip), C's is x."""
    dtype = jnp.result_type(x, y)
    mod = jnp.fmod(*_wide(x, y)).astype(dtype)
    if _is_int(mod):
        return mod
    return jnp.where(jnp.isinf(y) & jnp.isfinite(x), x, mod)


def _remainder(x, y):
    """Python's modulo (the divisor's sign), from ``_fmod`` as PyTorch's CPU kernel computes it."""
    if _is_int(jnp.result_type(x, y)):
        return jnp.remainder(x, y)
    mod = _fmod(x, y)
    return jnp.where((mod != 0) & ((mod < 0) != (y < 0)), mod + y, mod)


def _floor_divide(x, y):
    if _is_int(x):
        return jnp.floor_divide(x, y)
    # PyTorch's div_floor: exact for representable quotients, x/0 gives +-inf rather than NaN.
    mod = _fmod(x, y)
    div = _divide(x - mod, y)
    div = jnp.where((mod != 0) & ((y < 0) != (mod < 0)), div - 1, div)
    floor = jnp.floor(div)
    floor = jnp.where(div - floor > 0.5, floor + 1, floor)
    quotient = _divide_float64(x, y)
    floor = jnp.where(div == 0, copysign(jnp.zeros_like(div), quotient), floor)
    return jnp.where(y == 0, quotient, floor)


# true_divide is CompositeImplicit, so eager never sees it; a compiled graph does when Dynamo
# turns a symbolic float computation into tensor ops after decomposition (tensorify pass).
@lowers(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode,
        aten.true_divide.Tensor, aten.true_divide.Scalar, promote="result")
def div(x, y, rounding_mode=None):
    if rounding_mode is None:
        return _divide_float64(x, y)
    if rounding_mode == "floor":
        return _floor_divide(x, y)
    if _is_int(x):
        # lax.div truncates integers; unlike jnp it does not broadcast.
        return lax.div(*jnp.broadcast_arrays(x, jnp.asarray(y, x.dtype)))
    return _trunc_divide(x, y)


def _trunc_divide(x, y):
    # trunc(x / y) as CPU computes it: of the correctly rounded quotient (a quotient just below
    # an integer may round up to it: 2.1 / -0.7 is -3).
    return jnp.trunc(_divide(x, y))


@lowers(aten.square.default, promote="result")  # also from the tensorify pass, as above
def square(x):
    return jnp.square(x)


def pow_scalar_exponent(x, y):
    # A baked-in exponent (``eager/meta.SPECIAL_NUMBERS``) becomes multiplies or a square root,
    # as PyTorch computes them, instead of the general exp(y * log(x)).
    if isinstance(y, (int, float)) and jnp.issubdtype(x.dtype, jnp.inexact):
        if y == int(y) and abs(y) <= 4:
            return lax.integer_pow(x, int(y))
        if y == 0.5:
            return jnp.sqrt(x)
        if y == -0.5:
            return lax.rsqrt(x)
    return jnp.power(x, y)


@lowers(aten.floor_divide.default, aten.floor_divide.Scalar, promote="result")
def floor_divide(x, y):
    return _floor_divide(x, y)


lowers_each({
    # Python-style modulo (sign of the divisor) and C-style (sign of the dividend).
    aten.remainder.Tensor: _remainder,
    aten.remainder.Scalar: _remainder,
    aten.remainder.Scalar_Tensor: _remainder,
    aten.fmod.Tensor: _fmod,
    aten.fmod.Scalar: _fmod,
    aten.pow.Tensor_Tensor: jnp.power,
    aten.pow.Tensor_Scalar: pow_scalar_exponent,
    aten.pow.Scalar: jnp.power,
    aten.atan2.default: jnp.arctan2,
    aten.hypot.default: jnp.hypot,
    aten.logaddexp.default: jnp.logaddexp,
    aten.logaddexp2.default: jnp.logaddexp2,
    aten.copysign.Tensor: copysign,
    aten.copysign.Scalar: copysign,
    aten.nextafter.default: jnp.nextafter,
    aten.maximum.default: jnp.maximum,
    aten.minimum.default: jnp.minimum,
    aten.fmax.default: jnp.fmax,
    aten.fmin.default: jnp.fmin,
}, promote="result")


def _xlog(fn: Callable) -> Callable:
    def lowering(x, y):
        # 0 * log(0) is 0, but a NaN y still gives NaN (CPU's order of checks).
        out = jnp.where(x == 0, jnp.zeros_like(x * y), x * fn(y))
        return jnp.where(jnp.isnan(y), y, out)

    return lowering


lowers_each({
    aten.xlogy.Tensor: _xlog(jnp.log),
    aten.xlogy.Scalar_Self: _xlog(jnp.log),
    aten.xlogy.Scalar_Other: _xlog(jnp.log),
    aten.special_xlog1py.default: _xlog(jnp.log1p),
    aten.special_xlog1py.self_scalar: _xlog(jnp.log1p),
    aten.special_xlog1py.other_scalar: _xlog(jnp.log1p),
}, promote="result")


def opmath(x):
    """x in the type PyTorch's CPU kernels and fused optimizers compute it in: float32 for the
    half types."""
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


@lowers(aten.lerp.Scalar, aten.lerp.Tensor, promote="result")
def lerp(start, end, weight):
    # CPU's two-sided formula: exact at both weight == 0 and weight == 1, computed in CPU's
    # opmath type (float32 for the half types) with the weight rounded to it first (a number
    # arrives as a float64 scalar: 1 - 0.9 there, then rounded, is one ulp from 1 - 0.9f).
    out = start.dtype
    start, end = opmath(start), opmath(end)
    weight = jnp.asarray(weight).astype(start.dtype)
    diff = end - start
    small = jnp.abs(weight) < 0.5
    if jnp.ndim(weight) == 0:
        # One weight (AdamW's moment update): the side is chosen on the scalar, so each element
        # costs a select, a product and a difference instead of both sides' products and sums
        # (the optimizer step's largest fusions were bound by that arithmetic on a v5e, not by
        # their bytes). start - (-w) * diff is start + w * diff to the bit, signed zeros too.
        found = jnp.where(small, start, end) - jnp.where(small, -weight, 1 - weight) * diff
    else:
        found = jnp.where(small, start + weight * diff, end - diff * (1 - weight))
    return found.astype(out)


@lowers(aten.addcmul.default, promote="result")
def addcmul(x, t1, t2, value=1):
    return x + value * t1 * t2


@lowers(aten.addcdiv.default, promote="result")
def addcdiv(x, t1, t2, value=1):
    return x + value * t1 / t2


def _fma(a, b, c):
    return a * b + c


def register_inductor_prims() -> None:
    """Lower the prims Inductor defines (``torch._inductor.inductor_prims``: its decompositions,
    which a compiled ``addcmul_`` goes through, end in ``prims.fma``). Called once that module
    is imported: torchtpu does not import Inductor."""
    lowers(torch.ops.prims.fma.default, promote="result")(_fma)


# ----------------------------------------------------------------------------- unary math

def _frac(x):
    return x - jnp.trunc(x)


def _keep_int(fn: Callable) -> Callable:
    """Rounding functions leave integer tensors unchanged, as on CPU."""
    return lambda x: x if _is_int(x) else fn(x)


lowers_each({
    aten.neg.default: jnp.negative,
    aten.exp.default: jnp.exp,
    aten.exp2.default: jnp.exp2,
    aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.reciprocal.default: jnp.reciprocal,
    aten.sin.default: jnp.sin,
    aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin,
    aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh,
    aten.cosh.default: jnp.cosh,
    aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh,
    aten.atanh.default: jnp.arctanh,
    aten.erf.default: lax.erf,
    aten.erfc.default: lax.erfc,
    aten.erfinv.default: lax.erf_inv,
    aten.lgamma.default: lax.lgamma,
    aten.i0.default: jsp.i0,
    aten.sinc.default: jnp.sinc,
    aten.sigmoid.default: lax.logistic,
    aten.deg2rad.default: jnp.deg2rad,
    aten.rad2deg.default: jnp.rad2deg,
    aten.floor.default: _keep_int(jnp.floor),
    aten.ceil.default: _keep_int(jnp.ceil),
    aten.trunc.default: _keep_int(jnp.trunc),
    aten.round.default: _keep_int(jnp.round),
    aten.frac.default: _frac,
}, promote="result")


@lowers(aten.round.decimals, promote="result")
def round_decimals(x, decimals=0):
    if _is_int(x):
        return x
    # CPU divides by 10**-d for negative d rather than multiplying by an inexact 10**d.
    if decimals >= 0:
        scale = 10.0 ** decimals
        return jnp.round(x * scale) / scale
    scale = 10.0 ** -decimals
    return jnp.round(x / scale) * scale


@lowers(aten.logit.default, promote="result")
def logit(x, eps=None):
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@lowers(aten.clamp.default, aten.clamp.Tensor, promote="result")
def clamp(x, lo=None, hi=None):
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


@lowers(aten.clamp_min.default, aten.clamp_min.Tensor, promote="result")
def clamp_min(x, lo):
    return jnp.maximum(x, lo)


@lowers(aten.clamp_max.default, aten.clamp_max.Tensor, promote="result")
def clamp_max(x, hi):
    return jnp.minimum(x, hi)


@lowers(aten.heaviside.default, promote="result")
def heaviside(x, values):
    return jnp.where(x == 0, values, (x > 0).astype(x.dtype))


@lowers(aten.sign.default, aten.sgn.default)
def sign(x):
    if x.dtype == jnp.bool_:
        return x
    if jnp.iscomplexobj(x):
        return jnp.sign(x)
    # (0 < x) - (x < 0), as on CPU: NaN gives 0, not NaN.
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


@lowers(aten.angle.default)
def angle(x):
    if jnp.iscomplexobj(x):
        return jnp.angle(x)
    # Real input: pi for negatives, 0 otherwise (including -0.0), NaN stays NaN.
    out = jnp.where(x < 0, jnp.pi, 0.0)
    return jnp.where(jnp.isnan(x), x, out) if not _is_int(x) else out


@lowers(aten.nan_to_num.default)
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


# Result dtype differs from the input's (complex -> real, anything -> bool): no input cast.
lowers_each({
    aten.abs.default: jnp.abs,
    aten.isnan.default: jnp.isnan,
    aten.isinf.default: jnp.isinf,
    aten.isposinf.default: jnp.isposinf,
    aten.isneginf.default: jnp.isneginf,
    aten.signbit.default: signbit,
    aten._conj_physical.default: jnp.conj,
    # Its in-place variant has no composite kernel a Python backend can reach (a DispatchStub).
    aten.conj_physical.default: jnp.conj,
}, promote=None)


@lowers(aten.complex.default)
def complex_(real, imag):
    # lax.complex does not broadcast; torch.complex (and polar, built on it) does. Nor does it
    # take float16, whose complex32 result computes as complex64 (``device/dtypes.py``).
    if real.dtype == jnp.float16:
        real, imag = real.astype(jnp.float32), imag.astype(jnp.float32)
    return lax.complex(*jnp.broadcast_arrays(real, imag))


_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64,
            torch.float64: torch.complex128}


@check(aten.complex.out)
def _complex_out_check(real, imag, out=None):
    expected = _COMPLEX.get(real.dtype) if real.dtype == imag.dtype else None
    if expected is not None and out.dtype != expected:
        return RuntimeError(f"Expected object of scalar type {expected} but got scalar type "
                            f"{out.dtype} for argument 'out'")
    return None


@lowers(aten.frexp.Tensor)
def frexp(x):
    return jnp.frexp(x)


# ----------------------------------------------------------------------------- comparisons, logic

lowers_each({
    getattr(aten, name).Tensor if kind == "Tensor" else getattr(aten, name).Scalar: fn
    for name, fn in (("eq", jnp.equal), ("ne", jnp.not_equal), ("lt", jnp.less),
                     ("le", jnp.less_equal), ("gt", jnp.greater), ("ge", jnp.greater_equal))
    for kind in ("Tensor", "Scalar")
}, promote="common")

lowers_each({
    aten.logical_and.default: lambda x, y: _truth(x) & _truth(y),
    aten.logical_or.default: lambda x, y: _truth(x) | _truth(y),
    aten.logical_xor.default: lambda x, y: _truth(x) ^ _truth(y),
    aten.logical_not.default: lambda x: ~_truth(x),
}, promote=None)


def _bitwise(name: str, fn: Callable) -> dict:
    packet = getattr(aten, name)
    ops = (getattr(packet, o) for o in packet.overloads())
    # Only the tensor overloads: the packet also holds TorchScript's int/bool ones.
    return {op: fn for op in ops if not op._schema.is_mutable
            and any(str(a.type) == "Tensor" for a in op._schema.arguments)}


lowers_each({
    **_bitwise("bitwise_and", jnp.bitwise_and),
    **_bitwise("bitwise_or", jnp.bitwise_or),
    **_bitwise("bitwise_xor", jnp.bitwise_xor),
    **_bitwise("bitwise_left_shift", jnp.left_shift),
    **_bitwise("bitwise_right_shift", jnp.right_shift),
    **_bitwise("__lshift__", jnp.left_shift),
    **_bitwise("__rshift__", jnp.right_shift),
    aten.bitwise_not.default: jnp.invert,
}, promote="result")


@lowers(aten.where.self)
def where(cond, x, y):
    return jnp.where(cond, x, y)


# torch._assert_async (TorchTitan's RoPE bounds check): the op itself lowers to nothing; the
# assertion is its check, which reads the one value back, as CPU's kernel does.
@lowers(aten._assert_async.default, aten._assert_async.msg)
def assert_async(self, assert_msg=None):
    return ()


@check(aten._assert_async.default, aten._assert_async.msg)
def _assert_async_check(self,
                        assert_msg="Expected Tensor with single nonzero value, but got zero"):
    values = self.values()
    if values is None:
        return None
    if values.size != 1:
        return RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    return None if values.reshape(()).item() else RuntimeError(assert_msg)


# ----------------------------------------------------------------------------- fill

# x's values are overwritten: only its shape and dtype are read (``shape_only``).
@lowers(aten.fill.Scalar, aten.fill.Tensor, shape_only=("self",),
        constant=lambda x, value: value)
def fill(x, value):
    return jnp.full(x.shape, value, x.dtype)


@lowers(aten.zero.default, shape_only=("self",), constant=lambda x: 0)
def zero(x):
    return jnp.zeros(x.shape, x.dtype)
