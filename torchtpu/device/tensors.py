"""Tensors on the "tpu" device and the JAX arrays behind them.

``wrap`` makes a new device tensor that owns a JAX array; ``read`` gives the array a tensor (any
view) denotes; ``write`` stores an array into a tensor (any view), donating the old storage buffer
so an in-place update does not copy the whole storage. Everything here is about tensors and
storages; the math of reading a strided view lives in ``views``, and what a storage may hold in
place of its array (a pending value, a donated buffer) in ``ownership``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.array import ArrayImpl

from torchtpu import metrics
from torchtpu.cache import warm_dispatch
from torchtpu.device import dtypes, launch, memory_history
from torchtpu.device import storage as storages
from torchtpu.device.constants import GUARDED, host_constant, zeros_program
from torchtpu.device.hooks import HOOKS
from torchtpu.device.ownership import Deferred, lent
from torchtpu.device.views import (
    Geometry,
    check_in_bounds,
    complex32_pairs,
    dense_order,
    in_memory_order,
    read_view,
    rows_of,
    run_of,
    write_rows,
    write_run,
    write_view,
)

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
# The boxed handle directly: OpOverload.redispatch adds a Python frame and costs twice as much,
# and this runs for every tensor an op creates.
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset._handle.redispatch_boxed
_create_empty = torch._C._acc.create_empty_tensor
# What a computed storage array is (a ``Deferred`` or a capture's value is not one); jax.Array
# is its abstract base, which an exact type test cannot use.
_ArrayImpl = ArrayImpl
_TO_NP = dtypes.TORCH_TO_NP
# ``storages.bare_storage``'s small case, for the two places that make every op's results.
_small_index, _construct, _device = storages._small_index, storages._construct, storages._device
_BLOCK, _SMALL_BASE, _SMALL_BLOCKS = storages._BLOCK, storages._SMALL_BASE, storages._SMALL_BLOCKS


def _create(size: tuple, dtype: torch.dtype) -> torch.Tensor:
    # Every device tensor made here (results, allocations, copies; ``_contiguous`` inlines it).
    if dtype is torch.complex128:
        dtypes.check_platform(dtype)
    return _create_empty(size, dtype)


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(size: tuple) -> tuple:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def contiguous_strides(size) -> tuple:
    return _contiguous_strides(tuple(size))


@functools.lru_cache(maxsize=4096)
def _layout(size: tuple, dtype: torch.dtype, stride: tuple | None, nbytes: int | None) -> tuple:
    """(strides, bytes, whether row-major over exactly its elements) of a new tensor: derived
    once a layout (~240 strided results a Llama step replayed in DeferAndFuse)."""
    dtypes.to_jax(dtype)  # raises a clear TypeError for unsupported dtypes
    stride = contiguous_strides(size) if stride is None else stride
    if nbytes is None:
        span = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
        nbytes = span * dtype.itemsize
    return stride, nbytes, (stride == contiguous_strides(size)
                            and nbytes == math.prod(size) * dtype.itemsize)


def new_tensor(size, dtype: torch.dtype, stride=None, nbytes: int | None = None) -> torch.Tensor:
    """An unwritten device tensor (reads as zeros) with its own storage."""
    size = tuple(size)
    stride, nbytes, dense = _layout(size, dtype, stride if stride is None else tuple(stride),
                                    nbytes)
    if dense:
        return _contiguous(size, dtype, nbytes)
    t = _create(size, dtype)
    _set_storage(_CPU, t, storages.new_storage(nbytes), 0, list(size), list(stride))
    if memory_history.recording:
        memory_history.track(t.untyped_storage())
    return t


def _contiguous(size: tuple, dtype: torch.dtype, nbytes: int, array=None) -> torch.Tensor:
    # A new tensor's storage is empty; swapping a fresh storage's data pointer into it is a third
    # of the cost of ``set_`` through the dispatcher, on every op's every result (and so is
    # ``_create``'s check inlined, and the array stored here, once).
    if dtype is torch.complex128:
        dtypes.check_platform(dtype)
    t = _create_empty(size, dtype)
    st = t.untyped_storage()
    # (``storages.bare_storage``'s small case inline: a frame every result fewer.)
    block = next(_small_index) if nbytes <= _BLOCK else _SMALL_BLOCKS
    st._swap_data_ptr_(_construct(_SMALL_BASE + block * _BLOCK, _device(0), nbytes)
                       if block < _SMALL_BLOCKS else storages.bare_storage(nbytes))
    st._tpu_array = array
    if not all(size):  # made with zero strides there; PyTorch's are (2, 2, 1, 1) for (0, 1, 2, 0)
        _set_storage(_CPU, t, st, 0, list(size), list(contiguous_strides(size)))
    if memory_history.recording:
        memory_history.track(st)
    return t


_stored_complex32 = warm_dispatch.keyed(jax.jit(complex32_pairs), "complex32_pairs")


def stored_form(value, dtype: torch.dtype):
    """value (of dtype's compute dtype) as a storage of dtype holds it: itself, but complex32's
    float16 pairs (recorded while deferring)."""
    if dtype is not torch.complex32:
        return value
    if HOOKS.deferrer is None and isinstance(value, Deferred):
        value = value.resolve()  # a call Strict held (``lazy_casts``): computed, then paired
    return call(_stored_complex32, value)


def wrap(array: jax.Array, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous device tensor owning array (which no other storage may hold)."""
    dtype = dtypes.to_torch(array.dtype) if dtype is None else dtype
    # Every result of every op and graph comes here: an array's aval is read without the
    # shape property's Python step, and complex32's stored form only where it applies.
    size = tuple(array.aval.shape if type(array) is _ArrayImpl else array.shape)
    if dtype is torch.complex32:
        array = stored_form(array, dtype)
    if HOOKS.capture is None:
        return _contiguous(size, dtype, math.prod(size) * dtype.itemsize, array)
    t = _contiguous(size, dtype, math.prod(size) * dtype.itemsize)
    _hold(t.untyped_storage(), array)
    return t


def wrap_strided(array, dtype: torch.dtype, size: tuple, stride: tuple) -> torch.Tensor:
    """A new device tensor of size and stride owning array, its storage's value in memory order
    (a dense layout: array holds exactly its elements)."""
    t = new_tensor(size, dtype, stride)
    _hold(t.untyped_storage(), stored_form(array, dtype))
    return t


def _hold(st: torch.UntypedStorage, array) -> None:
    """st's value becomes array (in its stored form); a capture records it as the capture's."""
    capture = HOOKS.capture
    if capture is not None:
        capture.seen(st)
        array = capture.recorded(array)
    st._tpu_array = array


def wrapper(size: tuple, dtype: torch.dtype, stride: tuple | None = None):
    """``wrap`` for arrays of size and dtype known ahead (a call's remembered result), or
    ``wrap_strided`` of stride (one laid out as CPU lays it: a backward's products and sums in
    their inputs' order, ~270 a 12-layer Llama step): what it derives from each array, derived
    once, the strided tensor made by one ``set_``."""
    if dtype is torch.complex32 or dtype is torch.complex128 or not all(size):
        return functools.partial(wrap, dtype=dtype) if stride is None else \
            functools.partial(wrap_strided, dtype=dtype, size=size, stride=stride)
    nbytes = dtype.itemsize * (math.prod(size) if stride is None else
                               1 + sum((n - 1) * s for n, s in zip(size, stride)))
    sizes, strides = list(size), None if stride is None else list(stride)
    # ``storages.bare_storage``'s small case inline (a frame every result fewer): a block of
    # the upper region, where one is left; else that function's other case.
    small, device = nbytes <= _BLOCK, _device(0)

    def wrap_known(array) -> torch.Tensor:
        if HOOKS.capture is not None:
            return wrap(array, dtype) if stride is None else \
                wrap_strided(array, dtype, size, stride)
        t = _create_empty(size, dtype)
        block = next(_small_index) if small else _SMALL_BLOCKS
        new = _construct(_SMALL_BASE + block * _BLOCK, device, nbytes) \
            if block < _SMALL_BLOCKS else storages.bare_storage(nbytes)
        if strides is None:
            st = t.untyped_storage()
            st._swap_data_ptr_(new)
        else:
            st = new
            _set_storage(_CPU, t, st, 0, sizes, strides)
        st._tpu_array = array
        if memory_history.recording:
            memory_history.track(st)
        return t

    return wrap_known


def call(fn, *args, label=None):
    """fn (a pure jitted function of storage arrays) applied now, or recorded while deferring
    (``HOOKS.deferrer``); ``label``: what the launch runs (``launch.run``), where not fn's own
    name."""
    recorder = HOOKS.deferrer
    if recorder is not None:
        return recorder.record(fn, args)
    return launch.run(label, fn, args)


# A copy into a new buffer, jitted: ``jax.Array.copy()`` goes through slow Python paths.
copy_buffer = warm_dispatch.keyed(jax.jit(jnp.copy), "copy")


def fresh_copy(array):
    """array in a buffer of its own (recorded while deferring): storages never share buffers."""
    return call(copy_buffer, array)


def _covers_storage(t: torch.Tensor, st) -> bool:
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.numel() * t.element_size() == st.nbytes()
    )


