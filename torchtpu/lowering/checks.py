"""What a value check sees and the pieces checks are built of; each op's check itself is declared
with ``@check(op)`` beside the op's lowering, in its family module.

Meta kernels check shapes and dtypes; CPU kernels also check argument values (``uniform_`` with
from > to, ``kthvalue``'s k) and, for a few ops, data: index bounds (a device gathers with an
out-of-range index without complaint: XLA clamps it) and ``multinomial``'s probabilities. The
dispatcher finds an op's check with :func:`find` and calls it before running the op, in every
eager mode, with the op's bound arguments in schema order: Python values as given, tensors as
:class:`Arg` (shape, ndim and torch dtype; ``arg.values()`` reads the values to the host, so only
checks of data do that). A check returns an exception or None; the dispatcher then raises what
CPU raises for the same call, in PyTorch's words (see ``eager/fallback.cpu_error``), else this
one.

Checks of data are built on :func:`first_bad`: a test ``(xp, values) -> bool mask`` (NumPy on the
host, jax.numpy on the device) marks the values CPU refuses, and the first one marked is raised
in CPU's words. Where the values cannot be read without stalling the device (``values()`` gives
None), the device runs the test instead (``arg.check_on_device``) and the error is raised at the
next host read (``device/asserts.py``), as CUDA's device asserts are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.lowering.registry import CHECKS, OpOverload


class Arg:
    """What a check sees of a tensor argument: its shape, ndim and torch dtype, and its values
    through :meth:`values`."""

    __slots__ = ("shape", "ndim", "dtype", "_read", "_on_device")

    def __init__(self, shape: tuple, dtype: torch.dtype,
                 read: Callable[[], np.ndarray | None],
                 on_device: Callable[[Callable, Callable], None] | None = None):
        self.shape, self.ndim, self.dtype, self._read = tuple(shape), len(shape), dtype, read
        self._on_device = on_device

    def values(self) -> np.ndarray | None:
        """The values, read to the host; None where that would stall the device or run a
        DeferAndFuse recording early: then check them with :meth:`check_on_device`."""
        return self._read()

    def check_on_device(self, find: Callable, error: Callable[[int], Exception]) -> None:
        """Check the values on the device: ``find`` (jittable, the same function object for the
        same check, so that its program is reused) maps them to an int array ``[bad, value]``;
        when bad, ``error(value)`` is raised at the next host read."""
        if self._on_device is not None:
            self._on_device(find, error)


def find(op: OpOverload) -> Callable | None:
    """The op's check, if it has one."""
    return CHECKS.get(op)


def first_bad(arg: Arg | None, test: Callable, error: Callable) -> Exception | None:
    """error(value) for the first of arg's values that test marks; None when none is (or when
    the values are left to the device, which raises it later). test must be the same object
    for the same check (``functools.cache`` its maker): the device's program is kept per test;
    a module-level function or a partial of one, so that the program has a stable key."""
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
    # A partial of module-level functions, not a closure: a recording that runs the check on
    # the device (DeferAndFuse's) then has a stable form, and a new process loads its program
    # by key (``eager/fused_program.keyed``).
    return functools.partial(_find, test)


def _find(test: Callable, values):
    bad = jnp.broadcast_to(test(jnp, values), values.shape).ravel()
    first = values.ravel()[jnp.argmax(bad)]
    return jnp.stack([bad.any().astype(jnp.int64), first.astype(jnp.int64)])


def outside_unit(xp, v):
    """The test of values outside [0, 1] (NaN too)."""
    return ~((v >= 0) & (v <= 1))


def below_zero(xp, v):
    """The test of negative values (NaN too)."""
    return ~(v >= 0)


@functools.cache  # (a partial: a stable form, see _finder)
def outside(low: int, high: int) -> Callable:
    """The test of values outside [low, high)."""
    return functools.partial(_outside, low, high)


def _outside(low: int, high: int, xp, v):
    return (v < low) | (v >= high)


def fixed(kind: type[Exception], text: str) -> Callable:
    """An error maker for a message without the value (a new exception each time)."""
    return lambda value: kind(text)


def out_of_bounds(index: Arg | None, size: int, dim: int, negative: bool,
                  kind: type[Exception] = IndexError) -> Exception | None:
    """An error of CPU's kind for that op (IndexError; RuntimeError for gather, scatter and
    index_add) for the first value of index outside dimension dim of the given size."""
    if index is None or index.dtype in (torch.bool, torch.uint8):
        return None  # masks are checked by shape, which PyTorch's meta kernels already do
    return first_bad(index, outside(-size if negative else 0, size),
                     functools.partial(_out_of_bounds, dim=dim, size=size, kind=kind))


def _out_of_bounds(value: int, dim: int, size: int, kind: type[Exception]) -> Exception:
    return kind(f"index {value} is out of bounds for dimension {dim} with size {size}")


def along(x: Arg, dim: int) -> tuple[int, int]:
    """(dim counted from the front, x's size there; 1 for a 0-d x)."""
    d = dim + x.ndim if dim < 0 else dim
    return d, x.shape[d] if x.ndim else 1


def same_dtype(expected: torch.dtype, out: Arg) -> RuntimeError | None:
    """What the out= kernels that want their outputs' dtypes exactly raise (CPU's
    check_scalar_type_device_layout_equal; their meta kernels cast)."""
    if out.dtype != expected:
        return RuntimeError(f"expected scalar_type {expected} but found {out.dtype}")
    return None
