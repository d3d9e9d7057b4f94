"""Float32 inverse hyperbolics and the gamma family built from accurate logs, for a TPU.

XLA expands CHLO's ``asinh``, ``acosh``, ``atanh``, ``lgamma`` and ``digamma`` into its own
float32 ``log``, ``log1p`` and ``sqrt``, which on a TPU are the fast approximations whatever
``result_accuracy`` the outer op asks for: on a v5e chip, with the other transcendentals accurate,
these five stayed 1e-4 (``lgamma``) from CPU's. Written here in JAX's primitives instead, each
``log`` in them takes ``tpu_accuracy``'s rule and is accurate. JAX's semantics are kept, poles and
infinities included (the lowering table adds PyTorch's where they differ, e.g. digamma(0)).

Lanczos' approximation (g = 7, nine terms) gives ``lgamma`` for x >= 1/2, the reflection
formula the rest; ``digamma`` shifts x up past 6 and sums its asymptotic series there.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

# Far beyond this, x * x overflows float32; asinh and acosh of x are then log(2x).
_HUGE = 2.0 ** 60
_LANCZOS_G = 7.0
_LANCZOS = (0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313,
            -176.61502916214059, 12.507343278686905, -0.13857109526572012,
            9.9843695780195716e-6, 1.5056327351493116e-7)
# digamma's asymptotic series in 1/x^2: -1/12, 1/120, -1/252, 1/240, -1/132 (Bernoulli numbers).
_DIGAMMA_SERIES = (-1 / 12, 1 / 120, -1 / 252, 1 / 240, -1 / 132)


def asinh(x):
    a = jnp.abs(x)
    small = jnp.where(a < _HUGE, a, 1.0)
    near = lax.log1p(small + small * small / (1.0 + lax.sqrt(1.0 + small * small)))
    far = lax.log(jnp.where(a < _HUGE, 1.0, a)) + math.log(2.0)
    return jnp.copysign(jnp.where(a < _HUGE, near, far), x)


def acosh(x):
    small = jnp.where(x < _HUGE, x, 1.0)
    near = lax.log1p((small - 1.0) + lax.sqrt((small - 1.0) * (small + 1.0)))
    far = lax.log(jnp.where(x < _HUGE, 1.0, x)) + math.log(2.0)
    return jnp.where(x < 1.0, jnp.nan, jnp.where(x < _HUGE, near, far))


def atanh(x):
    a = jnp.abs(x)
    return jnp.copysign(0.5 * lax.log1p(2.0 * a / (1.0 - a)), x)  # |x| > 1: NaN; 1: inf


def _sin_pi(x):
    """sin(pi x), reduced first: pi * x of a large float32 x has no fractional part left."""
    return lax.sin(math.pi * (x - jnp.round(x)))


def _lgamma_lanczos(x):
    """lgamma(x) for x >= 1/2."""
    z = x - 1.0
    total = jnp.full_like(x, _LANCZOS[0])
    for i, c in enumerate(_LANCZOS[1:], start=1):
        total = total + c / (z + i)
    t = z + _LANCZOS_G + 0.5
    return 0.5 * math.log(2 * math.pi) + (z + 0.5) * lax.log(t) - t + lax.log(total)


def lgamma(x):
    upper = x >= 0.5
    direct = _lgamma_lanczos(jnp.where(upper, x, 1.0))
    mirrored = (math.log(math.pi) - lax.log(jnp.abs(_sin_pi(x)))
                - _lgamma_lanczos(jnp.where(upper, 1.0, 1.0 - x)))
    return jnp.where(jnp.isinf(x), jnp.inf, jnp.where(upper, direct, mirrored))


def _digamma_positive(x):
    shift = jnp.zeros_like(x)
    for _ in range(6):  # x + 6 > 6 for any x > 0
        below = x < 6.0
        shift = jnp.where(below, shift - 1.0 / x, shift)
        x = jnp.where(below, x + 1.0, x)
    inv2 = 1.0 / (x * x)
    series = jnp.zeros_like(x)
    for c in reversed(_DIGAMMA_SERIES):
        series = (series + c) * inv2
    return shift + lax.log(x) - 0.5 / x + series


def digamma(x):
    positive = x > 0
    direct = _digamma_positive(jnp.where(positive, x, 1.0))
    # psi(x) = psi(1 - x) - pi / tan(pi x); tan has period pi, so the reduced argument serves.
    r = x - jnp.round(x)
    mirrored = _digamma_positive(jnp.where(positive, 1.0, 1.0 - x)) - math.pi / lax.tan(math.pi * r)
    pole = (x <= 0) & (x == jnp.floor(x))
    value = jnp.where(positive, direct, jnp.where(pole, jnp.nan, mirrored))
    return jnp.where(x == jnp.inf, jnp.inf, value)


COMPOSITES = {"asinh": asinh, "acosh": acosh, "atanh": atanh, "lgamma": lgamma,
              "digamma": digamma}
