"""Special functions: the gamma family (digamma, polygamma, igamma), Bessel, Airy, erfcx, ndtri.

Where ``jax.scipy.special`` matches PyTorch's CPU kernels it is used as is; where it differs (NaN
where CPU gives a limit, wrong values for negative arguments) or is missing, the function is
written here from its series and asymptotic expansions, computed in float64 and rounded to the
result dtype, with CPU's values at 0, +-inf and NaN.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jsp
import torch
from jax import lax

from torchtpu.lowering.elementwise import copysign
from torchtpu.lowering.registry import lowers, lowers_each

aten = torch.ops.aten


def _digamma(x):
    # PyTorch: digamma(+-0) is -+inf (lax gives NaN).
    return jnp.where(x == 0, copysign(jnp.full_like(x, jnp.inf), -x), lax.digamma(x))


lowers_each({aten.digamma.default: _digamma}, promote="result")


def _spherical_bessel_j0(x):
    safe = jnp.where(x == 0, jnp.ones_like(x), x)
    # sin(x)/x, 1 at 0 and 0 at +-inf (where sin is NaN), as on CPU.
    return jnp.where(x == 0, 1, jnp.where(jnp.isinf(x), 0, jnp.sin(safe) / safe))


def _scaled_bessel_k(order: int):
    """exp(x) K_order(x) = int_0^inf exp(-x (cosh t - 1)) cosh(order t) dt, by the trapezoid
    rule in float64: the integrand is even and analytic, so the rule converges geometrically
    (error about exp(-pi^2 / step)). The range stops where the integrand is below e^-60."""

    def fn(x):
        wide = x.astype(jnp.float64)
        pos = jnp.where(wide > 0, wide, 1)
        end = jnp.arccosh(1 + 60 / pos)
        t = end[..., None] * jnp.linspace(0, 1, 257)
        f = jnp.exp(-pos[..., None] * 2 * jnp.sinh(t / 2) ** 2) * jnp.cosh(order * t)
        step = end / 256
        out = step * (jnp.sum(f, -1) - f[..., 0] / 2 - f[..., -1] / 2)
        # K is infinite at 0, 0 at +inf, NaN for negative and NaN x.
        out = jnp.where(wide > 0, out, jnp.where(wide == 0, jnp.inf, jnp.nan))
        out = jnp.where(wide == jnp.inf, 0, out)
        return out.astype(x.dtype)

    return fn


def _bessel_k(order: int):
    scaled = _scaled_bessel_k(order)
    return lambda x: scaled(x) * jnp.exp(-x)


# Bessel functions J0, J1, Y0, Y1 and Airy Ai in float64: power series near 0 and the
# classical asymptotic expansions beyond (error about e^(-2x) for Bessel, e^(-2 zeta) for Airy,
# so the switch points keep both well under float32's precision). In the asymptotic range the
# phase is rounded in the input dtype first, as CPU's kernel computes it there: at large |x|
# that rounding is what CPU's float32 result carries, and matching it keeps the two together.
_BESSEL_SERIES_END = 12.0
_EULER_GAMMA = 0.57721566490153286061


def _poly(coefs, t):
    """sum(coefs[k] * t**k) by Horner's rule."""
    out = jnp.zeros_like(t)
    for c in reversed(coefs):
        out = out * t + c
    return out


def _bessel_series(order: int, x):
    """(J_order(x), the series part of Y_order(x) besides the log term) for float64 x > 0."""
    terms = 40
    q = -(x * x) / 4
    fact = [math.factorial(k) for k in range(terms + 2)]
    harmonic = [sum(1 / j for j in range(1, k + 1)) for k in range(terms + 2)]
    j = (x / 2) ** order * _poly([1 / (fact[k] * fact[k + order]) for k in range(terms)], q)
    if order == 0:
        rest = -_poly([harmonic[k] / fact[k] ** 2 for k in range(terms)], q) * 2 / jnp.pi
        y = 2 / jnp.pi * (jnp.log(x / 2) + _EULER_GAMMA) * j + rest
    else:
        # psi(k + 1) + psi(k + 2) = H_k + H_(k+1) - 2 gamma
        psi = [harmonic[k] + harmonic[k + 1] - 2 * _EULER_GAMMA for k in range(terms)]
        rest = x / 2 * _poly([psi[k] / (fact[k] * fact[k + 1]) for k in range(terms)], q)
        y = -2 / (jnp.pi * x) + 2 / jnp.pi * jnp.log(x / 2) * j - rest / jnp.pi
    return j, y


