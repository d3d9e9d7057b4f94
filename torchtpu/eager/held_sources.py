"""The arrays a held value's source holds (``lazy_casts``): a held call's source is its
arguments, nested where held calls are chained; a lazy cast's, one array."""

from __future__ import annotations

import jax
from jax._src.array import ArrayImpl


def arrays(source) -> list:
    """The arrays a held value's ``source`` holds (its held calls' arguments, nested), in
    order. (Asked for every held value made and given back: a computed array is known by its
    exact type first, as ``isinstance`` of JAX's abstract ``Array`` costs ~10 times more.)"""
    if type(source) is not tuple:
        return [source] if type(source) is ArrayImpl or isinstance(source, jax.Array) else []
    out: list = []
    flatten(source, out)
    return out


def flatten(source: tuple, out: list) -> None:
    """Append the arrays of a held call's nested arguments to out, in order."""
    # (Recursive: a frame a nested held call, where a stack cost a pop and a push an element.)
    for s in source:
        kind = type(s)
        if kind is ArrayImpl:
            out.append(s)
        elif kind is tuple:
            flatten(s, out)
        elif isinstance(s, jax.Array):
            out.append(s)


def lead(source):
    """The array a held value's ``source`` reads: itself, or the first of a held call's
    arguments (``Converted.spread``), nested where held calls are chained."""
    while type(source) is tuple:
        source = source[0]
    return source
