"""Strict's short path for an op call whose signature ran before: no planning, no generic reads.

Every eager op call binds its arguments, builds its call key (``meta.call_key``), finds its plan
and walks the spec to read its arrays (``calls.dynamic_values``): ~20 small Python steps that
cost more than the jitted program call itself on small tensors. Most calls in a loop repeat a
signature seen before: the same tensor shapes and dtypes, the same constants. This module keeps,
per op, what the full path found for such a signature (its result, its spec, where its tensors
sit and how each is read), keyed by the signature (``lookup``): the bound values themselves,
each tensor as (shape, strides, offset, dtype, is_cpu), with every value's type (1, 1.0 and True
are equal keys that compute differently), and the default dtype (``int_tensor * 2.5``'s).
Strides and offsets keep apart the calls of one shape that read their tensors another way (a
backward's products of a square weight and of its transpose).

Only signatures whose spec takes nothing but device tensors, traced real numbers (``x *
0.3``: a Python number's value is in the signature, a CPU scalar tensor's is read at each call)
and baked-in constants are kept (no tensor lists, no random keys), and only outside a capture. A
call takes the short path only when each tensor's storage holds a computed array, or a value
DeferAndFuse recorded (which knows its shape and dtype), that the tensor reads as one of the
signature's remembered calls did (``lookup``): the array whole, or through the same view geometry
(a transposed or reshaped view, an offset: the same storage array shape and dtype), and no
traced number is a float zero (0.0 and -0.0 are one key); anything else (another storage array
shape, a padded value, a lazy conj/neg bit) takes the full path, which handles it and keeps its
own reads beside the earlier ones (``READS_PER_SIGNATURE``). The short path then runs as the
full path does from the read arrays and views on (``calls.compute`` with them): the upper
layers' hooks, the current executor, the launch observer all see the same call.
"""

from __future__ import annotations

from math import copysign

import torch
from jax._src.array import ArrayImpl

from torchtpu.device import tensors
from torchtpu.device.views import Geometry
from torchtpu.eager import meta
from torchtpu.eager.defer import Pending
from torchtpu.eager.lazy_casts import Cast, Converted
from torchtpu.eager.program import CONST, SCALAR, TENSOR, Spec, with_views

_Tensor = torch.Tensor


_SEQUENCES = (list, tuple)
_FLOAT_OR_SEQUENCE = (float, list, tuple)
_default_dtype = torch.get_default_dtype


# Types no tensor has: a value of one is keyed without ``isinstance`` (a call each).
_NOT_TENSORS = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device,
                          torch.layout, torch.memory_format, list, tuple})


def lookup(values: list, seen: dict, keyed: bool = False) -> tuple:
    """(the signature of a bound call, (the remembered call, the arrays) of the first of the
    signature's calls in ``seen`` whose reads this call's tensors can repeat (``arrays``) or
    None), in one frame: every op call on the short path asks this (a frame each for the key,
    its list and the read was ~3,600 Python calls of a 12-layer Llama step). The signature is
    None where a value is unhashable; ``keyed``: the remembered reads count from 1 (``Seen``).

    The signature is equal for calls whose plan, spec and program are the same: finer than
    ``meta.call_key`` (constants by value, a float's with its sign: SDPA's ``dropout_p=0.0``;
    the default dtype, which decides ``int_tensor * 2.5``'s); -0.0 equals 0.0 inside a
    sequence here, so ``remember`` keeps no signature holding one there.
    """
    try:
        key = (*[(v.shape, v.stride(), v.storage_offset(), v.dtype, v.is_cpu)
                 if type(v) is _Tensor or (type(v) not in _NOT_TENSORS and isinstance(v, _Tensor))
                 else (v, type(v)) if type(v) not in _FLOAT_OR_SEQUENCE
                 else (v, copysign(1.0, v)) if type(v) is float  # 0.0 and -0.0 apart
                 else (tuple(v), tuple(map(type, v)), type(v))
                 for v in values], _default_dtype())
        known = seen.get(key)
    except (TypeError, AttributeError):  # unhashable, or a None among tensors
        return None, None
    if known is None:
        return key, None
    # The remembered call found after the call the last lookup found (of any signature), the
    # last time, is tried first: a step calls its ops in the same order each time, so the call
    # before a site tells that site's remembered call apart where one signature's sites read
    # their tensors in several ways in turn (a 12-layer Llama step: the guess after the
    # signature's own last call missed 360 of its 1,198 calls). Any guess is checked: each try
    # checks all of a call's reads, so a wrong one (another thread's calls between, an id
    # reused) costs a try, and one whose reads were dropped from ``known`` meanwhile
    # (``READS_PER_SIGNATURE``) is still right.
    if keyed:
        values = [None, *values]
    before = _found[0]
    following = known.following
    guess = following.get(before)
    if guess is not None:
        out = arrays(values, guess.reads)
        if out is not None:
            _found[0] = id(guess)
            return key, (guess, out)
    for kept in known:
        if kept is guess:
            continue
        out = arrays(values, kept.reads)
        if out is not None:
            if len(following) >= _FOLLOWING:
                following.clear()
            following[before] = kept
            _found[0] = id(kept)
            return key, (kept, out)
    return key, None


