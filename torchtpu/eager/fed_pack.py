"""A captured program's host-fed inputs sent as one int32 array, unpacked inside the program.

A fed input (``Capture.feed``) is a host value the program reads at every replay: a served
step's token ids, positions, sequence lengths, block table, slot mapping, ... Passed one by one,
each is a host-to-device transfer of its own inside the program's call (PJRT makes a buffer per
NumPy argument). Feeds marked ``packed`` go as one: at replay their values are written into a
single int32 array (each 4-byte value as its bits, each 8-byte integer as two words, each
smaller integer or bool widened), and the program's first ops take them apart again; the
program has one argument where it had one per feed.

The layout (each packed feed's position among the program's sources, shape and dtype) is part
of the program, so it goes into the program's key.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.eager.replay_io import FED

_WORD = np.dtype(np.int32)


def _words(dtype: np.dtype) -> int | None:
    """int32 words an element of dtype takes in the packed array; None: not packable."""
    if dtype.kind in "biu" and dtype.itemsize <= 8:
        return 2 if dtype.itemsize == 8 else 1
    if dtype == np.float32:
        return 1
    return None


def _fill(out: np.ndarray, offset: int, value, shape: tuple, dtype: np.dtype) -> None:
    """Write value (of shape's element count) into out's words from offset on."""
    flat = np.asarray(value).reshape(-1)
    if flat.size != math.prod(shape):
        raise ValueError(f"torchtpu.capture: a fed input gave {flat.size} elements at replay, "
                         f"its captured shape is {shape}")
    if dtype.itemsize == 4 or dtype.itemsize == 8:
        flat = np.ascontiguousarray(flat.astype(dtype, copy=False)).view(_WORD)
    out[offset:offset + flat.size] = flat  # smaller integers and bools widen exactly


def _take(words, offset: int, shape: tuple, dtype: np.dtype, whole: tuple):
    """The packed value at offset (of shape), as the program's input of shape ``whole``: the
    rows past shape's are zeros."""
    n = math.prod(shape)
    if dtype.itemsize == 8:
        pair = words[offset:offset + 2 * n].reshape(n, 2)
        # assembled arithmetically: a width-changing bitcast's word order is the backend's
        low = lax.bitcast_convert_type(pair[:, 0], jnp.uint32).astype(jnp.uint64)
        high = lax.bitcast_convert_type(pair[:, 1], jnp.uint32).astype(jnp.uint64)
        value = lax.bitcast_convert_type(low | (high << 32), dtype)
    elif dtype.itemsize == 4:
        value = lax.bitcast_convert_type(words[offset:offset + n], dtype)
    elif dtype == np.bool_:
        value = words[offset:offset + n] != 0
    else:
        value = words[offset:offset + n].astype(dtype)
    value = value.reshape(shape)
    if shape != whole:
        value = jnp.concatenate([value, jnp.zeros((whole[0] - shape[0], *whole[1:]), dtype)])
    return value


def _fed_shape(shape: tuple, rows: int | None) -> tuple:
    """The shape a feed gives: its storage's, or its first ``rows`` rows."""
    return shape if rows is None else (rows, *shape[1:])


def _copied(fn: Callable, shape: tuple, dtype: np.dtype,
            rows: int | None) -> Callable[[], np.ndarray]:
    """fn's value alone, copied (and its rows past ``rows`` zeros)."""
    if rows is None:
        return lambda: np.array(fn(), dtype).reshape(shape)

    def whole() -> np.ndarray:
        out = np.zeros(shape, dtype)
        out[:rows] = np.asarray(fn()).reshape(_fed_shape(shape, rows))
        return out

    return whole


def pack(replay: Callable, sources: list, allowed: bool = True) -> tuple[Callable, tuple, list]:
    """replay taking the packed feeds of ``sources`` as one int32 argument (at the first one's
    place); the layout ((source position, shape, dtype name, rows), ...), for the program's key;
    and the sources left to pass. A packed feed's sig is (shape, dtype, rows): it gives its
    storage's first ``rows`` rows (None: all), the program reads zeros past them. A packed
    feed left out (a dtype the words cannot hold, fewer than two, not ``allowed``) is passed
    alone, its value copied: a packed feed may hand out a buffer its owner rewrites while the
    program still reads it."""
    sources, picks, fns = list(sources), [], []
    for i, (kind, fn, sig) in enumerate(sources):
        if kind is FED and sig is not None:
            shape, dtype, rows = tuple(sig[0]), np.dtype(sig[1]), sig[2]
            sources[i] = (FED, _copied(fn, shape, dtype, rows), None)
            if _words(dtype) is not None:
                picks.append((i, shape, dtype, rows))
                fns.append(fn)
    if not allowed or len(picks) < 2 or sys.byteorder != "little":
        return replay, (), sources
    offsets, total = [], 0
    for _, shape, dtype, rows in picks:
        offsets.append(total)
        total += _words(dtype) * math.prod(_fed_shape(shape, rows))
    entries = [(fn, offset, _fed_shape(shape, rows), dtype)
               for fn, offset, (_, shape, dtype, rows) in zip(fns, offsets, picks)]

    def packed_value() -> np.ndarray:  # a new array: the values are copied in
        out = np.empty(total, _WORD)
        for fn, offset, shape, dtype in entries:
            _fill(out, offset, fn(), shape, dtype)
        return out

    first, positions = picks[0][0], {p[0] for p in picks}
    n = len(sources)
    layout = tuple((i, shape, dtype.name, rows) for i, shape, dtype, rows in picks)

    def unpacked_step(*passed):
        rest = iter(passed)
        args = [None] * n
        for i in range(n):
            if i not in positions:
                args[i] = next(rest)
            elif i == first:
                words = next(rest)
                for (j, shape, dtype, rows), offset in zip(picks, offsets):
                    args[j] = _take(words, offset, _fed_shape(shape, rows), dtype, shape)
        return replay(*args)

    left = [(FED, packed_value, None) if i == first else s
            for i, s in enumerate(sources) if i == first or i not in positions]
    return unpacked_step, layout, left
