"""Strict's short path for an op call whose signature ran before: no planning, no generic reads.

Every eager op call binds its arguments, builds its call key (``meta.call_key``), finds its plan
and walks the spec to read its arrays (``dispatch.dynamic_values``): ~20 small Python steps that
cost more than the jitted program call itself on small tensors. Most calls in a loop repeat a
signature seen before: the same tensor shapes and dtypes, the same constants. This module keeps,
per op, what the full path found for such a signature (its result, its spec, where its tensors
sit and the dtype each array must have), keyed by ``signature``: the bound values themselves,
each tensor as (shape, dtype, is_cpu), with every value's type (1, 1.0 and True are equal keys
that compute differently).

Only signatures whose spec takes nothing but whole device tensors, traced real numbers (``x *
0.3``: a Python number's value is in the signature, a CPU scalar tensor's is read at each call)
and baked-in constants are kept (no tensor lists, no random keys), and only outside a capture. A
call takes the short path only when each tensor's storage holds a computed array, or a value
DeferAndFuse recorded (which knows its shape and dtype), that is the tensor whole
(``whole_arrays``) and no traced number is a float zero (0.0 and -0.0 are one key); anything
else (a view, a padded value, a lazy conj/neg bit) takes the full
path, which handles it. The short path then runs as the full path
does from the read arrays on (``dispatch.compute`` with them): the upper layers' hooks, the
current executor, the launch observer all see the same call.
"""

from __future__ import annotations

import torch
from jax._src.array import ArrayImpl

from torchtpu.device import dtypes
from torchtpu.eager import meta
from torchtpu.eager.defer import Pending
from torchtpu.eager.program import CONST, SCALAR, TENSOR, Spec

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
    each tensor argument and (position, None) of each traced number, in the order the program
    takes them."""

    __slots__ = ("result", "spec", "reads")

    def __init__(self, result, spec: Spec, reads: tuple) -> None:
        self.result = result
        self.spec = spec
        self.reads = reads


def _zero(x) -> bool:
    return type(x) in (float, complex) and x == 0


def _simple(spec: Spec) -> bool:
    """Whether a call of spec can be repeated from whole tensors and numbers alone: every entry
    a tensor, a traced number or a constant, no constant a float zero (whose sign a signature
    does not tell)."""
    for kind, payload in spec.entries:
        if kind in (TENSOR, SCALAR):
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
    reads = tuple((i, None if kind == SCALAR else dtypes.to_jax(values[i].dtype))
                  for i, (kind, _) in enumerate(spec.entries) if kind != CONST)
    meta.bounded_put(seen, key, Seen(result, spec, reads))


_REAL = (float, int, bool)


def whole_arrays(values: list, reads: tuple) -> tuple | None:
    """The arrays of the call's tensors when each is its storage's computed (or DeferAndFuse's
    recorded) array whole (the array's shape and dtype, contiguous, no lazy bits), with its
    traced numbers; else None.
    (The storage's bytes are its array's: a contiguous tensor of the array's shape and itemsize
    cannot start past 0.)"""
    arrays = []
    for i, dtype in reads:
        t = values[i]
        if dtype is None:  # a traced number, or a CPU scalar tensor's value
            if type(t) is _Tensor:
                t = t.item()
            if type(t) not in _REAL or (type(t) is float and t == 0):
                return None
            arrays.append(t)
            continue
        array = t.untyped_storage()._tpu_array
        kind = type(array)
        if kind is Pending:  # DeferAndFuse's value: its array once run, else itself
            array = array.resolve()
            kind = type(array)
        if kind is ArrayImpl:
            aval = array.aval  # its shape and dtype without the properties' Python steps
        elif kind is Pending:
            aval = array  # a recorded value knows its shape and dtype
        else:
            return None
        if (aval.dtype != dtype or aval.shape != t.shape or not t.is_contiguous()
                or t.is_conj() or t.is_neg()):
            return None
        arrays.append(array)
    return tuple(arrays)
