"""Elementwise ops against CPU: unary math, arithmetic, comparisons, logic, bits, where, fill."""

import math
import types

import numpy as np
import pytest
import torch

from torchtpu.device import dtypes
from torchtpu.device.hooks import HOOKS
from torchtpu.runtime import platform
from torchtpu.testing.compare import assert_same, check_against_cpu

SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.5, math.inf, -math.inf, math.nan]


def _floats(*shape):
    x = torch.randn(*shape) * 2
    flat = x.view(-1)
    n = min(flat.numel(), len(SPECIAL))
    flat[:n] = torch.tensor(SPECIAL[:n])
    return x


UNARY = [
    "abs", "neg", "sign", "sgn", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt",
    "rsqrt", "reciprocal", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh",
    "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "lgamma", "digamma", "sigmoid", "logit",
    "floor", "ceil", "round", "trunc", "frac", "isnan", "isinf", "isfinite", "isposinf",
    "isneginf", "signbit", "nan_to_num", "angle", "i0", "sinc", "deg2rad", "rad2deg",
    "logical_not", "square", "positive",
]


@pytest.mark.parametrize("name", UNARY)
def test_unary_float(name):
    fn = getattr(torch, name)
    check_against_cpu(fn, _floats(4, 5), atol=1e-5, rtol=1e-5)


INT_UNARY = ["abs", "neg", "sign", "exp", "sqrt", "sin", "sigmoid", "floor", "round", "trunc",
             "isnan", "signbit", "reciprocal", "bitwise_not", "logical_not", "angle"]


@pytest.mark.parametrize("name", INT_UNARY)
def test_unary_int(name):
    x = torch.randint(-5, 6, (3, 4), dtype=torch.int32)
    check_against_cpu(getattr(torch, name), x, rtol=1e-5)


def test_unary_extras():
    x = _floats(4, 5)
    check_against_cpu(lambda x: torch.round(x, decimals=1), x)
    check_against_cpu(lambda x: torch.round(x * 1000, decimals=-2), x)
    check_against_cpu(lambda x: torch.logit(x, eps=1e-3), x.sigmoid())
    check_against_cpu(lambda x: torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-3.0), x)
    check_against_cpu(lambda x: torch.clamp(x, -1, 0.5), x)
    check_against_cpu(lambda x: torch.clamp(x, max=0.2), x)
    check_against_cpu(lambda x: x.clamp_min(0.1) + x.clamp_max(-0.1), x)
    b = torch.randn(4, 5)
    check_against_cpu(lambda x, b: torch.clamp(x, min=b, max=b + 1), x, b)
    check_against_cpu(lambda x, b: torch.clamp_min(x, b) - torch.clamp_max(x, b), x, b)
    i = torch.arange(-4, 5)
    check_against_cpu(lambda i: torch.clamp(i, 0.5, 2.5), i)  # promotes to float


BINARY = ["add", "sub", "mul", "div", "remainder", "fmod", "pow", "floor_divide", "true_divide",
          "atan2", "hypot", "logaddexp", "logaddexp2", "copysign", "xlogy", "maximum", "minimum",
          "fmax", "fmin", "nextafter", "heaviside", "special.xlog1py"]


def _resolve(name):
    fn = torch
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


SCALAR_OVERLOADS = {"add", "sub", "mul", "div", "remainder", "fmod", "pow", "floor_divide",
                    "true_divide", "copysign", "xlogy"}


@pytest.mark.parametrize("name", BINARY)
def test_binary(name):
    fn = _resolve(name)
    x, y = _floats(3, 4), _floats(4)  # broadcasting, with NaN/inf/zero on both sides
    y = y.flip(0)
    check_against_cpu(fn, x, y, atol=1e-5, rtol=1e-5)
    if name in SCALAR_OVERLOADS:
        check_against_cpu(lambda x: fn(x, 1.5), x, atol=1e-5, rtol=1e-5)


