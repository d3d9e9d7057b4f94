"""Python numbers a Strict program takes, as device arrays: cached by value, lists packed.

A traced number (``x + 1e-5``, a mean's divisor, the foreach ops' per-tensor scalars) enters a
jitted program as a Python number, which JAX copies to the device on every call: on a TPU each
is a host-to-device transfer of a few bytes, with its latency, per op. Strict hands the program
a device array instead:

- a number is copied once and kept (``cached``: by type and value, bounded), so the same
  constant in every layer and every step crosses once; its array has the abstract value the
  number would have had (weakly typed), so the program is the same one;
- a list of numbers of one type (AdamW's ``step_size`` per parameter, which changes every step)
  crosses as one array and the program takes its elements apart again (``PACKED`` in its spec's
  entry): one transfer where there were as many as parameters.

Only Strict does this (``executor.Strict.run``): DeferAndFuse keeps numbers as inputs of its
recording and graphs as inputs of theirs.
"""

from __future__ import annotations

import math

import numpy as np

from torchtpu import metrics
from torchtpu.device import tensors
from torchtpu.eager.meta import bounded_put
from torchtpu.eager.program import CONST, PACKED, SCALAR, TENSORS, Spec
from torchtpu.runtime import platform, transfer

_LIMIT = 4096
_cache: dict = {}
_kept_ids: set = set()  # ids of the arrays in _cache
_packed_specs: dict = {}
_WEAK = {float: np.dtype(np.float64), int: np.dtype(np.int64)}


def _put(host: np.ndarray, weak: bool):
    metrics.count("host_to_device_bytes", host.nbytes)
    return transfer.put_uncommitted(host, platform.local_device(), weak)


def _kept(v) -> bool:
    # -0.0 equals 0.0 as a key (its sign survives a multiply) and NaN equals nothing.
    return not (type(v) is float and (v == 0 or math.isnan(v)))


def _keep(key, array) -> None:
    if len(_cache) >= _LIMIT:
        _cache.clear()
        _kept_ids.clear()
    _cache[key] = array
    _kept_ids.add(id(array))


def cached(v):
    """v (a Python number, or a NumPy scalar ``dispatch`` made of one) as a device array."""
    key = (type(v), v)
    try:
        hit = _cache.get(key)
    except TypeError:
        return v
    if hit is not None:
        return hit
    t = type(v)
    try:
        if t is bool or isinstance(v, np.generic):
            array = _put(np.asarray(v), False)
        elif t in _WEAK:
            array = _put(np.asarray(v, _WEAK[t]), True)
        else:
            return v
    except OverflowError:  # an int past int64: JAX says what it says of it
        return v
    if _kept(v):
        _keep(key, array)
    return array


def _uniform(v) -> type | None:
    t = type(v[0]) if v else None
    if t not in _WEAK or any(type(x) is not t for x in v):
        return None
    return t


def packed(v, t: type):
    key = (t, tuple(v))
    hit = _cache.get(key)
    if hit is None:
        try:
            hit = _put(np.asarray(v, _WEAK[t]), False)
        except OverflowError:
            return None
        if all(_kept(x) for x in v):
            _keep(key, hit)
    return hit


def scalar_slots(spec: Spec) -> tuple:
    """(entry index, position among the dynamic values) of spec's SCALAR entries."""
    slots = spec._scalars
    if slots is None:
        found, at = [], 0
        for i, (kind, payload) in enumerate(spec.entries):
            if kind == SCALAR:
                found.append((i, at))
            if kind == TENSORS:
                at += sum(element is not True for element in payload)
            elif kind != CONST:
                at += 1
        slots = spec._scalars = tuple(found)
    return slots


def on_device(spec: Spec, dyn: tuple) -> tuple[Spec, tuple]:
    """(spec, dyn) with each traced Python number a device array (see the module doc)."""
    dyn = list(dyn)
    packs = []
    for i, at in scalar_slots(spec):
        v = dyn[at]
        if type(v) in (list, tuple):
            t = _uniform(v)
            array = None if t is None else packed(v, t)
            if array is not None:
                dyn[at] = array
                packs.append(i)
            else:
                dyn[at] = type(v)(cached(x) for x in v)
        else:
            dyn[at] = cached(v)
    if packs:
        spec = _packed(spec, tuple(packs))
    return spec, tuple(dyn)


def not_kept(out):
    """out, with any array of the cache among its leaves replaced by a copy."""
    if isinstance(out, (tuple, list)):
        return type(out)(not_kept(o) for o in out)
    if out is not None and id(out) in _kept_ids:
        return tensors.fresh_copy(out)
    return out


def _packed(spec: Spec, packs: tuple) -> Spec:
    key = (spec, packs)
    derived = _packed_specs.get(key)
    if derived is None:
        entries = list(spec.entries)
        for i in packs:
            entries[i] = (SCALAR, PACKED)
        derived = Spec(tuple(entries), spec.compute, spec.final, spec.promote)
        bounded_put(_packed_specs, key, derived)
    return derived
