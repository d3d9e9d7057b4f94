"""DeferAndFuse's argument signatures by number: a recorded call's key holds small ints.

A signature is an array's (shape, dtype, weak type) or a Python number's type; each gets a
number once, shared by every recorder (captures too), so a recording's key hashes ints where
tuples of NumPy dtypes were hashed at every op. ``outputs`` gives a recorded call's outputs as
pending values carry them (``defer.Pending``).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from jax._src.array import ArrayImpl

from torchtpu.eager import facts

_SIG_NUMBERS: dict = {}
_SIGS: list = []
_sig_lock = threading.Lock()


def number_of(sig) -> int:
    """sig's number (given at its first use)."""
    n = _SIG_NUMBERS.get(sig)
    if n is None:
        with _sig_lock:
            n = _SIG_NUMBERS.get(sig)
            if n is None:
                n = _SIG_NUMBERS[sig] = len(_SIGS)
                _SIGS.append(sig)
    return n


def signature(x) -> int:
    """The number of x's signature: an array's or a value's (shape, dtype, weak type), a
    number's type."""
    if x.__class__ is ArrayImpl:
        aval = x.aval  # without the shape and dtype properties' Python steps
        return number_of((aval.shape, aval.dtype, aval.weak_type))
    if isinstance(x, (bool, int, float, complex)):
        return number_of(type(x))
    return number_of((tuple(x.shape), np.dtype(x.dtype), getattr(x, "weak_type", False)))


def abstract(n: int):
    """A stand-in of signature n for tracing: a zero of a number's type, else a shape struct."""
    sig = _SIGS[n]
    if isinstance(sig, type):
        return sig(0)
    return jax.ShapeDtypeStruct(sig[0], sig[1], weak_type=sig[2])


def outputs(fn, tree, sig: tuple, call_args) -> tuple:
    """(per output (shape, dtype, weak type, signature number), out tree, whether single)."""
    avals, out_tree, single = facts.shapes(fn, tree, tuple(_SIGS[n] for n in sig), call_args)
    outs = tuple((a.shape, a.dtype, a.weak_type, number_of((a.shape, a.dtype, a.weak_type)))
                 for a in avals)
    return outs, out_tree, single
