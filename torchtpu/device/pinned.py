"""Pinned host memory for the tpu device: PyTorch's C++ pinned-memory hooks, answered from Python.

C++ callers ask PrivateUse1's hooks for a pinned-memory allocator (``empty(pin_memory=True)``,
``Tensor.pin_memory()``, DDP's reducer with ``find_unused_parameters=True``, which stages its
used-parameter map through a pinned buffer and asserts ``is_pinned()``) and whether a host pointer
is pinned. A Python backend's hooks cannot answer either: PyTorch's Python hook class forwards only
``is_available``, ``is_built`` and ``has_primary_context``, so pinned allocation raised and
nothing was ever pinned.

``install()`` gives the registered hooks object those two answers. It copies the object's virtual
table, points the two entries at ctypes callbacks and points the object at the copy. Entry
positions follow PyTorch's header (``AcceleratorHooksInterface``); ``install`` first checks that
the object is PyTorch's ``PythonHooks`` laid out as that header says (against the exported base
table) and patches nothing otherwise, leaving PyTorch's own error. The allocator is ours (a
``c10::Allocator`` built with ctypes): host memory aligned like PyTorch's CPU allocator, recorded
while it lives, so ``is_pinned()`` is True exactly for memory it handed out. Host memory needs no
page-locking here (PJRT copies from any host buffer), so "pinned" costs nothing extra.

``c10::Allocator::allocate`` returns its ``DataPtr`` through a hidden pointer; the callback takes
it as its first argument, which is the x86-64 System V convention. Elsewhere nothing is patched.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading

import torch

# Positions in a virtual table (pointer-sized entries): the Itanium C++ ABI's two destructor
# entries, then AcceleratorHooksInterface's virtuals in declaration order (isBuilt 2 ...
# maybeExchangeDevice 10, isPinnedPtr 11, getPinnedMemoryAllocator 12, getDeviceFromPtr 13,
# getDefaultGenerator 14, getNewGenerator 15), then PrivateUse1's resizePrivateUse1Bytes 16.
_IS_PINNED_PTR, _PINNED_ALLOCATOR = 11, 12
_VIRTUALS = 17
# The entries PyTorch's Python hook class (torch::acc::PythonHooks) overrides: its destructors,
# the three it forwards to Python, the two answered here, getDeviceFromPtr and the generators.
_OVERRIDDEN = {0, 1, 2, 3, 4, 11, 12, 13, 14, 15}
# The table's two entries before the address objects point at: offset to top, type info.
_PREFIX = 2
_ALIGNMENT = 64  # PyTorch's CPU allocator aligns to 64 bytes
# c10::DataPtr: the data pointer, then its context as a unique_ptr (pointer and deleter, in the
# order the C++ library lays them out, found at install), then the device (type, index).
_DATA_PTR_BYTES = 32
_CPU, _NO_INDEX = 0, -1

_lock = threading.Lock()
_live: set[int] = set()
_keep: list = []  # callbacks and tables C++ points at: they must outlive every caller
_state = {"installed": False, "reason": None}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                 ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]

_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_Allocate = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_NoArgs = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_Destroy = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_IsPinned = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p)


def _torch_lib(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name))


def _words(address: int, count: int) -> ctypes.Array:
    return (ctypes.c_void_p * count).from_address(address)


def _context_slot(cpu_allocator: int) -> int:
    """Where a DataPtr holds its context pointer (1 or 2; the deleter is in the other): read from
    a DataPtr of PyTorch's own CPU allocator, whose context is its data pointer."""
    allocate = _Allocate(_words(_words(cpu_allocator, 1)[0], 3)[2])
    out = (ctypes.c_void_p * 4)()
    allocate(ctypes.addressof(out), cpu_allocator, 64)
    data, first, second = out[0], out[1], out[2]
    slot = 1 if first == data else 2 if second == data else 0
    if slot:
        _Deleter(out[3 - slot])(data)
    return slot


