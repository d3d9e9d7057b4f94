"""Strict's lazy casts and pointwise calls: a value computed inside the program that reads it.

Under autocast a Strict step launched a program for every cast: each weight's and input's cast
to bfloat16 and, in backward, each gradient's cast back to float32 (342 of a 12-layer Llama
step's 1,710 launches). Here ``x.to(dtype)`` (``kernels.to_copy``, through ``HOOKS.lazy_cast``)
stores a ``Converted``, the source array and the dtype, in the result's storage instead; a
consumer's program (``calls.dynamic_values`` -> ``tensors.read_parts(fold=True)``) takes the
source and converts it itself (the spec payload ``Cast``). Everything else that reads the
storage resolves it, as any ``Deferred``: one cast program, as before.

Memory cannot grow: a widening cast (the lazy value holds a narrower source) and a narrowing
cast of a parameter under autocast (the parameter is held anyway; autocast drops its casts when
its region ends and autograd when backward has run) wait for every reader. Any other narrowing
cast (an activation's, a float32 gradient's of a bfloat16 result) is ``keep``: the first
program converting it returns the narrow value too (``program.rebuild``'s ``kept``, taken by
``settle`` after the launch), which becomes the cast's value and lets the wide source go, so it
lives no longer than until that first reader (a cast saved for backward holds the narrow value,
as before). 110 more launches of a 12-layer Llama step folded so.

The same holds for a Strict call of a pointwise op (PyTorch's tag) on one tensor
(``lazy_op``, asked by ``Strict.run``; ``program.one_pointwise_input``): the ``Converted``
holds its (lowering, spec) as ``op``, read through the input's view, and the consumer's program
applies it (``program.applied``): the RMSNorm's square and rsqrt, the backward's multiplies by
special numbers, the rotary halves' negation, silu and sigmoid (186 of a 12-layer step's
launches). One smaller than its input (a slice's) is ``keep``; one larger (a broadcast) is held
up to ``LARGER`` bytes, else runs now, where its memory is asked for. A pointwise call of a
held value is held too, over the same source (a chain: the RMSNorm backward's power of its held
rsqrt, 50 launches of the step), up to ``program.CHAIN`` calls. An in-place op's value is
computed before it is written (``computed``). Fused with a reduction, the reduction may sum in
another order than it did over a stored input: an ulp.

A held call may carry traced numbers (the norms' ``+ eps``, a mean's divisor): its source is
then its arguments, the tensor's source and the numbers as device arrays, one input of the
reader's program (``Converted.spread``). An op whose lowering record says ``held`` (a slice's
gradient, a pad; a mean, the norms': kept) is held as a pointwise one is, and a held call over a
kept value smaller than its source is kept too (one program for a whole norm;
``program.kept_positions`` lists kept values nested in held calls). A copy of a view into a new
tensor (``kernels.read_converted``) reads its source through the view (``view``).

A pointwise call of several tensors (the norms' and rotary products, residual and gradient sums)
is held too (``held_call``), always kept: its first reader computes and returns it, so its inputs
live until then; what they hold beyond the results, over all pending ones, is bounded by
``LARGER``, and nothing is held under a memory limit. Such a call may read kept values, which
its reader returns, nested, and settles; a cast of one is the same call converted
(``_cast_of_held``), and settles it (``Cast.held``). A bfloat16 or float16 held value is rounded
inside its reader (``program.rounded``), where XLA would otherwise skip the rounding between ops.
(Launches of a 12-layer Llama step: 1,066 -> 418 over strict7-9, bench/RESULTS.md.)

The source array is immutable, a conversion between float dtypes cannot fail, and a view or an
in-place write of the result resolves or replaces the value: nothing a user can see changes.
The source is lent (``ownership.lend``) so that no view write or captured replay donates its
buffer meanwhile (they copy it), a call that donates it (``jax_op(donate_argnums=...)``) computes
the values reading it first (``settle_readers``), and every lazy cast still pending is resolved
when Strict stops being the executor (a capture or DeferAndFuse never sees one).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from typing import NamedTuple

import jax
import numpy as np
import torch
from jax._src.array import ArrayImpl

from torchtpu.cache import warm_dispatch
from torchtpu.device import autocast, dtypes, memory_limit, ownership, tensors
from torchtpu.device.views import Geometry, check_in_bounds, read_view
from torchtpu.eager.held_sources import arrays, flatten, lead

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# The loans of held values' source arrays (``ownership.lent``), given back inline.
_lent = ownership.lent
_pop_lent = _lent.pop
_NP = {d: dtypes.to_jax(d) for d in _FLOATS}


@functools.lru_cache(maxsize=1024)
def _converter(dtype: np.dtype, shape: tuple, view: Geometry | None = None):
    if view is None:
        return warm_dispatch.keyed(jax.jit(lambda a: dtypes.cast(a, dtype).reshape(shape)),
                                   "lazy_cast", dtype, shape)
    return warm_dispatch.keyed(
        jax.jit(lambda a: dtypes.cast(read_view(a, view), dtype).reshape(shape)),
        "lazy_cast", dtype, shape, view)


class Cast(NamedTuple):
    """How a program reads an argument held lazily cast: its array converted to ``dtype`` and
    reshaped to ``shape`` (None: its own), then read through ``geometry`` (None: whole);
    ``keep``: the program also returns the converted array, which becomes the cast's value (a
    narrowing cast, whose wide source must not outlive its first reader)."""

    dtype: np.dtype
    shape: tuple | None
    geometry: Geometry | None
    keep: bool = False
    # (lowering, spec) of a pointwise call of one tensor applied to the array first
    # (``program.applied``); dtype and shape are then its result's.
    op: tuple | None = None
    # A view Geometry the array is read through first (a held copy of a view: reshape's clone
    # of a transposed tensor); never with ``op`` (whose spec says how it reads).
    view: Geometry | None = None
    # ``op``'s value, before the conversion, is a kept held call's (autocast's cast of the
    # norm's ``weight * h`` for each of q's, k's and v's products): returned too, so that the
    # first reader settles that call and the others read it computed.
    held: bool = False


def read_input(array, how, kept: list | None = None):
    """An argument's value inside a program: ``how`` is a view Geometry or a ``Cast``; a kept
    cast's converted array is appended to ``kept`` (when given)."""
    if type(how) is Cast:
        if how.view is not None:
            array = read_view(array, how.view)
        if array.dtype != how.dtype:
            array = dtypes.cast(array, how.dtype)
        if how.shape is not None:
            array = array.reshape(how.shape)
        if how.keep and kept is not None:
            kept.append(array)
        return array if how.geometry is None else read_view(array, how.geometry)
    return read_view(array, how)