INT_BINARY = ["add", "sub", "mul", "div", "remainder", "fmod", "floor_divide", "maximum",
              "minimum", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift",
              "bitwise_right_shift", "logical_and", "logical_or", "logical_xor", "eq", "lt"]


@pytest.mark.parametrize("name", INT_BINARY)
def test_binary_int(name):
    fn = getattr(torch, name)
    x = torch.randint(-20, 20, (3, 4))
    y = torch.randint(1, 5, (4,), dtype=torch.int32)  # broadcast; int64 op int32 -> int64
    check_against_cpu(fn, x, y)
    if name not in ("maximum", "minimum") and not name.startswith("logical"):
        check_against_cpu(lambda x: fn(x, 3), x)


def test_arithmetic_overloads():
    x, y = _floats(3, 4), torch.randn(3, 4)
    i = torch.randint(-20, 20, (6,))
    for mode in ("trunc", "floor"):
        check_against_cpu(lambda x, y, m: torch.div(x, y, rounding_mode=m), x, y, mode)
        check_against_cpu(lambda x, m: torch.div(x, -0.7, rounding_mode=m), x, mode)
        check_against_cpu(lambda i, m: torch.div(i, 3, rounding_mode=m), i, mode)
        check_against_cpu(lambda i, m: torch.div(i, i[:1] - 21, rounding_mode=m), i, mode)
    check_against_cpu(lambda x, y: torch.add(x, y, alpha=2.5) - torch.sub(x, y, alpha=-2), x, y)
    check_against_cpu(lambda y: torch.pow(2.0, y) + torch.pow(y, 2) + torch.pow(y.abs(), 0.5), y)
    check_against_cpu(lambda y: torch.remainder(5, y + 10), y)
    i = torch.randint(0, 5, (5,))
    check_against_cpu(lambda i: torch.pow(i, 3) + torch.pow(2, i), i)
    check_against_cpu(lambda i: 7 / (i + 1), i)
    w = y.sigmoid()
    check_against_cpu(lambda x, y, w: torch.lerp(x, y, 0.3) + torch.lerp(x, y, w), x, y, w)
    check_against_cpu(lambda x, y: torch.addcmul(x, x, y, value=0.5), x, y)
    check_against_cpu(lambda x, y: torch.addcdiv(x, x, y, value=-2), x, y)
    check_against_cpu(lambda x: torch.xlogy(2.0, x) + torch.xlogy(x, 3.0), x)