def covers_storage(t: torch.Tensor) -> bool:
    """Whether device tensor t is its whole storage, contiguous from the start."""
    return _covers_storage(t, t.untyped_storage())


def _geometry(t: torch.Tensor, array) -> Geometry:
    return Geometry(
        tuple(array.shape),
        array.dtype,
        tuple(t.shape),
        tuple(t.stride()),
        t.storage_offset(),
        dtypes.layout(t.dtype),
    )


# Geometries include the storage array's shape, so checking bounds when a reader or writer is
# first built checks every later call too.
@functools.lru_cache(maxsize=4096)
def _reader(g: Geometry):
    check_in_bounds(g)
    return warm_dispatch.keyed(jax.jit(functools.partial(read_view, g=g)), "read_view", g)


@functools.lru_cache(maxsize=4096)
def _writer(g: Geometry, donate: bool = True):
    check_in_bounds(g)
    return warm_dispatch.keyed(
        jax.jit(functools.partial(write_view, g=g), donate_argnums=0 if donate else ()),
        "write_view", g, donate)


# One writer for every offset of a run (``views.run_of``); JAX's cache keys it by shapes.
_run_writers = {donate: warm_dispatch.keyed(jax.jit(write_run, donate_argnums=0 if donate else ()),
                                            "write_run", donate) for donate in (True, False)}