def check_read(how) -> None:
    """Raise if ``how`` (a view Geometry or a ``Cast``) reads past its storage's end."""
    if type(how) is Cast:
        if how.geometry is not None:
            check_in_bounds(how.geometry)
        if how.view is not None:
            check_in_bounds(how.view)
    else:
        check_in_bounds(how)


class Converted(ownership.Deferred):
    """A storage's value: ``source`` converted to ``dtype`` and reshaped to ``shape`` (a
    gradient's cast of a reshaped view), or ``op`` (lowering, spec) applied to it, computed by
    the first reader that cannot compute it itself (``fn`` of the source: one launch), or,
    ``keep``, returned by the first program that computes it (``settle``)."""

    __slots__ = ("source", "dtype", "shape", "keep", "op", "view", "fn", "_value", "spread",
                 "extra", "held", "lent", "__weakref__")

    def __init__(self, source, dtype: np.dtype, shape: tuple, keep: bool = False,
                 op: tuple | None = None, fn=None, view: Geometry | None = None,
                 spread: bool = False, lent: list | None = None) -> None:
        # ``spread``: source is the held call's arguments, (its tensor's source, its traced
        # numbers as device arrays), which a reader's program takes as one input (``applied``).
        self.source = source
        self.spread = spread
        # Bytes its inputs may hold beyond its result (``held_call``): counted in ``_holding``
        # until it is computed or dies.
        self.extra = 0
        # A cast of a kept held call (``_cast_of_held``): its readers settle that call too.
        self.held = False
        self.dtype = dtype
        self.shape = shape
        self.keep = keep
        self.op = op
        self.view = view
        self.fn = fn or _converter(dtype, shape, view)
        self._value = None
        # The arrays its source holds (nested held calls' arguments), found once (``lent``,
        # where the caller found them): lent now, given back when it is computed or dies.
        self.lent = arrays(source) if lent is None else lent
        ownership.lend_ids(map(id, self.lent))
        _pending[id(self)] = weakref.ref(self)
        if keep:
            _kept.setdefault(id(source), []).append(weakref.ref(self))

    def resolve(self):
        if self._value is None:
            # A held op's program is launched as Strict launches it at once: named by its op
            # (the profiler's trace shows one name for one program).
            args = self.source if self.spread else (self.source,)
            value = tensors.call(self.fn, *args, label=None if self.op is None else self.op[0].op)
            if self.op is not None and self.op[1].keeps:
                # A held call over a kept one: its program settles that one too.
                value = settle(self.op[1].keeps, args, value)
            self._value = value
            self._release()
        return self._value

    materialize = resolve

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def folded(self, geometry: Geometry | None):
        """(the source, how a program reads it) for a reader of the value through geometry;
        None once the value is computed."""
        if self._value is not None:
            return None
        view = self.view
        read = lead(self.source).aval.shape if view is None else view.size
        return self.source, Cast(self.dtype, None if self.shape == read else self.shape,
                                 geometry, self.keep, self.op, view, self.held)

    def _release(self) -> None:
        source = self.source
        for k in map(id, self.lent):  # (``ownership.unlend_all``, inline: a frame a value)
            n = _pop_lent(k) - 1
            if n:
                _lent[k] = n
        if self.extra:
            with _holding_lock:
                _holding[0] -= self.extra
        # (its source's arrays dropped with it: a computed value outlives them, and holding them
        # here kept a sampler's inputs alive past its use, +1.9 copies of its logits at peak)
        self.source = self.lent = None
        _pending.pop(id(self), None)
        if self.keep:
            _unkeep(source, self)

    def __del__(self) -> None:
        # (One computed left ``_pending`` then: ``_release``.)
        if self.source is not None:
            _pending.pop(id(self), None)
            for k in map(id, self.lent):  # (``ownership.unlend_all``, inline)
                n = _pop_lent(k) - 1
                if n:
                    _lent[k] = n
            if self.extra:
                with _holding_lock:
                    _holding[0] -= self.extra
            if self.keep:
                _unkeep(self.source, self)


