"""Python numbers a Strict program takes, as device arrays copied once and kept by value.

A traced number (``x + 1e-5``, a mean's divisor, the foreach ops' per-tensor scalars) enters a
jitted program as a Python number, which JAX copies to the device on every call: on a TPU each
is a host-to-device transfer of a few bytes, with its latency, per op (a Strict Llama step made
58 at one layer, most of them AdamW's per-parameter lists). Strict hands the program a device
array instead, copied once and kept (by type and value, bounded): the same constant in every
layer and every step crosses once, and a list whose values are all one (AdamW's step size for
each parameter) crosses once per new value. The array has the abstract value the number would
have had (weakly typed: ``x * 0.5`` of a float32 ``x`` stays float32), so the program is the
same one.

Strict does this per call (``executor.Strict.run``), DeferAndFuse for each flush's recorded
numbers (``defer.Recorder.flush``: ~250 a 12-layer Llama step); graphs keep numbers as inputs.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from torchtpu import metrics
from torchtpu.device import tensors
from torchtpu.eager.program import CONST, SCALAR, TENSORS, Spec
from torchtpu.runtime import platform, transfer

_LIMIT = 4096
_cache: dict = {}
_kept_ids: set = set()  # ids of the arrays in _cache
_lock = threading.Lock()
_WEAK = {float: np.dtype(np.float64), int: np.dtype(np.int64)}


def _keep(key, array) -> None:
    # Locked (misses only): backward's thread keeps numbers too, and an array in the cache whose
    # id a concurrent clear dropped from _kept_ids could be handed to a storage uncopied.
    with _lock:
        if len(_cache) >= _LIMIT:
            _cache.clear()
            _kept_ids.clear()
        _cache[key] = array
        _kept_ids.add(id(array))


def cached(v):
    """v (a Python number, or the NumPy scalar ``dispatch`` makes of a complex one) as a device
    array; anything else as it is."""
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
            host, weak = np.asarray(v), False
        elif t in _WEAK:
            host, weak = np.asarray(v, _WEAK[t]), True
        else:
            return v
    except OverflowError:  # an int past int64: JAX says what it says of it
        return v
    metrics.count("host_to_device_bytes", host.nbytes)
    metrics.count("number_transfers")
    array = transfer.put_uncommitted(host, platform.local_device(), weak)
    if not _ambiguous(v, t):
        _keep(key, array)
    return array


def _ambiguous(v, t) -> bool:
    """Whether v's key is equal to another value's (-0.0 equals 0.0, and its sign survives a
    multiply: so do a complex number's parts', ``x * complex(-0.0, 1.0)``) or to none (NaN)."""
    if t is float:
        return v == 0 or math.isnan(v)
    if t is int or t is bool:
        return False
    return v.real == 0 or v.imag == 0 or v != v  # NumPy's complex (``dispatch``'s) or float


def scalar_slots(spec: Spec) -> tuple:
    """The positions among the dynamic values of spec's SCALAR entries."""
    slots = spec._scalars
    if slots is None:
        found, at = [], 0
        for kind, payload in spec.entries:
            if kind == SCALAR:
                found.append(at)
            if kind == TENSORS:
                at += sum(element is not True for element in payload)
            elif kind != CONST:
                at += 1
        slots = spec._scalars = tuple(found)
    return slots


def on_device(spec: Spec, dyn: tuple) -> tuple:
    """dyn with each traced Python number (alone, or in a list) a kept device array."""
    dyn = list(dyn)
    for at in scalar_slots(spec):
        v = dyn[at]
        dyn[at] = type(v)(cached(x) for x in v) if type(v) in (list, tuple) else cached(v)
    return tuple(dyn)


def not_kept(out):
    """out, with any kept array among its leaves replaced by a copy: JAX hands back an input a
    program returns as it is, and a storage owning a kept array could give its buffer away."""
    if isinstance(out, (tuple, list)):
        return type(out)(not_kept(o) for o in out)
    if out is not None and id(out) in _kept_ids:
        return tensors.fresh_copy(out)
    return out
