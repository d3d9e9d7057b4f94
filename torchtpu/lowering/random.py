"""Random ops drawn from the device generator: uniform, normal, bernoulli, random_, the other
distributions, randperm, multinomial, dropout and RReLU's noise.

Every lowering here gets a JAX PRNG key: in the schema's ``Generator?`` slot, or, for ops without
one (``native_dropout``), as its first argument (``random=True``). Values cannot match CPU's
stream; their distributions and dtypes do. Low-precision floats are drawn in float32 and rounded,
so a bfloat16 normal is as good as a float32 one rounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.lowering.checks import below_zero, first_bad, fixed, outside_unit
from torchtpu.lowering.registry import check, lowers

aten = torch.ops.aten
# The functional forms of the in-place draws (``x.uniform_()``) read only their input's shape
# and dtype: the draw overwrites it.
_SELF = ("self",)


def _draw_dtype(dtype):
    """The float dtype to draw in for a result of dtype (float32 for halves and non-floats)."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 32:
        return dtype
    return jnp.float32


def _uniform(key, x, low=0.0, high=1.0):
    return jax.random.uniform(key, x.shape, _draw_dtype(x.dtype), low, high)


def _normal(key, x):
    return jax.random.normal(key, x.shape, _draw_dtype(x.dtype))


@lowers(aten.uniform.default, shape_only=_SELF)
def uniform(x, low=0.0, high=1.0, generator=None):
    return _uniform(generator, x, low, high)


@check(aten.uniform.default)
def _uniform_check(self, low=0.0, high=1.0, generator=None):
    if low > high:
        return RuntimeError(f"uniform_ expects to return a [from, to) range, but found "
                            f"from={low} > to={high}")
    return None


@lowers(aten.normal_functional.default, shape_only=_SELF)
def normal_functional(x, mean=0.0, std=1.0, generator=None):
    return _normal(generator, x) * std + mean


@lowers(aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor,
        promote="result")
def normal(mean, std, generator=None):
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    draw = _draw_dtype(jnp.result_type(mean, std))
    return mean + std * jax.random.normal(generator, shape, draw)


@check(aten.normal.Tensor_Tensor, aten.normal.float_Tensor)
def _normal_check(mean, std, generator=None):
    return first_bad(std, below_zero,
                     fixed(RuntimeError, "normal expects all elements of std >= 0.0"))


@lowers(aten.bernoulli.default)
def bernoulli(p, generator=None):
    return jax.random.uniform(generator, p.shape, _draw_dtype(p.dtype)) < p


@lowers(aten.bernoulli.p, aten.bernoulli.Tensor, shape_only=_SELF)
def bernoulli_p(x, p, generator=None):
    draw = _draw_dtype(getattr(p, "dtype", x.dtype))
    return jax.random.uniform(generator, x.shape, draw) < p


_P_IN = fixed(RuntimeError, "Expected p_in >= 0 && p_in <= 1 to be true, but got false.  "
              "(Could this error message be improved?  If so, please report an enhancement "
              "request to PyTorch.)")


@check(aten.bernoulli.default)
def _bernoulli_check(self, generator=None):
    return first_bad(self, outside_unit, _P_IN)


@check(aten.bernoulli.Tensor)
def _bernoulli_tensor_check(self, p, generator=None):
    return first_bad(p, outside_unit, _P_IN)


@check(aten.bernoulli.p)
def _bernoulli_p_check(self, p=0.5, generator=None):
    if not 0 <= p <= 1:
        return RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    return None


def _default_high(dtype) -> int:
    """The largest value random_ draws for dtype when no upper bound is given (inclusive):
    every integer a float holds exactly, or an integer type's maximum."""
    if jnp.issubdtype(dtype, jnp.floating):
        return 2 ** (jnp.finfo(dtype).nmant + 1)
    if dtype == jnp.bool_:
        return 1
    return int(jnp.iinfo(dtype).max)


def _random_ints(key, x, low: int, count: int):
    """count consecutive integers from low, uniformly (by modulo, as PyTorch draws them)."""
    wide = count > 2**32
    bits = jax.random.bits(key, x.shape, jnp.uint64 if wide else jnp.uint32)
    if count < 2 ** (64 if wide else 32):
        bits = bits % np.array(count, bits.dtype)
    return (bits.astype(jnp.uint64) + np.uint64(low % 2**64)).astype(jnp.int64)


@lowers(aten.random.default, shape_only=_SELF)
def random_(x, generator=None):
    return _random_ints(generator, x, 0, _default_high(x.dtype) + 1)


@lowers(aten.random.to, shape_only=_SELF)
def random_to(x, to: int, generator=None):
    return _random_ints(generator, x, 0, to)


@lowers(getattr(aten.random, "from"), shape_only=_SELF)  # "from" is a Python keyword
def random_from(x, low: int, high: int | None, generator=None):
    if high is None:
        high = _default_high(x.dtype) + 1
    return _random_ints(generator, x, low, high - low)


