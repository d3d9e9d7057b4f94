"""Padded values held by storages: a bucketed eager call's result kept at its bucket sizes.

A call ``eager_buckets`` runs padded gives arrays at bucket sizes. Cutting each one back to its
real size at once would cost a host round trip and a wait per call (a device slice would be a
program per real size). Instead the result's storage holds a ``Padded``: the padded array and,
per dim, the real and padded sizes of its layout's factors (``dynamic.Plan.layouts``). The next
bucketed call reads it padded, through ``source``: a view of the storage (a split's columns, a
head-split ``view`` and ``transpose``) is mapped onto the padded array when every padded factor
it touches is taken whole from its start (it stays padded), or as a window at an offset (the
window's start is a traced input: ``x[:, -1]`` of a growing ``x`` reads one row, at one program
per bucket). Anything else that reads the storage (``.cpu()``, an op that is not bucketed, a
view write) resolves the ``Padded`` like any deferred value: the real elements are cut out on the
host once, and the storage holds them from then on.

Padding positions hold garbage (whatever the program computed there), as between the nodes of a
padded graph: ``dynamic.plan`` masks every input of a call that mixes positions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np
import torch
from jax import lax

from torchtpu import metrics
from torchtpu.device import dtypes, ownership, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.device.views import Geometry, read_view
from torchtpu.eager import executor
from torchtpu.runtime import platform, transfer

made = [0]  # 1 once a Padded was made: until then no call looks for one among its inputs


class Padded(ownership.Deferred):
    """A storage's value at bucket sizes: ``array`` (padded, or a value DeferAndFuse holds
    pending), ``real`` and ``padded`` the sizes of each dim's factors; ``shape`` and ``dtype``
    are the real value's, as a storage array's."""

    __slots__ = ("array", "real", "padded", "shape", "dtype", "_cut")

    def __init__(self, array, real: tuple, padded: tuple) -> None:
        self.array = array
        self.real = real
        self.padded = padded
        self.shape = tuple(math.prod(dim) for dim in real)
        self.dtype = array.dtype
        self._cut = None
        made[0] = 1

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def resolve(self):
        """The real value, cut out of the padded array on the host (once)."""
        if self._cut is None:
            metrics.count("eager_padded_cuts")
            self._cut = transfer.put(cut(transfer.fetch(self.array), self.real, self.padded),
                                     platform.local_device())
        return self._cut

    materialize = resolve

    def copy_into(self, dst, src) -> bool:
        """Write src (a view of the storage holding self) into dst padded, when dst is its
        whole storage of src's shape and dtype and src's view keeps its padding whole (a
        program per bucket reads it); False: copy it as usual (a cut)."""
        if HOOKS.capture is not None or HOOKS.deferrer is not None \
                or executor.current().name == "debug" or src.is_conj() \
                or src.is_neg() or dst.dtype != src.dtype or dst.shape != src.shape \
                or not tensors.covers_storage(dst) or dst.is_conj() or dst.is_neg():
            return False
        got = source(src, self)
        if got is None or got[1] or got[2] == tuple(src.shape):
            return False  # a window (real-sized) or nothing padded: the usual copy is as good
        src_, starts, shape = got
        # A storage never shares its array with another.
        array = tensors.fresh_copy(self.array) if src_ is WHOLE else \
            read_now(self.array, starts, src_)
        dst.untyped_storage()._tpu_array = Padded(
            array, tuple((n,) for n in src.shape), tuple((n,) for n in shape))
        metrics.count("eager_padded_copies")
        return True

    def host_view(self, t) -> np.ndarray | None:
        """Tensor t's values (a view of the storage holding self) on the host, without cutting
        the storage's value; None while DeferAndFuse still holds the array pending."""
        if isinstance(self.array, ownership.Deferred) and self.array.resolve() is self.array:
            return None
        if dtypes.to_jax(t.dtype) != self.dtype or t.dtype is torch.complex32:
            return None
        flat = cut(transfer.fetch(self.array), self.real, self.padded).reshape(-1)
        view = np.lib.stride_tricks.as_strided(
            flat[t.storage_offset():], tuple(t.shape),
            tuple(s * flat.itemsize for s in t.stride()))
        return np.array(view, order="C")

    def __jax_array__(self):
        return self.resolve()