def test_lerp_by_one_weight_takes_one_product_an_element_and_keeps_both_sides_exact():
    """A scalar weight (AdamW's moment update, ``_foreach_lerp_(m, g, 1 - beta1)``) picks CPU's
    side of the formula on the scalar: one product an element, not both sides' (the step's
    largest fusions were bound by that arithmetic on a v5e). Both sides stay CPU's to the bit."""
    import jax
    import jax.numpy as jnp

    from torchtpu.lowering.registry import TABLE

    x = jnp.ones((8, 128), jnp.float32)
    for op in (torch.ops.aten.lerp.Scalar, torch.ops.aten.lerp.Tensor):
        eqns = jax.make_jaxpr(TABLE[op].fn)(x, x, jnp.float32(0.1)).jaxpr.eqns
        full = [e.primitive.name for e in eqns if e.outvars[0].aval.shape == x.shape]
        assert full.count("mul") == 1 and len(full) <= 4, full
    # Both sides as the two-sided formula computes them, to the bit (signed zeros, NaNs and
    # infinities included), and as CPU's lerp within its rounding.
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3e38, math.inf, -math.inf, math.nan,
                            1e-30, 0.1])
    a, b = special.repeat_interleave(len(special)), special.repeat(len(special))
    two_sided = jax.jit(lambda s, e, w: jnp.where(jnp.abs(w) < 0.5, s + w * (e - s),
                                                  e - (e - s) * (1 - w)))
    for dt, bits in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
        x, y = a.to(dt), b.to(dt)
        for w in (0.0, 0.1, 0.49999997, 0.5, 0.9, 1.0, -0.2, 1.5, math.inf, math.nan):
            want = torch.from_numpy(np.array(two_sided(x.numpy(), y.numpy(),
                                                         np.asarray(w, x.numpy().dtype))))
            by_tensor = torch.lerp(x.to("tpu"), y.to("tpu"), torch.tensor(w, dtype=dt).to("tpu"))
            by_number = torch.lerp(x.to("tpu"), y.to("tpu"), w).cpu()
            assert torch.equal(by_tensor.cpu().view(bits), want.view(bits)), (w, dt)
            # (a Python weight is rounded to the inputs' type first: 1 - 0.9f, not 1 - 0.9)
            assert torch.equal(by_number.view(bits), want.view(bits)), (w, dt)
            torch.testing.assert_close(by_number, torch.lerp(x, y, w), equal_nan=True)
    # The half types in CPU's opmath (float32), rounded once: CPU's bits
    g = torch.Generator().manual_seed(0)
    x, y, w = (torch.randn(512, generator=g) for _ in range(3))
    for dt in (torch.bfloat16, torch.float16):
        for weight in (0.3, 0.9, -0.6, w.to(dt)):
            want = torch.lerp(x.to(dt), y.to(dt), weight)
            got = torch.lerp(x.to(dt).to("tpu"), y.to(dt).to("tpu"),
                             weight.to("tpu") if isinstance(weight, torch.Tensor) else weight)
            assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), (dt, weight)


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparisons(op):
    fn = getattr(torch, op)
    x = torch.tensor([[1.0, 2.0, math.nan, -1.0], [0.0, -0.0, math.inf, 2.0]])
    y = torch.tensor([1.0, 3.0, math.nan, -1.0])
    check_against_cpu(fn, x, y)
    check_against_cpu(lambda x: fn(x, 2.0), x)
    i = torch.tensor([1, 2, 3])
    check_against_cpu(lambda i: fn(i, 2.5), i)  # compared in float, not truncated
    check_against_cpu(lambda i, f: fn(i, f), i, torch.tensor([1.0, 2.5, 3.0]))


def test_shifts_and_bool_logic():
    x = torch.tensor([1, -8, 255, 7], dtype=torch.int32)
    s = torch.tensor([0, 1, 31, 40], dtype=torch.int32)
    check_against_cpu(lambda x, s: (x << s, x >> s, x << 2, x >> 1), x, s)
    u = torch.tensor([1, 128, 255], dtype=torch.uint8)
    check_against_cpu(lambda u: (u >> 1, ~u, u & 0x0F, u ^ 3), u)
    a, b = torch.tensor([True, False, True]), torch.tensor([True, True, False])
    check_against_cpu(lambda a, b: (a & b, a | b, a ^ b, ~a, a + b), a, b)
    f = torch.tensor([0.0, 1.5, math.nan])
    check_against_cpu(lambda f: (torch.logical_and(f, f), torch.logical_not(f)), f)


def test_where():
    c = torch.rand(3, 4) > 0.5
    x, y = torch.randn(3, 4), torch.randn(4)
    check_against_cpu(torch.where, c, x, y)
    check_against_cpu(lambda c, x: torch.where(c, x, 0.0) + torch.where(c, 1.0, x), c, x)
    i = torch.randint(0, 9, (4,))
    check_against_cpu(torch.where, c, i, y)  # int64 with float32 -> float32


def test_inplace_on_view():
    x, y = torch.randn(4, 3), torch.randn(3)

    def fn(x, y):
        x[1:].add_(y)
        x[:, 0].mul_(2).clamp_(-0.5, 0.5)
        x.t()[1].sigmoid_()
        x[0].fill_(7)
        x[2].zero_()
        return x

    # fn mutates its input, so the CPU run gets its own copy.
    assert_same(fn(x.to("tpu"), y.to("tpu")), fn(x.clone(), y))
    i = torch.arange(6)
    assert_same(i.to("tpu")[::2].bitwise_xor_(5), i.clone()[::2].bitwise_xor_(5))