def _bessel_asymptotic(order: int, x, phase):
    """Hankel's expansion: (J_order(x), Y_order(x)) for large float64 x, at the given phase
    x - (2 order + 1) pi / 4."""
    mu = 4 * order * order
    a = [1.0]
    for k in range(1, 25):
        a.append(a[-1] * (mu - (2 * k - 1) ** 2) / (k * 8))
    inv = 1 / x
    p = _poly([a[k] * (-1) ** (k // 2) if k % 2 == 0 else 0.0 for k in range(25)], inv)
    q = _poly([a[k] * (-1) ** (k // 2) if k % 2 else 0.0 for k in range(25)], inv)
    scale = jnp.sqrt(2 / (jnp.pi * x))
    c, s = jnp.cos(phase), jnp.sin(phase)
    return scale * (p * c - q * s), scale * (p * s + q * c)


def _bessel(order: int, second_kind: bool):
    def fn(x):
        wide = x.astype(jnp.float64)
        mag = jnp.abs(wide)
        small = mag <= _BESSEL_SERIES_END
        phase = (jnp.abs(x) - jnp.asarray((2 * order + 1) * jnp.pi / 4, x.dtype))
        near = _bessel_series(order, jnp.where(small & (mag > 0), mag, 1.0))
        far = _bessel_asymptotic(order, jnp.where(small, _BESSEL_SERIES_END + 1, mag),
                                 phase.astype(jnp.float64))
        out = jnp.where(small, near[second_kind], far[second_kind])
        if second_kind:  # -inf at 0 (either sign), NaN below
            out = jnp.where(wide == 0, -jnp.inf, jnp.where(wide < 0, jnp.nan, out))
        elif order == 0:
            out = jnp.where(wide == 0, 1.0, out)
        else:  # odd, and x/2 near 0
            out = jnp.where(mag < 1e-150, wide / 2, jnp.sign(wide) * out)
        return jnp.where(jnp.isinf(wide), jnp.nan, out).astype(x.dtype)

    return fn


def _airy_ai(x):
    """Maclaurin series for -8 <= x <= 5, asymptotic expansions outside (x = +-inf: NaN)."""
    wide = x.astype(jnp.float64)
    # Ai = Ai(0) f(x) + Ai'(0) g(x), f and g the two power series solutions of y'' = x y.
    ai0, dai0 = 3 ** (-2 / 3) / math.gamma(2 / 3), -(3 ** (-1 / 3)) / math.gamma(1 / 3)
    f, g = [1.0], [1.0]
    for k in range(1, 40):  # the last term is below 1e-25 at x = -8
        f.append(f[-1] / ((3 * k - 1) * 3 * k))
        g.append(g[-1] / (3 * k * (3 * k + 1)))
    t = jnp.clip(wide, -8, 5)
    series = ai0 * _poly(f, t ** 3) + dai0 * t * _poly(g, t ** 3)
    u = [1.0]
    for k in range(1, 20):
        u.append(u[-1] * (6 * k - 5) * (6 * k - 3) * (6 * k - 1) / (216 * k * (2 * k - 1)))
    # x > 5: Ai = exp(-zeta) / (2 sqrt(pi) x^(1/4)) sum (-1)^k u_k zeta^-k, zeta = 2/3 x^(3/2)
    xp = jnp.where(wide > 5, wide, 6.0)
    zeta = 2 / 3 * xp ** 1.5
    decay = jnp.exp(-zeta) / (2 * jnp.sqrt(jnp.pi) * xp ** 0.25) * _poly(
        [(-1) ** k * u[k] for k in range(16)], 1 / zeta)
    # x < -8: oscillating, with the phase zeta + pi/4 rounded in the input dtype.
    xn = jnp.where(x < -8, x, jnp.asarray(-9, x.dtype))
    zn = -2 * xn * jnp.sqrt(-xn) / 3
    theta = (zn + jnp.asarray(jnp.pi / 4, x.dtype)).astype(jnp.float64)
    zn = zn.astype(jnp.float64)
    even = _poly([(-1) ** (k // 2) * u[k] if k % 2 == 0 else 0.0 for k in range(20)], 1 / zn)
    odd = _poly([(-1) ** (k // 2) * u[k] if k % 2 else 0.0 for k in range(20)], 1 / zn)
    wave = (jnp.sin(theta) * even - jnp.cos(theta) * odd) / (
        jnp.sqrt(jnp.pi) * (-xn.astype(jnp.float64)) ** 0.25)
    out = jnp.where(wide > 5, decay, jnp.where(wide < -8, wave, series))
    return jnp.where(jnp.isinf(wide), jnp.nan, out).astype(x.dtype)


def _igamma(a, x):
    # P(0, x) is 1 for x > 0 on CPU; jsp.gammainc gives NaN there.
    return jnp.where((a == 0) & (x > 0), 1, jsp.gammainc(a, x))


lowers_each({
    aten.special_erfcx.default: jsp.erfcx,
    aten.special_i0e.default: jsp.i0e,
    aten.special_i1.default: jsp.i1,
    aten.special_i1e.default: jsp.i1e,
    aten.special_modified_bessel_i0.default: jsp.i0,
    aten.special_modified_bessel_i1.default: jsp.i1,
    aten.special_ndtri.default: jsp.ndtri,
    aten.special_log_ndtr.default: jsp.log_ndtr,
    aten.special_spherical_bessel_j0.default: _spherical_bessel_j0,
    aten.special_modified_bessel_k0.default: _bessel_k(0),
    aten.special_modified_bessel_k1.default: _bessel_k(1),
    aten.special_scaled_modified_bessel_k0.default: _scaled_bessel_k(0),
    aten.special_scaled_modified_bessel_k1.default: _scaled_bessel_k(1),
    aten.special_bessel_j0.default: _bessel(0, False),
    aten.special_bessel_j1.default: _bessel(1, False),
    aten.special_bessel_y0.default: _bessel(0, True),
    aten.special_bessel_y1.default: _bessel(1, True),
    aten.special_airy_ai.default: _airy_ai,
    aten.igamma.default: _igamma,
    aten.igammac.default: jsp.gammaincc,
}, promote="result")


def _trigamma(x):
    # jsp.polygamma(1, .) goes through zeta(2, x), which is inaccurate for negative x; this is
    # the reflection psi1(x) = pi^2 / sin^2(pi x) - psi1(1 - x), then the recurrence
    # psi1(x) = 1/x^2 + psi1(x + 1) up to x + 6 and the asymptotic series there.
    reflect = x < 0.5
    pole = jnp.where(reflect, (jnp.pi / jnp.sin(jnp.pi * x)) ** 2, 0)
    x = jnp.where(reflect, 1 - x, x)
    total = jnp.zeros_like(x)
    for _ in range(6):
        total = total + 1 / (x * x)
        x = x + 1
    inv2 = 1 / (x * x)
    total = total + (1 + 1 / (2 * x) + inv2 * (1 / 6 - inv2 * (1 / 30 - inv2 / 42))) / x
    return jnp.where(reflect, pole - total, total)


def _zeta(s, q):
    """Hurwitz zeta; jsp.zeta is wrong for q < 0, so q is first shifted up past 1 with
    zeta(s, q) = q^-s + zeta(s, q + 1)."""
    def shift(state):
        total, q = state
        below = q < 1
        return total + jnp.where(below, q ** -s, 0), jnp.where(below, q + 1, q)

    total, q = lax.while_loop(lambda st: jnp.any(st[1] < 1), shift, (jnp.zeros_like(q), q))
    return total + jsp.zeta(s, q)


@lowers(aten.polygamma.default, promote="result")
def polygamma(n, x):
    # jsp.polygamma(0, .) is NaN at 0 where CPU's digamma gives -+inf.
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    sign = 1.0 if n % 2 else -1.0
    return sign * math.exp(math.lgamma(n + 1)) * _zeta(jnp.asarray(n + 1, x.dtype), x)