# The id of the remembered call the last ``lookup`` found (``Known.following``'s key: an id,
# which keeps no call of another signature alive), and how many predecessors a signature keeps.
_found = [None]
_FOLLOWING = 64


class Seen:
    """What the full path found for one signature: ``reads`` holds (position, how it is read,
    shape) of each tensor argument, in the order the program takes them, how being its array's
    dtype (read whole, the array of that shape) or the view ``Geometry`` it was read through
    (or a lazy cast's ``Cast``), and (position, None, None) of each traced number; ``views``
    the spec's views as ``calls.dynamic_values`` gives them, ``viewed`` the spec with them
    (``program.with_views``); ``wrap``: the caller's function making the results' tensors
    (kept here, made at first use); ``launcher``: (the executor, its ``launcher`` and
    ``holder`` for ``viewed``), found at first use; ``steady``:
    (``HOOKS.growing``, its epoch) when that hook answered a call of it ``STEADY``
    (``calls.run_seen``); ``autograd``: that hook where it answered a call of it ``AUTOGRAD``
    (run as usual whenever autograd's engine runs it)."""

    __slots__ = ("result", "spec", "reads", "views", "viewed", "wrap", "launcher", "steady",
                 "autograd")

    def __init__(self, result, spec: Spec, reads: tuple, views: tuple) -> None:
        self.result = result
        self.spec = spec
        self.reads = reads
        self.views = views
        self.viewed = with_views(spec, views) if views else spec
        self.wrap = None
        self.launcher = None
        self.steady = None
        self.autograd = None


def _zero(x) -> bool:
    return type(x) in (float, complex) and x == 0


def _simple(spec: Spec) -> bool:
    """Whether a call of spec can be repeated from whole tensors and numbers alone: every entry
    a tensor, a traced number or a constant, no constant a sequence holding a float zero
    (whose sign a signature does not tell there)."""
    for kind, payload in spec.entries:
        if kind in (TENSOR, SCALAR):
            if payload is not None:
                return False
        elif kind != CONST:
            return False
        elif (type(payload) is tuple and any(_zero(x) for x in payload)) or \
                (type(payload) is complex and payload == 0):
            return False
    return True


def reads_of(spec: Spec, values: list) -> tuple | None:
    """How the full path reads this call's arguments (``Seen.reads``), taken before it runs (a
    kept lazy value its program settles reads as a lazy value, as the next call's will); None
    where calls of it cannot repeat it."""
    simple = spec._simple
    if simple is None:
        simple = spec._simple = _simple(spec)
    if not simple:
        return None
    reads = []
    for i, (kind, _) in enumerate(spec.entries):
        if kind == SCALAR:
            reads.append((i, None, None))
        elif kind == TENSOR:
            how = read_as(values[i])
            if how is None:
                return None
            reads.append((i, how, tuple(values[i].shape)))
    return tuple(reads)


def remember(seen: dict, key, reads: tuple, result, spec: Spec) -> None:
    """Keep the full path's plan for this call's signature ``key`` and ``reads_of`` it."""
    views = tuple((i, None, how) for i, how, _ in reads
                  if type(how) is Geometry or type(how) is Cast)
    kept = Seen(result, spec, reads, views)
    known = seen.get(key)
    if known is None:
        meta.bounded_put(seen, key, Known([kept]))
    else:
        known.append(kept)
        if len(known) > READS_PER_SIGNATURE:
            del known[0]


