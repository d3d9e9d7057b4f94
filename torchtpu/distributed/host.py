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


def _to_device(t: torch.Tensor, value: np.ndarray | torch.Tensor) -> jax.Array:
    """Host value (t's shape and dtype) as a device array of its own."""
    if isinstance(value, torch.Tensor):
        value = as_numpy(value)
    value = np.ascontiguousarray(value).reshape(tuple(t.shape))
    # A jitted copy takes a small host value to the device ~10x faster than device_put (its
    # argument transfer is JAX's C++ fast path); device_put does not copy twice for large ones.
    return tensors.copy_buffer(value) if value.nbytes <= _SMALL \
        else jax.device_put(value, platform.local_device())


def write(t: torch.Tensor, value: np.ndarray | torch.Tensor) -> None:
    """Store host value (t's shape and dtype) into device tensor t, any view."""
    tensors.write(t, _to_device(t, value))


def _materialized(value):
    return value.materialize() if isinstance(value, tensors.Deferred) else value


def read_now(t: torch.Tensor) -> jax.Array:
    """Device tensor t's value (any view) as an array on the device, after running whatever
    DeferAndFuse holds pending for it."""
    executor.flush()
    value = _materialized(tensors.read(t))
    executor.flush()  # a view's read is itself pending while deferring
    return _materialized(value)


def _raw(array: jax.Array, t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over XLA:CPU array's own buffer (t's shape and dtype)."""
    raw = (ctypes.c_uint8 * array.nbytes).from_address(array.unsafe_buffer_pointer())
    return as_torch(np.frombuffer(raw, np.uint8).view(array.dtype).reshape(t.shape), t.dtype)


def _own_buffer(t: torch.Tensor):
    """The array of t's storage when gloo may use its buffer in place (XLA:CPU, t its whole
    storage, no lazy conj/neg bit); else None. Flushes what is pending first."""
    if platform.platform() != "cpu" or not tensors.covers_storage(t) or t.is_conj() \
            or t.is_neg():
        return None
    executor.flush()
    array = _materialized(tensors.storage_array(t))
    if tuple(array.shape) != tuple(t.shape) or array.dtype != dtypes.to_jax(t.dtype):
        return None
    return array


def alias(t: torch.Tensor) -> torch.Tensor | None:
    """A CPU tensor sharing device tensor t's buffer, for gloo to read and write in place.

    Only on XLA:CPU (device memory is host memory) and for a tensor that is its whole storage;
    None otherwise (use ``to_host`` and ``write``). Copying 64 MB each way cost about twice the
    gloo all_reduce itself here. Writing the buffer in place is what donation does: the storage
    owns its array alone (storages never share buffers), and every dispatched computation is
    waited for first, since one of them may still be reading this buffer.
    """
    array = _own_buffer(t)
    if array is None:
        return None
    for live in jax.live_arrays():
        live.block_until_ready()
    return _raw(array, t)


def buffer(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a CPU tensor with t's value for gloo, whether it shares t's buffer): ``alias`` where it
    can, else a copy whose result must be stored back with ``write``."""
    shared = alias(t)
    return (to_host(t), False) if shared is None else (shared, True)


class Staged:
    """A device tensor staged for a bulk collective that may run on another thread.

    Made on the caller's thread, which flushes and takes the array involved; ``host()`` and
    ``commit()`` then touch only that array, so the transfer may run on the group's
    communication thread while the caller's thread goes on dispatching work. ``host()`` is the
    CPU tensor gloo reads (``read``) and writes (``write``): for a tensor only read, t's own
    buffer where ``alias`` could use it, else a copy. A written tensor always gets a buffer of
    its own: writing a device buffer in place is safe only once every computation that may read
    it finished (``alias`` waits for all of them), which the caller's thread would have to wait
    for, and which another thread cannot wait for while the caller's thread frees arrays.
    ``commit()`` stores the result into t. ``threadable`` says whether both may run off the
    caller's thread: a result for a view must go through the caller's executor.
    """

    def __init__(self, t: torch.Tensor, *, read: bool, write: bool) -> None:
        self.tensor = t
        self._read = read
        self._buffer = None if write else _own_buffer(t)
        self._value = None
        if self._buffer is None and read:
            self._value = read_now(t)
        covers = tensors.covers_storage(t) and not (t.is_conj() or t.is_neg())
        self.threadable = tensors.capture is None and (covers or not write)

    def host(self) -> torch.Tensor:
        t = self.tensor
        if self._buffer is not None:
            self._buffer.block_until_ready()
            return _raw(self._buffer, t)
        if self._read:
            return as_torch(np.array(self._value), t.dtype)
        return torch.empty(tuple(t.shape), dtype=t.dtype)

    def commit(self, buf: torch.Tensor) -> None:
        tensors.write(self.tensor, _to_device(self.tensor, buf))


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
