"""Quantized dtypes on the device: refused by name.

PyTorch's quantized tensors (``torch.qint8``, ``quint8``, ``qint32``, ...) carry a scale and zero
point beside their integers and dispatch on the ``QuantizedPrivateUse1`` key, which has no
kernels here; without this, making one on tpu fails with a dispatcher error about the
"Quantizedtpu" backend. A fallback for that key raises a ``torchtpu.dtype`` error naming the
dtype and the way out: keep quantized tensors on CPU, or move their integer form
(``t.int_repr()``) with its scale and zero point.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from torchtpu import errors


def _dtype(args: tuple, kwargs: dict) -> str:
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = next((x.dtype for x in tree_flatten((args, kwargs))[0]
                      if isinstance(x, torch.Tensor) and x.is_quantized), None)
    return str(dtype) if dtype is not None else "a quantized dtype"


def _refuse(op, *args, **kwargs):
    raise TypeError(errors.message(
        "dtype", f"quantized tensors ({_dtype(args, kwargs)}) are not supported on tpu (aten op "
        f"'{op}'); keep them on CPU, or move their integer form (t.int_repr()) with its scale "
        "and zero point"))


def register() -> torch.library.Library:
    """Refuse quantized tensors on tpu; returns the fallback library, to be kept alive."""
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_refuse, "QuantizedPrivateUse1")
    return fallback
