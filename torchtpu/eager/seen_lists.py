"""The short path of in-place calls over tensor lists (``_foreach_mul_``, ``_foreach_addcdiv_``:
an optimizer's and clipping's calls), whose signature ran before.

The full path of an in-place call builds its call key over every tensor of its lists, infers
its results, checks its targets, plans its functional twin, reads each tensor's parts, runs it
and writes each result through ``tensors.write``: AdamW's and clipping's 7 in-place calls over
a 12-layer Llama's 111 parameters took ~7 ms of a ~85 ms DeferAndFuse step. Their calls repeat
one signature each step: the same tensor geometries, constants and number types (a learning
rate's bias correction changes every step; its type does not). Kept per signature, once the
full path ran it (``remember``): the twin's spec and where its tensors sit.

A call repeats that only when each tensor the twin reads is its storage's array whole (a
computed array or DeferAndFuse's recorded value of the tensor's shape and dtype, no lazy
bits, contiguous from its storage's start): then every target, being read too, is its storage
whole, and its result (the same shape and dtype as the target's, checked when remembered)
becomes the storage's array as ``tensors.write`` would make it. The overlap checks the full path
makes need not run again: a target's own overlap (an expanded tensor) is its geometry's, checked
when the signature first ran; and two tensors that are each their storage whole, of the
storage array's shape and dtype, share a storage only as one geometry, a full overlap, which
only ops that write no lists refuse (``overlap.NO_OVERLAP``).
"""

from __future__ import annotations

import math

import torch
from jax._src.array import ArrayImpl

from torchtpu.device.dtypes import TORCH_TO_NP
from torchtpu.device.views import Geometry
from torchtpu.eager import meta
from torchtpu.eager.defer import Pending
from torchtpu.eager.lazy_casts import Cast
from torchtpu.eager.program import CONST, SCALAR, TENSOR, TENSORS, Spec
from torchtpu.eager.seen_calls import Seen, read_as, stored_value
from torchtpu.eager.seen_calls import arrays as seen_arrays

_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)
_REAL = (float, int, bool)


def _where(t: _Tensor) -> tuple:
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.is_cpu)


def signature(values: list, traced: frozenset, defaults: tuple) -> tuple:
    """The key of a bound in-place call: each tensor's geometry, each traced number's type
    (``meta.call_key``'s rule: whether it is baked in, and then its value; its sign), each
    constant exactly (``meta.exact_key``: 0.0 is not -0.0), and the default dtype (a Python
    float's over integer tensors). Raises TypeError for an unhashable value."""
    parts = [torch.get_default_dtype()]
    for i, v in enumerate(values):
        if isinstance(v, _Tensor):
            parts.append(_where(v))
        elif type(v) in _SEQUENCES and v and isinstance(v[0], _Tensor):
            parts.append(tuple([_where(x) for x in v]))  # a None in it: AttributeError
        elif i in traced:
            parts.append(meta._traced_number_key(v, defaults[i]))
        else:
            parts.append(meta.exact_key(v))
    return tuple(parts)


def _whole(t: _Tensor):
    """The array (or recorded value) t is whole, or None."""
    array, aval = stored_value(t.untyped_storage()._tpu_array)
    if aval is None:
        return None
    if aval.shape != t.shape or aval.dtype != TORCH_TO_NP.get(t.dtype) or t.is_conj() \
            or t.is_neg():
        return None
    return array


def _read_whole(t: _Tensor) -> bool:
    # Contiguous from the storage's start: every later call of the signature (which holds
    # strides and offsets) is too, and ``_whole`` checks the rest.
    return not t.is_cpu and t.storage_offset() == 0 and t.is_contiguous() \
        and _whole(t) is not None


def _how(t: _Tensor, views: bool, casts: bool):
    """How the full path reads t: None, its storage's array whole; a lazy value's ``Cast``
    (where ``casts``: the program converts the value's source itself), one reading all of the
    value unless ``views``; a view ``Geometry`` (where ``views``); False where the short path
    may not read it so."""
    if t.is_cpu:
        return False
    if _read_whole(t):
        return None
    how = read_as(t)
    if type(how) is Cast:
        return how if casts and (views or how.geometry is None) else False
    if type(how) is not Geometry:
        return False
    return how if views or _covering(t, how) else False


def _covering(t: _Tensor, g: Geometry) -> bool:
    """Whether t, read through g, is all of its storage's array in another shape (a norm
    weight's gradient, a keepdim sum viewed flat): contiguous from the start, as many elements
    of the same dtype; a tensor sharing its storage that covers it too is the same geometry."""
    return g.offset == 0 and t.is_contiguous() and g.array_dtype == TORCH_TO_NP.get(t.dtype) \
        and math.prod(g.array_shape) == t.numel()


