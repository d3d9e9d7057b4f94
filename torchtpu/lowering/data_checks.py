"""The checks of data CPU's kernels make beyond index bounds: loss targets and inputs,
probabilities, repeats, standard deviations, unpooling indices, sorters, embedding-bag offsets.

Each is a check of ``lowering/checks.py`` built on :func:`first_bad`: a test ``(xp, values) ->
bool mask`` (NumPy on the host, jax.numpy on the device) marks the values CPU refuses, and the
first one marked is raised in CPU's words (on the host at the call; where the values are not
there yet, at the next host read, as CUDA's device asserts are).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.lowering.checks import Arg, out_of_bounds
from torchtpu.lowering.registry import check

aten = torch.ops.aten


def first_bad(arg: Arg | None, test: Callable, error: Callable) -> Exception | None:
    """error(value) for the first of arg's values that test marks; None when none is (or when
    the values are left to the device, which raises it later). test must be the same object
    for the same check (``functools.cache`` its maker): the device's program is kept per test."""
    if arg is None or 0 in arg.shape:
        return None
    values = arg.values()
    if values is None:
        arg.check_on_device(_finder(test), error)
        return None
    bad = np.broadcast_to(test(np, values), values.shape)
    return error(values[bad].flat[0].item()) if bad.any() else None


@functools.lru_cache(maxsize=512)
def _finder(test: Callable) -> Callable:
    def find(values):
        bad = jnp.broadcast_to(test(jnp, values), values.shape).ravel()
        first = values.ravel()[jnp.argmax(bad)]
        return jnp.stack([bad.any().astype(jnp.int64), first.astype(jnp.int64)])

    return find


def _outside_unit(xp, v):
    return ~((v >= 0) & (v <= 1))  # NaN too


def _negative(xp, v):
    return ~(v >= 0)  # NaN too


@functools.cache
def _outside(low: int, high: int) -> Callable:
    return lambda xp, v: (v < low) | (v >= high)


def _fixed(kind: type[Exception], text: str) -> Callable:
    """An error maker for a message without the value (a new exception each time)."""
    return lambda value: kind(text)


@check(aten.binary_cross_entropy.default)
def _binary_cross_entropy(self, target, weight=None, reduction=1):
    return first_bad(self, _outside_unit,
                     _fixed(RuntimeError, "all elements of input should be between 0 and 1"))


_P_IN = _fixed(RuntimeError, "Expected p_in >= 0 && p_in <= 1 to be true, but got false.  "
               "(Could this error message be improved?  If so, please report an enhancement "
               "request to PyTorch.)")


@check(aten.bernoulli.default)
def _bernoulli(self, generator=None):
    return first_bad(self, _outside_unit, _P_IN)


@check(aten.bernoulli.Tensor)
def _bernoulli_tensor(self, p, generator=None):
    return first_bad(p, _outside_unit, _P_IN)


@check(aten.bernoulli.p)
def _bernoulli_p(self, p=0.5, generator=None):
    if not 0 <= p <= 1:
        return RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    return None


@check(aten.normal.Tensor_Tensor, aten.normal.float_Tensor)
def _normal(mean, std, generator=None):
    return first_bad(std, _negative,
                     _fixed(RuntimeError, "normal expects all elements of std >= 0.0"))


@check(aten.multilabel_margin_loss_forward.default)
def _multilabel_margin_loss(self, target, reduction):
    classes = self.shape[-1] if self.ndim else 1
    return first_bad(target, _outside(-1, classes),
                     _fixed(RuntimeError, "argument #2 'target' is out of range"))


@check(aten.repeat_interleave.Tensor)
def _repeat_interleave(repeats, output_size=None):
    return first_bad(repeats, _negative, _fixed(RuntimeError, "repeats can not be negative"))


@check(aten.index_copy.default)
def _index_copy(self, dim, index, source):
    d = dim + self.ndim if dim < 0 else dim
    size = self.shape[d] if self.ndim else 1
    return first_bad(index, _outside(0, size), functools.partial(_index_copy_error, d, size))


def _index_copy_error(dim: int, size: int, value: int) -> IndexError:
    return IndexError(f"index_copy_(): index {value} is out of bounds for dimension {dim} with "
                      f"size {size}")


@check(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def _index_fill(self, dim, index, value):
    # The device would cast a complex fill value to a real dtype and drop its imaginary part.
    if isinstance(value, complex) and not self.dtype.is_complex:
        return RuntimeError("torchtpu.check: index_fill_(): Converting complex Scalar to "
                            "non-complex type is not supported")
    d = dim + self.ndim if dim < 0 else dim
    return out_of_bounds(index, self.shape[d] if self.ndim else 1, d, negative=True)


@check(aten.max_unpool2d.default, aten.max_unpool3d.default)
def _max_unpool(self, indices, output_size, *rest):
    volume = int(np.prod(output_size))
    return first_bad(indices, _outside(0, volume),
                     functools.partial(_unpool_error, "x".join(map(str, output_size))))


def _unpool_error(sizes: str, value: int) -> RuntimeError:
    return RuntimeError(f"Found an invalid max index: {value} (output volumes are of size "
                        f"{sizes})")


@check(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted(sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None):
    size = sorted_sequence.shape[-1] if sorted_sequence.ndim else 1
    return first_bad(sorter, _outside(0, size),
                     _fixed(RuntimeError, "torch.searchsorted(): sorter index out of range"))


@check(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    rows = weight.shape[0]
    error = first_bad(indices, _outside(0, rows), functools.partial(_bag_index_error, rows))
    if error is not None or indices.ndim != 1 or offsets is None or not offsets.shape[0]:
        return error
    return (first_bad(offsets, _first_not_zero, _bag_start_error)
            or first_bad(offsets, _last_after(indices.shape[0]),
                         functools.partial(_bag_end_error, indices.shape[0])))


def _first_not_zero(xp, v):
    return (xp.arange(v.shape[0]) == 0) & (v != 0)


@functools.cache
def _last_after(length: int) -> Callable:
    return lambda xp, v: (xp.arange(v.shape[0]) == v.shape[0] - 1) & (v > length)


def _bag_index_error(rows: int, value: int) -> RuntimeError:
    return RuntimeError(f"embedding_bag: index {value} is not in the valid range [0, {rows})")


def _bag_start_error(value: int) -> RuntimeError:
    return RuntimeError("offsets[0] has to be 0, i.e., the first sequence in the mini-batch has "
                        f"to start from position 0. However, got {value}")


def _bag_end_error(length: int, value: int) -> RuntimeError:
    return RuntimeError(f"offsets[-1] can not be greater than input's length {length} but got "
                        f"offsets[-1] of {value}")