# The lazy values not computed yet, by id: each leaves when it is computed or dies (its
# ``__del__``). Not a WeakSet, whose Python steps (an add, a discard, a callback at death) cost
# ~2 us a held value, ~1,200 of them a 12-layer Llama step.
_pending: dict[int, weakref.ref] = {}
# The kept casts still pending, by their source's id (each holds its source and leaves when it
# dies: the id is not reused meanwhile): where a program's returned conversions go. Weakly: a
# kept value no program read (one a held call read, whose tensor died) goes, uncomputed.
_kept: dict = {}


def _unkeep(source, converted: Converted) -> None:
    held = _kept.get(id(source))
    if held is not None:
        if len(held) == 1:  # (the common case, the source's one kept cast: no comprehension)
            r = held[0]()
            if r is None or r is converted:
                held.clear()
        else:
            held[:] = [r for r in held if r() is not None and r() is not converted]
        # (Not ``del``: another thread releasing the source's other kept cast may have emptied
        # the list and removed it between these two lines.)
        if not held:
            _kept.pop(id(source), None)


def settle(keeps: tuple, dyn: tuple, out):
    """A program's results without its kept conversions, which become their casts' values:
    ``out`` is (results, conversions) for a spec whose ``keeps`` (``program.kept_positions``)
    are ``keeps``."""
    out, converted = out
    for (path, dtype, shape, op, view), value in zip(keeps, converted):
        source = dyn
        for at in path:
            source = source[at]
        # Casts of one source to one dtype and shape are one value: any pending one takes it
        # (each program reading one settles one; none pending: no search).
        ref = _kept_value(source, dtype, shape, op, view) if id(source) in _kept else None
        c = None if ref is None else ref()
        if c is not None:
            c._value = value
            c._release()
    return out


