"""Device storages: PyTorch StorageImpls whose bytes live in a JAX array.

A storage is a real ``torch.UntypedStorage`` on the "tpu" device with the right byte size (so
PyTorch's own bounds and view checks work) and a unique, never-dereferenced address from a bump
allocator. Its Python object lives as long as the storage, so the JAX array is kept on it as the
attribute ``_tpu_array``: a C-contiguous array whose bytes, in order, are the storage's bytes.
``None`` means never written (``torch.empty``); it reads as zeros.
"""

from __future__ import annotations

import functools
import itertools
import threading

import jax
import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from torchtpu.device import memory_history, memory_limit
from torchtpu.runtime.platform import jax_device

_ALIGN = 64
# Two address regions, never overlapping and each only growing. A storage of up to ``_BLOCK``
# bytes (nearly every op result) takes the next block of the upper region, its index from a
# C counter (``next`` of an ``itertools.count`` is one call under the GIL: no lock, and no
# Python steps, on every result tensor of every op); a larger one, or any once the upper region
# is used up (after 2^35 small storages), is bumped under the lock in the lower region.
_BLOCK = 1 << 27
_SMALL_BASE = 1 << 62
_SMALL_BLOCKS = (1 << 62) // _BLOCK - 1  # (the last block ends below 2^63)
_small_index = itertools.count()
_lock = threading.Lock()
_next_address = [1 << 40]


@functools.cache
def _device(index: int) -> torch.device:
    return torch.device("tpu", index)


_construct = torch._C._construct_storage_from_data_pointer


def new_storage(nbytes: int, index: int = 0) -> torch.UntypedStorage:
    """A fresh device storage of nbytes with no array yet."""
    storage = bare_storage(nbytes, index)
    storage._tpu_array = None
    return storage


def bare_storage(nbytes: int, index: int = 0) -> torch.UntypedStorage:
    """A fresh device storage of nbytes, its Python object without the array attribute: for a
    caller that swaps its data pointer into another storage and drops it (an attribute would
    give the dropped object a ``__dict__`` for nothing)."""
    # Addresses are never dereferenced, but PyTorch's overlap checks compare address ranges,
    # so each storage gets its own range, never reused.
    if nbytes <= _BLOCK:
        block = next(_small_index)
        if block < _SMALL_BLOCKS:
            return _construct(_SMALL_BASE + block * _BLOCK, _device(index), nbytes)
    with _lock:
        address = _next_address[0]
        _next_address[0] += ((nbytes or 1) + _ALIGN - 1) // _ALIGN * _ALIGN
    return _construct(address, _device(index), nbytes)


def mark() -> tuple:
    """Where each address region's next storage will go: every storage made from now on is
    ``made_since`` it."""
    # (The small region's mark takes a block of its own, never used: the counter has no read.)
    small = _SMALL_BASE + next(_small_index) * _BLOCK
    with _lock:
        return _next_address[0], small


def made_since(mark: tuple, address: int) -> bool:
    """Whether the storage at address was made after ``mark`` gave mark."""
    return address >= (mark[1] if address >= _SMALL_BASE else mark[0])


def set_nbytes(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give storage a new byte size and a fresh address range in place, its array untouched.

    Every tensor on the storage sees the new size, as with a CPU storage's ``resize_``. PyTorch
    cannot resize a PrivateUse1 StorageImpl from Python, but it can swap a storage's data pointer
    (and with it its size) with another's when one of them is empty; two swaps through an empty
    storage give any size.
    """
    index = storage.device.index or 0
    if storage.nbytes():
        storage._swap_data_ptr_(new_storage(0, index))
    if nbytes:
        storage._swap_data_ptr_(new_storage(nbytes, index))
    if memory_history.recording:
        memory_history.retrack(storage)


def live_bytes() -> int:
    """Bytes of device memory held by live arrays in this process.

    Counted from the runtime rather than per storage: a storage that was never written holds no
    device memory, and tracking every storage's death would cost a finalizer per tensor.
    """
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def get_array(storage: torch.UntypedStorage) -> jax.Array | None:
    return storage._tpu_array


def set_array(storage: torch.UntypedStorage, array: jax.Array) -> None:
    storage._tpu_array = array


def zeros_for(storage: torch.UntypedStorage, index: int = 0) -> jax.Array:
    """The array an unwritten storage reads as: zero bytes."""
    arr = jax.device_put(np.zeros(storage.nbytes(), np.uint8), jax_device(index))
    storage._tpu_array = arr
    return arr


def _device_of(args, kwargs) -> torch.device | None:
    device = kwargs.get("device")
    return torch.device(device) if device is not None else None


def install_constructor() -> None:
    """Make ``torch.UntypedStorage(n, device="tpu")`` build a device storage (of n bytes, none,
    or the byte values of a sequence, as CPU's).

    PyTorch has no allocator for a Python backend, so its own constructor would dereference a
    null allocator; deepcopy, ``storage.clone()`` and ``torch.load(map_location="tpu")`` all
    construct device storages this way.
    """
    cls = torch.UntypedStorage
    base_new = cls.__new__

    def __new__(klass, *args, **kwargs):
        device = _device_of(args, kwargs)
        if device is not None and device.type == "tpu":
            from torchtpu.runtime import platform

            index = platform.check_index(device.index) if device.index is not None \
                else platform.current_index()
            if len(args) == 1 and isinstance(args[0], int):
                storage = new_storage(args[0], index)
            else:
                # No size, or a sequence of byte values: built on CPU first, so every other
                # argument is checked, and refused, in CPU's words.
                host = base_new(klass, *args)
                storage = new_storage(host.nbytes(), index)
                if host.nbytes():
                    memory_limit.admit(host.nbytes(), "copying a storage from the host")
                    host_bytes = torch.empty(0, dtype=torch.uint8).set_(host).numpy()
                    set_array(storage, jax.device_put(host_bytes, jax_device(index)))
            if memory_history.recording:
                memory_history.track(storage)
            return storage
        return base_new(klass, *args, **kwargs)

    cls.__new__ = __new__


def from_host(host_bytes: torch.Tensor, dtype: torch.dtype | None) -> torch.UntypedStorage:
    """A pickled device storage back on the device, typed when it was: its bytes travel as a
    CPU uint8 tensor."""
    untyped = host_bytes.to("tpu").untyped_storage()
    if dtype is None:
        return untyped
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def install_pickling() -> None:
    """Make device storages, and so device tensors, picklable (multiprocessing queues,
    ``copy.deepcopy`` through pickle): they travel as CPU bytes and come back on "tpu".

    PyTorch pickles a storage through its legacy file writer, which reads it through a second
    StorageImpl of the same address that carries no array.
    """
    for cls in (torch.UntypedStorage, torch.storage.TypedStorage):
        base_reduce = cls.__reduce__

        def __reduce__(self, base_reduce=base_reduce):
            typed = isinstance(self, torch.storage.TypedStorage)
            untyped = self._untyped_storage if typed else self
            if untyped.device.type != "tpu":
                return base_reduce(self)
            # The bytes of a real storage, also while a dispatch mode is active (AOTAutogradCache
            # pickles a graph's tpu constants under its FakeTensorMode, where set_ would be faked).
            with _disable_current_modes():
                host = torch.empty(0, dtype=torch.uint8).set_(untyped.cpu())
            return (from_host, (host, self.dtype if typed else None))

        cls.__reduce__ = __reduce__