def _build_allocator(context_slot: int) -> int:
    """A c10::Allocator object (address) handing out recorded, aligned host memory."""

    def free(ptr):
        with _lock:
            _live.discard(ptr)
        _libc.free(ptr)

    deleter = _Deleter(free)
    deleter_address = ctypes.cast(deleter, ctypes.c_void_p).value

    def allocate(out, this, n):
        ptr = ctypes.c_void_p()
        if n and _libc.posix_memalign(ctypes.byref(ptr), _ALIGNMENT, n) != 0:
            # A callback cannot raise into C++: say why before the caller meets a null pointer.
            print(f"torchtpu.device: could not allocate {n} bytes of pinned host memory",
                  file=sys.stderr, flush=True)
            ptr = ctypes.c_void_p()
        words = _words(out, 4)
        words[0] = words[context_slot] = ptr.value
        words[3 - context_slot] = deleter_address
        words[3] = 0
        ctypes.memmove(out + 24, bytes([_CPU, _NO_INDEX & 0xFF]), 2)
        if ptr.value:
            with _lock:
                _live.add(ptr.value)
        return out

    c10 = _torch_lib("libc10.so")
    methods = [
        _Destroy(lambda this: None), _Destroy(lambda this: None),  # never destroyed
        _Allocate(allocate),
        c10._ZNK3c109Allocator18is_simple_data_ptrERKNS_7DataPtrE,
        _NoArgs(lambda this: deleter_address),  # raw_deleter
        c10._ZNK3c109Allocator17default_copy_dataEPvPKvm,
    ]
    table = (ctypes.c_void_p * (_PREFIX + len(methods)))(
        0, 0, *(ctypes.cast(m, ctypes.c_void_p).value for m in methods))
    obj = (ctypes.c_void_p * 1)(ctypes.addressof(table) + _PREFIX * 8)
    _keep.extend([deleter, methods, table, obj])
    return ctypes.addressof(obj)


def _refusal() -> str | None:
    """Why the hooks cannot be patched here, or None."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"pinned memory needs Linux on x86-64 (this is {platform.system()} " \
               f"{platform.machine()})"
    return None


def install() -> None:
    """Answer PrivateUse1's pinned-memory hooks (idempotent). Call after the hooks are
    registered; where the tables do not match PyTorch's header, nothing changes."""
    with _lock:
        if _state["installed"] or _state["reason"]:
            return
    reason = _refusal()
    if reason is None:
        reason = _patch()
    with _lock:
        _state["installed"], _state["reason"] = reason is None, reason


def _patch() -> str | None:
    cpu_lib = _torch_lib("libtorch_cpu.so")
    get_hooks = cpu_lib._ZN2at6detail19getPrivateUse1HooksEv
    get_hooks.restype = ctypes.c_void_p
    hooks = get_hooks()
    base = ctypes.c_void_p.in_dll(_torch_lib("libtorch_python.so"),
                                  "_ZTVN2at25PrivateUse1HooksInterfaceE")
    base_table = _words(ctypes.addressof(base) + _PREFIX * 8, _VIRTUALS)
    table = _words(_words(hooks, 1)[0] - _PREFIX * 8, _PREFIX + _VIRTUALS)
    # The registered object must be PythonHooks: it differs from its base class's table at
    # exactly the entries that class overrides (anything else means another layout or class).
    differs = {i for i in range(_VIRTUALS) if table[_PREFIX + i] != base_table[i]}
    if differs != _OVERRIDDEN:
        return "PrivateUse1's hooks are not laid out as torch 2.13's PythonHooks"
    cpu_get = cpu_lib._ZN3c1015GetCPUAllocatorEv
    cpu_get.restype = ctypes.c_void_p
    slot = _context_slot(cpu_get())
    if not slot:
        return "c10::DataPtr's layout is not the one expected"
    allocator = _build_allocator(slot)
    is_pinned = _IsPinned(lambda this, ptr: ptr in _live)
    get_allocator = _NoArgs(lambda this: allocator)
    copy = (ctypes.c_void_p * (_PREFIX + _VIRTUALS))(*table)
    copy[_PREFIX + _IS_PINNED_PTR] = ctypes.cast(is_pinned, ctypes.c_void_p).value
    copy[_PREFIX + _PINNED_ALLOCATOR] = ctypes.cast(get_allocator, ctypes.c_void_p).value
    _keep.extend([is_pinned, get_allocator, copy])
    _words(hooks, 1)[0] = ctypes.addressof(copy) + _PREFIX * 8
    return None


def status() -> tuple[bool, str | None]:
    """(whether pinned memory is answered, why not)."""
    return _state["installed"], _state["reason"]