class Known(list):
    """One signature's remembered calls (``Seen``), and ``following``: which of them
    ``lookup`` found after the call of each id it found just before (up to ``_FOLLOWING``)."""

    __slots__ = ("following",)

    def __init__(self, calls: list) -> None:
        super().__init__(calls)
        self.following = {}


# One signature's calls can read their tensors more than one way (a contiguous product input
# that is its array whole in one place and a reshaped view of a 3-d array in another).
READS_PER_SIGNATURE = 8


def stored_value(array) -> tuple:
    """(a storage's value, what gives its shape and dtype without the properties' Python
    steps): an array and its aval, or DeferAndFuse's recorded value (its array once run) twice;
    (the value, None) for anything else (a lazy cast)."""
    kind = type(array)
    if kind is Pending:
        if array._value is not None:
            array = array._value
            kind = type(array)
        elif array._error is not None:
            array.resolve()  # raises what lost it
    if kind is ArrayImpl:
        return array, array.aval
    return array, array if kind is Pending else None


def _stored(t: _Tensor):
    """t's storage's computed array or recorded value (what the short path can read), or None."""
    st = t.untyped_storage()
    array = st._tpu_array
    if type(array) is Pending:  # DeferAndFuse's value: its array once run, else itself
        array = array.resolve()
    elif type(array) is Converted and array.source is None:  # a lazy value computed by now
        array = st._tpu_array = array.resolve()
    return array if type(array) in (ArrayImpl, Pending) else None


def read_as(t: _Tensor):
    """How the full path read t (``tensors.read_parts``): its array's dtype where t is its array
    whole, else the view's geometry, or a lazy cast's ``Cast``; None where it read something
    the short path cannot."""
    held = t.untyped_storage()._tpu_array
    if type(held) is Converted and held.source is not None and not t.is_neg():
        return tensors.read_parts(t, fold=True)[1]
    if _stored(t) is None or t.is_conj() or t.is_neg():
        return None
    array, g = tensors.read_parts(t)
    return array.dtype if g is None else g


_REAL = (float, int, bool)


def arrays(values: list, reads: tuple) -> tuple | None:
    """The arrays of the call's tensors when each is its storage's computed (or DeferAndFuse's
    recorded) array read as the remembered call read it (whole: the array's shape and dtype; a
    view: the same storage array shape and dtype; the signature holds the tensor's shape,
    strides and offset), no lazy bits, with its traced numbers; else None.
    (The storage's bytes are its array's: a contiguous tensor of the array's shape and itemsize
    cannot start past 0.)"""
    out = []
    for i, how, shape in reads:
        t = values[i]
        if how is None:  # a traced number, or a CPU scalar tensor's value
            if type(t) is _Tensor:
                t = t.item()
            if type(t) not in _REAL or (type(t) is float and t == 0):
                return None
            out.append(t)
            continue
        array = t.untyped_storage()._tpu_array
        # ``stored``'s common cases inline: a computed array (every repeated call reads some),
        # a lazy value (~2,000 reads a 12-layer Llama step).
        kind = type(array)
        if kind is ArrayImpl:
            aval = array.aval
        elif kind is Converted:
            source = array.source
            if source is not None:
                # A lazy value: its source, where the program reads it as the full path would
                # now (``how``, the remembered ``Cast``). Inline: ~1,900 reads a step.
                if (type(how) is not Cast or array.dtype != how.dtype or t.is_neg()
                        or array.op != how.op or array.keep is not how.keep
                        or array.view != how.view):
                    return None
                made, view = array.shape, array.view
                if view is None:
                    read = source
                    while type(read) is tuple:  # ``lead``, inline
                        read = read[0]
                    read = read.aval.shape
                else:
                    read = view.size
                g = how.geometry
                if how.shape != (None if read == made else made) or (
                        (made != t.shape) if g is None else (g.array_shape != made)):
                    return None
                out.append(source)
                continue
            # Computed by now (settled by a reader, which dropped its source): its value.
            array = array._value
            aval = array.aval
        else:
            array, aval = stored_value(array)
            if aval is None:
                return None
        if t.is_conj() or t.is_neg():
            return None
        if type(how) is Geometry:
            if aval.shape != how.array_shape or aval.dtype != how.array_dtype:
                return None
        elif aval.shape != shape or (aval.dtype is not how and aval.dtype != how):
            return None
        out.append(array)
    return tuple(out)
