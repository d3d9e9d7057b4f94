"""The host transport: device values go to host memory, through gloo, and back to the device.

Measured on XLA:CPU (bench/collectives.py), gloo over host memory beats JAX's cross-process CPU
collectives at every size, so this is the transport wherever the device is XLA:CPU. Reading a
tensor flushes whatever DeferAndFuse holds pending for it, so a collective never becomes part of
a fused program that other ranks do not run; its result is written back as a fresh array. Bulk
collectives (``Staged``) copy nothing on XLA:CPU but an all_reduce's input, once: gloo reads
device buffers in place and writes host buffers that become device arrays as they are.
"""

from __future__ import annotations

import ctypes
import sys
import threading

import jax
import numpy as np
import torch
from torch.distributed import ReduceOp

from torchtpu.device import dtypes, kernels, ownership, tensors
from torchtpu.device.hooks import HOOKS
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
    return value.materialize() if isinstance(value, ownership.Deferred) else value


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


def _own_array(t: torch.Tensor):
    """The array of t's storage when gloo may read its buffer in place (XLA:CPU, t its whole
    storage, no lazy conj/neg bit); else None. Flushes what is pending first."""
    if platform.platform() != "cpu" or not tensors.covers_storage(t) or t.is_conj() \
            or t.is_neg():
        return None
    executor.flush()
    array = _materialized(tensors.storage_array(t))
    if tuple(array.shape) != tuple(t.shape) or array.dtype != dtypes.to_jax(t.dtype):
        return None
    return array


# XLA:CPU takes a host buffer as a device array's own, without copying it, at this alignment.
_ALIGN = 64
# XLA releases the Python references of buffers it is done with in batches, here (private API).
_collect_garbage = getattr(getattr(jax._src.lib, "_jax", None), "collect_garbage", lambda: None)


class _HostBuffers:
    """Aligned host buffers that bulk collectives write their results into.

    ``jax.device_put`` of an aligned NumPy array on XLA:CPU makes a device array over that same
    memory, and XLA keeps a reference to the buffer until nothing uses that memory any more:
    until the array is gone and every computation that read it finished. A buffer nothing but
    this pool references is thus free to write again. Reusing buffers is what makes this pay: the
    host zeroes fresh pages on first touch, and writing into a new 64 MB buffer took longer than
    the gloo all_reduce itself (bench/RESULTS.md).
    """

    # Free buffers kept for reuse, newest first, up to this many and bytes; older ones are let go.
    KEEP, KEEP_BYTES = 4, 1 << 29

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """An aligned uint8 array of nbytes that nothing else references."""
        with self._lock:
            _collect_garbage()
            found, free = None, []
            for i in range(len(self._buffers)):
                if sys.getrefcount(self._buffers[i]) == 2:  # the list and the argument
                    if found is None and self._buffers[i].nbytes == nbytes + _ALIGN:
                        found = self._buffers[i]
                    else:
                        free.append(i)
            kept = total = 0
            for i in reversed(free):
                total += self._buffers[i].nbytes
                kept += 1
                if kept > self.KEEP or total > self.KEEP_BYTES:
                    del self._buffers[i]
            if found is None:
                found = np.empty(nbytes + _ALIGN, np.uint8)
                self._buffers.append(found)
        start = -found.ctypes.data % _ALIGN
        return found[start : start + nbytes]


_BUFFERS = _HostBuffers()


class Staged:
    """A device tensor staged for a bulk collective that may run on another thread.

    Made on the caller's thread, which flushes and takes what the transfer needs; ``input()``,
    ``output()`` and ``commit()`` then touch only that, so the transfer may run on the group's
    communication thread while the caller's thread goes on dispatching and freeing work.

    ``input()`` is t's value for gloo to read: on XLA:CPU t's own buffer, read in place (lent, so
    that no view write donates it meanwhile; DeferAndFuse and compiled graphs donate nothing
    referenced elsewhere, and this holds a reference), else a host copy. ``output()`` is where
    gloo writes the result: a host buffer of the collective's own (``_HostBuffers``), never a
    device buffer, which a computation dispatched earlier may still be reading (writing those in
    place raced the caller's thread and crashed DDP). ``commit()`` makes that buffer t's new
    array, without a copy on XLA:CPU. ``threadable`` says whether all of it may run off the
    caller's thread: a result for a view must go through the caller's executor.
    """

    def __init__(self, t: torch.Tensor, *, read: bool, write: bool) -> None:
        self.tensor = t
        self._array = self._value = self._out = None
        if read:
            self._array = _own_array(t)
            if self._array is not None:
                ownership.lend(self._array)
            else:
                self._value = read_now(t)
        if write and t.dtype is not torch.complex32:  # complex32 crosses as a complex64 copy
            nbytes = t.numel() * t.element_size()
            self._out = _BUFFERS.take(nbytes).view(dtypes.to_jax(t.dtype)).reshape(t.shape)
        covers = tensors.covers_storage(t) and not (t.is_conj() or t.is_neg())
        self.threadable = HOOKS.capture is None and (covers or not write)

    def input(self) -> torch.Tensor:
        """A CPU tensor with t's value, for gloo to read (and never write)."""
        if self._array is not None:
            self._array.block_until_ready()
            return _raw(self._array, self.tensor)
        return as_torch(np.array(self._value), self.tensor.dtype)

    def output(self, *, filled: bool = False) -> torch.Tensor:
        """The CPU tensor for gloo to write t's result into; filled: holding t's value first
        (an in-place all_reduce: one copy, read from t's own buffer)."""
        t = self.tensor
        if self._out is None:
            out = torch.empty(tuple(t.shape), dtype=t.dtype)
            return out.copy_(self.input()) if filled else out
        if filled:  # NumPy's copy: torch's copy_ waits on its thread pool (8 ms for 1 MB here)
            np.copyto(self._out, as_numpy(self.input()))
        return as_torch(self._out, t.dtype)

    def commit(self, buf: torch.Tensor) -> None:
        """Store the result buf (``output()``'s tensor, or any like it) into t."""
        t = self.tensor
        if self._out is not None and buf.data_ptr() == self._out.ctypes.data:
            value = jax.device_put(self._out, platform.local_device())  # no copy on XLA:CPU
        else:
            value = _to_device(t, buf)
        self.release()
        tensors.write(t, value)

    def release(self) -> None:
        """Let go of what was staged (done by ``commit``; also after a failed transfer)."""
        if self._array is not None:
            ownership.unlend(self._array)
        self._array = self._value = self._out = None


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
    """Scale value by PREMUL_SUM's factor before the sum: a torch tensor in place, a NumPy or
    JAX array (the XLA transport's, traced) into a new one of its dtype."""
    if kind == RedOpType.PREMUL_SUM:
        return value.mul_(factor) if isinstance(value, torch.Tensor) \
            else value * np.asarray(factor).astype(value.dtype)
    return value


def finish(kind: RedOpType, value, size: int):
    """Divide an AVG's sum by the group size (in place for a torch tensor, as premultiply)."""
    if kind == RedOpType.AVG:
        return value.div_(size) if isinstance(value, torch.Tensor) \
            else (value / size).astype(value.dtype)
    return value


def gloo_op(kind: RedOpType) -> ReduceOp:
    return _GLOO[kind]


def reduce_rows(rows: np.ndarray, kind: RedOpType, factor, size: int) -> np.ndarray:
    """The reduction of every rank's value (rows[r]), in rank order, the same on every rank."""
    rows = premultiply(kind, factor, rows)
    out = _NUMPY[kind].reduce(rows, axis=0, dtype=rows.dtype)
    return finish(kind, out, size)
