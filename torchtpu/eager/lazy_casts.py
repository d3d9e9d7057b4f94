"""Strict's lazy casts and pointwise calls: a value computed inside the program that reads it.

Under autocast a Strict step launched a program for every cast: each weight's and input's cast
to bfloat16 and, in backward, each gradient's cast back to float32 (342 of a 12-layer Llama
step's 1,710 launches). Here ``x.to(dtype)`` (``kernels.to_copy``, through ``HOOKS.lazy_cast``)
stores a ``Converted``, the source array and the dtype, in the result's storage instead; a
consumer's program (``dispatch.dynamic_values`` -> ``tensors.read_parts(fold=True)``) takes the
source and converts it itself (the spec payload ``Cast``). Everything else that reads the
storage resolves it, as any ``Deferred``: one cast program, as before.

Memory cannot grow: a widening cast (the lazy value holds a narrower source) and a narrowing
cast of a parameter under autocast (the parameter is held anyway; autocast drops its casts when
its region ends and autograd when backward has run) wait for every reader. Any other narrowing
cast (an activation's, a float32 gradient's of a bfloat16 result) is ``keep``: the first
program converting it returns the narrow value too (``program.rebuild``'s ``kept``, taken by
``settle`` after the launch), which becomes the cast's value and lets the wide source go, so it
lives no longer than until that first reader (a cast saved for backward holds the narrow value,
as before). 110 more launches of a 12-layer Llama step folded so.

The same holds for a Strict call of a pointwise op (PyTorch's tag) on one tensor with no traced
number (``lazy_op``, asked by ``Strict.run``; ``program.one_pointwise_input``): the
``Converted`` holds its (lowering, spec) as ``op``, read through the input's view, and the
consumer's program applies it (``program.applied``): the RMSNorm's square and rsqrt, the
backward's multiplies by special numbers, the rotary halves' negation, silu and sigmoid (186 of
a 12-layer step's launches). One larger than its input (a broadcast) runs now, where its
memory is asked for; one smaller (a slice's) is ``keep``. An in-place op's value is computed
before it is written (``computed``). Fused with a reduction, the reduction may sum in another
order than it did over a stored input: an ulp.

The source array is immutable, a conversion between float dtypes cannot fail, and a view or an
in-place write of the result resolves or replaces the value: nothing a user can see changes.
The source is lent (``tensors.lend``) so that no view write donates its buffer meanwhile, and
every lazy cast still pending is resolved when Strict stops being the executor (a capture or
DeferAndFuse never sees one).
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import NamedTuple

import jax
import numpy as np
import torch
from jax._src.array import ArrayImpl

from torchtpu.device import autocast, dtypes, tensors
from torchtpu.device.views import Geometry, check_in_bounds, read_view
from torchtpu.runtime import warm

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_NP = {d: dtypes.to_jax(d) for d in _FLOATS}


@functools.lru_cache(maxsize=1024)
def _converter(dtype: np.dtype, shape: tuple):
    return warm.named(jax.jit(lambda a: dtypes.cast(a, dtype).reshape(shape)), "lazy_cast",
                      dtype, shape)


class Cast(NamedTuple):
    """How a program reads an argument held lazily cast: its array converted to ``dtype`` and
    reshaped to ``shape`` (None: its own), then read through ``geometry`` (None: whole);
    ``keep``: the program also returns the converted array, which becomes the cast's value (a
    narrowing cast, whose wide source must not outlive its first reader)."""

    dtype: np.dtype
    shape: tuple | None
    geometry: Geometry | None
    keep: bool = False
    # (lowering, spec) of a pointwise call of one tensor applied to the array first
    # (``program.applied``); dtype and shape are then its result's.
    op: tuple | None = None


def read_input(array, how, kept: list | None = None):
    """An argument's value inside a program: ``how`` is a view Geometry or a ``Cast``; a kept
    cast's converted array is appended to ``kept`` (when given)."""
    if type(how) is Cast:
        if array.dtype != how.dtype:
            array = dtypes.cast(array, how.dtype)
        if how.shape is not None:
            array = array.reshape(how.shape)
        if how.keep and kept is not None:
            kept.append(array)
        return array if how.geometry is None else read_view(array, how.geometry)
    return read_view(array, how)


def check_read(how) -> None:
    """Raise if ``how`` (a view Geometry or a ``Cast``) reads past its storage's end."""
    if type(how) is Cast:
        if how.geometry is not None:
            check_in_bounds(how.geometry)
    else:
        check_in_bounds(how)


