"""Kernels that belong to the device itself rather than to the lowering table.

Allocation (``empty``), transfers and conversions (``copy_``), host reads (``item``), storage
resizing, and the metadata-only view kernels, which are PyTorch's own CPU kernels redispatched:
they touch sizes, strides and offsets only, so ``_base``, version counters and aliasing are
PyTorch's.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu import errors, metrics
from torchtpu.cache import warm_dispatch
from torchtpu.device import asserts, dtypes, launch, memory_limit, overlap, tensors
from torchtpu.device import storage as storages
from torchtpu.device.hooks import HOOKS, MISS
from torchtpu.device.views import _bitcast_flat, read_view
from torchtpu.runtime import platform, transfer

aten = torch.ops.aten
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

# Metadata-only kernels: PyTorch's CPU implementation is right for any device.
VIEW_OPS = (
    aten.view.default,
    aten.view.dtype,
    aten.as_strided.default,
    aten._reshape_alias.default,
    aten.unfold.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
    aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor,
    aten.alias.default,
    aten._unsafe_view.default,
)


def _redispatch_cpu(op):
    # A partial, not a closure: no Python frame of ours on a view (~1 of its ~4 us; autograd
    # makes ~800 views in a 12-layer Llama's backward).
    return functools.partial(op._handle.redispatch_boxed, _CPU)


def _check_device(device) -> None:
    if device is not None:
        # (Autograd's allocations pass a torch.device: no new one made from it.)
        d = device if type(device) is torch.device else torch.device(device)
        if d.index is not None:
            platform.check_index(d.index)


def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None,
                        memory_format=None):
    _check_device(device)
    strides = None
    if memory_format not in (None, torch.contiguous_format):
        # channels_last(_3d) strides, or the error CPU gives for a format the rank cannot take.
        strides = torch.empty(size, device="meta", memory_format=memory_format).stride()
    return _filled_if_deterministic(
        tensors.new_tensor(size, dtype or torch.get_default_dtype(), strides))


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    _check_device(device)
    return _filled_if_deterministic(
        tensors.new_tensor(size, dtype or torch.get_default_dtype(), stride))


def _fills_uninitialized() -> bool:
    # torch.use_deterministic_algorithms(True) with torch.utils.deterministic
    # .fill_uninitialized_memory (its default): CPU's and CUDA's allocations are then filled, so
    # that a read of memory never written gives the same (and a conspicuous) value every run.
    return (torch.are_deterministic_algorithms_enabled()
            and torch._C._get_deterministic_fill_uninitialized_memory())


def _fill_uninitialized(t: torch.Tensor) -> None:
    """What CPU writes into memory it hands out uninitialized in deterministic mode: NaN for
    floating and complex dtypes, the dtype's largest value for integers (True for bool)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    else:
        t.fill_(True if t.dtype is torch.bool else torch.iinfo(t.dtype).max)