def test_out_variants():
    x, y = torch.randn(3, 4), torch.randn(3, 4)

    def fn(x, y):
        out = torch.empty_like(x)
        torch.mul(x, y, out=out)
        flags = torch.empty(3, 4, dtype=torch.bool, device=x.device)
        torch.gt(x, y, out=flags)
        grown = torch.empty(0, device=x.device)  # out= is resized to the result shape
        torch.exp(x, out=grown)
        return out, flags, grown

    check_against_cpu(fn, x, y)


def test_complex():
    z = torch.randn(3, 4, dtype=torch.complex64)
    w = torch.randn(4, dtype=torch.complex64)
    check_against_cpu(lambda z, w: (z + w, z * w, z / w, z - 2j * w), z, w, atol=1e-5, rtol=1e-5)
    check_against_cpu(lambda z: (z.abs(), z.exp(), z.sgn(), z.angle(), z.sqrt(), z.log()), z,
                      atol=1e-5, rtol=1e-5)
    check_against_cpu(lambda z: (z.conj_physical(), z.conj() * z, z.isnan(), z == z), z)
    re, im = torch.randn(3), torch.randn(3)
    check_against_cpu(lambda re, im: torch.complex(re, im) * 2, re, im)


def test_python_complex_scalars_compute_in_the_tensors_precision():
    # A Python complex enters a complex64 call's program as complex64 (a TPU has no
    # complex128), and a complex128 call's at full precision where the platform has it.
    c = 1 / 3 + 1j / 7
    for dtype in (torch.complex64,) if platform.platform() == "tpu" else (
            torch.complex64, torch.complex128):
        z = torch.randn(6, dtype=dtype)
        check_against_cpu(lambda z: (z * c, c - z, z.real * c), z, atol=0, rtol=2e-16
                          if dtype is torch.complex128 else 1.2e-7)


_MAKES_COMPLEX128 = {
    "to": lambda x, y: y.to("tpu", torch.complex128),
    "zeros": lambda x, y: torch.zeros(len(x), dtype=torch.complex128, device="tpu"),
    "times_1j": lambda x, y: x * 1j,
    "view_as_complex": lambda x, y: torch.view_as_complex(x.view(-1, 2)),
    "view_dtype": lambda x, y: x.view(torch.complex128),
    "complex": lambda x, y: torch.complex(x, x),
    "fft": lambda x, y: torch.fft.fft(x),
    "compiled": lambda x, y: torch.compile(lambda a: (a * 1j).abs(), backend="tpu")(x),
}


@pytest.mark.parametrize("make", list(_MAKES_COMPLEX128))
def test_complex128_is_refused_on_a_tpu_before_a_program_holds_it(monkeypatch, make):
    """libtpu ends the process (no Python error) on a program holding complex128; on a TPU every
    way of making a complex128 device value raises first, naming the dtype (found on a v5e
    chip). Elsewhere complex128 computes."""
    x = torch.randn(4, dtype=torch.float64).to("tpu")
    y = torch.randn(4, dtype=torch.complex128)
    torch._dynamo.reset()
    if platform.platform() != "tpu":
        _MAKES_COMPLEX128[make](x, y)  # this platform computes complex128
        torch._dynamo.reset()
        monkeypatch.setattr(dtypes, "platform", types.SimpleNamespace(platform=lambda: "tpu"))

    def launched(label, fn, args):  # the refusal must come before any program compiles
        raise AssertionError(f"a program ran: {label}")

    monkeypatch.setattr(HOOKS, "launch_observer", launched)
    # A size no other test uses: no plan an earlier call left is reused.
    x, y = torch.randn(38, dtype=torch.float64).to("tpu"), torch.randn(38, dtype=torch.complex128)
    with pytest.raises(Exception, match="torchtpu.dtype: complex128 is not supported on a TPU"):
        _MAKES_COMPLEX128[make](x, y)
    monkeypatch.undo()
    torch._dynamo.reset()