def reads_of(spec: Spec, values: list, written: tuple, views: bool = False,
             casts: bool = True) -> tuple | None:
    """Per spec entry how a call reads it: (position, TENSOR or TENSORS, how) for tensors, how
    None where each is read whole, else each one's ``_how`` (a list's: a tuple, None for one
    read whole), (position, SCALAR, None) for a traced real number or list of them; None where
    this call cannot be repeated so (a view, unless ``views``; a lazy value, unless ``casts``;
    a CPU scalar tensor, a random key, a target the twin does not read).

    A call that writes (``written``) reads its tensors whole, as all of a lazy value or through
    a view covering its storage's array (``_covering``): a target is then all of its storage,
    and a tensor sharing a target's storage is all of it too (the module's doc); another view
    read beside a target could overlap it in part, which the full path refuses
    (``overlap.check_between``), so ``views`` is for calls writing nothing.
    """
    reads, tensors_at = [], set()
    for i, (kind, payload) in enumerate(spec.entries):
        v = values[i]
        how = None
        if kind == TENSOR:
            how = _how(v, views, casts)
            if how is False:
                return None
            tensors_at.add(i)
        elif kind == TENSORS:
            if any(payload):
                return None
            hows = tuple([_how(x, views, casts) for x in v])
            if False in hows:
                return None
            how = None if hows.count(None) == len(hows) else hows
            tensors_at.add(i)
        elif kind == SCALAR:
            numbers = v if type(v) in _SEQUENCES else (v,)
            if not all(type(x) in _REAL for x in numbers):
                return None
        elif kind != CONST:
            return None
        reads.append((i, kind, how))
    if not all(i in tensors_at for i in written):
        return None
    return tuple(reads)


def _read(t: _Tensor, how):
    """t's value as a program reads it through ``how`` (a lazy value's ``Cast``: its source; a
    view ``Geometry``: its storage's array) where the remembered call read it so (the same
    cast, the same storage array shape and dtype), else None."""
    if type(how) is Cast:  # (``seen_calls.arrays`` of t alone reads a lazy value's source)
        out = seen_arrays((t,), ((0, how, None),))
        return None if out is None else out[0]
    array, aval = stored_value(t.untyped_storage()._tpu_array)
    if aval is None or t.is_conj() or t.is_neg() or aval.shape != how.array_shape \
            or aval.dtype != how.array_dtype:
        return None
    return array


def arrays(values: list, reads: tuple) -> tuple | None:
    """The program's arguments, in the spec's order, when this call reads as the remembered
    one did (``reads_of``); else None."""
    dyn = []
    for i, kind, how in reads:
        v = values[i]
        if kind == TENSORS:
            if how is None:
                for x in v:
                    array = _whole(x)
                    if array is None:
                        return None
                    dyn.append(array)
                continue
            for x, h in zip(v, how):
                array = _whole(x) if h is None else _read(x, h)
                if array is None:
                    return None
                dyn.append(array)
        elif kind == TENSOR:
            array = _whole(v) if how is None else _read(v, how)
            if array is None:
                return None
            dyn.append(array)
        elif kind == SCALAR:
            dyn.append(v)
    return tuple(dyn)


def storable(flat: list, results: list) -> bool:
    """Whether each result is what ``tensors.write`` stores as its target's array: an array of
    the target's shape and dtype (no conversion), not complex32's stored pairs."""
    return len(flat) == len(results) and all(
        type(a) in (ArrayImpl, Pending) and t.dtype is not torch.complex32
        and tuple(a.shape) == tuple(t.shape) and a.dtype == TORCH_TO_NP.get(t.dtype)
        for t, a in zip(flat, results))


def remember(seen: dict, key: tuple, spec: Spec, reads: tuple, result=None,
             listed: bool = False) -> None:
    """Keep the full path's spec (and a functional call's result descriptions) for signature
    ``key``; ``listed``: as ``seen_calls`` keeps a signature's calls, a list of them."""
    views = []  # (entry, list position or None, how) of each tensor not read whole
    for i, kind, how in reads:
        if how is not None:
            if kind == TENSOR:
                views.append((i, None, how))
            else:
                views.extend((i, j, h) for j, h in enumerate(how) if h is not None)
    kept = Seen(result, spec, reads, tuple(views))
    meta.bounded_put(seen, key, [kept] if listed else kept)


def functional(oi, traced: frozenset, casts: bool = True) -> tuple:
    """(lookup, reads_of) for ``dispatch._functional_handler`` of an op reading tensor lists
    (``_foreach_norm``, ``cat``), in ``seen_calls``' terms: it writes nothing, so its tensors
    may be read through views (``casts``: and as lazy values' sources)."""

    def lookup(values: list, seen: dict, keyed: bool) -> tuple:
        try:
            key = signature(values, traced, oi.defaults)
            known = seen.get(key)
        except (TypeError, AttributeError):  # unhashable, or a None among tensors
            return None, None
        if known is None:
            return key, None
        dyn = arrays([None, *values] if keyed else values, known[0].reads)
        return key, None if dyn is None else (known[0], dyn)

    return lookup, lambda spec, values: reads_of(spec, values, (), True, casts)