def _filled_if_deterministic(t: torch.Tensor) -> torch.Tensor:
    if _fills_uninitialized() and t.numel():
        _fill_uninitialized(t)
    return t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU copy of device tensor t as a NumPy array (never aliasing a device buffer). Every
    host read (``.item()``, ``.cpu()``, ``print``) comes here, which tells the capture, the
    deferring executor and a watching tool (``HOOKS``)."""
    if HOOKS.capture is not None:
        HOOKS.capture.host_read()
    if HOOKS.deferrer is not None:
        HOOKS.deferrer.host_read()
    watcher = HOOKS.host_read_watcher
    start = time.perf_counter() if watcher is not None else 0.0
    # A copy: a donated buffer must never back a CPU tensor.
    stored = tensors.stored_in_order(t)
    if stored is None:
        array = launch.wait(np.array, tensors.read(t))
    else:  # t's strides, as CPU's copy keeps a dense layout (``np.argsort``: the inverse order)
        array = launch.wait(np.array, stored[0]).transpose(np.argsort(stored[1]))
    metrics.count("device_to_host_bytes", array.nbytes)
    asserts.raise_pending()
    if watcher is not None:
        watcher(array.nbytes, time.perf_counter() - start)
    return array


# Dtypes NumPy has only through ml_dtypes: they cross as same-width unsigned integers.
_BITS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8,
         torch.float8_e5m2: torch.uint8, torch.float8_e4m3fnuz: torch.uint8,
         torch.float8_e5m2fnuz: torch.uint8}


def numpy_to_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype in _BITS:
        return torch.from_numpy(array.view(dtypes.to_jax(_BITS[dtype]))).view(dtype)
    if dtype is torch.complex32:  # NumPy has no complex32: it crosses as complex64 (exactly)
        return torch.from_numpy(array).to(dtype)
    return torch.from_numpy(array)


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    t = t.to(torch.complex64) if t.dtype is torch.complex32 else t.contiguous()
    if t.dtype in _BITS:
        return t.view(_BITS[t.dtype]).numpy().view(dtypes.to_jax(t.dtype))
    if t.is_conj():
        t = t.resolve_conj()
    return t.resolve_neg().numpy()


@functools.lru_cache(maxsize=1024)
def _converter(dtype, shape):
    jitted = jax.jit(lambda a: jnp.broadcast_to(dtypes.cast(a, dtype), shape))
    jitted._ttpu_cast = dtype
    return warm_dispatch.keyed(jitted, "convert", dtype, shape)


def cast_of(fn) -> np.dtype | None:
    """The dtype that fn, a recorded program of ``convert``'s, casts its one input to (then
    broadcasts), else None."""
    return getattr(fn, "_ttpu_cast", None)


def convert(array, t: torch.Tensor):
    """array cast to t's dtype and broadcast to t's shape (recorded while deferring)."""
    dtype, shape = dtypes.to_jax(t.dtype), tuple(t.shape)
    if array.dtype == dtype and array.shape == shape:
        return array
    return tensors.call(_converter(dtype, shape), array)


@functools.lru_cache(maxsize=1024)
def _view_converter(g, dtype, shape):
    tensors.check_in_bounds(g)
    return warm_dispatch.keyed(
        jax.jit(lambda a: jnp.broadcast_to(dtypes.cast(read_view(a, g), dtype), shape)),
        "convert_view", g, dtype, shape)


def read_converted(src: torch.Tensor, dtype: torch.dtype, shape: tuple, lazy: bool = False):
    """src's value (any view) cast to dtype and broadcast to shape: one program where src is a
    view that needs both a read and a cast (``x.t().float()``, a slice's ``.to()``), which were
    a program each. ``lazy``: the value may be one the executor lets its readers' programs
    compute (``HOOKS.lazy_cast`` of a view: reshape's clone of a transposed tensor), for a
    caller that stores it as a storage's whole value."""
    array, g = tensors.read_parts(src)
    jax_dtype = dtypes.to_jax(dtype)
    if g is not None:
        value = None if HOOKS.view_reader is None else HOOKS.view_reader(src, array, g)
        lazy_cast = HOOKS.lazy_cast
        if value is None and lazy and lazy_cast is not None and tuple(src.shape) == shape:
            value = lazy_cast(src, array, dtype, g)
            if value is not None:
                return value
        if value is None:
            if np.dtype(g.dtype) == jax_dtype and g.size == shape:  # a read alone
                return tensors.read(src)
            return tensors.call(_view_converter(g, jax_dtype, shape), array)
        array = value
    if array.dtype == jax_dtype and array.shape == shape:
        return array
    return tensors.call(_converter(jax_dtype, shape), array)


def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if dst.device.type == "tpu":
        # The copy is computed whole and then written, so an expand-ed target or one that
        # partly overlaps src would get an answer where CPU refuses the copy: refuse as CPU.
        overlap.check_internal([dst])
        if src.device.type == "tpu":
            overlap.check_between(aten.copy_.default, [dst], [src])
            # A padded value (``compile/padded_values.py``) may copy itself padded into dst
            # (reshape's clone of a transposed attention output), where a read would cut it.
            # (Asked of its type: a pending value of a capture or of DeferAndFuse would run to
            # answer an attribute read.)
            held = src.untyped_storage()._tpu_array
            copy_into = getattr(type(held), "copy_into", None)
            if copy_into is not None and copy_into(held, dst, src):
                return dst
            value = read_converted(src, dst.dtype, tuple(dst.shape),
                                   tensors.covers_storage(dst) and HOOKS.capture is None)
            owned = value is not src.untyped_storage()._tpu_array
        else:
            value = convert(sent(src, dst.device.index), dst)
            owned = True
        tensors.write(dst, value, owned)
        return dst
    dst.copy_(numpy_to_torch(to_numpy(src), src.dtype))
    return dst


def sent(src: torch.Tensor, index: int | None = None) -> jax.Array:
    """CPU tensor src's value as an array on tpu:index."""
    # A copy: on the CPU platform device_put may alias the NumPy buffer, and the CPU tensor's
    # later in-place writes would then show through on the device.
    host = np.array(torch_to_numpy(src), copy=True)
    memory_limit.admit(host.nbytes, "copying a tensor from the host")
    return transfer.put(host, platform.jax_device(index))  # (which counts its bytes)


def to_copy(t: torch.Tensor, *, dtype=None, layout=None, device=None, pin_memory=None,
            non_blocking: bool = False, memory_format=None) -> torch.Tensor:
    """``Tensor.to`` from the device. PyTorch's own kernel stages a non-blocking copy to the
    host in pinned memory, which only a C++ backend can allocate; the device's copies are
    asynchronous anyway, so every copy takes the same path."""
    if layout not in (None, torch.strided):
        raise RuntimeError(errors.message(
            "unsupported", f"tpu tensors are strided; .to(layout={layout}) is not supported"))
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
        # A lazy module's placeholder (``module.double()`` before its first forward): its
        # Python properties refuse to answer, so read it as the plain tensor it holds.
        t = t.as_subclass(torch.Tensor)
    recorder = HOOKS.deferrer
    if (recorder is not None and dtype is not None and dtype is not t.dtype
            and memory_format is None and (device is None or device == t.device)):
        # A recorded step's casts (autocast's, 342 a 12-layer Llama step, both ways): a tensor
        # that is its storage's whole value is recorded converted, without the general path's
        # steps (~1.5 of its ~13 us a cast). A view (a geometry to read) goes on; no geometry
        # means t is contiguous, its array whole (PyTorch resolves a lazy negation first).
        array, g = tensors.read_parts(t)
        if g is None:
            shape = tuple(t.shape)
            return tensors.wrap(recorder.record(_converter(dtypes.to_jax(dtype), shape), (array,)),
                                dtype)
    dtype = dtype or t.dtype
    held = t.untyped_storage()._tpu_array if t.device.type == "tpu" else None
    if (held is not None and t.is_contiguous() and memory_format in _KEEPS_CONTIGUOUS
            and (device is None or torch.device(device) == t.device)
            and getattr(type(held), "copy_into", None) is None):
        # A contiguous result on the same device: its value, wrapped; not an empty tensor made
        # through the dispatcher and then written (every autocast cast comes here).
        lazy_cast = HOOKS.lazy_cast
        if lazy_cast is not None and dtype is not t.dtype:
            lazy = lazy_cast(t, held, dtype)
            if lazy is not None:
                return tensors.wrap(lazy, dtype)
        value = read_converted(t, dtype, tuple(t.shape))
        return tensors.wrap(tensors.fresh_copy(value) if value is held else value, dtype)
    out = torch.empty_like(t, dtype=dtype, device=device or t.device,
                           memory_format=memory_format or torch.preserve_format)
    return out.copy_(t)


_KEEPS_CONTIGUOUS = (None, torch.preserve_format, torch.contiguous_format)


def _replayed(op: torch._ops.OpOverload, kernel):
    """kernel, whose path is a function of its arguments alone, asking ``HOOKS.replay`` as the
    dispatcher's entry does (``eager/defer_replay.py``: autocast's recorded casts repeat), with
    its errors trimmed as ``errors.at_user`` trims them (here, not by a second wrapper: a frame
    a cast, ~320 a 12-layer Llama step's autocast casts)."""
    op._torchtpu_replayable = True

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        try:
            replay = HOOKS.replay
            if replay is None:
                return kernel(*args, **kwargs)
            out = replay.repeat(op, args, kwargs)
            if out is not MISS:
                return out
            mark = replay.mark(op, args)
            out = kernel(*args, **kwargs)
            replay.keep(op, args, kwargs, out, mark)
            return out
        except Exception as error:
            errors.trim(error)
            raise  # bare: adds no frame of this one

    return run


def local_scalar_dense(t: torch.Tensor):
    return to_numpy(t).item()


@functools.lru_cache(maxsize=256)
def _rebyter(shape: tuple, dtype, nbytes: int):
    def rebyte(array):
        flat = _bitcast_flat(array.reshape(-1), np.dtype(np.uint8))
        if flat.size >= nbytes:
            return flat[:nbytes]
        return jnp.concatenate([flat, jnp.zeros(nbytes - flat.size, np.uint8)])

    return warm_dispatch.keyed(jax.jit(rebyte), "rebyte", shape, dtype, nbytes)


def resize_storage(st: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
    """``UntypedStorage.resize_`` for a device storage: in place, so every tensor on it sees
    the new size; the leading bytes are kept and new ones read as zeros. Size 0 drops the
    array, freeing its device memory (FSDP2 frees unsharded parameters this way)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(errors.message(
            "argument", f"storage resize_ takes a byte count >= 0, got {nbytes!r}"))
    if nbytes == st.nbytes():
        return st
    array = tensors.stored_array(st) if nbytes else None
    storages.set_nbytes(st, nbytes)
    if array is not None:
        array = tensors.call(_rebyter(tuple(array.shape), np.dtype(array.dtype), nbytes), array)
    st._tpu_array = array
    return st


def resize_(t: torch.Tensor, size, memory_format=None) -> torch.Tensor:
    size = tuple(size)
    if size == tuple(t.shape) and memory_format is None:
        return t  # as on CPU: the same sizes keep the strides
    st = t.untyped_storage()
    needed = (t.storage_offset() + math.prod(size)) * t.element_size()
    if needed > st.nbytes():
        old_numel = st.nbytes() // t.element_size()
        resize_storage(st, needed)
        if _fills_uninitialized():  # the storage's new elements, as CPU's resize_ fills them
            tail = tensors.new_tensor((0,), t.dtype)
            aten.set_.source_Storage_storage_offset.redispatch(
                _CPU, tail, st, old_numel, (needed // t.element_size() - old_numel,), (1,))
            _fill_uninitialized(tail)
    strides = tensors.contiguous_strides(size)
    if memory_format not in (None, torch.contiguous_format):
        strides = torch.empty(size, device="meta", memory_format=memory_format).stride()
    aten.set_.source_Storage_storage_offset.redispatch(
        _CPU, t, st, t.storage_offset(), size, strides
    )
    return t


def _install_storage_resize() -> None:
    # PyTorch sends a PrivateUse1 storage's resize_ to a C++ hook a Python backend cannot fill.
    cls = torch.UntypedStorage
    base_resize = cls.resize_

    def resize_(self, size: int):
        if self.device.type == "tpu":
            return resize_storage(self, size)
        return base_resize(self, size)

    cls.resize_ = resize_


def is_set_to(self: torch.Tensor, src: torch.Tensor) -> bool:
    """PyTorch's is_set_to: the same StorageImpl, offset, sizes and strides (metadata only)."""
    return (self.untyped_storage()._cdata == src.untyped_storage()._cdata
            and self.storage_offset() == src.storage_offset()
            and self.shape == src.shape and self.stride() == src.stride())


def _dtype_checked(kernel):
    # The views that reinterpret bytes as another dtype make tensors without ``tensors._create``.
    def checked(*args, **kwargs):
        out = kernel(*args, **kwargs)
        if out.dtype is torch.complex128:
            dtypes.check_platform(out.dtype)
        return out

    return checked


_REINTERPRETING = (aten.view.dtype, aten.view_as_complex.default)


def register(lib: torch.library.Library) -> None:
    for op in VIEW_OPS:
        kernel = _redispatch_cpu(op)
        lib.impl(op, _dtype_checked(kernel) if op in _REINTERPRETING else kernel, "PrivateUse1")
    lib.impl(aten.empty.memory_format, empty_memory_format, "PrivateUse1")
    lib.impl(aten.empty_strided.default, empty_strided, "PrivateUse1")
    # Host reads: where the device's checks and DeferAndFuse's failed programs raise.
    lib.impl(aten.copy_.default, errors.at_user(copy_), "PrivateUse1")
    lib.impl(aten._local_scalar_dense.default, errors.at_user(local_scalar_dense), "PrivateUse1")
    lib.impl(aten._to_copy.default, _replayed(aten._to_copy.default, to_copy),
             "PrivateUse1")
    lib.impl(aten.resize_.default, resize_, "PrivateUse1")
    lib.impl(aten.is_set_to.default, is_set_to, "PrivateUse1")
    # One stream per device, and JAX orders work on it: nothing to record (DDP's input copies).
    lib.impl(aten.record_stream.default, lambda t, stream: None, "PrivateUse1")
    _install_storage_resize()