class Converted(tensors.Deferred):
    """A storage's value: ``source`` converted to ``dtype`` and reshaped to ``shape`` (a
    gradient's cast of a reshaped view), or ``op`` (lowering, spec) applied to it, computed by
    the first reader that cannot compute it itself (``fn`` of the source: one launch), or,
    ``keep``, returned by the first program that computes it (``settle``)."""

    __slots__ = ("source", "dtype", "shape", "keep", "op", "fn", "_value", "__weakref__")

    def __init__(self, source, dtype: np.dtype, shape: tuple, keep: bool = False,
                 op: tuple | None = None, fn=None) -> None:
        self.source = source
        self.dtype = dtype
        self.shape = shape
        self.keep = keep
        self.op = op
        self.fn = fn or _converter(dtype, shape)
        self._value = None
        tensors.lend(source)
        _pending.add(self)
        if keep:
            _kept.setdefault(id(source), []).append(self)

    def resolve(self):
        if self._value is None:
            # A held op's program is launched as Strict launches it at once: named by its op
            # (the profiler's trace shows one name for one program).
            self._value = tensors.call(self.fn, self.source,
                                       label=None if self.op is None else self.op[0].op)
            self._release()
        return self._value

    materialize = resolve

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def folded(self, geometry: Geometry | None):
        """(the source, how a program reads it) for a reader of the value through geometry;
        None once the value is computed."""
        if self._value is not None:
            return None
        reshaped = None if self.shape == self.source.aval.shape else self.shape
        return self.source, Cast(self.dtype, reshaped, geometry, self.keep, self.op)

    def _release(self) -> None:
        source = self.source
        tensors.unlend(source)
        self.source = None
        _pending.discard(self)
        if self.keep:
            _unkeep(source, self)

    def __del__(self) -> None:
        if self.source is not None:
            tensors.unlend(self.source)
            if self.keep:
                _unkeep(self.source, self)


_pending: weakref.WeakSet = weakref.WeakSet()
# The kept casts still pending, by their source's id (each holds its source: the id is not
# reused meanwhile): where a program's returned conversions go.
_kept: dict = {}


def _unkeep(source, converted: Converted) -> None:
    held = _kept.get(id(source))
    if held is not None:
        held[:] = [c for c in held if c is not converted]
        if not held:
            del _kept[id(source)]


def settle(keeps: tuple, dyn: tuple, out):
    """A program's results without its kept conversions, which become their casts' values:
    ``out`` is (results, conversions) for a spec whose ``keeps`` (``program.kept_positions``)
    are ``keeps``."""
    out, converted = out
    for (at, dtype, shape, op), value in zip(keeps, converted):
        source = dyn[at]
        want = source.aval.shape if shape is None else shape
        # Casts of one source to one dtype and shape are one value: any pending one takes it
        # (each program reading one settles one).
        for c in _kept.get(id(source), ()):
            if c.source is source and c.dtype == dtype and c.shape == want and c.op == op:
                c._value = value
                c._release()
                break
    return out


def lazy_cast(t: torch.Tensor, array, dtype: torch.dtype):
    """``HOOKS.lazy_cast``: a ``Converted`` for t (whose storage array is ``array``) cast to
    dtype, or None to cast now."""
    if type(array) is not ArrayImpl and type(array) is not Converted \
            and isinstance(array, tensors.Deferred):
        array = array.resolve()  # a value DeferAndFuse computed (a fused optimizer step's)
    # t is its storage's array whole, or that array reshaped.
    if (type(array) is not ArrayImpl or t.dtype not in _FLOATS or dtype not in _FLOATS
            or t.storage_offset() or not t.is_contiguous() or t.is_neg()
            or array.aval.dtype != _NP[t.dtype] or array.size != t.numel()):
        return None
    # A narrowing cast of anything but a parameter under autocast (held anyway) is kept: its
    # first reader returns the narrow value, so the wide source lives no longer than that.
    keep = dtype.itemsize < t.dtype.itemsize and not (
        t.is_leaf and t.requires_grad and autocast.casting())
    return Converted(array, _NP[dtype], tuple(t.shape), keep)


def lazy_op(lowering, spec, dyn: tuple, fn, read) -> Converted | None:
    """Strict's call of a pointwise op on one tensor (``program.one_pointwise_input``: ``read``,
    how it reads ``dyn[0]``, None or a view Geometry), held as a ``Converted`` its consumers
    compute in their programs; None to launch it now."""
    source = dyn[0]
    if type(source) is not ArrayImpl:
        return None
    shape = source.aval.shape if read is None else read.size
    dtype = spec.final
    nbytes, held = math.prod(shape) * dtype.itemsize, source.size * source.dtype.itemsize
    if nbytes > held:
        # Larger than its source (a broadcast view's): run now, where the memory it needs is
        # asked for (a refusal is raised at the user's line).
        return None
    # Kept (settled by its first reader) where its source holds more bytes than it would.
    return Converted(source, dtype, tuple(shape), nbytes < held, (lowering, spec), fn)


def computed(out):
    """out (a call's results) with every lazy value in it computed: what is written into
    another tensor's storage (an in-place op's functional twin) must be an array."""
    if isinstance(out, (tuple, list)):
        return type(out)(computed(o) for o in out)
    return out.resolve() if type(out) is Converted else out


def resolve_pending() -> None:
    """Compute every lazy cast still pending (before another executor takes over)."""
    for converted in list(_pending):
        converted.resolve()