def _kept_value(source, dtype, shape, op, view):
    """A weak reference to a pending kept value of ``source`` a program reads as a ``Cast`` of
    these fields gives (shape None: the source's, or the view's, own), or None."""
    want = shape
    if want is None:
        if view is None:
            want = source
            while type(want) is tuple:  # ``lead``, inline (a frame a settled value)
                want = want[0]
            want = want.aval.shape
        else:
            want = view.size
    for ref in _kept.get(id(source), ()):
        c = ref()
        if (c is not None and c.source is source and c.dtype == dtype and c.shape == want
                and c.op == op and c.view == view):
            return ref
    return None


def lazy_cast(t: torch.Tensor, array, dtype: torch.dtype, view: Geometry | None = None):
    """``HOOKS.lazy_cast``: a ``Converted`` for t (whose storage array is ``array``) cast to
    dtype, or None to cast now; ``view``: t is a view of ``array`` read through it, the copy
    of a view (``_lazy_view``)."""
    if view is not None:
        return _lazy_view(t, array, dtype, view)
    if type(array) is Converted and array._value is None:
        return _cast_of_held(t, array, dtype)
    if type(array) is not ArrayImpl and isinstance(array, ownership.Deferred):
        # A value DeferAndFuse computed (a fused optimizer step's), or a held one settled (the
        # norm's, by the first of q's, k's and v's products): cast as an array is.
        array = array.resolve()
    # t is its storage's array whole, or that array reshaped. (The array's facts off its aval:
    # ``size`` is two Python properties, at every autocast cast.)
    if (type(array) is not ArrayImpl or t.dtype not in _FLOATS or dtype not in _FLOATS
            or t.storage_offset() or not t.is_contiguous() or t.is_neg()
            or array.aval.dtype != _NP[t.dtype] or math.prod(array.aval.shape) != t.numel()):
        return None
    # A narrowing cast of anything but a parameter under autocast (held anyway) is kept: its
    # first reader returns the narrow value, so the wide source lives no longer than that.
    keep = dtype.itemsize < t.dtype.itemsize and not (
        t.is_leaf and t.requires_grad and autocast.casting())
    return Converted(array, _NP[dtype], tuple(t.shape), keep, lent=[array])


def _cast_of_held(t: torch.Tensor, held: Converted, dtype: torch.dtype):
    """A ``Converted`` for t, all of a pending held call of several tensors (the norm's
    ``weight * h``), cast to dtype (autocast's cast for the next product): the same call, its
    result converted (``read_input`` casts what ``program.applied`` gives); kept where
    narrowing. Else None: the call is computed, then cast."""
    if (held._value is not None or not held.spread or held.op is None or held.view is not None
            or t.dtype not in _FLOATS or dtype not in _FLOATS or held.dtype != _NP[t.dtype]
            or t.storage_offset() or not t.is_contiguous() or t.is_neg()
            or tuple(t.shape) != held.shape):
        return None
    cast = Converted(held.source, _NP[dtype], held.shape, dtype.itemsize < t.dtype.itemsize,
                     held.op, _cast_after(held.fn, _NP[dtype], bool(held.op[1].keeps)),
                     spread=True)
    cast.held = held.keep
    return cast


