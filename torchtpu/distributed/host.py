"""The host transport: device values go to host memory, through gloo, and back to the device.

Measured on XLA:CPU (bench/collectives.py), gloo over host memory beats JAX's cross-process CPU
collectives at every size, so this is the transport wherever the device is XLA:CPU. Reading a
tensor flushes whatever DeferAndFuse holds pending for it, so a collective never becomes part of
a fused program that other ranks do not run; its result is written back as a fresh array.
"""

from __future__ import annotations

import ctypes

import jax
import numpy as np
import torch
from torch.distributed import ReduceOp

from torchtpu.device import dtypes, kernels, tensors
from torchtpu.eager import executor
from torchtpu.runtime import platform

RedOpType = ReduceOp.RedOpType
_SMALL = 1 << 16


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A writable host copy of device tensor t (contiguous, t's shape)."""
    return kernels.to_numpy(t)


def as_torch(value: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor sharing value's memory."""
    return kernels.numpy_to_torch(value, dtype)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return kernels.torch_to_numpy(t)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor holding a copy of device tensor t, for gloo to read and write."""
    return as_torch(to_numpy(t), t.dtype)


def write(t: torch.Tensor, value: np.ndarray | torch.Tensor) -> None:
    """Store host value (t's shape and dtype) into device tensor t, any view."""
    if isinstance(value, torch.Tensor):
        value = as_numpy(value)
    value = np.ascontiguousarray(value).reshape(tuple(t.shape))
    # A jitted copy takes a small host value to the device ~10x faster than device_put (its
    # argument transfer is JAX's C++ fast path); device_put does not copy twice for large ones.
    tensors.write(t, tensors.copy_buffer(value) if value.nbytes <= _SMALL
                  else jax.device_put(value, platform.local_device()))


def alias(t: torch.Tensor) -> torch.Tensor | None:
    """A CPU tensor sharing device tensor t's buffer, for gloo to read and write in place.

    Only on XLA:CPU (device memory is host memory) and for a tensor that is its whole storage;
    None otherwise (use ``to_host`` and ``write``). Copying 64 MB each way cost about twice the
    gloo all_reduce itself here. Writing the buffer in place is what donation does: the storage
    owns its array alone (storages never share buffers), and every dispatched computation is
    waited for first, since one of them may still be reading this buffer.
    """
    if platform.platform() != "cpu" or not tensors.covers_storage(t) or t.is_conj() \
            or t.is_neg():
        return None
    executor.flush()
    array = tensors.storage_array(t)
    array = array.materialize() if isinstance(array, tensors.Deferred) else array
    if tuple(array.shape) != tuple(t.shape) or array.dtype != dtypes.to_jax(t.dtype):
        return None
    for live in jax.live_arrays():
        live.block_until_ready()
    raw = (ctypes.c_uint8 * array.nbytes).from_address(array.unsafe_buffer_pointer())
    return as_torch(np.frombuffer(raw, np.uint8).view(array.dtype).reshape(t.shape), t.dtype)


def buffer(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a CPU tensor with t's value for gloo, whether it shares t's buffer): ``alias`` where it
    can, else a copy whose result must be stored back with ``write``."""
    shared = alias(t)
    return (to_host(t), False) if shared is None else (shared, True)


# gloo reduces these itself; AVG and PREMUL_SUM are a SUM with a division or a multiplication.
_GLOO = {
    RedOpType.SUM: ReduceOp.SUM, RedOpType.PRODUCT: ReduceOp.PRODUCT,
    RedOpType.MIN: ReduceOp.MIN, RedOpType.MAX: ReduceOp.MAX, RedOpType.BAND: ReduceOp.BAND,
    RedOpType.BOR: ReduceOp.BOR, RedOpType.BXOR: ReduceOp.BXOR,
    RedOpType.AVG: ReduceOp.SUM, RedOpType.PREMUL_SUM: ReduceOp.SUM,
}
_NUMPY = {
    RedOpType.SUM: np.add, RedOpType.PRODUCT: np.multiply, RedOpType.MIN: np.minimum,
    RedOpType.MAX: np.maximum, RedOpType.BAND: np.bitwise_and, RedOpType.BOR: np.bitwise_or,
    RedOpType.BXOR: np.bitwise_xor, RedOpType.AVG: np.add, RedOpType.PREMUL_SUM: np.add,
}
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


def reduce_op(op: ReduceOp, dtype: torch.dtype) -> tuple[RedOpType, float | None]:
    """(op type, PREMUL_SUM's factor) of op, checked against dtype."""
    kind = op.op if isinstance(op, ReduceOp) else RedOpType(op)
    if kind in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"torchtpu.distributed: tpu_dist: {kind.name} needs an integer or bool "
                        f"tensor, got {dtype}")
    if kind == RedOpType.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"torchtpu.distributed: tpu_dist: AVG needs a floating-point tensor, got "
                        f"{dtype}")
    factor = None
    if kind == RedOpType.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        if factor is None:
            raise ValueError("torchtpu.distributed: tpu_dist: PREMUL_SUM needs a factor "
                             "(dist._make_nccl_premul_sum)")
    return kind, factor


def premultiply(kind: RedOpType, factor, value):
    """Scale value by PREMUL_SUM's factor before the sum (numpy or torch, in place if possible)."""
    if kind == RedOpType.PREMUL_SUM:
        return value * np.asarray(factor).astype(value.dtype) if isinstance(value, np.ndarray) \
            else value.mul_(factor)
    return value


def finish(kind: RedOpType, value, size: int):
    """Divide an AVG's sum by the group size."""
    if kind == RedOpType.AVG:
        return (value / size).astype(value.dtype) if isinstance(value, np.ndarray) \
            else value.div_(size)
    return value


def gloo_op(kind: RedOpType) -> ReduceOp:
    return _GLOO[kind]


def reduce_rows(rows: np.ndarray, kind: RedOpType, factor, size: int) -> np.ndarray:
    """The reduction of every rank's value (rows[r]), in rank order, the same on every rank."""
    rows = premultiply(kind, factor, rows)
    out = _NUMPY[kind].reduce(rows, axis=0, dtype=rows.dtype)
    return finish(kind, out, size)