@lowers(aten.exponential.default, shape_only=_SELF)
def exponential(x, lambd=1.0, generator=None):
    return jax.random.exponential(generator, x.shape, _draw_dtype(x.dtype)) / lambd


@lowers(aten.geometric.default, shape_only=_SELF)
def geometric(x, p, generator=None):
    # Number of trials up to and including the first success: ceil(log(U) / log(1 - p)).
    u = jax.random.uniform(generator, x.shape, jnp.float64 if x.dtype == jnp.float64
                           else jnp.float32, minval=np.finfo(np.float32).tiny)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-p))


@lowers(aten.log_normal.default, shape_only=_SELF)
def log_normal(x, mean=1.0, std=2.0, generator=None):
    return jnp.exp(_normal(generator, x) * std + mean)


@lowers(aten.cauchy.default, shape_only=_SELF)
def cauchy(x, median=0.0, sigma=1.0, generator=None):
    return jax.random.cauchy(generator, x.shape, _draw_dtype(x.dtype)) * sigma + median


@lowers(aten.randperm.generator)
def randperm(n: int, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return jax.random.permutation(generator, n)


@lowers(aten.randperm.default, random=True)
def randperm_default(key, n: int, dtype=None, layout=None, device=None, pin_memory=None):
    return jax.random.permutation(key, n)


@lowers(aten.multinomial.default)
def multinomial(probs, num_samples: int, replacement: bool = False, generator=None):
    logits = jnp.log(probs.astype(_draw_dtype(probs.dtype)))
    if replacement:
        batch = probs.shape[:-1]
        draws = jax.random.categorical(generator, logits, shape=(num_samples, *batch))
        return jnp.moveaxis(draws, 0, -1)
    # Without replacement: the top num_samples of logits + Gumbel noise (Gumbel-top-k).
    noisy = logits + jax.random.gumbel(generator, logits.shape, logits.dtype)
    return jax.lax.top_k(noisy, num_samples)[1]


@check(aten.multinomial.default)
def _multinomial_check(self, num_samples, replacement=False, generator=None):
    if not self.dtype.is_floating_point:
        return RuntimeError(f"multinomial only supports floating-point dtypes for input, got: "
                            f"{self.dtype}")
    if num_samples <= 0:
        return RuntimeError("cannot sample n_sample <= 0 samples")
    categories = self.shape[-1] if self.ndim else 1
    if categories > 2**24:
        return RuntimeError("number of categories cannot exceed 2^24")
    if not replacement and num_samples > categories:
        return RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                            "replacement")
    p = self.values()
    if p is None:
        self.check_on_device(_bad_distribution, _distribution_error)
        return None
    return _distribution_error(int(_bad_distribution(p)[1]))


@check(aten.multinomial.out)
def _multinomial_out_check(self, num_samples, replacement=False, generator=None, out=None):
    if out.dtype != torch.int64:
        return RuntimeError(f"multinomial expects Long tensor out, got: {out.dtype}")
    return _multinomial_check(self, num_samples, replacement, generator)


# What is wrong with multinomial's probabilities, by code (0: nothing), in CPU's words.
_DISTRIBUTION_ERRORS = {1: "probability tensor contains either `inf`, `nan` or element < 0",
                        2: "invalid multinomial distribution (sum of probabilities <= 0)"}


def _bad_distribution(p):
    xp = np if isinstance(p, np.ndarray) else jnp
    code = xp.where(~(xp.isfinite(p) & (p >= 0)).all(), 1, xp.where((p.sum(-1) <= 0).any(), 2, 0))
    return xp.stack([code > 0, code]).astype(xp.int64)


def _distribution_error(code: int) -> RuntimeError | None:
    return RuntimeError(_DISTRIBUTION_ERRORS[code]) if code else None


@lowers(aten.native_dropout.default, random=True)
def native_dropout(key, x, p: float, train: bool | None):
    if train is False:
        return x, jnp.ones(x.shape, jnp.bool_)
    keep = 1.0 - p
    mask = jax.random.uniform(key, x.shape, _draw_dtype(x.dtype)) < keep
    scale = 0.0 if keep == 0 else 1.0 / keep
    return jnp.where(mask, x * scale, jnp.zeros((), x.dtype)), mask


@lowers(aten.native_dropout_backward.default, promote="result")
def native_dropout_backward(grad, mask, scale: float):
    return grad * mask.astype(grad.dtype) * scale


@lowers(aten.rrelu_with_noise_functional.default)
def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1 / 3, training=False,
                                generator=None):
    """(result, noise): in training each element <= 0 is scaled by a slope drawn from
    U(lower, upper), which noise records (1 elsewhere); in eval, leaky_relu at their mean."""
    if not training:
        return jnp.where(x > 0, x, x * ((lower + upper) / 2)).astype(x.dtype), noise
    slope = jax.random.uniform(generator, x.shape, _draw_dtype(x.dtype), lower, upper)
    negative = x <= 0
    slope = jnp.where(negative, slope, 1).astype(x.dtype)
    return jnp.where(negative, x * slope, x), slope.astype(noise.dtype)