@functools.lru_cache(maxsize=256)
def _cast_after(fn, dtype: np.dtype, keeps: bool):
    # (Run alone only where no program could compute it: a host read of the cast.) A call
    # reading kept values returns them too (``settle`` takes them), not cast.
    # Named by what it computes, so that a recording holding it keeps its key (a new process
    # loads that fused program, and this one run alone, by key, not traced: rl12).
    if keeps:
        jitted = jax.jit(lambda *args: (lambda out, kept: (dtypes.cast(out, dtype), kept))(
            *fn(*args)))
    else:
        jitted = jax.jit(lambda *args: dtypes.cast(fn(*args), dtype))
    return warm_dispatch.keyed(jitted, "cast_after", fn, dtype, keeps)


def _lazy_view(t: torch.Tensor, array, dtype: torch.dtype, view: Geometry):
    """A ``Converted`` reading ``array`` through view (t, all of ``array`` in another dim order:
    reshape's clone of a transposed tensor), cast to dtype, for its readers' programs. Kept
    (settled by its first reader) where the copy holds fewer bytes than the array (a narrowing
    cast). Not a part of the array (a row, a slice): each offset would be a program of its own
    for every reader (a loop writing elements one by one compiled one per element)."""
    if (type(array) is not ArrayImpl or t.dtype not in _FLOATS or dtype not in _FLOATS
            or array.aval.dtype != _NP[t.dtype] or tuple(view.size) != tuple(t.shape)
            or view.offset or t.numel() != array.size):
        return None
    check_in_bounds(view)
    keep = _kept_when(t.numel() * dtype.itemsize, array.size * array.itemsize)
    return None if keep is None else Converted(array, _NP[dtype], tuple(t.shape), keep,
                                               view=view)


# A held value larger than its source (a broadcast: a mean's gradient divided by its count) is
# computed by each of its readers; one past this many bytes is computed now, where the memory it
# needs is asked for (a refusal is raised at the user's line, not at a reader's).
LARGER = 64 << 20


def _kept_when(nbytes: int, source: int) -> bool | None:
    """Whether a held value of ``nbytes`` over a source of ``source`` bytes is kept (settled by
    its first reader, which lets a larger source go); None: not held."""
    if nbytes > source and nbytes > LARGER:
        return None
    return nbytes < source


def lazy_op(owner, lowering, spec, fn, read, dyn: tuple) -> Converted | None:
    """Strict's call of a pointwise op on one tensor (``program.one_pointwise_input``: ``read``,
    how it reads ``dyn[0]``: None, a view Geometry, or a held value's ``Cast``, whose source
    ``dyn[0]`` then is), held as a ``Converted`` its consumers compute in their programs; None
    to launch it now (a call of several tensors: ``held_call``), or where its executor
    (``owner``) holds no calls (``lazy_ops``). An op not pointwise (a pad, a mean) has its
    result shape from its plan (``Spec.shape``)."""
    if not owner.lazy_ops:
        return None
    source = dyn[0]
    array = lead(source)
    if type(array) is not ArrayImpl:
        return None
    pointwise = not lowering.held or torch.Tag.pointwise in lowering.op.tags
    # (A result in memory order, ``Spec.order``, has its stored shape from its plan too.)
    shape = _read_shape(array, read) if pointwise and spec.order is None else spec.shape
    if shape is None:
        return None
    dtype = spec.final
    aval = array.aval  # (the array's size and dtype properties: three Python steps)
    nbytes, source_bytes = math.prod(shape) * dtype.itemsize, \
        math.prod(aval.shape) * aval.dtype.itemsize
    keep = _kept_when(nbytes, source_bytes)
    if keep is None or (keep and not pointwise and source_bytes - nbytes > LARGER):
        # (A reduction kept holds all of its source for a small value until its first reader,
        # which may come late (a statistic kept for logging): not past ``LARGER`` bytes.)
        return None
    # Its traced numbers (``x + eps``, a mean's divisor) travel with its source, as the device
    # arrays ``numbers.on_device`` made of them.
    spread = len(dyn) > 1
    return Converted(dyn if spread else source, dtype, tuple(shape), keep, (lowering, spec), fn,
                     spread=spread)