def cut(host: np.ndarray, real: tuple, padded: tuple) -> np.ndarray:
    """The real elements of a padded host array (factor sizes per dim)."""
    flat_real = [f for dim in real for f in dim]
    split = host.reshape([f for dim in padded for f in dim])
    split = split[tuple(slice(0, f) for f in flat_real)]
    return np.ascontiguousarray(split.reshape([math.prod(dim) for dim in real]))


def held(t) -> Padded | None:
    """The Padded value t's storage holds, if any (a CPU operand of a tpu op, a 0-d CPU tensor,
    holds no device value)."""
    array = getattr(t.untyped_storage(), "_tpu_array", None)
    return array if type(array) is Padded else None


class Source(NamedTuple):
    """How a program reads one input out of the array it is passed: reshaped to ``factors``,
    a traced-start window of ``size`` taken along each ``(axis, size)`` of ``windows``, then
    the view ``geometry`` (None: the array as it is)."""

    factors: tuple
    windows: tuple
    geometry: Geometry | None


WHOLE = Source((), (), None)


def read(array, starts, source: Source):
    """An input inside a program, from its array and its windows' starts (traced)."""
    if source.windows:
        array = array.reshape(source.factors)
        for (axis, size), start in zip(source.windows, starts, strict=True):
            array = lax.dynamic_slice_in_dim(array, start, size, axis)
    return array if source.geometry is None else read_view(array, source.geometry)


def _strides(shape) -> list:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return out[::-1]


def _merged(real: list, padded: list) -> tuple[list, list]:
    """The factors with each run of unpadded ones merged into one (the storage is contiguous:
    a view may walk across them, ``view(b, t, c)`` of ``(b, t, heads, head_dim)``)."""
    r_out, p_out = [], []
    for r, p in zip(real, padded):
        if r == p and r_out and r_out[-1] == p_out[-1]:
            r_out[-1] *= r
            p_out[-1] *= p
        else:
            r_out.append(r)
            p_out.append(p)
    return r_out, p_out


def _factor_of(s: int, rs: list, real: list) -> int | None:
    """The factor a view stride s steps along (a multiple of its stride, inside its extent)."""
    for k, (r, n) in enumerate(zip(rs, real)):
        if r <= s < r * n and s % r == 0:
            return k
    return None


