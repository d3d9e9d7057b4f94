"""Strict's short path for an op call whose signature ran before: no planning, no generic reads.

Every eager op call binds its arguments, builds its call key (``meta.call_key``), finds its plan
and walks the spec to read its arrays (``dispatch.dynamic_values``): ~20 small Python steps that
cost more than the jitted program call itself on small tensors. Most calls in a loop repeat a
signature seen before: the same tensor shapes and dtypes, the same constants. This module keeps,
per op, what the full path found for such a signature (its result, its spec, where its tensors
sit and the dtype each array must have), keyed by ``signature``: the bound values themselves,
each tensor as (shape, dtype, is_cpu), with every value's type (1, 1.0 and True are equal keys
that compute differently).

Only signatures whose spec takes nothing but whole device tensors and baked-in constants are
kept (no traced numbers, whose values vary, no tensor lists, no random keys), and only outside a
capture. A call takes the short path only when each tensor's storage holds a computed array that
is the tensor whole (``whole_arrays``); anything else (a view, a pending or padded value, a lazy
conj/neg bit) takes the full path, which handles it. The short path then runs as the full path
does from the read arrays on (``dispatch.compute`` with them): the upper layers' hooks, the
current executor, the launch observer all see the same call.
"""

from __future__ import annotations

import torch
from jax._src.array import ArrayImpl

from torchtpu.device import dtypes
from torchtpu.eager import meta
from torchtpu.eager.program import CONST, TENSOR, Spec

_Tensor = torch.Tensor


def signature(values: list):
    """The key of a bound call: equal for calls whose plan, spec and program are the same.

    Finer than ``meta.call_key`` (constants by value), and raises TypeError for an unhashable
    value; -0.0 equals 0.0 here, so ``remember`` keeps no signature holding a float zero.
    """
    return tuple([(v.shape, v.dtype, v.is_cpu) if isinstance(v, _Tensor)
                  else (tuple(v), tuple(map(type, v))) if type(v) in (list, tuple) else v
                  for v in values]), tuple(map(type, values))


class Seen:
    """What the full path found for one signature: ``reads`` holds (position, array dtype) of
    each tensor argument, in the order the program takes their arrays."""

    __slots__ = ("result", "spec", "reads")

    def __init__(self, result, spec: Spec, reads: tuple) -> None:
        self.result = result
        self.spec = spec
        self.reads = reads


def _zero(x) -> bool:
    return type(x) in (float, complex) and x == 0


def _simple(spec: Spec) -> bool:
    """Whether a call of spec can be repeated from whole tensors alone: every entry a tensor or
    a constant, no constant a float zero (whose sign a signature does not tell)."""
    for kind, payload in spec.entries:
        if kind == TENSOR:
            if payload is not None:
                return False
        elif kind != CONST:
            return False
        elif _zero(payload) or (type(payload) is tuple and any(_zero(x) for x in payload)):
            return False
    return True


def remember(seen: dict, key, values: list, result, spec: Spec) -> None:
    """Keep the full path's plan for this call's signature ``key``, if calls of it can repeat
    it."""
    simple = spec._simple
    if simple is None:
        simple = spec._simple = _simple(spec)
    if not simple:
        return
    reads = tuple((i, dtypes.to_jax(v.dtype)) for i, v in enumerate(values)
                  if isinstance(v, _Tensor))
    meta.bounded_put(seen, key, Seen(result, spec, reads))


def whole_arrays(values: list, reads: tuple) -> tuple | None:
    """The arrays of the call's tensors when each is its storage's computed array whole (the
    array's shape and dtype, contiguous, no lazy bits); else None. (The storage's bytes are its
    array's: a contiguous tensor of the array's shape and itemsize cannot start past 0.)"""
    arrays = []
    for i, dtype in reads:
        t = values[i]
        array = t.untyped_storage()._tpu_array
        if type(array) is not ArrayImpl:
            return None
        aval = array.aval  # its shape and dtype without the properties' Python steps
        if (aval.dtype != dtype or aval.shape != t.shape or not t.is_contiguous()
                or t.is_conj() or t.is_neg()):
            return None
        arrays.append(array)
    return tuple(arrays)
