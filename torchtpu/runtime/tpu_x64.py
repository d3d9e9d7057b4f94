"""JAX's TPU lowerings that torchtpu traces without 64-bit types, because libtpu ends the process
on what they make under ``jax_enable_x64``, which torchtpu always sets (PyTorch's int64 indices
and float64 tensors need it).

JAX's TPU SVD with singular vectors (QDWH, its Python body traced when the program is lowered)
counts its iterations in int64 and keeps float64 scalars when x64 is on; libtpu 0.0.42 then aborts
the process at compile ("shape.h: Check failed: buffer != nullptr"), found on a v5e chip as
``torch.linalg.svdvals``' backward and ``pinv``. For 32-bit operands the body is traced with x64
off, as any JAX user's program is by default; float64 operands keep JAX's rule (they cannot be
traced narrower without losing precision).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src.interpreters import mlir
from jax._src.lax import linalg

_NARROW = (np.dtype(np.float32), np.dtype(np.complex64))
_installed: list = []


def _narrow_rule(default, ctx, *args, **params):
    if ctx.avals_in[0].dtype in _NARROW:
        with jax.enable_x64(False):
            return default(ctx, *args, **params)
    return default(ctx, *args, **params)


def install() -> None:
    """Register the TPU rules (once), each wrapping JAX's own."""
    if _installed:
        return
    entry = mlir._lowerings[linalg.svd_p]  # JAX's generic rule for svd is its TPU one
    mlir.register_lowering(linalg.svd_p, functools.partial(_narrow_rule, entry.rule),
                           platform="tpu")
    _installed.append("svd")