def source(t, p: Padded) -> tuple[Source, tuple, tuple] | None:
    """(Source, window starts, the shape the program sees) for tensor t on a storage holding p,
    or None when t's view cannot be read out of the padded array without its real layout
    (a dim that merges a padded factor with others, a step along one, a view that
    reinterprets the dtype)."""
    if dtypes.to_jax(t.dtype) != p.dtype or t.dtype is torch.complex32:
        return None
    real, padded = _merged([f for dim in p.real for f in dim],
                           [f for dim in p.padded for f in dim])
    if not real:
        return None
    rs = _strides(real)
    coords, rest = [], t.storage_offset()
    for s in rs:
        coords.append(rest // s)
        rest %= s
    walked = [[] for _ in real]  # per factor: (view dim, size, step)
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        if n == 1 or s == 0:
            continue
        k = _factor_of(s, rs, real)
        if k is None:
            return None
        walked[k].append((d, n, s // rs[k]))
    factors, windows, starts = list(padded), [], []
    size = list(t.shape)
    for k, (r, p_) in enumerate(zip(real, padded)):
        reach = coords[k] + sum((n - 1) * step for _, n, step in walked[k])
        if reach >= r:
            return None  # the view runs across factors: it needs the real layout
        if r == p_:
            continue
        if len(walked[k]) > 1 or any(step != 1 for _, _, step in walked[k]):
            return None
        n = walked[k][0][1] if walked[k] else 1
        # (A factor of one real element no dim of the view walks, a length-1 tensor's in a
        # bucket, is read as a window: no dim of the view can say it is still padded.)
        if n == r and coords[k] == 0 and walked[k]:
            (d, _, _), = walked[k]
            size[d] = p_  # taken whole: still padded
            continue
        windows.append((k, n))
        starts.append(np.asarray(coords[k], np.int32))
        factors[k] = n
        coords[k] = 0
    fs = _strides(factors)
    stride = list(t.stride())
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        if n == 1 or s == 0:
            stride[d] = 0 if s == 0 else 1
            continue
        k = _factor_of(s, rs, real)
        stride[d] = (s // rs[k]) * fs[k]
    offset = sum(c * s for c, s in zip(coords, fs))
    g = Geometry(tuple(factors), p.dtype, tuple(size), tuple(stride), offset,
                 dtypes.layout(t.dtype))
    if windows:
        return Source(tuple(padded), tuple(windows), g), tuple(starts), tuple(size)
    if offset == 0 and tuple(size) == _flat_shape(p.padded) and \
            tuple(stride) == tuple(_strides(size)):
        return WHOLE, (), tuple(size)
    return Source((), (), g._replace(array_shape=_flat_shape(p.padded))), (), tuple(size)


def window(g: Geometry) -> tuple[Source, tuple] | None:
    """(Source, window starts) that read view g out of its unpadded storage array at traced
    starts: one program for every position of a view of that size (a vocabulary chunk of a
    head's weight, ``x[:, -1]`` of an exact ``x``), where g bakes its offset in. None unless g is
    a box of the array (each dim of it steps along one axis, each axis once, in bounds) that
    leaves some axis short, and reads the array's own dtype."""
    if g.dtype != g.array_dtype:
        return None
    shape = g.array_shape
    strides = _strides(shape)
    coords, rest = [], g.offset
    for s in strides:
        coords.append(rest // s)
        rest %= s
    extent, axes = [1] * len(shape), []
    for n, s in zip(g.size, g.stride):
        if n == 1:
            axes.append(None)
            continue
        a = next((a for a, (m, st) in enumerate(zip(shape, strides)) if st == s and m > 1), None)
        if a is None or extent[a] != 1:
            return None
        extent[a] = n
        axes.append(a)
    if any(c + e > m for c, e, m in zip(coords, extent, shape)):
        return None
    windows = tuple((a, e) for a, (e, m) in enumerate(zip(extent, shape)) if e < m)
    if not windows:
        return None
    inner = _strides(extent)
    stride = tuple(1 if a is None else inner[a] for a in axes)
    view = None if tuple(g.size) == tuple(extent) and stride == tuple(_strides(g.size)) else \
        Geometry(tuple(extent), g.array_dtype, tuple(g.size), stride, 0, g.dtype)
    return Source(tuple(shape), windows, view), \
        tuple(np.asarray(coords[a], np.int32) for a, _ in windows)


def _flat_shape(layout_sizes: tuple) -> tuple:
    return tuple(math.prod(dim) for dim in layout_sizes)


def real_input(t, array, g) -> tuple:
    """(array, Source) for tensor t whose storage holds a real array: read in the program."""
    return array, (WHOLE if g is None else Source((), (), g))


def wrap_output(array, real: tuple, padded: tuple):
    """What a storage holds for a program output: array itself when nothing is padded."""
    if real == padded:
        return array
    return Padded(array, real, padded)


_readers: dict = {}


def read_now(array, starts: tuple, src: Source):
    """An input read out of a padded array by its own program (one per Source)."""
    fn = _readers.get(src)
    if fn is None:
        fn = _readers[src] = jax.jit(lambda a, s: read(a, s, src))
    return tensors.call(fn, array, starts)


def run(jitted, args: tuple, label, executor):
    """jitted(*args) now (Strict) or recorded (DeferAndFuse)."""
    if HOOKS.deferrer is not None:
        metrics.count("executions")
        return HOOKS.deferrer.record(jitted, args)
    return executor.run_program(label, jitted, args)