_rows_writers = {donate: warm_dispatch.keyed(
    jax.jit(write_rows, donate_argnums=0 if donate else ()), "write_rows", donate)
    for donate in (True, False)}


def stored_array(st: torch.UntypedStorage):
    """The array (or pending value) st holds; None for a never-written storage."""
    array = st._tpu_array
    if isinstance(array, Deferred):
        array = st._tpu_array = array.resolve()
    return array


def _typed_shape(t: torch.Tensor, st) -> tuple | None:
    """The typed array a never-written storage starts as when t is its first reader or writer:
    t's own shape where t covers it; where t is a run of whole rows of a contiguous tensor that
    fills the storage (a merged weight loaded part by part: vLLM's qkv and gate-up projections
    write ``param.narrow(0, ...)``), that tensor's shape. Else None: the storage's bytes.

    Stored as bytes, every later read of such a weight bitcast them back, and on a TPU a 1-d
    byte array is laid out in 128-byte tiles: the v5e's served decode step spent ~250 ms a step
    re-tiling its merged weights (serving, session 21)."""
    if t.dtype is torch.complex32:
        return None
    if _covers_storage(t, st):
        return tuple(t.shape)
    if t.dim() == 0 or not t.is_contiguous():
        return None
    row = t.element_size() * math.prod(t.shape[1:])
    if not row or st.nbytes() % row or t.storage_offset() * t.element_size() % row:
        return None
    return (st.nbytes() // row, *t.shape[1:])


def storage_array(t: torch.Tensor):
    """The array behind t's storage, materializing zeros for a never-written storage."""
    st = t.untyped_storage()
    array = stored_array(st)
    capture = HOOKS.capture
    if array is None:
        # Counted: a call that reads only shapes (``lowers(shape_only)``) must make none.
        metrics.count("unwritten_reads")
        shape = _typed_shape(t, st)
        if shape is not None:
            dtype = dtypes.to_jax(t.dtype)
            # (A recording keeps the zeros: its program makes them, with no program of theirs.)
            array = None if HOOKS.deferrer is not None else host_constant(shape, dtype, 0)
            if array is None:
                # A capture reads a never-written storage as a real input, not as zeros it
                # records.
                program = zeros_program(shape, dtype)
                array = launch.run(None, program, ()) if capture is not None else call(program)
            st._tpu_array = array
        else:
            array = storages.zeros_for(st)
    if capture is not None:
        capture.seen(st)
    return array


_conj = warm_dispatch.keyed(jax.jit(jnp.conj), "conj")
_negate = warm_dispatch.keyed(jax.jit(jnp.negative), "negative")


def _apply_lazy_bits(t: torch.Tensor, value):
    # PyTorch's conj() and _neg_view are lazy: the storage keeps the plain values and the tensor
    # carries a bit. Both are involutions, so the same step serves reading and writing.
    if t.is_conj():
        value = call(_conj, value)
    if t.is_neg():
        value = call(_negate, value)
    return value


def _is_whole(t: torch.Tensor, array) -> bool:
    """t's value is array itself: the same shape and dtype, contiguous from the storage's start."""
    return (array.shape == t.shape and t.storage_offset() == 0 and t.is_contiguous()
            and array.dtype == dtypes.to_jax(t.dtype))


def reads_whole(t: torch.Tensor) -> bool:
    """Whether t's value is its storage's computed array itself (reading it runs no program)."""
    array = t.untyped_storage()._tpu_array
    return (array is not None and not isinstance(array, Deferred) and not t.is_conj()
            and not t.is_neg() and _is_whole(t, array))


def _parts(t: torch.Tensor) -> tuple:
    array = storage_array(t)
    return (array, None) if _is_whole(t, array) else (array, _geometry(t, array))


def read(t: torch.Tensor) -> jax.Array:
    """The value of device tensor t (any view) as a JAX array of t's shape and dtype."""
    array, g = _parts(t)
    if g is not None:
        reader = HOOKS.view_reader
        value = None if reader is None else reader(t, array, g)
        array = call(_reader(g), array) if value is None else value
    if t.is_conj() or t.is_neg():
        array = _apply_lazy_bits(t, array)
    return array


def read_parts(t: torch.Tensor, fold: bool = False) -> tuple:
    """(array, geometry): t's value is ``read_view(array, geometry)``, or array itself when the
    geometry is None. A program that takes t can read the view itself, inside its own
    computation, instead of a separate program call reading it first. ``fold``: a storage whose
    pending value can be computed inside the reading program (``folded(value, geometry)``: a
    lazy cast) gives what it answers, ``(its input, how to read it)``, instead."""
    st = t.untyped_storage()
    array = st._tpu_array
    # Every op's and every compiled graph's every tensor argument comes here: the common case (a
    # computed array that is t whole) is tested first, with the cheapest reads there are (the
    # array's aval, not its shape and dtype properties: a third of the cost).
    capture = HOOKS.capture
    kind = type(array)
    if capture is None and (kind is _ArrayImpl or getattr(kind, "whole_is_itself", False)) \
            and t.storage_offset() == 0 and t.is_contiguous() and not t.is_neg() \
            and not t.is_conj():
        if kind is not _ArrayImpl:
            # DeferAndFuse's recorded value (every tensor of a deferred step): the value while
            # pending; once run, its array, which the storage then holds (as ``stored_array``).
            value = array.resolve()
            if value is not array:
                array = st._tpu_array = value
            kind = type(array)
        known = array.aval if kind is _ArrayImpl else array
        if known.shape == t.shape and known.dtype == _TO_NP.get(t.dtype):
            return array, None
    if t.is_conj() or t.is_neg():
        return read(t), None
    if fold and capture is None:
        folded = getattr(type(array), "folded", None)
        if folded is not None:
            parts = folded(array, None if _is_whole(t, array) else _geometry(t, array))
            if parts is not None:
                return parts
    if (array is not None and not isinstance(array, Deferred) and capture is None
            and _is_whole(t, array)):
        return array, None
    return _parts(t)


def stored_in_order(t: torch.Tensor) -> tuple | None:
    """(t's storage array, t's dims in memory order) where t is all of that array in another
    dim order than row-major (a pointwise result laid out as CPU lays it): a host read takes the
    array as it is and transposes on the host, with no program to read the view. Else None."""
    if t.is_conj() or t.is_neg():
        return None
    st = t.untyped_storage()
    order = _storage_order(t, st)
    if order is None:
        return None
    array = stored_array(st)
    if (type(array) is not _ArrayImpl or array.dtype != _TO_NP.get(t.dtype)
            or array.shape != tuple(t.shape[d] for d in order)):
        return None
    return array, order


def _storage_order(t: torch.Tensor, st) -> tuple | None:
    """t's dims in memory order when t is all of its storage in another dim order than
    row-major (``views.dense_order``), else None."""
    if t.storage_offset() or t.numel() * t.element_size() != st.nbytes():
        return None
    return dense_order(tuple(t.shape), tuple(t.stride()))


@functools.lru_cache(maxsize=256)
def _orderer(order: tuple):
    return warm_dispatch.keyed(jax.jit(functools.partial(in_memory_order, order=order)),
                               "in_memory_order", order)


def in_order(value, order: tuple):
    """value with its dims in ``order`` (row-major in memory order), by one program call
    (recorded while deferring)."""
    return call(_orderer(tuple(order)), value)


def write(t: torch.Tensor, value: jax.Array, owned: bool = True) -> None:
    """Store value (t's shape and dtype) into device tensor t (any view); ``owned`` False: value
    is another storage's array, copied where it would be stored as it is."""
    if t.is_conj() or t.is_neg():
        value = _apply_lazy_bits(t, value)
    st = t.untyped_storage()
    covers = _covers_storage(t, st)
    # All of the storage in another dim order (a transposed or channels-last result laid out as
    # CPU lays it, SDPA's gradients in their inputs' order): the value becomes the storage's
    # array transposed to memory order, in one program. Written through the view instead, a
    # storage not yet written was a zero byte array (copied in from the host), the value was
    # bitcast into its bytes and every product reading the view bitcast them back: on a TPU,
    # ~40x the product's own time (a v5e lays out bytes of a 1-d array in 128-byte tiles).
    order = None if covers else _storage_order(t, st)
    if covers or order is not None:
        if order is not None:
            value = in_order(value, order)
        elif not owned:
            value = fresh_copy(value)
        _hold(st, stored_form(value, t.dtype))
        return
    array = storage_array(t)
    g = _geometry(t, array)
    donate = id(array) not in lent
    # A run's offset goes in as an argument, in plain eager only: a deferred or captured program
    # keeps the static writer (its recording and replay take storage arrays as inputs).
    # (and not under a JAX transfer guard that refuses the host's 8-byte offset: a weight push
    # checked to move nothing from the host, say)
    eager = (HOOKS.deferrer is None and HOOKS.capture is None
             and jax.config.jax_transfer_guard_host_to_device not in GUARDED)
    run = run_of(g) if eager else None
    row = rows_of(g) if eager and run is None else None
    if run is not None:
        check_in_bounds(g)
        st._tpu_array = call(_run_writers[donate], array, value, np.int64(g.offset))
    elif row is not None:
        check_in_bounds(g)
        st._tpu_array = call(_rows_writers[donate], array, value, np.int64(row))
    else:
        st._tpu_array = call(_writer(g, donate), array, value)
