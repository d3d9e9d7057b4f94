"""Constant arrays on the device: small ones sent from the host, the rest made by a program.

A never-written storage's zeros, a fill's value, a capture's zeroed state: up to
``HOST_CONSTANT_BYTES`` they are sent (no program compiled per shape), beyond it one jitted
``zeros`` program a shape and dtype makes them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from torchtpu.cache import warm_dispatch
from torchtpu.device import launch
from torchtpu.runtime import platform, transfer

# JAX's transfer guards that refuse an implicit host-to-device transfer.
GUARDED = ("disallow", "disallow_explicit")

# A constant array up to this many bytes (a never-written storage's zeros, a fill's value:
# ``host_constant``) is sent from the host instead of made by a program compiled per shape: a
# MiB crosses a TPU host's link in ~0.1 ms, where the program costs a compile (~0.1 s of libtpu
# for a zeros program, compile-only; ~0.5-1 s a program in a chip's warm-up) the first time.
HOST_CONSTANT_BYTES = 1 << 20
_NUMBERS = (bool, int, float, complex)


def host_constant(shape: tuple, dtype: np.dtype, value) -> jax.Array | None:
    """A new array of shape and dtype holding value everywhere, sent from the host; None where
    a program should make it: past ``HOST_CONSTANT_BYTES``, under a JAX transfer guard, or for
    a value that is no Python number or that dtype does not hold exactly (a program rounds or
    wraps it: NaN, 1/3 in float16, 300 in uint8 take the program's path)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (nbytes > HOST_CONSTANT_BYTES or type(value) not in _NUMBERS
            or (type(value) is complex and dtype.kind != "c")
            or jax.config.jax_transfer_guard_host_to_device in GUARDED):
        return None
    try:
        held = np.asarray(value, dtype)
    except (OverflowError, ValueError, TypeError):
        return None
    # Compared as Python numbers: NumPy compares a Python number with a float16 (or a float32)
    # in that dtype, where 1/3 (or 2**40 + 1) equals its rounding.
    if held.item() != value:
        return None
    return transfer.put(np.full(shape, held), platform.local_device())  # (its bytes counted)


def zeros(shape: tuple, dtype: np.dtype) -> jax.Array:
    """A new array of zeros of shape and dtype, now: sent (``host_constant``) or computed."""
    array = host_constant(shape, dtype, 0)
    return launch.run(None, zeros_program(shape, dtype), ()) if array is None else array


@functools.lru_cache(maxsize=1024)
def zeros_program(shape: tuple, dtype):
    """The program making zeros of shape and dtype, one a process: run now (``launch.run``, a
    capture's state tensors) or recorded (``call``)."""
    # Jitted: an eager jnp.zeros costs ~70 us, and every empty() that is then filled reads one.
    return warm_dispatch.keyed(jax.jit(functools.partial(jnp.zeros, shape, dtype)), "zeros",
                               shape, dtype)
