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

import torch
from jax._src.array import ArrayImpl

from torchtpu.device.dtypes import TORCH_TO_NP
from torchtpu.eager import meta
from torchtpu.eager.defer import Pending
from torchtpu.eager.program import CONST, SCALAR, TENSOR, TENSORS, Spec
from torchtpu.eager.seen_calls import Seen, stored

_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)
_REAL = (float, int, bool)


def _where(t: _Tensor) -> tuple:
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.is_cpu)


def signature(values: list, traced: frozenset, defaults: tuple) -> tuple:
    """The key of a bound in-place call: each tensor's geometry, each traced number's type
    (``meta.call_key``'s rule: whether it is baked in, and then its value), each constant
    exactly (``meta.exact_key``: 0.0 is not -0.0). Raises TypeError for an unhashable value."""
    parts = []
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
    array, aval = stored(t)
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


def reads_of(spec: Spec, values: list, written: tuple) -> tuple | None:
    """Per spec entry how a call reads it: (position, TENSOR or TENSORS) for tensors, each read
    whole, (position, SCALAR) for a traced real number or list of them; None where this call
    cannot be repeated so (a view, a lazy value, a CPU scalar tensor, a random key, a target
    the twin does not read)."""
    reads, tensors_at = [], set()
    for i, (kind, payload) in enumerate(spec.entries):
        v = values[i]
        if kind == TENSOR:
            if not _read_whole(v):
                return None
            tensors_at.add(i)
        elif kind == TENSORS:
            if any(payload) or not all(_read_whole(x) for x in v):
                return None
            tensors_at.add(i)
        elif kind == SCALAR:
            numbers = v if type(v) in _SEQUENCES else (v,)
            if not all(type(x) in _REAL for x in numbers):
                return None
        elif kind != CONST:
            return None
        reads.append((i, kind))
    if not all(i in tensors_at for i in written):
        return None
    return tuple(reads)


def arrays(values: list, reads: tuple) -> tuple | None:
    """The program's arguments, in the spec's order, when this call reads as the remembered
    one did (``reads_of``); else None."""
    dyn = []
    for i, kind in reads:
        v = values[i]
        if kind == TENSORS:
            for x in v:
                array = _whole(x)
                if array is None:
                    return None
                dyn.append(array)
        elif kind == TENSOR:
            array = _whole(v)
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
    kept = Seen(result, spec, reads, ())
    meta.bounded_put(seen, key, [kept] if listed else kept)


def functional(oi, traced: frozenset) -> tuple:
    """(signature, reads_of, read) for ``dispatch._functional_handler`` of an op reading tensor
    lists (``_foreach_norm``, ``cat``), in ``seen_calls``' terms."""

    def read(values: list, known: list):
        dyn = arrays(values, known[0].reads)
        return None if dyn is None else (known[0], dyn)

    return (lambda values: signature(values, traced, oi.defaults),
            lambda spec, values: reads_of(spec, values, ()), read)
