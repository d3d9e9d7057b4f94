"""The one mapping between torch dtypes and JAX dtypes.

Every dtype has a JAX dtype that its values compute in (``to_jax``) and a layout its storage
bytes have (``layout``); they differ only for complex32 (``torch.chalf``), which XLA lacks: its
storage holds float16 (real, imag) pairs, as on CPU, and its values compute as complex64,
rounded back to float16 pairs whenever they are stored (``device/views.py``, ``device/tensors.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.runtime import platform

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    # TPUs compute in fp8; XLA holds all four of PyTorch's 8-bit float formats.
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
    torch.float8_e4m3fnuz: jnp.float8_e4m3fnuz,
    torch.float8_e5m2fnuz: jnp.float8_e5m2fnuz,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}
_TORCH_TO_NP = {**{k: np.dtype(v) for k, v in _TORCH_TO_JAX.items()},
                torch.complex32: np.dtype(np.complex64)}

# The layout of complex32 storage: two float16s an element. No JAX array has this dtype; it names
# the layout in view geometries, which read it as complex64 and write complex64 back as pairs.
COMPLEX32 = np.dtype([("real", np.float16), ("imag", np.float16)])
_LAYOUT = {**_TORCH_TO_NP, torch.complex32: COMPLEX32}
# Each torch dtype's compute dtype, for lookups on hot paths (``to_jax`` without its error).
TORCH_TO_NP = _TORCH_TO_NP


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype a torch dtype's values compute in (complex64 for complex32); raises
    TypeError naming the dtype when there is none."""
    try:
        return _TORCH_TO_NP[dtype]
    except KeyError:
        raise _unsupported(dtype) from None


def layout(dtype: torch.dtype) -> np.dtype:
    """The dtype of a torch dtype's storage elements: ``to_jax(dtype)``, but ``COMPLEX32``."""
    try:
        return _LAYOUT[dtype]
    except KeyError:
        raise _unsupported(dtype) from None


def value_dtype(element: np.dtype) -> np.dtype:
    """The JAX dtype a storage layout's values compute in (``layout``'s inverse on values)."""
    return _TORCH_TO_NP[torch.complex32] if element == COMPLEX32 else element


def _unsupported(dtype) -> TypeError:
    return TypeError(
        f"torchtpu.dtype: dtype {dtype} is not supported on the tpu device; supported: "
        + ", ".join(str(d).removeprefix("torch.") for d in _LAYOUT))


def check_platform(dtype: torch.dtype, where: str = "") -> None:
    """Refuse a dtype the platform's chips cannot hold, before any program sees it: a TPU has no
    64-bit complex arithmetic, and libtpu ends the process (not a Python error) on a program that
    holds complex128 ("Unsupported CVT X{64|128} expansion from c128[]"). float64 stays: XLA:TPU
    emulates it as float32 pairs. A RuntimeError, as CUDA's "not implemented for" errors: a
    TypeError inside ``tensor * 1j`` would become Python's own "unsupported operand type"."""
    if dtype is torch.complex128 and platform.platform() == "tpu":
        raise RuntimeError(
            "torchtpu.dtype: complex128 is not supported on a TPU (the chip has no 64-bit complex "
            f"arithmetic); use complex64, or compute this on CPU{where}")


def to_torch(dtype) -> torch.dtype:
    return _JAX_TO_TORCH[np.dtype(dtype)]


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _LAYOUT


_E4M3FN = np.dtype(jnp.float8_e4m3fn)
_E4M3FN_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)


def cast(array, dtype):
    """array as dtype (a NumPy/JAX dtype), rounding as PyTorch's CPU does: a complex value casts
    to a real dtype as its real part; float8_e4m3fn has no
    infinity, and PyTorch saturates what is beyond its range (infinities too) to +-448 where
    XLA gives NaN."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(array.dtype, jnp.complexfloating) and not jnp.issubdtype(
            dtype, jnp.complexfloating):
        array = array.real  # as PyTorch casts (JAX deprecates casting complex to real)
    if dtype == _E4M3FN and jnp.issubdtype(array.dtype, jnp.floating) and array.dtype != dtype:
        array = jnp.clip(array, -_E4M3FN_MAX, _E4M3FN_MAX)  # NaN stays NaN
    return array.astype(dtype)