def held_call(owner, lowering, spec, fn, count: int, dyn: tuple) -> Converted | None:
    """A pointwise call of ``count`` tensors (``x * rsqrt``, a gradient's product, a residual
    sum) held, kept: its first reader computes it and returns it, so it is computed once, and
    its inputs live no longer than until that reader, which settles the kept values it reads
    too (the rotary ``x * cos`` over its kept bfloat16 table). Not where the held calls pending
    would then hold more than ``LARGER`` bytes beyond their results in all: each input may die
    before the first reader comes (a gradient kept in ``.grad`` is read by the optimizer), and
    then holding it costs what it holds beyond the result. Nor under a memory limit: its
    result's memory would be asked for at its reader, whose line a refusal would then name,
    not the user's. None too where its executor (``owner``) holds no calls (``lazy_ops``)."""
    shape = spec.shape
    if shape is None or not owner.lazy_ops or memory_limit.limit_as_set() is not None:
        return None
    lent, numbers = [], dyn[count:]
    for s in dyn:  # (``arrays`` of the tuple dyn: ``flatten``'s top level inline)
        kind = type(s)
        if kind is ArrayImpl:
            lent.append(s)
        elif kind is tuple:
            flatten(s, lent)
        elif isinstance(s, jax.Array):
            lent.append(s)
    # Its tensors' arrays lead (``arrays`` keeps their order), then each traced number's device
    # array: one flattening of a chain's nested arguments, not two.
    held = lent if not numbers else lent[:len(lent) - len(numbers)] \
        if all(type(x) is ArrayImpl for x in numbers) else arrays(dyn[:count])
    # The bytes of its distinct input arrays (each once: a dict of them by id, made in C; from
    # their avals: ``size`` and ``dtype`` are Python properties, ~5 calls an array, 1,600
    # arrays a step).
    nbytes = 0
    for a in dict(zip(map(id, held), held)).values():
        if type(a) is not ArrayImpl:
            return None
        aval = a.aval
        nbytes += math.prod(aval.shape) * aval.dtype.itemsize
    extra = nbytes - math.prod(shape) * spec.final.itemsize
    if extra < 0:
        extra = 0
    if extra and _holding[0] + extra > LARGER:
        return None
    held = Converted(dyn, spec.final, tuple(shape), True, (lowering, spec), fn, spread=True,
                     lent=lent)
    held.extra = extra
    if extra:
        with _holding_lock:
            _holding[0] += extra
    return held


# The bytes the pending held calls of several tensors hold beyond their results, at most,
# changed under the lock (backward holds calls on autograd's thread; a value may die on either
# thread), inline where it changes (a frame a held call and a death, ~950 a step).
_holding = [0]
_holding_lock = threading.Lock()


def _read_shape(source, read) -> tuple:
    """The shape of what a program reads of ``source`` through ``read`` (a spec payload)."""
    if read is None:
        return source.aval.shape
    if type(read) is Cast:
        if read.geometry is not None:
            return read.geometry.size
        if read.shape is not None:
            return read.shape
        return source.aval.shape if read.view is None else read.view.size
    return read.size


def computed(out):
    """out (a call's results) with every lazy value in it computed: what is written into
    another tensor's storage (an in-place op's functional twin) must be an array."""
    if isinstance(out, (tuple, list)):
        return type(out)(computed(o) for o in out)
    return out.resolve() if type(out) is Converted else out


def any_pending() -> bool:
    """Whether a lazy value is still pending: another executor taking over computes each alone."""
    return any(ref() is not None for ref in _pending.values())


def settle_readers(array) -> None:
    """Compute each pending value whose source holds array (``HOOKS.settle_readers``): a call
    about to take array's buffer (a donating op) finds it lent to none of them."""
    for ref in list(_pending.values()):
        converted = ref()
        if converted is not None:
            lent = converted.lent
            if lent is not None and any(a is array for a in lent):
                converted.resolve()


def resolve_pending() -> None:
    """Compute every lazy cast still pending (before another executor takes over)."""
    for ref in list(_pending.values()):
        converted = ref()
        if converted is not None:
            converted.resolve()