_ROUNDED = {
    "trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
    "floor": lambda x, y: torch.div(x, y, rounding_mode="floor"),
    "fmod": torch.fmod,
    "remainder": torch.remainder,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", list(_ROUNDED))
def test_rounded_division_and_remainders_at_their_edges(dtype, op):
    # Rounded quotients are computed from x - fmod(x, y), not from a rounded x / y (a TPU's
    # float32 division is not correctly rounded), and fmod by an infinity is x (a TPU's is NaN):
    # signed zeros, infinities, NaNs, huge and near-integer quotients as CPU gives them.
    # Subnormals are left out: XLA flushes them.
    values = torch.tensor([-7.5, -3.0, -0.5, -0.0, 0.0, 0.5, 3.0, 7.5, 1e30, -1e30, math.inf,
                           -math.inf, math.nan, 6.0000005, 2.0**24 + 3])
    x, y = (t.reshape(-1).to(dtype) for t in torch.meshgrid(values, values, indexing="ij"))
    got = check_against_cpu(_ROUNDED[op], x, y, atol=0, rtol=0)
    expected = _ROUNDED[op](x, y)
    nan = expected.isnan()
    assert torch.equal(got.cpu().signbit() | nan, expected.signbit() | nan)  # signed zeros


def test_half_precision():
    x = torch.randn(8)
    for dtype in (torch.float16, torch.bfloat16):
        check_against_cpu(lambda x: (x.exp(), x * 3, x.tanh()), x.to(dtype), atol=1e-2, rtol=1e-2)


def test_factories_fill():
    assert_same(torch.ones(3, device="tpu"), torch.ones(3))
    assert_same(torch.zeros(2, 3, dtype=torch.int64, device="tpu"),
                torch.zeros(2, 3, dtype=torch.int64))
    assert_same(torch.full((2, 2), 2.5, device="tpu"), torch.full((2, 2), 2.5))
    assert_same(torch.full((3,), True, device="tpu"), torch.full((3,), True))
    assert_same(torch.ones_like(torch.empty(2, 2, device="tpu")), torch.ones(2, 2))
    v = torch.tensor(4.0)
    check_against_cpu(lambda x, v: x.fill_(v), torch.randn(3), v)


def test_print_does_not_fall_back():
    x = torch.tensor([[1.5, -2.0, math.nan], [math.inf, 0.0, 1e-8]])
    samples = (x, x.to(torch.int64), x > 0, torch.randn(50, 50), torch.tensor(2.5),
               torch.tensor([1 + 2j, -3j]))
    for t in samples:
        shown = "".join(repr(t.to("tpu")).split())  # the device suffix may wrap a line
        assert ",device='tpu:0'" in shown
        assert shown.replace(",device='tpu:0'", "") == "".join(repr(t).split())


SPECIAL_FNS = ["erfcx", "i0e", "i1", "i1e", "ndtri", "log_ndtr", "modified_bessel_i0",
               "modified_bessel_i1", "spherical_bessel_j0", "modified_bessel_k0",
               "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1"]


def test_special_functions():
    x = _floats(4, 5)
    p = torch.rand(4, 5)

    def fn(x, p):
        out = [getattr(torch.special, name)(p if name == "ndtri" else x) for name in SPECIAL_FNS]
        return out + [torch.igamma(x.abs(), p * 3), torch.igammac(x.abs(), p * 3)]

    check_against_cpu(fn, x, p, atol=1e-5, rtol=2e-5)


def test_polygamma_negative_and_poles():
    # Negative non-integers go through reflection (n == 1) or a shifted zeta (n >= 2).
    x = torch.tensor([-8.4784, -3.0337, -0.5, 0.3, 1.0, 2.5, 30.0, 0.0, -2.0])
    check_against_cpu(lambda x: [torch.polygamma(n, x) for n in range(5)], x, rtol=2e-6)


def test_polygamma_gradient():
    def grad(x):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(torch.polygamma(1, x).sum(), x)[0]

    x = torch.tensor([-2.5, 0.7, 3.0])
    assert_same(grad(x.to("tpu")), grad(x), rtol=2e-6)


def test_complex_and_polar_broadcast():
    a, b = torch.rand(3), torch.randn(2, 3)
    check_against_cpu(lambda a, b: (torch.complex(a, b), torch.polar(a, b)), a, b)


def test_frexp():
    x = _floats(3, 4) * 1000
    check_against_cpu(lambda x: torch.frexp(x), x)


def test_equal():
    a = torch.tensor([1.0, 2.0, 3.0])
    d = a.to("tpu")
    assert torch.equal(d, d.clone())
    assert not torch.equal(d, d + 1)
    assert not torch.equal(d, d[:2])
    nan = torch.tensor([float("nan")], device="tpu")
    assert torch.equal(nan, nan) == torch.equal(nan.cpu(), nan.cpu())


@pytest.mark.parametrize("name", ["bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "airy_ai"])
def test_bessel_and_airy(name):
    # Across the series/asymptotic switch points, far out where the phase rounding matters,
    # and at the special values (0, -0, +-inf, NaN, negative x for Y).
    x = torch.cat([torch.linspace(-40, 40, 2001), torch.logspace(-6, 4, 200),
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-30, -1e4])])
    check_against_cpu(getattr(torch.special, name), x)


class _SignsOfFloat64(torch.nn.Module):
    def forward(self, x, y):
        return (torch.div(x, y, rounding_mode="trunc"), torch.div(x, y, rounding_mode="floor"),
                torch.copysign(x, y), torch.signbit(y))


def test_float64_signs_take_no_shift_on_a_tpu():
    # libtpu 0.0.42 refuses a float64 bitcast followed by jnp.signbit's shift (a TPU emulates
    # float64; seen on a v5e chip): lowered for a TPU, float64 signs are a compare of the bits.
    import jax

    from torchtpu.jax import to_jax

    fn, params = to_jax(_SignsOfFloat64())
    spec = jax.ShapeDtypeStruct((15,), dtypes.to_jax(torch.float64))
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(params, spec, spec).mlir_module()
    assert "bitcast_convert" in text and "shift_right_arithmetic" not in text


def test_float64_signbit_from_bits_keeps_signed_zeros_and_nans():
    x = torch.tensor([-0.0, 0.0, -1e-300, 1e-300, -math.inf, math.inf, -2.5, 3.0, math.nan,
                      -math.nan], dtype=torch.float64)
    check_against_cpu(torch.signbit, x)
    check_against_cpu(torch.copysign, torch.ones_like(x), x)


@pytest.mark.parametrize("op", list(_ROUNDED))
def test_rounded_division_of_near_integer_quotients(op):
    # Quotients a few ulps from an integer, by a Python number (cast to float32 first, as CPU
    # does): trunc is of the correctly rounded quotient (2.1 / -0.7 is -3), floor and the
    # remainders of the exact one (on a v5e chip fmod(3.5, -0.7) came out 0.0).
    k = torch.arange(-40, 41, dtype=torch.float32) * torch.tensor(0.7)
    x = torch.cat([k, k.nextafter(k + 1), k.nextafter(k - 1), torch.tensor([2.1, -2.1, 3.5])])
    x = x[(x == 0) | (x.abs() > 1e-30)]  # no subnormals (0's neighbours): XLA flushes them
    check_against_cpu(lambda x: _ROUNDED[op](x, -0.7), x, atol=0, rtol=0)
    check_against_cpu(lambda x: _ROUNDED[op](x, torch.full_like(x, 0.7)), x, atol=0, rtol=0)
