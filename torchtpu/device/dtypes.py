"""The one mapping between torch dtypes and JAX dtypes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

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
}
_TORCH_TO_NP = {k: np.dtype(v) for k, v in _TORCH_TO_JAX.items()}
_JAX_TO_TORCH = {v: k for k, v in _TORCH_TO_NP.items()}


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype for a torch dtype; raises TypeError naming the dtype when there is none."""
    try:
        return _TORCH_TO_NP[dtype]
    except KeyError:
        raise TypeError(
            f"torchtpu.dtype: dtype {dtype} is not supported on the tpu device; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in _TORCH_TO_JAX)
        ) from None


def to_torch(dtype) -> torch.dtype:
    return _JAX_TO_TORCH[np.dtype(dtype)]


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _TORCH_TO_JAX
